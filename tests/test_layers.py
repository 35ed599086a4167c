"""The package's layers point one way (docs/architecture.md), read from the source with `ast`.

Every import between the project's own modules, at any depth (inside functions and under
`TYPE_CHECKING` too), must go from a higher layer to a lower one or stay inside one room
(a subpackage or a top-level module); the rooms' import graph has no cycle; no module imports
a `_private` name from another module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "trio_tasksets"

# Lower numbers are lower layers. A room may import its own layer's rooms only where listed in
# SIDEWAYS, and any room of a lower layer. Shims of moved modules sit at the top (they only
# re-export).
LAYERS: dict[str, int] = {
    "_exceptions": -1,
    "version": 0,
    "backoff": 0,
    "window": 0,
    "runner": 1,
    "drain": 1,
    "batching": 1,
    "limits": 1,
    "tasksets": 1,
    "sources": 2,
    "tools": 2,
    "training": 2,
    "builtin": 2,
    "datasets": 2,
    "transport": 2,
    "health": 2,
    "models": 3,
    "env": 4,
    "dashboard": 4,
    "traces": 4,
    "metrics": 4,
    "loading": 5,
    "groups": 5,
    "agents": 5,
    "queue": 5,
    "envspec": 6,
    "backend": 6,
    "consumer": 6,
    "testing": 6,
    "serve": 7,
    "redis": 7,
    "eval": 8,
    "aio": 9,
    "cli": 10,
    "client": 11,
    "distributed": 11,
    "__init__": 12,
    "__main__": 12,
}
# The worker loop rebuilds tasks and checks declarations with the env's own description.
SIDEWAYS: set[tuple[str, str]] = {("consumer", "envspec")}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _room(module: str) -> str:
    parts = module.split(".")
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
    return [_room(target)]


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
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        assert target == module or not private, (
            f"{path.relative_to(PACKAGE)}:{line}: imports private {private} from {target}"
        )


# Rooms that must not import each other although the layers would allow it: the eval runs its
# slots through a `backend.SlotBackend`, each one in the room of its transport; the worker
# loop consumes a `queue.TaskQueue`, whatever the feed.
APART: dict[str, set[str]] = {
    "eval": {"serve", "redis"},
    "consumer": {"serve", "redis"},
    "queue": {"serve", "redis"},
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
    """The checks above can fail: an upward and a private import are found."""
    bad = tmp_path / "trio_tasksets" / "runner.py"
    bad.parent.mkdir()
    bad.write_text("from .cli import main\nfrom .env import _private\n")
    global PACKAGE
    saved, PACKAGE = PACKAGE, bad.parent
    try:
        found = _imports(bad)
    finally:
        PACKAGE = saved
    assert ("trio_tasksets.cli", ["main"], 1) in found
    assert ("trio_tasksets.env", ["_private"], 2) in found
    assert LAYERS[_room("trio_tasksets.cli")] > LAYERS["runner"]
