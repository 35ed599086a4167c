"""The package's layers point one way (docs/architecture.md), read from the source with `ast`.

Every import between the project's own modules, at any depth (inside functions and under
`TYPE_CHECKING` too), must go from a higher layer to a lower one or stay inside one room
(a subpackage or a top-level module); the rooms' import graph has no cycle; no module imports
a `_private` name from another module; and no module imports another package's private
modules: a room of a package is reached through that package's `__init__`
(`from .._models import OpenAIClient`, `from ..redis import RedisStreamTaskset`), never as
`from ..redis._feed import ...` (the top-level private rooms, `trio_tasksets._core.window`, are
the package's own, as in trio's `from ._core import ...`). Tests may import private modules.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "trio_tasksets"

# Lower numbers are lower layers. A room may import its own layer's rooms only where listed in
# SIDEWAYS, and any room of a lower layer. A room is a top-level module or package, but for
# the two floors (`_core`, `_env`), whose modules are rooms of their own with layers inside
# the floor (`_core.window` below `_core.runner`).
FLOORS = {"_core", "_env"}
LAYERS: dict[str, int] = {
    # the core: no I/O beyond the source and the runs
    "_core": 0,  # the floor's __init__ (a docstring)
    "_core.exceptions": 0,
    "_core.views": 0,
    "_core.version": 1,
    "_core.backoff": 1,
    "_core.window": 1,
    "_core.pacing": 1,
    "_core.adaptive": 2,
    "_core.runner": 2,
    "_core.drain": 2,
    "_core.batching": 2,
    "_core.limits": 3,
    "_core.tasksets": 2,
    "_core.sources": 4,
    "_core.training": 4,
    "_core.builtin": 4,
    "_core.datasets": 4,
    "_core.health": 4,
    # beside the core: tools, the HTTP client, the live view
    "sandboxes": 9,  # below the tools that run in them
    "tools": 10,
    "_transport": 10,
    "_monitor": 10,
    "_models": 11,
    # the env side
    "_env": 20,
    "_env.rollout_limits": 19,  # below the env that holds them
    "_env.boxes": 19,  # an env's sandboxes: below the env that holds them
    "_env.env": 20,
    "_env.traces": 20,
    "_env.loading": 21,
    "_env.groups": 21,
    "_env.agents": 21,
    "_env.spec": 22,
    "_env.backend": 22,
    # what runs envs: the report of a run dir, the worker side, the served path, Redis
    "_report": 30,
    "worker": 30,
    "testing": 31,
    "_serve": 31,
    "redis": 31,
    "_eval": 40,
    "aio": 41,
    "_cli": 50,
    "__init__": 60,
    "__main__": 60,
}
SIDEWAYS: set[tuple[str, str]] = set()


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _room(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 2 and parts[1] in FLOORS:
        return f"{parts[1]}.{parts[2]}"
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(imported module, names, line) for every import of the project's own modules."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, list[str], int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target == "trio_tasksets" or target.startswith("trio_tasksets."):
                names = [alias.name for alias in node.names]
                found.append((target, names, node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("trio_tasksets"):
                    found.append((alias.name, [], node.lineno))
    return found


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_room_has_a_layer() -> None:
    rooms = {_room(_module_name(path)) for path in _sources()}
    assert rooms <= set(LAYERS), f"give these a layer in LAYERS: {sorted(rooms - set(LAYERS))}"


def _target_room(target: str, names: list[str]) -> list[str]:
    """The rooms an import reaches (`from trio_tasksets import aio` reaches `aio`)."""
    if target == "trio_tasksets":
        return [name for name in names if name in LAYERS] or ["__init__"]
    room = _room(target)
    if room in FLOORS:  # `from .._core import window`
        return [f"{room}.{name}" for name in names if f"{room}.{name}" in LAYERS] or [room]
    return [room]


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down_and_take_no_private_names(path: Path) -> None:
    module = _module_name(path)
    room = _room(module)
    for target, names, line in _imports(path):
        for other in _target_room(target, names):
            if other == room or (room, other) in SIDEWAYS:
                continue
            assert LAYERS[other] < LAYERS[room], (
                f"{path.relative_to(PACKAGE)}:{line}: {room} (layer {LAYERS[room]}) imports "
                f"{target} (layer {LAYERS[other]}): layers point down only"
            )
        private = [
            n
            for n in names
            if n.startswith("_") and not n.startswith("__") and f"{target}.{n}" not in MODULES
        ]
        assert target == module or not private, (
            f"{path.relative_to(PACKAGE)}:{line}: imports private {private} from {target}"
        )


MODULES = {_module_name(path) for path in _sources()}

# The command line runs the Redis worker and loads verifiers envs: `_cli` may reach these
# private rooms of the public packages `redis` and `aio` (each listed, not the package).
BACK_DOORS: dict[str, set[str]] = {
    "_cli": {
        "trio_tasksets.redis._entries",
        "trio_tasksets.redis._link",
        "trio_tasksets.redis._resp",
        "trio_tasksets.redis._results",
        "trio_tasksets.redis._worker",
        "trio_tasksets.aio._verifiers",
    },
}


def _private_modules_reached(path: Path) -> list[tuple[str, int]]:
    """(module, line) for every private module of another package that `path` imports:
    a module `trio_tasksets.P._m` (any depth) whose package `trio_tasksets.P` is not the
    importing module's own room."""
    module = _module_name(path)
    room = _room(module)
    found: list[tuple[str, int]] = []
    for target, names, line in _imports(path):
        for reached in [target, *(f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES)]:
            parts = reached.split(".")
            if len(parts) < 3 or parts[1] == room:
                continue
            if any(p.startswith("_") and not p.startswith("__") for p in parts[2:]):
                found.append((reached, line))
    return found


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_another_packages_private_modules(path: Path) -> None:
    allowed = BACK_DOORS.get(_room(_module_name(path)), set())
    wrong = [
        f"{path.relative_to(PACKAGE)}:{line}: imports {reached}: import it from its package"
        for reached, line in _private_modules_reached(path)
        if reached not in allowed
    ]
    assert not wrong


