"""Deadlines that travel through Redis (SPEC 12): a `--via` entry carries its deadline (epoch
seconds) and a worker runs the slot under the time left; an entry taken after its deadline
is answered as timed out, not run. A real redis-server and `run_worker` in this process;
the episodes sleep on the echo model's delay (real time, bounded by `trio.fail_after`)."""

from __future__ import annotations

import functools
import time
from typing import Any

import pytest
import redis
import trio
from helpers import needs
from test_redis import Names, Server, make_tasks, names, r, results, server, wait_for

import trio_tasksets as tt
from trio_tasksets._env.spec import Declaration
from trio_tasksets.redis import TASK_FIELD, EntryRef, encode_task
from trio_tasksets.redis._entries import (
    DEADLINE_FIELD,
    ENV_FIELD,
    MalformedEntry,
    deadline_field,
    decode_entry,
)
from trio_tasksets.redis._worker import WorkerConfig, run_worker

pytestmark = needs("redis-server", why="deadlines over a real Redis")
__all__ = ["names", "r", "server"]  # the fixtures, used by name

MARGIN = 1.5  # seconds an answer may come after the deadline, on a loaded machine


async def _work(
    server: Server,
    r: redis.Redis,
    names: Names,
    delay: float,
    count: int,
    env: tt.Env[Any] | None = None,
) -> None:
    config = WorkerConfig(server.url, names.stream, names.group, names.results, consumer="me",
                          max_concurrent=4, dashboard=False)  # fmt: skip
    ctx = tt.ModelContext(tt.EchoClient(delay=delay), "echo")
    async with trio.open_nursery() as nursery:
        start = functools.partial(run_worker, config, ctx, env=env, handle_signals=False, log=print)
        shut_down = await nursery.start(start)
        await wait_for(lambda: r.xlen(names.results) >= count)
        shut_down("told")


def _push(
    r: redis.Redis, stream: str, deadline: float | None, key: str = "t:0", env: str | None = None
) -> None:
    task = tt.Task("Repeat exactly: hi", answer="hi", key=key)
    fields: dict[Any, Any] = {TASK_FIELD: encode_task(task)}
    if deadline is not None:
        fields[DEADLINE_FIELD] = repr(deadline)
    if env is not None:
        fields[ENV_FIELD] = env
    r.xadd(stream, fields)


async def test_an_expired_entry_is_answered_as_timed_out_not_run(
    server: Server, r: redis.Redis, names: Names
) -> None:
    _push(r, names.stream, time.time() - 5.0)
    _push(r, names.stream, None, key="t:1")  # no deadline: runs
    await _work(server, r, names, delay=0.0, count=2)
    rows = {row["row"]["task"]["key"]: row["row"] for row in results(r, names.results)}
    late = rows["t:0"]
    assert late["ok"] is False
    assert late["attempts"] == 0  # not run
    assert late["completion"] is None
    assert [e["type"] for e in late["errors"]] == ["DeadlineExceededError"]
    assert "before a worker took it: not run" in late["errors"][0]["message"]
    assert rows["t:1"]["ok"] is True


async def test_a_slot_runs_under_the_time_left_of_its_entry(
    server: Server, r: redis.Redis, names: Names
) -> None:
    """A rollout with 1 s left on the eval's side: its remote episode (60 s of model
    latency) is cut within the margin, and answered."""
    began = time.monotonic()
    _push(r, names.stream, time.time() + 1.0)
    await _work(server, r, names, delay=60.0, count=1)
    took = time.monotonic() - began
    (row,) = [found["row"] for found in results(r, names.results)]
    assert row["ok"] is False
    assert row["errors"][-1]["type"] == "DeadlineExceededError"
    assert "while it ran" in row["errors"][-1]["message"]
    assert row["attempts"] == 1
    assert took < 1.0 + MARGIN + 1.0  # + the worker's own start and stop


async def test_an_entry_with_time_in_hand_runs(
    server: Server, r: redis.Redis, names: Names
) -> None:
    _push(r, names.stream, time.time() + 60.0)
    await _work(server, r, names, delay=0.0, count=1)
    (row,) = [found["row"] for found in results(r, names.results)]
    assert (row["ok"], row["errors"]) == (True, [])


async def test_the_rollout_limits_an_eval_sets_hold_on_the_worker(
    server: Server, r: redis.Redis, names: Names
) -> None:
    """The eval's env has a 1 s rollout timeout, the worker's none: the entry's declaration
    (what an `--via` eval writes, `Declaration.of(env, ctx)`) carries the eval's limits
    whole, and the worker runs the slot under them (60 s of model latency, cut at 1 s)."""
    ctx = tt.ModelContext(tt.EchoClient(), "echo")
    eval_env: tt.Env[tt.Task] = tt.Env(
        tt.Taskset(), rollout_limits=tt.RolloutLimits(rollout_timeout=1.0)
    )
    declared = Declaration.of(eval_env, ctx)
    assert declared.limits == eval_env.rollout_limits
    _push(r, names.stream, None, env=declared.to_json())
    began = time.monotonic()
    await _work(server, r, names, delay=60.0, count=1, env=tt.Env(tt.Taskset()))
    took = time.monotonic() - began
    (row,) = [found["row"] for found in results(r, names.results)]
    assert (row["ok"], [e["type"] for e in row["errors"]]) == (False, ["RolloutTimeoutError"])
    assert took < 1.0 + MARGIN + 1.0  # + the worker's own start and stop


async def test_the_deadline_field_is_the_callers_deadline_in_epoch_seconds() -> None:
    assert deadline_field() is None
    with trio.move_on_after(2.0):
        field = deadline_field()
        await trio.lowlevel.checkpoint()
    assert field is not None
    assert time.time() + 1.9 < float(field) <= time.time() + 2.0


@pytest.mark.parametrize("bad", ["soon", "nan", "inf", ""])
def test_a_malformed_deadline_is_a_malformed_entry(bad: str) -> None:
    fields = {TASK_FIELD: encode_task(make_tasks(1)[0]).decode(), DEADLINE_FIELD: bad}
    with pytest.raises(MalformedEntry, match="'deadline' is not epoch seconds"):
        decode_entry(EntryRef("s", "g", "1-0"), fields)
