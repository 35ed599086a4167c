"""The public API is deliberate (as trio's `test_exports` and httpx's `test_exported_members`).

The public names are `__all__` of `trio_tasksets` (the flat API), of its public submodules
(`trio_tasksets.aio`, `trio_tasksets.testing`, `trio_tasksets.tools`, `trio_tasksets.sandboxes`, `trio_tasksets.worker`,
`trio_tasksets.redis`), pinned below: adding or
dropping one is a change to this file and to CHANGELOG.md. Every other module of the package
is private (a leading underscore: `trio_tasksets._core.window`, `trio_tasksets.aio._guest`; trio's
`trio._core`, httpx's `httpx._client`), so:

* no module is public but the pinned ones (and `__main__`);
* each package's `__init__` states its names in a sorted `__all__`; a public one binds no
  other public name than its submodules;
* the public classes and functions a public module defines are in its `__all__`;
* the docs (README.md, docs/*.md but the internals' maps `architecture.md` and
  `benchmarks.md`, examples/) use only public names: every `tt.NAME` and
  ``from trio_tasksets import NAME`` is in the flat API, every ``tt.aio.NAME`` /
  ``tt.testing.NAME`` and ``from trio_tasksets.SUB import NAME`` in that public submodule, and
  a dotted ``trio_tasksets.SUB`` in the prose names a public submodule (a ``module:Name``
  the program prints is not a name the docs teach).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path
from types import ModuleType

import pytest

import trio_tasksets as tt

ROOT = Path(__file__).resolve().parent.parent

FLAT = [
    "AdaptiveBounds",
    "AdaptiveWindow",
    "CallObserver",
    "ClientDescription",
    "Completion",
    "ConfigError",
    "ConfigTypeError",
    "CsvConfig",
    "CsvTaskset",
    "DatasetError",
    "EchoClient",
    "EchoStreamConfig",
    "EchoStreamTaskset",
    "EchoTaskset",
    "EmptyEvalError",
    "EndpointCalls",
    "EndpointLimits",
    "EngineControl",
    "Env",
    "EnvClient",
    "EnvServerError",
    "Episode",
    "EpisodeError",
    "EpisodeTask",
    "EvalConfig",
    "EvalConfigError",
    "EvalResult",
    "ExecResult",
    "Group",
    "GroupFailedError",
    "HFConfig",
    "HFTaskset",
    "HTTPClient",
    "InProcess",
    "JsonlConfig",
    "JsonlTaskset",
    "ModelClient",
    "ModelClientBase",
    "ModelConnectionError",
    "ModelContext",
    "ModelError",
    "ModelHTTPError",
    "ModelResponseError",
    "ModelTimeoutError",
    "OpenAIClient",
    "Policy",
    "RateLimiter",
    "Request",
    "Response",
    "RetryPolicy",
    "RolloutLimits",
    "RolloutTimeoutError",
    "RunSlot",
    "Sampling",
    "Sandbox",
    "ServedBackend",
    "SlotBackend",
    "Staleness",
    "StalledError",
    "Task",
    "Taskset",
    "TasksetConfig",
    "Timeouts",
    "Tokens",
    "Tool",
    "ToolCall",
    "ToolEnv",
    "TrioTasksetsError",
    "VLLMControl",
    "VersionSpan",
    "Window",
    "__version__",
    "aio",
    "api_key_from_env",
    "as_completed",
    "batches",
    "build_window",
    "chat_messages",
    "current_sandbox",
    "fan_out",
    "first",
    "group_advantages",
    "group_feed",
    "merge",
    "observe_calls",
    "parked",
    "parse_window",
    "report",
    "report_outcome",
    "report_progress",
    "rescore",
    "rest",
    "run_eval",
    "run_group",
    "run_stream",
    "sandboxes",
    "spawn_server",
    "sticky",
    "take",
    "testing",
    "tool",
    "tools",
    "until",
]

PUBLIC_SUBMODULES = {
    "aio": [
        "AsyncioCancelled",
        "AsyncioModelContext",
        "AsyncioTaskset",
        "BridgedEnv",
        "GuestRunStopped",
        "TrioAsyncioUnavailable",
        "bridge_env",
        "run_eval",
        "run_stream",
        "run_trio",
        "verifiers_env",
    ],
    "testing": [
        "ASSISTANT",
        "EOS",
        "Feed",
        "FeedTaskset",
        "Gate",
        "MemoryTaskQueue",
        "ScriptExhausted",
        "ScriptedCall",
        "ScriptedClient",
        "SimulatedEngine",
        "reply",
    ],
    "sandboxes": [
        "ExecResult",
        "ExecTimeoutError",
        "Limits",
        "NoSandboxError",
        "Sandbox",
        "SandboxError",
        "SandboxFactory",
        "SandboxStartError",
        "bwrap",
        "current_or_none",
        "current_sandbox",
        "docker",
        "effective_timeout",
        "load",
        "local",
        "open_sandbox",
        "parse",
        "using",
    ],
    "tools": [
        "Tool",
        "ToolArgumentError",
        "list_dir",
        "read_file",
        "shell",
        "tool",
        "write_file",
    ],
    # The worker side: a feed of one's own implements `worker.TaskQueue` and runs
    # `worker.consume` over it.
    "worker": [
        "EntryRefused",
        "Finished",
        "MalformedEntry",
        "TaskEntry",
        "TaskQueue",
        "WorkerReport",
        "consume",
        "plain_task",
        "run_by",
        "run_group_by",
    ],
    "redis": [
        "EntryRef",
        "MalformedEntry",
        "Published",
        "RedisResults",
        "RedisStreamTaskset",
        "RedisTask",
        "RedisTaskQueue",
        "TASK_FIELD",
        "ViaBackend",
        "check_url",
        "decode_task",
        "encode_task",
        "enqueue",
    ],
}


def _public(module: ModuleType, name: str) -> object:
    return getattr(module, name)


def test_the_flat_api_is_exactly_the_pinned_names() -> None:
    assert tt.__all__ == FLAT  # sorted, and nothing added or dropped by accident
    for name in tt.__all__:
        assert hasattr(tt, name), name
    namespace: dict[str, object] = {}
    exec("from trio_tasksets import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == sorted(FLAT)


@pytest.mark.parametrize("name", sorted(PUBLIC_SUBMODULES))
def test_each_public_submodule_exports_exactly_its_pinned_names(name: str) -> None:
    module = importlib.import_module(f"trio_tasksets.{name}")
    assert sorted(module.__all__) == sorted(PUBLIC_SUBMODULES[name])
    for export in module.__all__:
        assert hasattr(module, export), f"trio_tasksets.{name}.{export}"


def _packages() -> list[str]:
    found = ["trio_tasksets"]
    for info in pkgutil.walk_packages(tt.__path__, "trio_tasksets."):
        if info.ispkg and not info.name.endswith("__main__"):
            found.append(info.name)
    return found


def _is_private(module: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in module.split("."))


def _modules() -> list[str]:
    return [info.name for info in pkgutil.walk_packages(tt.__path__, "trio_tasksets.")]


def test_no_module_is_public_but_the_pinned_ones() -> None:
    """A module added without a leading underscore (or left public by a merge) fails here:
    make it private, or pin it above (and in CHANGELOG.md) if it is meant to be public."""
    public = {f"trio_tasksets.{name}" for name in [*PUBLIC_SUBMODULES, "__main__"]}
    assert sorted(m for m in _modules() if not _is_private(m) and m not in public) == []
    assert public <= set(_modules())  # the check sees the modules it allows


OLD_PATHS = [
    *["window", "env", "models", "eval", "serve", "cli", "aio.guest", "redis.feed"],
    *["client", "distributed", "queue", "consumer"],  # shims and modules of 0.x, removed
]


@pytest.mark.parametrize("old", OLD_PATHS)
def test_the_old_implementation_paths_are_gone(old: str) -> None:
    """CHANGELOG.md: the implementation modules moved to private names, the old paths'
    shims are gone, and `queue` and `consumer` are one package, `worker`."""
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("trio_tasksets." + old)


@pytest.mark.parametrize("package", _packages())
def test_every_package_states_its_public_names(package: str) -> None:
    """A package's `__init__` binds its `__all__`, sorted and resolvable; a public package
    binds no other public name of the project's but its submodules: a helper imported or
    defined there without being listed fails here. (A private package's names are the
    project's own business: its `__all__` says what its rooms share.)"""
    module = importlib.import_module(package)
    assert isinstance(getattr(module, "__all__", None), list), f"{package} has no __all__"
    exports: list[str] = module.__all__
    if package != "trio_tasksets.redis":  # its order groups the entry format first
        assert exports == sorted(exports), f"{package}.__all__ is not sorted"
    assert len(set(exports)) == len(exports)
    submodules = {info.name for info in pkgutil.iter_modules(module.__path__)}
    for name, value in vars(module).items():
        if name.startswith("_") or name in exports:
            continue
        home = value.__name__ if isinstance(value, ModuleType) else getattr(value, "__module__", "")
        if not isinstance(home, str) or not home.startswith("trio_tasksets"):
            continue  # what the package imports from elsewhere (typing, the stdlib, trio)
        if _is_private(package):
            continue
        leak = f"{package}.{name} is public but not in its __all__"
        assert isinstance(value, ModuleType), leak
        assert name in submodules, leak


@pytest.mark.parametrize("name", ["testing"])
def test_what_a_public_module_defines_is_exported_or_private(name: str) -> None:
    module = importlib.import_module(f"trio_tasksets.{name}")
    defined = [
        n
        for n, value in vars(module).items()
        if (inspect.isclass(value) or inspect.isfunction(value))
        and value.__module__ == module.__name__
        and not n.startswith("_")
    ]
    assert sorted(set(defined) - set(module.__all__)) == []


# --- what the docs name ---------------------------------------------------------------------

DOCS = sorted(
    [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").glob("*.py")]
)
INTERNAL_MAPS = {"architecture.md", "benchmarks.md"}
FROM_IMPORT = re.compile(
    r"^\s*from (trio_tasksets(?:\.\w+)*) import (?:\(([\w\s,]*)\)|([\w ,]+)$)", re.M
)
ATTRIBUTE = re.compile(r"(?<![\w.])tt\.(\w+)(?:\.(\w+))?")
DOTTED = re.compile(r"(?<![\w./])trio_tasksets\.(\w+)(?![\w.]*:)")  # not a printed `mod:Name`


def _doc_texts() -> list[tuple[str, str]]:
    return [(p.name, p.read_text(encoding="utf-8")) for p in DOCS if p.name not in INTERNAL_MAPS]


def test_the_docs_use_only_public_names() -> None:
    wrong: list[str] = []
    for file, text in _doc_texts():
        for match in FROM_IMPORT.finditer(text):
            where = match[1]
            names = [n for n in re.split(r"[\s,]+", match[2] or match[3]) if n]
            sub = where.removeprefix("trio_tasksets").removeprefix(".")
            allowed = FLAT if not sub else PUBLIC_SUBMODULES.get(sub, [])
            wrong += [f"{file}: from {where} import {n}" for n in names if n not in allowed]
        for match in ATTRIBUTE.finditer(text):
            name, attribute = match[1], match[2]
            if name not in FLAT:
                wrong.append(f"{file}: tt.{name}")
            elif (
                name in PUBLIC_SUBMODULES and attribute and attribute not in PUBLIC_SUBMODULES[name]
            ):
                wrong.append(f"{file}: tt.{name}.{attribute}")
        for match in DOTTED.finditer(text):
            if match[1] not in PUBLIC_SUBMODULES:
                wrong.append(f"{file}: trio_tasksets.{match[1]}")
    assert sorted(set(wrong)) == []


def test_the_doc_scan_sees_the_names_it_checks() -> None:
    """The scan above finds what it looks for (else it would pass on nothing)."""
    seen = {m[1] for _, text in _doc_texts() for m in ATTRIBUTE.finditer(text)}
    assert {"run_stream", "Taskset", "aio", "EvalConfig"} <= seen
    imports = {m[1] for _, text in _doc_texts() for m in FROM_IMPORT.finditer(text)}
    assert {"trio_tasksets", "trio_tasksets.testing", "trio_tasksets.redis"} <= imports
    assert DOTTED.findall("see `trio_tasksets._env.env.WindowFeed`") == ["_env"]
    assert DOTTED.findall(
        "`trio_tasksets.redis` prints trio_tasksets._core.builtin:EchoTaskset"
    ) == ["redis"]
    assert FROM_IMPORT.findall(
        "from trio_tasksets._core.window import (\n    Window, AdaptiveBounds,\n)"
    )


def test_a_class_the_program_records_is_named_by_its_public_home() -> None:
    """An env spec, a Redis entry's declaration and a run's taskset name a class of the
    package where the public API binds it, not by the private module that defines it."""
    from trio_tasksets._core.adaptive import Change
    from trio_tasksets._env.loading import load_object, object_spec, taskset_label
    from trio_tasksets.redis import RedisStreamTaskset

    assert object_spec(tt.EchoTaskset, "the taskset") == "trio_tasksets:EchoTaskset"
    assert taskset_label(tt.EchoTaskset()) == "trio_tasksets:EchoTaskset"
    spec = object_spec(RedisStreamTaskset, "the taskset")
    assert spec == "trio_tasksets.redis:RedisStreamTaskset"
    assert object_spec(Change, "x") == "trio_tasksets._core.adaptive:Change"  # bound nowhere public
    for cls in (tt.EchoTaskset, RedisStreamTaskset, Change):
        assert load_object(object_spec(cls, "x")) is cls