# Rooms that must not import each other although the layers would allow it: the eval runs its
# slots through a `backend.SlotBackend`, each one in the room of its transport; the worker
# loop consumes a `queue.TaskQueue`, whatever the feed.
APART: dict[str, set[str]] = {
    "_eval": {"_serve", "redis"},
    "worker": {"_serve", "redis"},
}


@pytest.mark.parametrize("room", sorted(APART))
def test_rooms_kept_apart_do_not_import_each_other(room: str) -> None:
    found = [
        f"{path.relative_to(PACKAGE)}:{line}: imports {target}"
        for path in _sources()
        if _room(_module_name(path)) == room
        for target, names, line in _imports(path)
        if set(_target_room(target, names)) & APART[room]
    ]
    assert not found, f"{room} must not import {sorted(APART[room])}: {found}"


def test_no_import_cycle_between_modules() -> None:
    graph: dict[str, set[str]] = {}
    modules = {_module_name(path) for path in _sources()}
    for path in _sources():
        edges = graph.setdefault(_module_name(path), set())
        for target, names, _line in _imports(path):
            for name in names or [""]:
                sub = f"{target}.{name}"
                edges.add(sub if sub in modules else target)
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt == node or nxt not in graph:
                continue
            # A package's __init__ re-exports its rooms: an import of the package from inside
            # it is the same room importing its own front door, not a cycle of rooms.
            if nxt in node.split(".")[:-1] or node.startswith(nxt + "."):
                continue
            if state.get(nxt) == 1:
                cycle = [*trail[trail.index(nxt) :], nxt] if nxt in trail else [node, nxt]
                pytest.fail(f"import cycle: {' -> '.join(cycle)}")
            if nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_the_checker_sees_a_bad_import(tmp_path: Path) -> None:
    """The checks above can fail: an upward, a private name's and a private module's import of
    another package are found; a package's own private rooms, a top-level private room and a
    front door are not."""
    global PACKAGE, MODULES
    root = tmp_path / "trio_tasksets"
    (root / "_serve").mkdir(parents=True)
    (root / "redis").mkdir()
    (root / "_models").mkdir()
    bad = root / "_runner.py"
    bad.write_text("from ._cli import main\nfrom ._env import _private\n")
    served = root / "_serve" / "policy.py"
    served.write_text(
        "from ..redis._feed import RedisStreamTaskset\n"
        "from .._models import _openai\n"
        "from .._models import OpenAIClient\n"
        "from .._window import Window\n"
        "from . import _wire\n"
        "from ..redis import RedisResults\n"
    )
    for name in ["redis/__init__", "redis/_feed", "_models/__init__", "_models/_openai"]:
        (root / f"{name}.py").write_text("")
    saved = PACKAGE, MODULES
    PACKAGE = root
    MODULES = {_module_name(path) for path in root.rglob("*.py")}
    try:
        found = _imports(bad)
        reached = _private_modules_reached(served)
    finally:
        PACKAGE, MODULES = saved
    assert ("trio_tasksets._cli", ["main"], 1) in found
    assert ("trio_tasksets._env", ["_private"], 2) in found
    assert LAYERS[_room("trio_tasksets._cli")] > LAYERS[_room("trio_tasksets._core.runner")]
    assert reached == [("trio_tasksets.redis._feed", 1), ("trio_tasksets._models._openai", 2)]


ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def _drawn_tree() -> dict[str, tuple[str, str]]:
    """The tree `docs/architecture.md` draws: {top-level unit: (its text, its layer text)}."""
    text = ARCHITECTURE.read_text()
    block = text.split("```text\n", 1)[1].split("```", 1)[0]
    units: dict[str, tuple[str, str]] = {}
    current = ""
    for line in block.splitlines()[1:]:
        head = line[:14].strip()
        if head and head not in {"|"} and not line.startswith("  "):
            current = head.rstrip("/").removesuffix(".py")
            units[current] = ("", line[85:].strip() if len(line) > 85 else "")
        if current:
            body, layer = units[current]
            units[current] = (body + " " + line[14:], layer or line.strip().split()[-1])
    return units


