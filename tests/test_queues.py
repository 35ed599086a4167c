"""The worker side's conformance suite (issue 20): the worker loop (`consume`) over every
`TaskQueue`, as anyio runs its tests on every backend.

Each test runs twice: over `tt.testing.MemoryTaskQueue` on trio's MockClock, and over
`RedisTaskQueue` against the session's real redis-server (real time, every wait under
`trio.fail_after`). A queue of one's own (a NATS feed, say) joins by adding a `Harness`.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, cast

import attrs
import pytest
import redis
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis_server import RedisServer

import trio_tasksets as tt
from trio_tasksets._env.spec import Declaration
from trio_tasksets.testing import MemoryTaskQueue
from trio_tasksets.worker import (
    MalformedEntry,
    TaskEntry,
    TaskQueue,
    WorkerReport,
    consume,
    plain_task,
)

Row = dict[str, Any]


class Harness:
    """One kind of queue: entries in, rows out, what is still unacknowledged."""

    clock: trio.abc.Clock | None = None

    def queue(self, consumer: str, *, claim_idle: float = 60.0) -> TaskQueue:
        raise NotImplementedError

    def put(self, task: Any, **fields: Any) -> None:
        raise NotImplementedError

    def answers(self) -> list[list[Row]]:
        """Each answer's rows (one, or a group's), in publish order."""
        raise NotImplementedError

    def unacknowledged(self) -> int:
        raise NotImplementedError

    def refused(self) -> list[str]:
        raise NotImplementedError

    async def crashed(self, queue: TaskQueue) -> None:
        """What happens once a worker has crashed: its entries become another's to take."""

    def rows(self) -> list[Row]:
        return [row for rows in self.answers() for row in rows]


class Memory(Harness):
    def __init__(self) -> None:
        self.clock = trio.testing.MockClock(autojump_threshold=0)
        self.memory = MemoryTaskQueue("w0")

    def queue(self, consumer: str, *, claim_idle: float = 60.0) -> TaskQueue:
        self.memory.restart(consumer)
        return self.memory

    def put(self, task: Any, **fields: Any) -> None:
        self.memory.put(task, **fields)

    def answers(self) -> list[list[Row]]:
        return [[e.to_row() for e in finished.episodes] for finished in self.memory.answered]

    def unacknowledged(self) -> int:
        return len(self.memory.held)

    def refused(self) -> list[str]:
        return [reason for _, reason in self.memory.refused]

    async def crashed(self, queue: TaskQueue) -> None:
        self.memory.reclaim()


class Redis(Harness):
    def __init__(self, server: RedisServer) -> None:
        self.url = server.url
        tag = uuid.uuid4().hex[:8]
        self.stream, self.group, self.results = f"{tag}:tasks", f"{tag}:g", f"{tag}:results"
        self.r = redis.Redis.from_url(server.url, decode_responses=True)

    def queue(self, consumer: str, *, claim_idle: float = 60.0) -> TaskQueue:
        from trio_tasksets.redis import RedisTaskQueue

        return RedisTaskQueue(self.url, self.stream, self.group, consumer, self.results,
                              claim_idle=claim_idle, block=0.1, log=lambda line: None)  # fmt: skip

    def put(self, task: Any, **fields: Any) -> None:
        from trio_tasksets.redis._entries import encode_task

        entry: dict[str, str] = {"task": encode_task(task).decode()}
        entry.update({name: str(value) for name, value in fields.items()})
        if "declared" in entry:
            entry["env"] = entry.pop("declared")
        self.r.xadd(self.stream, entry)  # type: ignore[arg-type]

    def answers(self) -> list[list[Row]]:
        out: list[list[Row]] = []
        found = cast(list[tuple[str, dict[str, str]]], self.r.xrange(self.results))
        for _id, fields in found:
            if "rows" in fields:
                out.append(json.loads(fields["rows"]))
            else:
                out.append([json.loads(fields["row"])])
        return out

    def unacknowledged(self) -> int:
        try:
            return int(self.r.xpending(self.stream, self.group)["pending"])
        except redis.ResponseError:
            return 0

    def refused(self) -> list[str]:
        dead = cast(list[tuple[str, dict[str, str]]], self.r.xrange(f"{self.stream}:dead"))
        return [fields["error"] for _id, fields in dead]


@pytest.fixture(params=["memory", "redis"])
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    if request.param == "memory":
        yield Memory()
    else:
        made = Redis(request.getfixturevalue("redis_server"))
        yield made
        made.r.close()


@pytest.fixture
def clock(harness: Harness) -> trio.abc.Clock | None:
    """MockClock (autojump) for the in-memory queue; real time for Redis (pytest-trio runs
    a test on the Clock among its fixtures, if any)."""
    return harness.clock


