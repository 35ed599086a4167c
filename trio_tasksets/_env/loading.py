"""Objects by name: `module:Name` and `path/file.py:Name`, and the TASKSET argument.

`object_spec(obj)` names an object so that another process (an env server, a worker) can
import it; `load_object(spec)` imports it. `resolve_target(TASKSET)` is what every command
does with its TASKSET argument (a built-in id, `path/to/file.py:Class`, `package.module:Class`,
a data file `data.jsonl` / `data.csv` / `hf:NAME[:SPLIT]`, whose config fields `env_options`
sets).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
import traceback
from pathlib import Path
from typing import Any

from .._core.builtin import BUILTIN
from .._core.datasets import DATA_SUFFIXES, data_target
from .._core.exceptions import ConfigError, TrioTasksetsError
from .._core.tasksets import Taskset
from .env import Env

FILE_MODULE_PREFIX = "_trio_tasksets_user_"  # the module name a file loaded by path gets


class TravelError(ConfigError):
    """Something of the env or the model context cannot be rebuilt in another process."""


class TargetError(ConfigError):
    """A TASKSET argument that names nothing this process can load (the CLI: exit 2)."""


class LoadError(TrioTasksetsError, ValueError):
    """`load_object`'s spec names nothing: a malformed spec, or no such name in the module."""


def _module_file(module_name: str) -> str | None:
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    return str(Path(path).resolve()) if isinstance(path, str) else None


def _public_home(module_name: str, qualname: str, obj: Any) -> str:
    """The shortest public module of this package that binds `obj` as `qualname`
    (`trio_tasksets._core.builtin` -> `trio_tasksets`, `trio_tasksets.redis._feed` ->
    `trio_tasksets.redis`), so that a name the program records (an env spec, a Redis entry's
    declaration, a run's taskset) is the public one, which survives moves of the private
    modules; else `module_name`."""
    parts = module_name.split(".")
    if parts[0] != "trio_tasksets":
        return module_name
    for end in range(1, len(parts)):
        if parts[end - 1].startswith("_"):
            break  # a prefix under a private module is private too
        module = sys.modules.get(".".join(parts[:end]))
        if module is not None and getattr(module, qualname, None) is obj:
            return ".".join(parts[:end])
    return module_name


def object_spec(obj: Any, what: str) -> str:
    """`module:Name`, or `path/file.py:Name` for an object of a script or a file loaded by
    path (of a `python -m pkg.mod` run: `pkg.mod:Name`); `TravelError` for an object another
    process cannot import by that name."""
    module_name = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(module_name, str) or not isinstance(qualname, str):
        raise TravelError(f"{what} {obj!r} has no importable name; run in-process")
    if "." in qualname or "<" in qualname:
        raise TravelError(
            f"{what} {qualname} is not defined at the top level of a module (a lambda, or a "
            f"definition inside a function or class), so an env server cannot import it; "
            f"define it at module level or run in-process"
        )
    module = sys.modules.get(module_name)
    if module is None or getattr(module, qualname, None) is not obj:
        raise TravelError(f"{what} {module_name}:{qualname} cannot be found by that name")
    main_spec = getattr(module, "__spec__", None) if module_name == "__main__" else None
    if main_spec is not None and main_spec.name:  # `python -m package.module`
        return f"{main_spec.name}:{qualname}"
    if module_name == "__main__" or module_name.startswith(FILE_MODULE_PREFIX):
        path = _module_file(module_name)
        if path is None:
            raise TravelError(f"{what} {qualname} lives in a module with no file; run in-process")
        return f"{path}:{qualname}"
    return f"{_public_home(module_name, qualname, obj)}:{qualname}"


def upgraded_label(label: object) -> object:
    """A `module:Name` an earlier release of this package recorded (a run's config.json, a
    Redis entry's declaration) whose module has since moved, read as its public home today:
    0.x releases made the implementation modules private, so the `EchoTaskset` once recorded
    under the module `builtin` is now `trio_tasksets:EchoTaskset`. A label whose module still
    imports, or of another package, or that no public module of this package binds, is
    returned unchanged."""
    if not isinstance(label, str) or not label.startswith("trio_tasksets.") or ":" not in label:
        return label
    module_name, _, qualname = label.partition(":")
    try:
        if importlib.util.find_spec(module_name) is not None:
            return label
    except (ImportError, ValueError):
        pass  # a parent package of the old path is gone too
    parts = module_name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        home = ".".join(parts[:end])
        if any(part.startswith("_") for part in parts[:end]):
            continue
        try:
            module = importlib.import_module(home)
        except ImportError:
            continue
        if isinstance(getattr(module, qualname, None), type):
            return f"{home}:{qualname}"
    return label


