"""`@tt.tool` (schemas from type hints, arguments validated before the call) and the shell
tool (`tt.tools.shell`: a real /bin/sh, its process group killed on timeout and cancel)."""

from __future__ import annotations

import functools
import signal
import sys
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, TypedDict

import attrs
import pytest
import trio
from helpers import marked

import trio_tasksets as tt
from trio_tasksets.tools import ToolArgumentError

# --- schemas -------------------------------------------------------------------------------


@attrs.frozen
class Point:
    x: int
    y: int = 0


class Box(TypedDict):
    width: float
    label: str


def test_the_schema_follows_the_hints_and_the_docstring() -> None:
    @tt.tool
    async def place(
        name: str,
        count: int,
        scale: float,
        visible: bool,
        tags: list[str],
        mode: Literal["fast", "slow"],
        where: Point,
        box: Box,
        note: str | None = None,
        weights: dict[str, float] | None = None,
        level: Annotated[int, "how deep"] = 1,
    ) -> str:
        """Place a thing.

        Args:
            name: what to call it
            count: how many,
                at least one
        """
        return name

    assert place.name == "place"
    assert place.description == "Place a thing."
    params = place.parameters
    assert params["required"] == [
        "name", "count", "scale", "visible", "tags", "mode", "where", "box"
    ]  # fmt: skip
    assert params["additionalProperties"] is False
    props = params["properties"]
    assert props["name"] == {"type": "string", "description": "what to call it"}
    assert props["count"] == {"type": "integer", "description": "how many, at least one"}
    assert props["scale"] == {"type": "number"}
    assert props["visible"] == {"type": "boolean"}
    assert props["tags"] == {"type": "array", "items": {"type": "string"}}
    assert props["mode"] == {"type": "string", "enum": ["fast", "slow"]}
    assert props["where"] == {
        "type": "object",
        "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
        "required": ["x"],
        "additionalProperties": False,
    }
    assert props["box"]["required"] == ["width", "label"]
    assert props["note"] == {"anyOf": [{"type": "string"}, {"type": "null"}]}
    assert props["weights"]["anyOf"][0] == {
        "type": "object",
        "additionalProperties": {"type": "number"},
    }
    assert props["level"] == {"type": "integer", "description": "how deep"}
    assert place.schema == {
        "type": "function",
        "function": {"name": "place", "description": "Place a thing.", "parameters": params},
    }


def test_sphinx_params_and_names_and_descriptions_given() -> None:
    def scale(factor: Optional[float] = None) -> float:  # noqa: UP045 (Optional on purpose)
        """Scale it.

        :param factor: by how much
        """
        return factor or 1.0

    made = tt.tool(name="resize", description="Resize.")(scale)
    assert (made.name, made.description) == ("resize", "Resize.")
    assert made.parameters["properties"]["factor"]["description"] == "by how much"
    assert "required" not in made.parameters


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("def f(x): ...", "parameter 'x' needs a type hint"),
        ("def f(x: complex) -> None: ...", "'x': a tool argument cannot be complex"),
        ("def f(x: tuple[int, str]) -> None: ...", "only tuple"),
        ("def f(x: dict[int, str]) -> None: ...", "str keys"),
        ("def f(*xs: int) -> None: ...", r"\*args and \*\*kwargs"),
        ("def f(x: int, /) -> None: ...", "positional-only"),
        ("def f(x: list[object]) -> None: ...", "cannot be object"),
    ],
)
def test_what_a_schema_cannot_express_is_a_type_error_at_decoration(
    source: str, message: str
) -> None:
    namespace: dict[str, Any] = {}
    exec(source, namespace)
    with pytest.raises(TypeError, match=message):
        tt.tool(namespace["f"])


def test_a_bad_name_is_refused() -> None:
    with pytest.raises(TypeError, match="a tool's name must be"):
        tt.tool(name="no spaces")(lambda: None)


async def test_arguments_are_validated_and_converted_before_the_call() -> None:
    calls: list[dict[str, Any]] = []

    @tt.tool
    def record(
        a: int, where: Point, tags: tuple[str, ...] = (), mode: Literal["x", 1] = "x"
    ) -> str:
        """Record."""
        calls.append({"a": a, "where": where, "tags": tags, "mode": mode})
        return "ok"

    assert await record.call({"a": 3.0, "where": {"x": 1}, "tags": ["t"], "mode": 1}) == "ok"
    assert calls == [{"a": 3, "where": Point(1, 0), "tags": ("t",), "mode": 1}]
    assert await record(a=1, where={"x": 2, "y": 3}) == "ok"
    assert calls[-1]["where"] == Point(2, 3)
    bad = [
        ({"where": {"x": 1}}, "missing argument 'a'"),
        ({"a": 1.5, "where": {"x": 1}}, "a: expected an integer, got number 1.5"),
        ({"a": True, "where": {"x": 1}}, "a: expected an integer, got boolean true"),
        ({"a": 1, "where": {"x": "1"}}, "where.x: expected an integer, got string '1'"),
        ({"a": 1, "where": {"x": 1, "z": 0}}, "where: unexpected argument 'z'"),
        ({"a": 1, "where": {"x": 1}, "tags": [1]}, r"tags\[0\]: expected a string"),
        ({"a": 1, "where": {"x": 1}, "mode": "y"}, "mode: expected one of 'x', 1"),
        ({"a": 1, "where": {"x": 1}, "extra": 0}, r"unexpected argument 'extra' \(it takes"),
        ([1, 2], "arguments: expected an object"),
    ]
    for arguments, message in bad:
        with pytest.raises(ToolArgumentError, match=message):
            await record.call(arguments)
    assert len(calls) == 2  # no call with bad arguments ran