def tasks(n: int, prefix: str = "t") -> list[tt.Task]:
    return [tt.Task(f"Repeat exactly: {prefix}{i}", answer=f"{prefix}{i}", key=f"{prefix}:{i}")
            for i in range(n)]  # fmt: skip


def echo(delay: float = 0.0) -> tt.ModelContext:
    return tt.ModelContext(tt.EchoClient(delay=delay), "echo")


class Grpo(tt.Env[Any]):
    """Advantage: reward minus the group's mean (every echo rollout gets reward 1.0)."""

    async def score_group(self, task: Any, episodes: list[tt.Episode]) -> None:
        mean = sum(e.reward for e in episodes) / len(episodes)
        for episode in episodes:
            episode.advantage = episode.reward - mean


def env() -> tt.Env[Any]:
    return Grpo(tt.EchoTaskset())


@attrs.define
class Running:
    report: WorkerReport | None = None
    shut_down: Callable[[str], None] | None = None


async def start(
    nursery: trio.Nursery,
    queue: TaskQueue,
    ctx: tt.ModelContext,
    *,
    window: int = 3,
    grace: float = 30.0,
    worker_env: tt.Env[Any] | None = None,
) -> Running:
    running = Running()

    async def run(task_status: trio.TaskStatus[Callable[[str], None]]) -> None:
        running.report = await consume(
            queue, ctx, window=tt.Window(window), env=worker_env or env(), grace=grace,
            live=False, handle_signals=False, log=lambda line: None, task_status=task_status,
        )  # fmt: skip

    running.shut_down = await nursery.start(run)
    return running


async def until(predicate: Callable[[], bool]) -> None:
    """Poll the queue's state (Redis's: no trio event can tell) for at most 20 s."""
    with trio.fail_after(20):
        while not predicate():  # noqa: ASYNC110
            await trio.sleep(0.01)


async def test_every_task_is_answered_exactly_once_within_the_window(
    harness: Harness, clock: trio.abc.Clock | None
) -> None:
    for task in tasks(20):
        harness.put(task)
    async with trio.open_nursery() as nursery:
        running = await start(nursery, harness.queue("w0"), echo(0.05), window=3)
        await until(lambda: len(harness.rows()) >= 20)
        assert running.shut_down is not None
        running.shut_down("done")
    rows = harness.rows()
    assert sorted(row["task"]["key"] for row in rows) == sorted(t.key for t in tasks(20))
    assert all(row["ok"] and row["worker"] == "w0" for row in rows)
    assert harness.unacknowledged() == 0
    assert running.report is not None
    assert running.report.peak == 3  # the window filled, and never more was held
    assert running.report.published == 20


async def test_a_graceful_stop_finishes_what_it_holds_and_leaves_the_rest(
    harness: Harness, clock: trio.abc.Clock | None
) -> None:
    for task in tasks(10):
        harness.put(task)
    queue = harness.queue("w0")
    async with trio.open_nursery() as nursery:
        running = await start(nursery, queue, echo(0.5), window=4)
        await until(lambda: harness.unacknowledged() == 4)
        assert running.shut_down is not None
        running.shut_down("told")
    assert running.report is not None
    assert running.report.published == len(harness.rows()) == 4  # finished within the grace
    assert harness.unacknowledged() == 0  # nothing claimed and left behind
    async with trio.open_nursery() as nursery:  # the rest, for the next worker
        running = await start(nursery, harness.queue("w1"), echo(), window=4)
        await until(lambda: len(harness.rows()) >= 10)
        assert running.shut_down is not None
        running.shut_down("done")
    keys = [row["task"]["key"] for row in harness.rows()]
    assert sorted(keys) == sorted(t.key for t in tasks(10))  # each once: nothing lost


async def test_a_crash_mid_run_leaves_its_entries_to_be_reclaimed(
    harness: Harness, clock: trio.abc.Clock | None
) -> None:
    for task in tasks(2):
        harness.put(task)
    queue = harness.queue("w0", claim_idle=0.5)
    with trio.CancelScope() as crash:
        async with trio.open_nursery() as nursery:
            await start(nursery, queue, echo(30.0), window=2)
            await until(lambda: harness.unacknowledged() == 2)
            crash.cancel()  # as a kill: no grace, no publish
    assert harness.rows() == []
    assert harness.unacknowledged() == 2  # not acknowledged: still owed
    await harness.crashed(queue)
    async with trio.open_nursery() as nursery:
        running = await start(nursery, harness.queue("w1", claim_idle=0.5), echo(), window=2)
        await until(lambda: len(harness.rows()) >= 2)
        assert running.shut_down is not None
        running.shut_down("done")
    rows = harness.rows()
    assert sorted(row["task"]["key"] for row in rows) == ["t:0", "t:1"]
    assert {row["worker"] for row in rows} == {"w1"}
    assert harness.unacknowledged() == 0