def taskset_label(taskset: Taskset[Any, Any]) -> str:
    """How a run names its taskset (`config.json`, `summary.json`, the report): the
    taskset's own `taskset_id` when it has one (a verifiers env: `vf:ID`), `file.py:Class`
    for a class of a file TASKSET named by path (not the loader's internal module name),
    else `package.module:Class`."""
    own = getattr(taskset, "taskset_id", None)
    if isinstance(own, str) and own:
        return own
    cls = type(taskset)
    module = cls.__module__
    if module.startswith(FILE_MODULE_PREFIX):
        path = _module_file(module)
        if path is not None:
            return f"{Path(path).name}:{cls.__qualname__}"
    return f"{_public_home(module, cls.__qualname__, cls)}:{cls.__qualname__}"


def taskset_short_name(taskset: Taskset[Any, Any]) -> str:
    """The taskset's part of a default run name: its class name, or for a taskset with a
    `taskset_id` (`vf:ID`, a data file, `hf:NAME:SPLIT`) that id (so that runs of two are
    told apart, and `--resume` finds the run of the same one): `vf:owner/my-tasks` ->
    `owner_my-tasks`, `hf:gsm8k:test` -> `gsm8k_test`, `data/arith.jsonl` -> `arith`."""
    own = getattr(taskset, "taskset_id", None)
    if not (isinstance(own, str) and own):
        return type(taskset).__name__
    kind, colon, rest = own.partition(":")
    text = rest if colon and kind in ("vf", "hf") else own
    if Path(text).suffix.lower() in DATA_SUFFIXES:
        text = Path(text).stem
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or type(taskset).__name__


def _exec_file_module(module_name: str, path: Path) -> Any:
    """Run the file as module `module_name`, its folder first on `sys.path` while it runs (so
    that it imports its sibling modules); a module that fails is not left in sys.modules."""
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise LoadError(f"cannot import {path}")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    folder = str(path.parent)
    sys.path.insert(0, folder)
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    finally:
        if folder in sys.path:
            sys.path.remove(folder)  # the one we inserted (the first occurrence)
    return module