def test_the_architecture_page_draws_the_tree_as_it_is() -> None:
    """docs/architecture.md names every top-level unit with its layer in `LAYERS`, every
    module of each folder inside that folder's entry, and only paths that exist."""
    drawn = _drawn_tree()
    units = {
        p.name.removesuffix(".py")
        for p in PACKAGE.iterdir()
        if (p.suffix == ".py" or (p / "__init__.py").exists())
        and p.name not in {"__init__.py", "__main__.py"}
    }
    assert set(drawn) == units
    for unit, (body, layer) in drawn.items():
        numbers = [int(n) for n in re.findall(r"\d+", layer)]
        inside = [LAYERS[r] for r in LAYERS if r == unit or r.startswith(unit + ".")]
        assert numbers, f"{unit}: give its layer in docs/architecture.md"
        assert min(numbers) == min(inside), (unit, layer, inside)
        folder = PACKAGE / unit
        if folder.is_dir():
            missing = [
                m.stem
                for m in folder.glob("*.py")
                if m.stem != "__init__" and not re.search(rf"(?<![\w]){m.stem}(?![\w])", body)
            ]
            assert not missing, f"{unit}/: draw {missing} in docs/architecture.md"
    text = ARCHITECTURE.read_text()
    named = set(re.findall(r"`((?:_[a-z]+|aio|redis|sandboxes|tools|worker)/[a-z_]+)`", text))
    gone = sorted(
        n for n in named if not (PACKAGE / f"{n}.py").exists() and not (PACKAGE / n).is_dir()
    )
    assert not gone, f"docs/architecture.md names modules that do not exist: {gone}"