# --- the shell tool -------------------------------------------------------------------------

posix = pytest.mark.skipif(sys.platform == "win32", reason="process groups are POSIX")


async def _gone(token: str) -> bool:
    """No process whose command line holds `token` is left (within 5 s). The commands run in
    a PID namespace: the pids they see are not the host's, so the tests look for a marker."""
    with trio.move_on_after(5):
        while marked(token):  # noqa: ASYNC110 (a process's state: no event to wait on)
            await trio.sleep(0.01)
        return True
    return False


@posix
async def test_shell_runs_in_its_directory_and_reports_the_exit_status(tmp_path: Path) -> None:
    shell = tt.tools.shell(cwd=tmp_path)
    assert shell.name == "shell"
    assert shell.parameters["required"] == ["command"]
    assert await shell(command="echo hi > f; cat f; pwd") == f"hi\n{tmp_path}\n"
    assert await shell(command="echo out; echo err >&2; exit 3") == ("out\nerr\n\n[exit status 3]")
    assert await shell(command="true") == "[no output]"


@posix
async def test_shell_caps_its_output(tmp_path: Path) -> None:
    shell = tt.tools.shell(cwd=tmp_path, max_output=10)
    text = await shell(command="head -c 100000 /dev/zero | tr '\\0' a")
    assert text == "a" * 10 + "\n[output truncated: only its first 10 bytes are shown]"


@posix
async def test_shell_does_not_hand_the_evals_secrets_to_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    text = await tt.tools.shell(cwd=tmp_path, env={"MINE": "1"})(command="env")
    assert "sk-secret" not in text
    assert "MINE=1" in text
    assert f"HOME={tmp_path}" in text
    inherited = await tt.tools.shell(cwd=tmp_path, inherit_env=True)(command="env")
    assert "OPENAI_API_KEY=sk-secret" in inherited


@posix
async def test_shell_timeout_kills_a_child_that_ignores_sigterm(tmp_path: Path) -> None:
    """The command's child ignores SIGTERM: the group gets SIGKILL after `grace`; no process
    is left."""
    shell = tt.tools.shell(cwd=tmp_path, timeout=0.5, grace=0.2)
    script = "trap '' TERM; sh -c \"trap '' TERM; sleep 60.7101\" & echo started; wait"
    text = await shell(command=script)
    assert text.startswith("started\n")
    assert text.endswith("[timed out after 0.5s: the command was killed]")
    assert await _gone("60.7101")


@posix
async def test_shell_background_jobs_do_not_outlive_the_command(tmp_path: Path) -> None:
    shell = tt.tools.shell(cwd=tmp_path, timeout=30)
    with trio.fail_after(10):  # the background job keeps the pipe: it must be killed
        text = await shell(command="sleep 60.7102 > /dev/null & echo done")
    assert text == "done\n"
    assert await _gone("60.7102")


@posix
async def test_cancelling_a_shell_call_kills_its_group(tmp_path: Path) -> None:
    shell = tt.tools.shell(cwd=tmp_path, timeout=60, grace=0.2)
    script = "trap '' TERM; sleep 60.7103 & echo started; wait"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(functools.partial(shell, command=script))
        with trio.fail_after(5):
            while not marked("60.7103"):  # noqa: ASYNC110 (a process's state)
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()  # a cancellation, not a deadline: no timeout answer
    assert await _gone("60.7103")


def test_shell_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="timeout must be"):
        tt.tools.shell(timeout=0)
    with pytest.raises(ValueError, match="max_output must be"):
        tt.tools.shell(max_output=-1)
    with pytest.raises(ValueError, match="cwd must be an existing directory"):
        tt.tools.shell(cwd=tmp_path / "missing")


@posix
async def test_a_command_over_the_argument_limit_answers_E2BIG(tmp_path: Path) -> None:
    """Issue 36, F12: the model reads the cause, not "ExceptionGroup"."""
    text = await tt.tools.shell(cwd=tmp_path)(command="echo " + "x" * 300_000)
    assert text.startswith("[could not start the command: E2BIG: Argument list too long")
    assert "ExceptionGroup" not in text


@posix
async def test_a_command_killed_by_a_signal_says_so(tmp_path: Path) -> None:
    assert await tt.tools.shell(cwd=tmp_path)(command="kill -KILL $$") == (
        f"[exit status -{int(signal.SIGKILL)} (killed by SIGKILL)]"
    )