def load_object(spec: str) -> Any:
    """The object `object_spec` named, imported in this process (a file module is loaded
    once, under a name of its own: FILE_MODULE_PREFIX + the file's stem, with the file's
    folder on `sys.path` while it loads)."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise LoadError(f"{spec!r}: expected module:Name or path/file.py:Name")
    if where.endswith(".py"):
        path = Path(where).resolve()
        module_name = f"{FILE_MODULE_PREFIX}{path.stem}"
        module = sys.modules.get(module_name)
        if module is None or _module_file(module_name) != str(path):
            module = _exec_file_module(module_name, path)
    else:
        module = importlib.import_module(where)
    try:
        return getattr(module, name)
    except AttributeError:
        raise LoadError(f"{spec!r}: {where} has no {name!r}") from None


def _where(filename: str, line: int | None) -> str:
    path = Path(filename).resolve()
    shown = str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else filename
    return f"{shown}:{line}" if line else shown


def _is_machinery(filename: str) -> bool:
    """A frame of the import system or of this package: not where a user looks."""
    path = Path(filename).resolve()
    return filename.startswith("<") or any(path.is_relative_to(d) for d in _MACHINERY_DIRS)


_PACKAGE_DIR = Path(__file__).resolve().parent
_MACHINERY_DIRS = (_PACKAGE_DIR, Path(importlib.__file__).resolve().parent)


def import_failure(exc: BaseException, where: str) -> str:
    """`file:line: Type: message` for a module that raised while it was imported, naming the
    line of the user's own code (in the folder of the file TASKSET names) and, when the error
    was raised elsewhere (in a library that code imported), that place too."""
    error = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{_where(exc.filename, exc.lineno)}: {type(exc).__name__}: {exc.msg}"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not _is_machinery(f.filename)]
    if not frames:
        return f"cannot import {where}: {error}"
    raised = frames[-1]
    mine = raised
    if where.endswith(".py"):
        folder = Path(where).resolve().parent
        own = [f for f in frames if Path(f.filename).resolve().is_relative_to(folder)]
        mine = own[-1] if own else raised
    text = f"{_where(mine.filename, mine.lineno)}: {error}"
    if mine is not raised:
        text += f" (raised at {_where(raised.filename, raised.lineno)})"
    return text


def _missing_module(exc: ModuleNotFoundError, spec: str) -> str | None:
    """For `module:Class` naming a module that is not on the import path (not one it
    imports): what is missing, and the fix (the file form, or `PYTHONPATH=.` when the module
    is a file or package of the current folder, which a console script's path lacks)."""
    where, _, cls = spec.rpartition(":")
    name = exc.name or ""
    if not name or not (where == name or where.startswith(f"{name}.")):
        return None
    top = name.split(".")[0]
    here = Path.cwd()
    if (here / f"{top}.py").is_file() or (here / top / "__init__.py").is_file():
        as_file = where.replace(".", "/") + ".py"
        return (
            f"TASKSET {spec!r}: no module named {name!r} on the import path; {top} is in the "
            f"current folder, which is not on it: name the file instead ({as_file}:{cls}), "
            f"or run with PYTHONPATH=."
        )
    return (
        f"TASKSET {spec!r}: no module named {name!r} on the import path: install its package, "
        f"add its folder to PYTHONPATH, or name the file (path/to/file.py:Class)"
    )


def resolve_taskset(spec: str) -> type[Taskset[Any, Any]]:
    """A taskset class from a built-in id, `path/to/file.py:Class` or `package.module:Class`."""
    return resolve_target(spec)[0]


def resolve_target(spec: str) -> tuple[type[Taskset[Any, Any]], type[Env[Any]] | None]:
    """The taskset class TASKSET names, and the env class when it names an Env subclass with
    a `taskset_class` (e.g. a `tt.aio.BridgedEnv` around an asyncio env), else None."""
    if spec in BUILTIN:
        return BUILTIN[spec], None
    data = data_target(spec)
    if data is not None:
        cls, fields = data
        path = fields.get("path")
        if path is not None and not Path(path).is_file():
            raise TargetError(f"TASKSET {spec!r}: no file {path}")
        return cls, None
    if ":" not in spec:
        known = ", ".join(sorted(BUILTIN))
        raise TargetError(
            f"TASKSET {spec!r} is not a built-in id ({known}), nor path/to/file.py:Class, "
            f"nor package.module:Class, nor a data file (data.jsonl, data.csv, "
            f"hf:NAME[:SPLIT])"
        )
    where, _, name = spec.rpartition(":")
    if where.endswith(".py") and not Path(where).is_file():
        raise TargetError(f"TASKSET {spec!r}: no file {where}")
    try:
        cls = load_object(spec)
    except LoadError as exc:
        raise TargetError(f"TASKSET {spec!r}: cannot load it: {exc}") from exc
    except ModuleNotFoundError as exc:
        missing = _missing_module(exc, spec)
        if missing is None:
            raise TargetError(f"TASKSET {spec!r}: {import_failure(exc, where)}") from exc
        raise TargetError(missing) from exc
    except Exception as exc:  # the module raised while it ran: one line, not a traceback
        raise TargetError(f"TASKSET {spec!r}: {import_failure(exc, where)}") from exc
    if isinstance(cls, type) and issubclass(cls, Env):
        taskset_cls = getattr(cls, "taskset_class", None)
        if isinstance(taskset_cls, type) and issubclass(taskset_cls, Taskset):
            return taskset_cls, cls
        raise TargetError(
            f"TASKSET {spec!r}: {name} is an Env class without a `taskset_class` (a Taskset "
            f"subclass) to build it around"
        )
    if not (isinstance(cls, type) and issubclass(cls, Taskset)):
        raise TargetError(f"TASKSET {spec!r}: {where} has no Taskset subclass named {name!r}")
    return cls, None