async def test_an_entrys_deadline_is_enforced(
    harness: Harness, clock: trio.abc.Clock | None
) -> None:
    late, cut, fine, group = tasks(4)
    harness.put(late, deadline=time.time() - 5)  # passed before any worker took it
    harness.put(cut, deadline=time.time() + 0.3)  # passes while it runs
    harness.put(fine)
    harness.put(group, group="g", rollouts=2, deadline=time.time() + 0.3)  # the whole group
    async with trio.open_nursery() as nursery:
        running = await start(nursery, harness.queue("w0"), echo(1.0), window=5)
        await until(lambda: len(harness.rows()) >= 5)
        assert running.shut_down is not None
        running.shut_down("done")
    grouped = [row for row in harness.rows() if row["task"]["key"] == group.key]
    assert [row["rollout"] for row in grouped] == [0, 1]  # answered together, as one group
    for row in grouped:
        assert not row["ok"]
        assert row["group"] == "g"
        assert row["errors"][-1]["type"] == "DeadlineExceededError"
    rows = {row["task"]["key"]: row for row in harness.rows()}
    assert rows[fine.key]["ok"]
    for key, attempts, what in [(late.key, 0, "before a worker took it"), (cut.key, 1, "while")]:
        row = rows[key]
        assert not row["ok"]
        assert row["attempts"] == attempts
        assert row["errors"][-1]["type"] == "DeadlineExceededError"
        assert what in row["errors"][-1]["message"]


# duplicates: each test starts a worker on the harness alike; what it puts and asserts differs
async def test_a_group_entry_runs_on_one_worker_and_is_answered_as_one(
    harness: Harness, clock: trio.abc.Clock | None
) -> None:
    for i, task in enumerate(tasks(3)):
        harness.put(task, group=f"g{i}", rollouts=4)
    async with trio.open_nursery() as nursery:
        running = await start(nursery, harness.queue("w0"), echo(0.05), window=4)
        await until(lambda: len(harness.answers()) >= 3)
        assert running.shut_down is not None
        running.shut_down("done")
    answers = harness.answers()
    assert [len(rows) for rows in answers] == [4, 4, 4]  # each group's rows together
    for rows in answers:
        assert [row["rollout"] for row in rows] == [0, 1, 2, 3]
        assert len({row["group"] for row in rows}) == 1
        assert len({row["task"]["key"] for row in rows}) == 1
        assert all(row["advantage"] == 0.0 and row["ok"] for row in rows)  # score_group ran
    assert harness.unacknowledged() == 0
    assert running.report is not None
    # Held entries never exceed the window; once a group of 4 is known, a read of new
    # entries counts 4 places per entry (the first read could not know).
    assert running.report.peak <= 4
    assert running.report.room() == 1


async def test_an_entry_declared_for_another_env_is_refused_not_run(
    harness: Harness, clock: trio.abc.Clock | None
) -> None:
    other = Declaration("elsewhere.py:Other")
    [a, b] = tasks(2)
    harness.put(a, declared=other.to_json())
    harness.put(b)
    async with trio.open_nursery() as nursery:
        running = await start(nursery, harness.queue("w0"), echo(), window=2)
        await until(lambda: len(harness.rows()) >= 1 and len(harness.refused()) >= 1)
        assert running.shut_down is not None
        running.shut_down("done")
    assert [row["task"]["key"] for row in harness.rows()] == [b.key]
    [reason] = harness.refused()
    assert "declared for taskset elsewhere.py:Other" in reason
    assert "start the worker with taskset elsewhere.py:Other" in reason
    assert harness.unacknowledged() == 0


def test_the_loop_works_with_any_object_of_the_protocol() -> None:
    assert isinstance(MemoryTaskQueue(), TaskQueue)
    with pytest.raises(ValueError, match="rollouts"):
        tt.testing.MemoryTaskQueue().put(tasks(1)[0], rollouts=0)
    from trio_tasksets.redis import RedisTaskQueue

    queue = RedisTaskQueue("redis://127.0.0.1:1/0", "s", "g", "c", "r", log=print)
    assert isinstance(queue, TaskQueue)
    assert queue.keep_alive_every == pytest.approx(20.0)
    queue.results.close()


# --- the loop's invariants over random schedules (the memory queue, MockClock) ---------------


