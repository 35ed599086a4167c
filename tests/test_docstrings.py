"""Public functions and methods that raise say what: a `Raises:` line or a sentence.

Every name in the `__all__` of `trio_tasksets` and of its public submodules, and every public
method of a public class, whose own body has a ``raise`` of an exception (not a bare
re-raise) says in its docstring what it raises (for `__init__`, the class docstring may say
it). A few that raise only through a shared check (the runner's arguments, say) are listed
by name. The test reads the source, so it cannot be fooled by an exception raised through
a helper it does not list: that is what the list is for.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import trio_tasksets as tt

PUBLIC = ["trio_tasksets", "trio_tasksets.aio", "trio_tasksets.testing", "trio_tasksets.tools",
          "trio_tasksets.worker", "trio_tasksets.redis"]  # fmt: skip

# What a docstring says when it says what is raised: "raises", "refused", or an exception's name.
SAYS = re.compile(
    r"(?i:rais|refus)|\b[A-Z]\w*(Error|Exception|Unavailable|Exhausted|Stopped|Refused|Cancelled)\b"
)

# Public names that raise for bad input only through a shared check.
THROUGH_A_CHECK = [
    tt.run_stream, tt.as_completed, tt.fan_out, tt.first, tt.take, tt.until, tt.merge,
    tt.Window, tt.AdaptiveWindow, tt.EndpointLimits, tt.RateLimiter, tt.tool, tt.build_window,
    tt.JsonlTaskset, tt.CsvTaskset, tt.HFTaskset, tt.EnvClient, tt.Staleness, tt.report,
    tt.rescore, tt.Env, tt.Sampling, tt.Tokens, tt.aio.BridgedEnv, tt.testing.ScriptedClient,
]  # fmt: skip


def _raises(fn: Callable[..., Any]) -> bool:
    """Whether `fn`'s own body (not a nested function's) raises an exception by name."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return False
    top = ast.parse(source).body[0]
    found = False

    class Visit(ast.NodeVisitor):
        def visit_Raise(self, node: ast.Raise) -> None:
            nonlocal found
            found = found or node.exc is not None

        def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
            if node is top:
                self.generic_visit(node)

        def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
            if node is top:
                self.generic_visit(node)

        def visit_ClassDef(self, node: ast.ClassDef) -> None:
            pass  # a nested class's methods are not this function's body

    Visit().visit(top)
    return found


def _public() -> Iterator[tuple[str, Callable[..., Any], str]]:
    """(name, function, the docstrings that may say it) of every public callable."""
    for module_name in PUBLIC:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj):
                if issubclass(obj, BaseException):
                    continue
                for attr, value in vars(obj).items():
                    if attr.startswith("_") and attr != "__init__":
                        continue
                    fn = value.fget if isinstance(value, property) else value
                    fn = getattr(fn, "__func__", fn)
                    if inspect.isfunction(fn) and fn.__module__ == obj.__module__:
                        docs = (fn.__doc__ or "") + (
                            obj.__doc__ or "" if attr == "__init__" else ""
                        )
                        yield f"{module_name}.{name}.{attr}", fn, docs
            elif inspect.isfunction(inspect.unwrap(obj)):
                fn = inspect.unwrap(obj)
                yield f"{module_name}.{name}", fn, fn.__doc__ or ""


def test_the_walk_finds_the_public_api() -> None:
    names = [name for name, _, _ in _public()]
    assert len(names) > 150
    assert "trio_tasksets.run_stream" in names
    assert "trio_tasksets.Window.resize" in names


def test_what_raises_says_so() -> None:
    silent = sorted({name for name, fn, docs in _public() if _raises(fn) and not SAYS.search(docs)})
    assert silent == [], f"say what these raise (a Raises: line or a sentence): {silent}"


@pytest.mark.parametrize("obj", THROUGH_A_CHECK, ids=lambda obj: obj.__qualname__)
def test_what_raises_through_a_check_says_so(obj: Any) -> None:
    assert SAYS.search(obj.__doc__ or ""), f"{obj.__qualname__}: say what it raises"


def test_the_check_sees_a_silent_raise() -> None:
    def quiet(x: int) -> int:
        """Doubles."""
        if x < 0:
            raise ValueError(x)
        return 2 * x

    def says(x: int) -> int:
        """Doubles; raises ValueError for x < 0."""
        if x < 0:
            raise ValueError(x)
        return 2 * x

    def nested() -> None:
        """Nothing."""

        def inner() -> None:
            raise ValueError

    assert _raises(quiet)
    assert not SAYS.search(quiet.__doc__ or "")
    assert SAYS.search(says.__doc__ or "")
    assert not _raises(nested)
