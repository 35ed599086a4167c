"""The eval's contract on every slot backend, as anyio runs its tests on every backend.

Each test runs once per backend: in process, served (a real `trio-tasksets serve` child) and
via Redis (a real redis-server and two workers, `run_worker` in this trio run). The env is
`tests/fixtures/redis_env.py:TwoTurns` (its own task type, reward and Env subclass: what
must travel) against the fake OpenAI server `tests/fixtures/chat_server.py`, which counts
every model call wherever it comes from: in this process, the server child or a worker.
"""

from __future__ import annotations

import functools
import json
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

import trio_tasksets as tt
from trio_tasksets._core.adaptive import AdaptiveBounds
from trio_tasksets._env.backend import DescribedBackend, InProcess
from trio_tasksets._env.loading import resolve_target

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
from chat_server import ChatServer
from helpers import need

REDIS_ENV = str(Path(__file__).resolve().parent / "fixtures" / "redis_env.py")
BACKENDS = ["in_process", "served", "via"]
SAME = ("task", "rollout", "ok", "reward", "completion", "messages", "errors", "attempts")


def make_env() -> tt.Env[Any]:
    taskset_cls, env_cls = resolve_target(f"{REDIS_ENV}:TwoTurns")
    env: tt.Env[Any] = (env_cls or tt.Env)(taskset_cls())
    env.retries = tt.RetryPolicy(max_retries=2, include=("ModelHTTPError",), backoff=0.0)
    return env