class Counting(Grpo):
    """`Grpo` that records the most rollouts running at once."""

    live = 0
    most = 0

    async def rollout(self, task: Any, ctx: tt.ModelContext) -> Any:
        Counting.live += 1
        Counting.most = max(Counting.most, Counting.live)
        try:
            return await super().rollout(task, ctx)
        finally:
            Counting.live -= 1


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=10),
    window=st.integers(1, 5),
    crash_at=st.one_of(st.none(), st.integers(0, 5)),
)
async def test_every_entry_is_answered_once_and_the_window_holds_whatever_the_schedule(
    autojump_clock: trio.testing.MockClock, sizes: list[int], window: int, crash_at: int | None
) -> None:
    """Entries (single or groups of 1-4) through a worker that may crash mid-run and a second
    one after the reclaim: each entry answered exactly once, a group's rows together and
    complete, at most `window` rollouts running and entries held, nothing left held."""
    Counting.live = Counting.most = 0
    queue = MemoryTaskQueue("w0")
    for i, size in enumerate(sizes):
        task = tt.Task(f"Repeat exactly: {i}", answer=str(i), key=f"t:{i}")
        if size == 1:
            queue.put(task)
        else:
            queue.put(task, group=f"g{i}", rollouts=size)
    ctx = echo(1.0)
    options: dict[str, Any] = {"live": False, "handle_signals": False, "log": lambda line: None}
    with trio.fail_after(600):
        if crash_at is not None:
            with trio.move_on_after(crash_at + 0.5):  # a crash: cancelled, no grace, no publish
                await consume(queue, ctx, window=tt.Window(window), env=Counting(tt.EchoTaskset()),
                              **options)  # fmt: skip
            queue.reclaim()
            queue.restart("w1")
        async with trio.open_nursery() as nursery:
            run = functools.partial(consume, queue, ctx, window=tt.Window(window),
                                    env=Counting(tt.EchoTaskset()), **options)  # fmt: skip
            shut_down = await nursery.start(run)
            while len(queue.answered) < len(sizes):  # noqa: ASYNC110 (the queue has no event)
                await trio.sleep(0.5)
            shut_down("done")
    keys = [finished.entry.key for finished in queue.answered]
    assert sorted(keys) == sorted(f"t:{i}" for i in range(len(sizes)))  # each exactly once
    for finished in queue.answered:
        size = sizes[int(finished.entry.key.split(":")[1])]
        assert [e.rollout for e in finished.episodes] == list(range(size))
        assert all(e.ok for e in finished.episodes)
        if size > 1:
            assert {e.group for e in finished.episodes} == {finished.entry.group}
    assert queue.held == {}
    assert queue.peak <= window
    assert Counting.most <= window


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"group": "g", "rollouts": "0"}, "'rollouts' is not a count >= 1"),
        ({"group": "g", "rollouts": "²"}, "'rollouts' is not a count >= 1"),
        ({"group": "", "rollouts": "2"}, "'group' must be a non-empty id"),
        ({"rollouts": "3"}, "'rollouts' needs 'group'"),
    ],
)
def test_a_malformed_group_entry_is_refused_saying_why(fields: dict[str, str], why: str) -> None:
    from trio_tasksets.redis import EntryRef, MalformedEntry, encode_task
    from trio_tasksets.redis._entries import decode_entry

    entry = EntryRef("s", "g", "1-0")
    task = encode_task(tasks(1)[0]).decode()
    with pytest.raises(MalformedEntry, match=why):
        decode_entry(entry, {"task": task, **fields})
    good = decode_entry(entry, {"task": task, "group": "g7", "rollouts": "4"})
    assert (good.group, good.rollouts) == ("g7", 4)


def test_a_task_entry_is_valid_once_built_and_a_plain_task_is_rebuilt_by_the_one_decoder() -> None:
    for field, value in (("rollout", -1), ("rollouts", 0)):
        bad: dict[str, Any] = {field: value}
        with pytest.raises(tt.ConfigError, match=f"{field} must be an int") as raised:
            TaskEntry(None, "1-0", "k", {"prompt": "hi"}, **bad)
        assert raised.value.parameter == field
    entry = TaskEntry(None, "1-0", "k", {"prompt": "hi", "answer": "hi", "info": None})
    assert plain_task(entry) == tt.Task("hi", answer="hi", key="k")
    for data, why in (({"answer": "x"}, "no prompt"), ({"prompt": "p", "x": 1}, "unknown")):
        with pytest.raises(MalformedEntry, match=f"entry 1-0: .*{why}"):
            plain_task(TaskEntry(None, "1-0", "k", data))