def comparable(rows: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    """Rows by slot, without what differs between any two runs (id, timing)."""
    return {(row["task"]["key"], row["rollout"]): {k: row[k] for k in SAME} for row in rows}


def trace_rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "traces.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def chat() -> Iterator[ChatServer]:
    with ChatServer(delay=0.02) as server:  # long enough for calls to overlap
        yield server


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "via":  # here: a skip raised in the async test would lose its reason
        need("redis-server", why="slots run by workers over a real Redis")
    return str(request.param)


@pytest.fixture
def ctx(chat: ChatServer) -> tt.ModelContext:
    chat.reset()
    return tt.ModelContext(tt.OpenAIClient(chat.url, max_retries=0), "m")


@asynccontextmanager
async def running_on(
    backend: str, request: pytest.FixtureRequest, ctx: tt.ModelContext
) -> AsyncIterator[dict[str, Any]]:
    """The `EvalConfig` settings that put the slots on `backend`, with what it needs running
    meanwhile (two workers for `via`, each allowed more than the eval's window)."""
    if backend == "in_process":
        yield {}
    elif backend == "served":
        yield {"serve": True}  # the shorthand of backend=tt.ServedBackend()
    else:
        from trio_tasksets.redis._worker import WorkerConfig, run_worker

        url = request.getfixturevalue("redis_server").url  # the session's, keys of our own
        tag = uuid.uuid4().hex[:8]
        async with trio.open_nursery() as nursery:
            stops = []
            for i in range(2):
                config = WorkerConfig(url, f"{tag}:tasks", f"{tag}:g", f"{tag}:results",
                                      consumer=f"w{i}", max_concurrent=8, dashboard=False)  # fmt: skip
                run = functools.partial(
                    run_worker, config, ctx, env=make_env(), handle_signals=False,
                    log=lambda line: None,
                )  # fmt: skip
                stops.append(await nursery.start(run))
            from trio_tasksets.redis import ViaBackend

            yield {"backend": ViaBackend(url, stream=f"{tag}:tasks")}
            for stop in stops:
                stop("done")


def eval_config(tmp_path: Path, name: str, **kw: Any) -> tt.EvalConfig:
    return tt.EvalConfig(output_dir=str(tmp_path), run_name=name, dashboard=False, **kw)


async def test_rows_equal_an_in_process_evals(
    backend: str, request: pytest.FixtureRequest, ctx: tt.ModelContext, tmp_path: Path
) -> None:
    shape = {"num_examples": 6, "rollouts_per_example": 2}
    local = await tt.run_eval(make_env(), ctx, eval_config(tmp_path, "local", **shape))
    async with running_on(backend, request, ctx) as where:
        there = await tt.run_eval(make_env(), ctx, eval_config(tmp_path, "there", **shape, **where))
    expected = comparable(trace_rows(local.run_dir))
    assert len(expected) == 12
    assert comparable(trace_rows(there.run_dir)) == expected
    assert all(len(row["messages"]) == 4 for row in expected.values())  # the Env subclass's
    assert {row["reward"] for row in expected.values()} == {0.0, 0.25, 0.5}  # its own reward
    assert there.summary["finished"] == 12
    assert there.summary["ok"] == 12


async def test_c_bounds_the_model_calls_in_flight_across_workers(
    backend: str, request: pytest.FixtureRequest, chat: ChatServer, ctx: tt.ModelContext,
    tmp_path: Path,
) -> None:  # fmt: skip
    async with running_on(backend, request, ctx) as where:
        chat.reset()
        result = await tt.run_eval(
            make_env(), ctx, eval_config(tmp_path, "c3", num_examples=12, max_concurrent=3, **where)
        )
    assert result.summary["ok"] == 12
    assert len(chat.requests) == 24  # two turns per episode
    # -c 3 bounds every call, wherever it is made (the via workers may take 8 each):
    assert 2 <= chat.peak <= 3


async def test_groups_give_the_same_rows_and_c_counts_their_live_rollouts(
    backend: str, request: pytest.FixtureRequest, chat: ChatServer, ctx: tt.ModelContext,
    tmp_path: Path,
) -> None:  # fmt: skip
    """`--group -r 3 -c 3` (SPEC 10): the rows of an in-process run, each group's written
    together, and at most 3 rollouts live wherever they run (`--via`: a group on one worker,
    whose own window would take 8)."""
    shape = {"num_examples": 4, "rollouts_per_example": 3, "group": True, "max_concurrent": 3}
    local = await tt.run_eval(make_env(), ctx, eval_config(tmp_path, "local", **shape))
    async with running_on(backend, request, ctx) as where:
        chat.reset()
        there = await tt.run_eval(make_env(), ctx, eval_config(tmp_path, "there", **shape, **where))
    rows = trace_rows(there.run_dir)
    assert comparable(rows) == comparable(trace_rows(local.run_dir))
    assert len(rows) == 12
    groups = [row["group"] for row in rows]
    assert all(groups[i] == groups[i - 1] for i in range(1, 12) if i % 3)  # written together
    assert len(set(groups)) == 4
    if backend == "via":  # each group ran on one worker
        assert all(len({r["worker"] for r in rows if r["group"] == g}) == 1 for g in groups)
    assert len(chat.requests) == 24
    assert 2 <= chat.peak <= 3


async def test_resume_runs_exactly_the_owed_slots(
    backend: str, request: pytest.FixtureRequest, chat: ChatServer, ctx: tt.ModelContext,
    tmp_path: Path,
) -> None:  # fmt: skip
    async with running_on(backend, request, ctx) as where:
        first = await tt.run_eval(
            make_env(), ctx, eval_config(tmp_path, "run", num_examples=6, **where)
        )
        traces = first.run_dir / "traces.jsonl"
        lines = traces.read_text().splitlines(keepends=True)
        traces.write_text("".join(lines[:4]))  # as if killed after four rows
        chat.reset()
        resumed = await tt.run_eval(
            make_env(), ctx, eval_config(tmp_path, "run", num_examples=6, resume=True, **where)
        )
    assert len(chat.requests) == 2 * 2  # the two owed slots, two turns each
    assert resumed.summary["kept_from_resume"] == 4
    assert comparable(trace_rows(resumed.run_dir)) == comparable(
        [json.loads(line) for line in lines]
    )


# duplicates: every test here runs an eval on each backend the same way; what each asserts differs
async def test_a_429_reaches_an_adaptive_window(
    backend: str, request: pytest.FixtureRequest, chat: ChatServer, ctx: tt.ModelContext,
    tmp_path: Path,
) -> None:  # fmt: skip
    async with running_on(backend, request, ctx) as where:
        chat.reset()
        chat.statuses = [429]  # the first model call is rate-limited; its episode retries
        result = await tt.run_eval(
            make_env(), ctx,
            eval_config(tmp_path, "adaptive", num_examples=4,
                        max_concurrent=AdaptiveBounds(1, 4, 8), **where),
        )  # fmt: skip
    assert result.summary["ok"] == 4
    [failed] = [row for row in trace_rows(result.run_dir) if row["errors"]]
    assert failed["errors"][0]["type"] == "ModelHTTPError"
    assert failed["errors"][0]["status"] == 429  # data, not text: read by the remote window
    reasons = [reason for _, _, reason in result.summary["window_history"]]
    assert any(reason.startswith("429") for reason in reasons), reasons


# --- choosing the backend -----------------------------------------------------------------


def test_serve_is_the_shorthand_of_a_served_backend() -> None:
    config = tt.EvalConfig(serve=True, workers=2)
    assert config.backend == tt.ServedBackend(workers=2)
    assert isinstance(config.backend, DescribedBackend)
    assert config.backend.remote
    assert type(config.backend).__module__ == "trio_tasksets._serve.slots"
    assert tt.EvalConfig().backend == InProcess()
    # Resolved once: evolving the config keeps its backend and asks for nothing again.
    assert attrs.evolve(config, num_examples=3).backend == tt.ServedBackend(workers=2)
    running = tt.ServedBackend(server_url="http://127.0.0.1:1", token="secret")
    assert "secret" not in repr(tt.EvalConfig(backend=running))  # the token is never shown
    assert tt.EvalConfig(backend=running).backend.token == "secret"  # type: ignore[attr-defined]


def test_the_built_in_backends_describe_themselves() -> None:
    """What the command line asks, instead of its own arguments; config.json's keys."""
    spawned, running = tt.ServedBackend(workers=3), tt.ServedBackend(server_url="http://h")
    assert (spawned.parameter, spawned.uses_env, spawned.uses_client) == ("serve", True, True)
    assert (running.parameter, running.uses_env, running.uses_client) == (
        "server_url", False, True,
    )  # fmt: skip
    assert spawned.settings == {"serve": True, "workers": 3, "server_url": None}
    local = InProcess()
    assert (local.remote, local.parameter, local.settings) == (False, None, {})
    pytest.importorskip("hiredis")
    from trio_tasksets.redis import ViaBackend

    via = ViaBackend("redis://h", stream="s")
    assert (via.parameter, via.uses_env, via.uses_client) == ("via", False, False)
    assert via.settings == {"via": "redis://h", "stream": "s"}
    assert all(isinstance(b, DescribedBackend) for b in (spawned, running, local, via))


@pytest.mark.parametrize(
    ("settings", "names"),
    [({"workers": 2}, ("workers", "serve")),
     ({"workers": 0}, ("workers",)),
     ({"serve": True, "workers": 0}, ("workers",)),
     ({"serve": "yes"}, ("serve",)),
     ({"backend": "in process"}, ("backend",)),
     ({"serve": True, "backend": tt.ServedBackend()}, ("backend", "serve"))],
)  # fmt: skip
def test_contradicting_settings_name_their_parameters(
    settings: dict[str, Any], names: tuple[str, ...]
) -> None:
    with pytest.raises(tt.EvalConfigError) as raised:
        tt.EvalConfig(**settings)
    assert raised.value.parameters == names
    assert str(raised.value).startswith(names[0])
    assert "--" not in str(raised.value)  # the library names parameters, not flags


@pytest.mark.parametrize(
    ("build", "names"),
    [(lambda: tt.ServedBackend(server_url="ftp://h"), ("server_url",)),
     (lambda: tt.ServedBackend(workers=0), ("workers",)),
     (lambda: tt.ServedBackend(server_url="http://h", workers=2),
      ("workers", "serve", "server_url"))],
)  # fmt: skip
def test_a_built_in_backend_is_valid_once_built(build: Any, names: tuple[str, ...]) -> None:
    with pytest.raises(tt.EvalConfigError) as raised:
        build()
    assert raised.value.parameters == names


def test_a_via_backend_is_valid_once_built() -> None:
    pytest.importorskip("hiredis")
    from trio_tasksets.redis import ViaBackend

    with pytest.raises(tt.EvalConfigError) as raised:
        ViaBackend("http://h")
    assert raised.value.parameter == "via"
    with pytest.raises(tt.EvalConfigError) as raised:
        ViaBackend("redis://h", stream="")
    assert raised.value.parameter == "stream"


async def test_a_backend_of_ones_own_runs_every_slot(tmp_path: Path) -> None:
    """`EvalConfig(backend=...)` takes any object with the protocol (a new transport)."""
    opened: list[int] = []

    class Counting:
        remote = False

        def check(self, env: tt.Env[Any], ctx: tt.ModelContext) -> None:
            pass

        async def reach(self) -> Counting:
            return self

        @asynccontextmanager
        async def open(
            self, env: tt.Env[Any], ctx: tt.ModelContext, **_: Any
        ) -> AsyncIterator[Any]:
            async with InProcess().open(env, ctx, **_) as run:

                def counted(slot: tt.RunSlot[Any], **kw: Any) -> Any:
                    opened.append(1)
                    return run(slot, **kw)

                yield counted

    env = tt.Env(tt._core.builtin.EchoTaskset())
    ctx = tt.ModelContext(tt.EchoClient(), "echo")
    result = await tt.run_eval(
        env, ctx, eval_config(tmp_path, "own", num_examples=5, backend=Counting())
    )
    assert result.summary["ok"] == 5
    assert len(opened) == 5
    assert "backend" in json.loads((result.run_dir / "config.json").read_text())["eval"]
    with pytest.raises(tt.EvalConfigError, match="choose one") as raised:
        eval_config(tmp_path, "x", backend=Counting(), serve=True)
    assert raised.value.parameter == "backend"
