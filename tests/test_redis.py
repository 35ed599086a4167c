"""The Redis Streams feed, results sink and worker (issue 6), against a real redis-server.

The session's `redis-server` (tests/conftest.py: on free loopback ports, no persistence) serves
most tests, each on streams of its own; the restart test runs a second, persistent one (AOF)
that it stops and starts on the same port. Workers are real processes (`python -m trio_tasksets worker`).
Every wait polls Redis state (XLEN, XPENDING, XINFO) or a worker's log under a deadline.
"""

from __future__ import annotations

import functools
import json
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import attrs
import forkserver
import pytest
import redis
import trio
from helpers import free_port, needs, until
from redis_server import RedisServer

import trio_tasksets as tt
from trio_tasksets._cli import main as cli_main
from trio_tasksets._core.adaptive import AdaptiveBounds
from trio_tasksets.redis import (
    TASK_FIELD,
    EntryRef,
    RedisResults,
    RedisStreamTaskset,
    RedisTask,
    encode_task,
    enqueue,
)
from trio_tasksets.redis._worker import WorkerConfig, run_worker
from trio_tasksets.testing import Gate

Server = RedisServer  # the name other test files import from here
pytestmark = needs("redis-server", why="the Redis Streams feed against a real Redis")
WORKER = [sys.executable, "-m", "trio_tasksets", "worker", "--no-dashboard"]
ROOT = Path(__file__).resolve().parent.parent
REDIS_ENV = str(ROOT / "tests" / "fixtures" / "redis_env.py")
# A worker process running a TASKSET's env (until `trio-tasksets worker TASKSET` takes one):
ENV_WORKER = [sys.executable, str(ROOT / "tests" / "fixtures" / "redis_worker.py")]


# --- servers, names and polling ---------------------------------------------------------------


@pytest.fixture
def server(redis_server: Server) -> Server:
    """The session's redis-server (tests/conftest.py)."""
    return redis_server


@pytest.fixture
def r(server: Server) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(server.url, decode_responses=True)
    yield client
    client.close()


@attrs.frozen
class Names:
    stream: str
    group: str
    results: str


@pytest.fixture
def names() -> Names:
    tag = uuid.uuid4().hex[:8]
    return Names(f"{tag}:tasks", f"{tag}:workers", f"{tag}:results")


def make_tasks(n: int, prefix: str = "t") -> list[tt.Task]:
    return [tt.Task(f"Repeat exactly: {prefix} {i}", answer=f"{prefix} {i}", key=f"{prefix}:{i}")
            for i in range(n)]  # fmt: skip


def push(r: redis.Redis, stream: str, tasks: list[tt.Task]) -> list[str]:
    with r.pipeline(transaction=False) as pipe:
        for task in tasks:
            pipe.xadd(stream, {TASK_FIELD: encode_task(task)})
        return [str(i) for i in pipe.execute()]


def entries(r: redis.Redis, stream: str) -> list[dict[str, str]]:
    """The fields of every entry of `stream`, oldest first."""
    return [
        dict(fields) for _id, fields in cast(list[tuple[str, dict[str, str]]], r.xrange(stream))
    ]


def results(r: redis.Redis, stream: str) -> list[dict[str, Any]]:
    return [{**fields, "row": json.loads(fields["row"])} for fields in entries(r, stream)]


def pending(r: redis.Redis, names: Names) -> int:
    try:
        return int(r.xpending(names.stream, names.group)["pending"])
    except redis.ResponseError:  # no group yet
        return 0


def pending_of(r: redis.Redis, names: Names) -> dict[str, int]:
    try:
        consumers = r.xinfo_consumers(names.stream, names.group)
    except redis.ResponseError:
        return {}
    return {str(c["name"]): int(c["pending"]) for c in consumers}


# --- worker processes -------------------------------------------------------------------------


@attrs.define
class Worker:
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout: float = 20.0) -> int:
        self.process.send_signal(sig)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            pytest.fail(f"worker still running {timeout} s after {sig.name}:\n{self.log}")


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    started: list[Worker] = []

    def start(
        url: str, names: Names, consumer: str, *options: str, taskset: str | None = None
    ) -> Worker:
        """A worker process: `trio-tasksets worker`, or with `taskset` one that runs that
        TASKSET's env (tests/fixtures/redis_worker.py)."""
        log_path = tmp_path / f"{consumer}.log"
        command = WORKER if taskset is None else [*ENV_WORKER, taskset]
        with log_path.open("wb") as log:
            process = forkserver.popen(
                [*command, "--feed", url, "--stream", names.stream, "--group", names.group,
                 "--results", names.results, "--consumer", consumer, *options],
                stdout=subprocess.DEVNULL, stderr=log,
            )  # fmt: skip
        worker = Worker(process, log_path)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        if worker.process.poll() is None:
            worker.process.kill()
            worker.process.wait()


def by_key(rows: list[dict[str, Any]]) -> Counter[str]:
    return Counter(row["key"] for row in rows)


# --- the worker, end to end -------------------------------------------------------------------


def test_one_worker_publishes_50_results_and_acknowledges_all(
    server: Server, r: redis.Redis, names: Names, workers: Callable[..., Worker]
) -> None:
    tasks = make_tasks(50)
    ids = push(r, names.stream, tasks)
    worker = workers(server.url, names, "w1", "-c", "8", "--echo-delay", "0.01")
    until(lambda: r.xlen(names.results) >= 50, "50 results")
    assert worker.stop() == 0, worker.log
    rows = results(r, names.results)
    assert by_key(rows) == Counter(t.key for t in tasks)  # each task exactly once
    assert pending(r, names) == 0
    assert sorted(row["entry"] for row in rows) == sorted(ids)
    data = {t.key: t.data for t in tasks}
    for row in rows:
        episode = tt.Episode.from_row(row["row"])  # the SPEC row
        assert episode.ok
        assert episode.reward == 1.0
        assert episode.task.data == data[row["key"]]
        assert episode.task.key == row["key"]
        assert row["consumer"] == "w1"
        assert 1 <= int(row["in_flight"]) <= 8
    assert "stopped: published 50 episodes" in worker.log
    assert pending_of(r, names) == {}  # a worker that holds nothing leaves the group


def test_three_workers_share_300_tasks_exactly_once_within_their_windows(
    server: Server, r: redis.Redis, names: Names, workers: Callable[..., Worker]
) -> None:
    started = [workers(server.url, names, f"w{i}", "-c", "3", "--echo-delay", "0.01")
               for i in range(3)]  # fmt: skip
    until(lambda: len(pending_of(r, names)) == 3, "three consumers in the group")
    tasks = make_tasks(300)
    push(r, names.stream, tasks)
    most = 0

    def done() -> bool:
        nonlocal most
        most = max([most, *pending_of(r, names).values()])
        return bool(r.xlen(names.results) >= 300)

    until(done, "300 results")
    assert all(worker.stop() == 0 for worker in started)
    rows = results(r, names.results)
    assert by_key(rows) == Counter(t.key for t in tasks)
    assert pending(r, names) == 0
    assert 1 <= most <= 3  # sampled XPENDING per consumer: never above -c
    per_worker = Counter(row["consumer"] for row in rows)
    assert set(per_worker) == {"w0", "w1", "w2"}, per_worker
    assert max(int(row["in_flight"]) for row in rows) <= 3
    for worker in started:
        peak = int(worker.log.split("peak in flight ")[1].split("/")[0])
        assert 1 <= peak <= 3, worker.log


def test_a_killed_workers_pending_tasks_are_reclaimed_by_another(
    server: Server, r: redis.Redis, names: Names, workers: Callable[..., Worker]
) -> None:
    tasks = make_tasks(40)
    push(r, names.stream, tasks)
    doomed = workers(server.url, names, "doomed", "-c", "4", "--echo-delay", "30")
    until(lambda: pending_of(r, names).get("doomed") == 4, "4 entries held by the doomed worker")
    held = {str(p["message_id"]) for p in r.xpending_range(names.stream, names.group, "-", "+", 10)}
    doomed.process.kill()  # SIGKILL: no chance to clean up
    doomed.process.wait(timeout=10)
    rescuer = workers(
        server.url, names, "rescuer", "-c", "8", "--echo-delay", "0.01", "--claim-idle", "1"
    )
    until(lambda: r.xlen(names.results) >= 40 and pending(r, names) == 0, "every task done")
    assert rescuer.stop() == 0, rescuer.log
    rows = results(r, names.results)
    assert by_key(rows) == Counter(t.key for t in tasks)  # no loss, no duplicate
    assert {row["entry"] for row in rows if row["entry"] in held} == held
    assert all(row["consumer"] == "rescuer" for row in rows)
    assert rescuer.log.count("reclaimed entry") == 4, rescuer.log


def test_a_live_workers_long_episodes_are_kept_alive_not_reclaimed(
    server: Server, r: redis.Redis, names: Names, workers: Callable[..., Worker]
) -> None:
    tasks = make_tasks(4)
    push(r, names.stream, tasks)
    options = ("-c", "2", "--echo-delay", "1.5", "--claim-idle", "0.6")  # episodes > claim idle
    pair = [workers(server.url, names, name, *options) for name in ("a", "b")]
    until(lambda: r.xlen(names.results) >= 4 and pending(r, names) == 0, "4 results")
    assert all(worker.stop() == 0 for worker in pair)
    assert by_key(results(r, names.results)) == Counter(t.key for t in tasks)  # no duplicate
    assert not any("reclaimed" in worker.log for worker in pair)


def _sigterm_when_full(
    names: Names, r: redis.Redis, worker: Callable[..., Worker], tasks: int, *options: str
) -> Worker:
    """`tasks` tasks for a worker "w" of `options` (``-c N`` first); SIGTERM once its N
    places are busy: it exits 0 within 5 s."""
    push(r, names.stream, make_tasks(tasks))
    started = worker(names, "w", *options)
    places = int(options[1])
    until(lambda: pending_of(r, names).get("w") == places, f"{places} episodes in flight")
    began = time.monotonic()
    assert started.stop(signal.SIGTERM) == 0, started.log
    assert time.monotonic() - began < 5
    return started


def test_sigterm_finishes_in_flight_episodes_within_the_grace_and_exits_0(
    server: Server, r: redis.Redis, names: Names, workers: Callable[..., Worker]
) -> None:
    """Within 5 s: the episodes' own second, not the 20 s grace."""
    options = ("-c", "4", "--echo-delay", "1.0", "--grace", "20")
    worker = _sigterm_when_full(names, r, functools.partial(workers, server.url), 10, *options)
    assert r.xlen(names.results) == 4  # the in-flight four finished and were published...
    assert pending(r, names) == 0  # ...and acknowledged; nothing else was pulled
    group = r.xinfo_groups(names.stream)[0]
    assert group["lag"] == 6
    assert "SIGTERM: stopping" in worker.log
    assert "published 4 episodes" in worker.log


def test_past_the_grace_in_flight_episodes_are_cancelled_and_left_pending(
    server: Server, r: redis.Redis, names: Names, workers: Callable[..., Worker]
) -> None:
    options = ("-c", "2", "--echo-delay", "60", "--grace", "0.3")
    worker = _sigterm_when_full(names, r, functools.partial(workers, server.url), 3, *options)
    assert r.xlen(names.results) == 0
    assert pending_of(r, names) == {"w": 2}  # left for another worker; so is its name
    assert "2 cancelled at the grace deadline" in worker.log


def test_a_redis_restart_mid_run_is_retried_and_loses_nothing(
    r: redis.Redis, names: Names, workers: Callable[..., Worker], tmp_path: Path
) -> None:
    own = Server(free_port(), tmp_path, persistent=True)
    own.start()
    client = redis.Redis.from_url(own.url, decode_responses=True, socket_timeout=2.0)
    try:
        tasks = make_tasks(120)
        push(client, names.stream, tasks)
        options = ("-c", "4", "--echo-delay", "0.05", "--claim-idle", "10")
        worker = workers(own.url, names, "w", *options)
        until(lambda: client.xlen(names.results) >= 20, "the first 20 results")
        own.stop()
        until(lambda: f"redis at {own.url} unreachable" in worker.log, "the retry log line")
        own.start()
        until(
            lambda: client.xlen(names.results) >= 120 and pending(client, names) == 0,
            "all 120 results after the restart",
            timeout=30,
        )
        assert worker.stop() == 0, worker.log
        assert by_key(results(client, names.results)) == Counter(t.key for t in tasks)
        assert f"redis at {own.url} reachable again" in worker.log
    finally:
        client.close()
        own.stop()


# --- the taskset and the sink, in process -----------------------------------------------------


async def wait_for(predicate: Callable[[], bool]) -> None:
    """Poll Redis state (no trio event can tell) until `predicate` holds, for at most 10 s."""
    with trio.fail_after(10):
        while not predicate():  # noqa: ASYNC110
            await trio.sleep(0.01)


async def test_a_pull_claims_one_entry_and_only_when_the_window_asks(
    server: Server, r: redis.Redis, names: Names
) -> None:
    push(r, names.stream, make_tasks(6))
    feed = RedisStreamTaskset(server.url, names.stream, names.group, "c", block=0.1)
    gate = Gate()
    async with feed.channel() as tasks, tt.as_completed(tasks, gate.run, window=2) as done:
        await wait_for(lambda: pending(r, names) == 2)
        await gate.wait_running(2)
        await trio.sleep(0.5)  # an absence check: five block periods, and still only two
        assert pending(r, names) == 2
        assert gate.started == 2
        feed.stop()  # the runs' results are read below; the next pull ends the stream
        gate.open()
        got = [task async for _, task in done]
    assert pending(r, names) == len(got)  # nothing acknowledges but the sink
    assert {t.entry.id for t in got} == {str(p["message_id"]) for p in _pending_list(r, names)}


def _pending_list(r: redis.Redis, names: Names) -> list[dict[str, Any]]:
    return list(r.xpending_range(names.stream, names.group, "-", "+", 100))


async def test_a_consumer_resumes_its_own_pending_entries_first(
    server: Server, r: redis.Redis, names: Names
) -> None:
    old = push(r, names.stream, make_tasks(2, "old"))
    r.xgroup_create(names.stream, names.group, id="0")
    r.xreadgroup(names.group, "c", {names.stream: ">"}, count=2)  # delivered, never acked
    push(r, names.stream, make_tasks(1, "new"))
    feed = RedisStreamTaskset(server.url, names.stream, names.group, "c", block=0.1)
    async with feed.channel() as tasks:
        got = [await tasks.receive() for _ in range(3)]
    assert [t.entry.id for t in got[:2]] == old
    assert [t.key for t in got] == ["old:0", "old:1", "new:0"]
    assert pending_of(r, names) == {"c": 3}


async def test_a_dead_consumers_entries_are_reclaimed_one_per_pull(
    server: Server, r: redis.Redis, names: Names
) -> None:
    lost = push(r, names.stream, make_tasks(3))
    r.xgroup_create(names.stream, names.group, id="0")
    r.xreadgroup(names.group, "ghost", {names.stream: ">"}, count=3)
    feed = RedisStreamTaskset(
        server.url, names.stream, names.group, "live", claim_idle=0.2, block=0.1
    )
    async with feed.channel() as tasks:
        first = await tasks.receive()  # after 0.2 s idle
        assert pending_of(r, names) == {"ghost": 2, "live": 1}
        rest = [await tasks.receive() for _ in range(2)]
    assert [t.entry.id for t in [first, *rest]] == lost
    assert pending_of(r, names) == {"ghost": 0, "live": 3}


async def test_publish_adds_the_row_and_acknowledges_in_one_transaction(
    server: Server, r: redis.Redis, names: Names
) -> None:
    push(r, names.stream, make_tasks(1))
    feed = RedisStreamTaskset(server.url, names.stream, names.group, "c", block=0.1)
    sink = RedisResults(server.url, names.results)
    env = tt.Env(feed)
    async with feed.channel() as tasks:
        task = await tasks.receive()
    episode = await env.run_slot(tt.RunSlot(task), tt.ModelContext(tt.EchoClient(), "echo"))
    first = await sink.publish(episode, task.entry, consumer="c")
    again = await sink.publish(episode, task.entry, consumer="c")
    sink.close()
    assert first.acked
    assert first.result_id is not None
    assert not again.acked  # already acknowledged: a duplicate, marked by its task key
    assert pending(r, names) == 0
    rows = results(r, names.results)
    assert [row["key"] for row in rows] == ["t:0", "t:0"]
    assert rows[0]["row"] == json.loads(json.dumps(episode.to_row()))
    assert rows[0]["entry"] == task.entry.id
    assert rows[0]["stream"] == names.stream


async def test_keep_alive_refreshes_only_the_entries_still_owned(
    server: Server, r: redis.Redis, names: Names
) -> None:
    first, second = (
        EntryRef(names.stream, names.group, i) for i in push(r, names.stream, make_tasks(2))
    )
    r.xgroup_create(names.stream, names.group, id="0")
    r.xreadgroup(names.group, "a", {names.stream: ">"}, count=2)
    sink = RedisResults(server.url, names.results)
    await trio.sleep(0.3)  # let both entries age
    r.xclaim(names.stream, names.group, "b", 0, [second.id])  # b takes the second one over
    assert await sink.keep_alive("a", [first, second]) == 1
    sink.close()
    rows = {str(p["message_id"]): p for p in _pending_list(r, names)}
    assert rows[first.id]["consumer"] == "a"
    assert rows[first.id]["time_since_delivered"] < 250  # reset by keep_alive
    assert rows[second.id]["consumer"] == "b"  # left to its new owner
    assert rows[first.id]["times_delivered"] == 1  # a refresh is not a delivery


async def test_an_entry_without_a_task_is_dead_lettered(
    server: Server, r: redis.Redis, names: Names
) -> None:
    r.xadd(names.stream, {"other": "x"})
    r.xadd(names.stream, {TASK_FIELD: "not json"})
    push(r, names.stream, make_tasks(1))
    lines: list[str] = []
    feed = RedisStreamTaskset(
        server.url, names.stream, names.group, "c", block=0.1, log=lines.append
    )
    async with feed.channel() as tasks:
        task = await tasks.receive()
    assert task.key == "t:0"
    assert r.xlen(f"{names.stream}:dead") == 2
    assert pending(r, names) == 1
    assert len(lines) == 2
    assert all("dead" in line for line in lines)


async def test_stop_ends_a_quiet_stream_within_one_block(server: Server, names: Names) -> None:
    feed = RedisStreamTaskset(server.url, names.stream, names.group, "c", block=0.2)
    async with feed.channel() as tasks:

        async def stop_soon() -> None:
            await trio.sleep(0.3)
            feed.stop()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stop_soon)
            with trio.fail_after(2):
                assert [t async for t in tasks] == []


async def test_enqueue_round_trips_a_taskset_to_equal_tasks(
    server: Server, r: redis.Redis, names: Names
) -> None:
    from trio_tasksets._core.builtin import EchoTaskset

    source = list(EchoTaskset())
    ids = await enqueue(server.url, names.stream, source, batch=3)
    assert len(ids) == len(source) == r.xlen(names.stream)
    feed = RedisStreamTaskset(server.url, names.stream, names.group, "c", block=0.1)
    async with feed.channel() as tasks:
        got: list[RedisTask] = [await tasks.receive() for _ in source]
    assert [(t.key, t.data) for t in got] == [(t.key, t.data) for t in source]
    assert all(isinstance(t, tt.Task) for t in got)


async def _work_until_told(
    server: Server, r: redis.Redis, names: Names, count: int, window: int | AdaptiveBounds
) -> list[str]:
    """`count` tasks for an in-process worker of `window` whose episodes take 0.2 s (so they
    overlap and the window fills whatever the timing), told to stop once all are published;
    its log lines."""
    push(r, names.stream, make_tasks(count))
    config = WorkerConfig(server.url, names.stream, names.group, names.results, consumer="me",
                          max_concurrent=window, dashboard=False)  # fmt: skip
    lines: list[str] = []
    ctx = tt.ModelContext(tt.EchoClient(delay=0.2), "echo")
    async with trio.open_nursery() as nursery:
        start = functools.partial(run_worker, config, ctx, handle_signals=False, log=lines.append)
        shut_down = await nursery.start(start)
        await wait_for(lambda: r.xlen(names.results) >= count)
        shut_down("told")
    assert pending(r, names) == 0
    return lines


async def test_run_worker_in_process_stops_when_told(
    server: Server, r: redis.Redis, names: Names
) -> None:
    lines = await _work_until_told(server, r, names, 5, window=2)
    assert lines[-1].startswith("stopped: published 5 episodes; peak in flight 2/2")
    assert any(line.startswith("told: stopping") for line in lines)


async def test_a_worker_with_an_adaptive_window_grows_it_while_episodes_succeed(
    server: Server, r: redis.Redis, names: Names
) -> None:
    """`worker -c 1-1-4`: the window (episodes in flight, entries held) starts at 1 and
    doubles per full round of successes, as an eval's does."""
    lines = await _work_until_told(server, r, names, 30, window=AdaptiveBounds(1, 1, 4))
    assert "window 1-1-4" in lines[0]
    assert lines[-1].startswith("stopped: published 30 episodes; peak in flight 4/4 (adaptive")


async def test_a_worker_with_a_time_limit_shuts_down_as_on_sigterm(
    server: Server, r: redis.Redis, names: Names
) -> None:
    push(r, names.stream, make_tasks(3))
    config = WorkerConfig(server.url, names.stream, names.group, names.results, consumer="me",
                          dashboard=False, time_limit=0.5)  # fmt: skip
    lines: list[str] = []
    ctx = tt.ModelContext(tt.EchoClient(), "echo")
    with trio.fail_after(30):
        report = await run_worker(config, ctx, handle_signals=False, log=lines.append)
    assert report.published == 3
    assert any(line.startswith("time_limit 0.5s reached: stopping") for line in lines)
    assert pending(r, names) == 0


def test_a_task_that_cannot_travel_is_refused_before_anything_is_written() -> None:
    @attrs.frozen
    class Odd:
        prompt: str
        level: int
        key: str = "odd"

    with pytest.raises(TypeError, match="level"):
        encode_task(Odd("hi", 3))
    with pytest.raises(TypeError, match="JSON"):
        encode_task(tt.Task("hi", info={"x": object()}))


# --- the command line -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["worker", "--feed", "http://h", "--stream", "s", "--group", "g", "--results", "r"],
         "--feed"),
        (["worker", "--feed", "redis://h:x", "--stream", "s", "--group", "g", "--results", "r"],
         "--feed"),
        (["worker", "--feed", "redis://h", "--stream", "s", "--group", "g", "--results", "s"],
         "--results"),
        (["worker", "--feed", "redis://h", "--stream", "s", "--group", "g", "--results", "r",
          "-c", "0"], "-c/--max-concurrent"),
        (["worker", "--feed", "redis://h", "--stream", "s", "--group", "g", "--results", "r",
          "--claim-idle", "0"], "--claim-idle"),
        (["worker", "--feed", "redis://h", "--stream", "s", "--group", "g", "--results", "r",
          "-m", "gpt-4o"], "--base-url"),
        (["worker", "--feed", "redis://h", "--stream", "s", "--group", "", "--results", "r"],
         "--group"),  # default "workers" (issue 25); an empty name is refused
        (["enqueue", "--feed", "redis://h", "--stream", "s", "echo-stream"], "-n/--num-examples"),
        (["enqueue", "--feed", "redis://h", "--stream", "s", "nope"], "TASKSET"),
        (["enqueue", "--feed", "redis://127.0.0.1:1/0", "--stream", "s", "echo"], "--feed"),
    ],
)  # fmt: skip
def test_a_bad_command_line_names_the_flag_and_exits_2(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(argv)
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


def test_enqueue_command_pushes_the_next_n_of_a_stream(
    server: Server, r: redis.Redis, names: Names, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["enqueue", "--feed", server.url, "--stream", names.stream]
    assert cli_main([*argv, "echo"]) == 0
    assert cli_main([*argv, "echo-stream", "-n", "2"]) == 0  # (a 0.5 s gap per task)
    assert "enqueued 8 tasks" in capsys.readouterr().out
    keys = [json.loads(f[TASK_FIELD])["key"] for f in entries(r, names.stream)]
    assert keys[-2:] == ["echo-stream:0", "echo-stream:1"]
    assert len(keys) == 10


# --- the user's env on workers, and the eval over workers (issue 12) ---------------------------

SAME = ("task", "rollout", "ok", "reward", "completion", "messages", "errors", "attempts")


def comparable(rows: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    """Rows by slot, without what differs between any two runs (id, timing)."""
    return {(row["task"]["key"], row["rollout"]): {k: row[k] for k in SAME} for row in rows}


def trace_rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "traces.jsonl").read_text().splitlines()]


def graded_env(spec: str = "TwoTurns", **config: Any) -> tt.Env[Any]:
    from trio_tasksets._env.loading import resolve_target

    taskset_cls, env_cls = resolve_target(f"{REDIS_ENV}:{spec}")
    taskset = taskset_cls(taskset_cls._default_config().__class__(**config))
    return (env_cls or tt.Env)(taskset)


def eval_config(
    tmp_path: Path, name: str, *, via: str | None = None, stream: str = "tasks", **kw: Any
) -> tt.EvalConfig:
    if via is not None:  # the slots on workers, as `eval --via URL --stream S`
        from trio_tasksets.redis import ViaBackend

        kw["backend"] = ViaBackend(via, stream=stream)
    return tt.EvalConfig(output_dir=str(tmp_path), run_name=name, dashboard=False, **kw)


@attrs.define
class InProcessWorker:
    """`run_worker` in this trio run, with the given env; its log lines kept."""

    config: WorkerConfig
    lines: list[str] = attrs.Factory(list)

    async def run(
        self, env: tt.Env[Any] | None, *, task_status: trio.TaskStatus[Callable[[str], None]]
    ) -> None:
        ctx = tt.ModelContext(tt.EchoClient(delay=0.01), "echo")
        await run_worker(self.config, ctx, env=env, handle_signals=False, log=self.lines.append,
                         task_status=task_status)  # fmt: skip


def only_entry(client: redis.Redis, stream: str) -> tuple[str, dict[str, str]]:
    """The id and fields of the one entry of `stream`."""
    [(entry_id, fields)] = cast(list[tuple[str, dict[str, str]]], client.xrange(stream))
    return entry_id, fields


def answer(
    client: redis.Redis,
    reply_to: str,
    stream: str,
    entry_id: str,
    episode: tt.Episode,
    times: int = 1,
) -> None:
    """Publish `episode` as a worker would, for the entry `entry_id` of `stream`, `times`
    times in one transaction (a reader sees all of them or none)."""
    row = json.dumps(episode.to_row())
    key = episode.task.key
    with client.pipeline(transaction=True) as pipe:
        for _ in range(times):
            pipe.xadd(reply_to, {"key": key, "entry": entry_id, "stream": stream, "row": row})
        pipe.execute()


def in_process_worker(server: Server, names: Names, consumer: str = "w") -> InProcessWorker:
    return InProcessWorker(WorkerConfig(server.url, names.stream, names.group, names.results,
                                        consumer=consumer, max_concurrent=8, dashboard=False))  # fmt: skip


async def test_a_worker_runs_the_users_env_so_its_rows_equal_an_in_process_evals(
    server: Server, r: redis.Redis, names: Names, tmp_path: Path
) -> None:
    ctx = tt.ModelContext(tt.EchoClient(), "echo")
    local = await tt.run_eval(graded_env(), ctx, eval_config(tmp_path, "local", num_examples=10,
                                                            rollouts_per_example=2))  # fmt: skip
    worker = in_process_worker(server, names)
    async with trio.open_nursery() as nursery:
        shut_down = await nursery.start(worker.run, graded_env())
        via = eval_config(tmp_path, "via", num_examples=10, rollouts_per_example=2,
                          via=server.url, stream=names.stream)  # fmt: skip
        remote = await tt.run_eval(graded_env(), ctx, via)
        shut_down("done")
    expected = comparable(trace_rows(local.run_dir))
    got = comparable(trace_rows(remote.run_dir))
    assert got == expected
    assert len(got) == 20
    # The taskset's own reward, its own task type and the Env subclass's two turns:
    assert {row["reward"] for row in got.values()} == {0.5, 0.75, 1.0}
    assert all(len(row["messages"]) == 4 for row in got.values())
    assert all(set(row["task"]["data"]) == {"text", "answer", "level"} for row in got.values())
    assert remote.summary["finished"] == 20
    assert r.xlen(names.stream) == 0  # every answered entry deleted
    assert not r.keys(f"{names.stream}:reply:*")  # and the reply stream, once all came back


@pytest.mark.parametrize(
    ("worker_env", "reason"),
    [
        (lambda: graded_env("Graded"), "with env class"),  # the same taskset, a plain Env
        (
            lambda: graded_env(bonus=0.5),
            'taskset config {"bonus":0.25,"size":40}',
        ),  # another config
        (lambda: tt.Env(tt._core.builtin.EchoTaskset()), "with taskset"),  # another taskset
        (lambda: None, "runs no taskset"),  # no env at all
    ],
)
async def test_a_worker_with_another_env_refuses_the_entries_and_the_eval_says_why(
    server: Server,
    r: redis.Redis,
    names: Names,
    tmp_path: Path,
    worker_env: Callable[[], tt.Env[Any] | None],
    reason: str,
) -> None:
    from trio_tasksets.redis._coordinator import ViaError

    worker = in_process_worker(server, names)
    ctx = tt.ModelContext(tt.EchoClient(), "echo")
    via = eval_config(tmp_path, "via", num_examples=1, via=server.url, stream=names.stream)
    async with trio.open_nursery() as nursery:
        shut_down = await nursery.start(worker.run, worker_env())
        with pytest.raises(ViaError, match="refused") as refused, trio.fail_after(20):
            await tt.run_eval(graded_env(), ctx, via)
        shut_down("done")
    assert reason in str(refused.value)
    dead = entries(r, f"{names.stream}:dead")
    assert len(dead) == 1
    assert reason in dead[0]["error"]
    assert r.xlen(names.results) == 0  # nothing scored with the wrong env
    assert pending(r, names) == 0  # refused is acknowledged: no other worker retries it


async def test_the_coordinator_keeps_one_row_per_slot_when_a_result_comes_twice(
    server: Server, r: redis.Redis, names: Names
) -> None:
    from trio_tasksets._monitor.dashboard import Progress
    from trio_tasksets.redis._coordinator import via_runner

    env, ctx = graded_env(), tt.ModelContext(tt.EchoClient(), "echo")
    task = next(iter(env.taskset))
    lines: list[str] = []
    r.xgroup_create(names.stream, names.group, id="0", mkstream=True)
    done: list[tt.Episode] = []
    async with (
        via_runner(env, ctx, url=server.url, stream=names.stream, progress=Progress(),
                   log=lines.append) as run,
        trio.open_nursery() as nursery,
    ):  # fmt: skip

        async def one() -> None:
            done.append(await run(tt.RunSlot(task, 1)))

        nursery.start_soon(one)
        await wait_for(lambda: r.xlen(names.stream) == 1)
        # A worker's result, published twice (an outage longer than --claim-idle):
        r.xreadgroup(names.group, "w", {names.stream: ">"})
        entry_id, fields = only_entry(r, names.stream)
        episode = await env.run_slot(tt.RunSlot(task, int(fields["rollout"])), ctx)
        answer(r, fields["reply_to"], names.stream, entry_id, episode, times=2)
    assert [e.to_row() for e in done] == [episode.to_row()]
    assert done[0].rollout == 1
    assert r.xlen(names.stream) == 0
    assert any("dropped 1 duplicate" in line for line in lines), lines


async def test_with_no_worker_the_dashboard_says_so_and_stopping_leaves_nothing_behind(
    server: Server, r: redis.Redis, names: Names
) -> None:
    from trio_tasksets._monitor.dashboard import Progress
    from trio_tasksets.redis._coordinator import via_runner

    env, ctx = graded_env(), tt.ModelContext(tt.EchoClient(), "echo")
    progress = Progress()
    lines: list[str] = []
    tasks = list(env.taskset)[:3]
    with trio.move_on_after(30) as scope:
        async with (
            via_runner(env, ctx, url=server.url, stream=names.stream, progress=progress,
                       log=lines.append, quiet=0.2, watch_every=0.05) as run,
            trio.open_nursery() as nursery,
        ):  # fmt: skip
            for task in tasks:
                nursery.start_soon(run, tt.RunSlot(task))
            await wait_for(lambda: progress.note is not None)
            assert "no worker reads" in str(progress.note)
            assert "start one on this Redis" in str(progress.note)
            assert r.xlen(names.stream) == 3
            # A group appears, but nobody in it pulls:
            r.xgroup_create(names.stream, names.group, id="0")
            await wait_for(lambda: "no worker took one" in str(progress.note))
            scope.cancel()  # as Ctrl-C does
    assert r.xlen(names.stream) == 0  # nothing of this run left for a worker to pick up
    assert not r.keys(f"{names.stream}:reply:*")
    assert any("deleted 3 unanswered slots" in line for line in lines), lines
    assert sum("no worker reads" in line for line in lines) == 1  # said once, not every tick


async def test_a_redis_that_lost_its_data_gets_the_waiting_slots_again(
    r: redis.Redis, names: Names, tmp_path: Path
) -> None:
    from trio_tasksets._monitor.dashboard import Progress
    from trio_tasksets.redis._coordinator import via_runner

    own = Server(free_port(), tmp_path)
    own.start()
    client = redis.Redis.from_url(own.url, decode_responses=True, socket_timeout=2.0)
    env, ctx = graded_env(), tt.ModelContext(tt.EchoClient(), "echo")
    task = next(iter(env.taskset))
    lines: list[str] = []
    done: list[tt.Episode] = []
    try:
        async with (
            via_runner(env, ctx, url=own.url, stream=names.stream, progress=Progress(),
                       log=lines.append, watch_every=0.05) as run,
            trio.open_nursery() as nursery,
        ):  # fmt: skip

            async def one() -> None:
                done.append(await run(tt.RunSlot(task)))

            nursery.start_soon(one)
            await wait_for(lambda: _xlen(client, names.stream) == 1)
            first, _ = only_entry(client, names.stream)
            assert own.process is not None
            own.process.kill()  # SIGKILL: no chance to save anything
            own.process.wait()
            own.start()  # empty
            await wait_for(lambda: _xlen(client, names.stream) == 1)
            entry_id, fields = only_entry(client, names.stream)
            assert entry_id != first
            episode = await env.run_slot(tt.RunSlot(task), ctx)
            answer(client, fields["reply_to"], names.stream, entry_id, episode)
        assert [e.reward for e in done] == [episode.reward]
        assert any("enqueued them again" in line for line in lines), lines
    finally:
        client.close()
        own.stop()


def _xlen(client: redis.Redis, stream: str) -> int:
    try:
        return int(client.xlen(stream))
    except redis.RedisError:
        return -1


# --- NOGROUP on every path ----------------------------------------------------------------------


async def test_every_path_survives_a_group_that_is_gone(
    server: Server, r: redis.Redis, names: Names
) -> None:
    [entry_id] = push(r, names.stream, make_tasks(1))
    r.xgroup_create(names.stream, names.group, id="0")
    r.xreadgroup(names.group, "c", {names.stream: ">"})
    entry = EntryRef(names.stream, names.group, entry_id)
    r.xgroup_destroy(names.stream, names.group)  # as a Redis that restarted empty, then an XADD
    lines: list[str] = []
    sink = RedisResults(server.url, names.results, log=lines.append)
    assert await sink.keep_alive("c", [entry]) == 0  # the keep-alive
    episode = await tt.Env(tt._core.builtin.EchoTaskset()).run_slot(
        tt.RunSlot(make_tasks(1)[0]), tt.ModelContext(tt.EchoClient(), "echo")
    )
    done = await sink.publish(episode, entry, consumer="c")  # the publish
    assert done.result_id is not None
    assert not done.acked
    assert "is gone" in lines[-1]
    r.delete(names.stream)  # the stream too
    feed = RedisStreamTaskset(
        server.url, names.stream, names.group, "c", block=0.1, log=lines.append
    )
    assert not await feed.leave()  # the way out
    # The group recreated by another worker, the entry lost: the result is still published.
    r.xgroup_create(names.stream, names.group, id="0", mkstream=True)
    again = await sink.publish(episode, entry, consumer="c")
    assert again.result_id is not None
    assert "is no longer in" in lines[-1]
    sink.close()
    assert r.xlen(names.results) == 2


# --- processes: Redis restarted empty, `eval --via` over two workers, resume --------------------


def test_redis_killed_and_restarted_empty_mid_run_workers_recreate_the_group_and_go_on(
    names: Names, workers: Callable[..., Worker], tmp_path: Path
) -> None:
    own = Server(free_port(), tmp_path)  # no persistence: a restart loses everything
    own.start()
    client = redis.Redis.from_url(own.url, decode_responses=True, socket_timeout=2.0)
    try:
        push(client, names.stream, make_tasks(4))
        # Episodes outlive the outage; the keep-alive runs every 0.3 s through it.
        options = ("-c", "2", "--echo-delay", "1.0", "--claim-idle", "0.9")
        worker = workers(own.url, names, "w", *options)
        until(lambda: pending_of(client, names) == {"w": 2}, "2 episodes in flight")
        assert own.process is not None
        own.process.kill()  # SIGKILL
        own.process.wait()
        own.start()  # empty: no stream, no group
        push(client, names.stream, make_tasks(3, "new"))  # enqueued after the restart
        want = {"t:0", "t:1", "new:0", "new:1", "new:2"}

        def done() -> bool:
            got = set(by_key(results(client, names.results)))
            return got == want and pending(client, names) == 0

        until(done, "the 2 in-flight results and the 3 tasks enqueued after the restart")
        assert worker.stop() == 0, worker.log
        assert worker.process.returncode == 0
        assert "is gone (Redis restarted without its data?): recreating it" in worker.log
        assert "published 5 episodes" in worker.log
    finally:
        client.close()
        own.stop()


def eval_via(url: str, names: Names, out: Path, *options: str) -> list[str]:
    return [sys.executable, "-m", "trio_tasksets", "eval", f"{REDIS_ENV}:TwoTurns",
            "--via", url, "--stream", names.stream, "-o", str(out), "--no-dashboard",
            *options]  # fmt: skip


def test_eval_via_two_worker_processes_gives_every_row_with_at_most_c_outstanding(
    server: Server, r: redis.Redis, names: Names, workers: Callable[..., Worker], tmp_path: Path
) -> None:
    spec = f"{REDIS_ENV}:TwoTurns"
    pair = [workers(server.url, names, f"w{i}", "-c", "3", "--echo-delay", "0.02", taskset=spec)
            for i in range(2)]  # fmt: skip
    argv = eval_via(
        server.url, names, tmp_path, "-n", "40", "-r", "2", "-c", "4", "--run-name", "via"
    )
    coordinator = forkserver.popen(argv, stderr=subprocess.PIPE, text=True)
    most = 0
    while coordinator.poll() is None:  # XLEN: this eval's entries enqueued and unanswered
        most = max(most, int(r.xlen(names.stream)))
    _, err = coordinator.communicate()
    assert coordinator.returncode == 0, err
    rows = trace_rows(tmp_path / "via")
    assert len(rows) == 80
    assert len(comparable(rows)) == 80  # one row per slot
    assert 1 <= most <= 4
    assert r.xlen(names.stream) == 0
    local = trio.run(tt.run_eval, graded_env(), tt.ModelContext(tt.EchoClient(), "echo"),
                     eval_config(tmp_path, "local", num_examples=40, rollouts_per_example=2))  # fmt: skip
    assert comparable(rows) == comparable(trace_rows(local.run_dir))
    assert all(worker.stop() == 0 for worker in pair)
    published = [int(w.log.split("published ")[1].split()[0]) for w in pair]
    assert sum(published) == 80
    assert min(published) > 0, published  # both workers served the eval


def test_eval_via_resumed_after_the_coordinator_is_killed_runs_exactly_the_owed_slots(
    server: Server, r: redis.Redis, names: Names, workers: Callable[..., Worker], tmp_path: Path
) -> None:
    from trio_tasksets._env.traces import read_rows

    spec = f"{REDIS_ENV}:TwoTurns"
    for i in range(2):
        workers(server.url, names, f"w{i}", "-c", "2", "--echo-delay", "0.02", taskset=spec)
    argv = eval_via(
        server.url, names, tmp_path, "-n", "40", "-r", "2", "-c", "4", "--run-name", "run"
    )
    traces = tmp_path / "run" / "traces.jsonl"
    first = forkserver.popen(argv, stderr=subprocess.DEVNULL)
    until(lambda: traces.exists() and len(traces.read_bytes().splitlines()) >= 20, "20 rows")
    first.kill()  # SIGKILL: no clean-up at all
    first.wait()
    before = {row["id"] for row in read_rows(traces)[0] if row.get("ok")}
    kept = len(before)
    assert 20 <= kept < 80
    second = forkserver.run([*argv, "--resume"], stderr=subprocess.PIPE, text=True, timeout=60)
    assert second.returncode == 0, second.stderr
    rows = trace_rows(tmp_path / "run")
    assert len(rows) == 80
    assert len(comparable(rows)) == 80
    assert before <= {row["id"] for row in rows}  # what was done is kept...
    assert len({row["id"] for row in rows} - before) == 80 - kept  # ...and the owed ran once
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["kept_from_resume"] == kept
    assert summary["finished"] == 80


def test_eval_via_bad_settings_are_usage_errors(
    server: Server, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = ["-o", str(tmp_path)]
    for argv, message in [
        (["eval", "echo", "--via", "http://h", *out], "--via"),
        (["eval", "echo", "--stream", "s", *out], "--stream names the workers' stream"),
        (["eval", "echo", "--via", "redis://127.0.0.1:1/0", *out], "cannot reach Redis"),
        (["eval", "echo", "--via", server.url, "--serve", *out], "choose one"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            cli_main(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # no run dir


def test_a_declaration_names_what_differs_and_the_fix() -> None:
    from trio_tasksets.redis._entries import Declaration

    echo = tt.ModelContext(tt.EchoClient(), "echo")
    ours = Declaration.of(graded_env(), echo)
    assert Declaration.from_json(ours.to_json()) == ours
    assert ours.differs(Declaration.of(graded_env(), echo)) is None
    # The same file in another checkout is the same class:
    elsewhere = attrs.evolve(ours, taskset=ours.taskset.replace(str(ROOT), "/srv/other"))
    assert elsewhere.taskset != ours.taskset
    assert elsewhere.differs(ours) is None
    # A declaration without env, model or sampling (from `enqueue`) checks the taskset only:
    plain = Declaration.of_taskset(graded_env().taskset)
    assert plain.differs(Declaration.of(graded_env("Graded"), echo)) is None
    assert "system_prompt" not in (plain.config or {})  # each task carries its own
    echo_tasks = Declaration.of(tt.Env(tt._core.builtin.EchoTaskset()), echo)
    assert "start the worker with taskset echo" in str(echo_tasks.differs(ours))
    other_model = Declaration.of(graded_env(), tt.ModelContext(tt.EchoClient(), "m2"))
    assert "the same model" in str(other_model.differs(ours))
    hot = Declaration.of(graded_env(), tt.ModelContext(tt.EchoClient(), "echo",
                                                       tt.Sampling(temperature=0.7)))  # fmt: skip
    assert "sampling" in str(hot.differs(ours))


def test_ctrl_c_on_eval_via_leaves_nothing_for_workers_and_exits_130(
    server: Server, r: redis.Redis, names: Names, tmp_path: Path
) -> None:
    argv = eval_via(server.url, names, tmp_path, "-n", "5", "-c", "3", "--run-name", "stop")
    coordinator = forkserver.popen(argv, stderr=subprocess.PIPE, text=True)
    until(lambda: r.xlen(names.stream) == 3, "3 slots enqueued (no worker runs them)")
    coordinator.send_signal(signal.SIGINT)
    _, err = coordinator.communicate(timeout=20)
    assert coordinator.returncode == 130, err
    assert r.xlen(names.stream) == 0  # a worker started now finds nothing of this eval
    assert not r.keys(f"{names.stream}:reply:*")
    assert "deleted 3 unanswered slots" in err
    # Nothing finished: no run dir is left behind (a rerun with the same name starts afresh).
    assert not (tmp_path / "stop").exists()


async def test_eval_via_takes_the_next_n_of_a_stream_with_r_slots_each(
    server: Server, names: Names, tmp_path: Path
) -> None:
    from trio_tasksets._core.builtin import EchoStreamConfig, EchoStreamTaskset

    def feed() -> tt.Env[Any]:
        return tt.Env(EchoStreamTaskset(EchoStreamConfig(gap=0.01)))

    worker = in_process_worker(server, names)
    ctx = tt.ModelContext(tt.EchoClient(), "echo")
    via = eval_config(tmp_path, "stream", num_examples=4, rollouts_per_example=2,
                      via=server.url, stream=names.stream)  # fmt: skip
    async with trio.open_nursery() as nursery:
        shut_down = await nursery.start(worker.run, feed())
        with trio.fail_after(20):
            result = await tt.run_eval(feed(), ctx, via)
        shut_down("done")
    assert sorted(comparable(trace_rows(result.run_dir))) == [
        (f"echo-stream:{i}", r) for i in range(4) for r in range(2)
    ]
    assert result.summary["ok"] == 8


async def test_eval_via_with_groups_writes_each_group_together(
    server: Server, names: Names, tmp_path: Path
) -> None:
    from trio_tasksets._core.builtin import EchoStreamConfig, EchoStreamTaskset

    class Grpo(tt.Env[Any]):
        scored: list[int] = []  # noqa: RUF012

        async def score_group(self, task: Any, episodes: list[tt.Episode]) -> None:
            Grpo.scored.append(len(episodes))
            for episode in episodes:
                episode.advantage = 0.0

    def feed() -> tt.Env[Any]:
        return Grpo(EchoStreamTaskset(EchoStreamConfig(gap=0.01)))

    worker = in_process_worker(server, names)
    ctx = tt.ModelContext(tt.EchoClient(), "echo")
    via = eval_config(tmp_path, "groups", num_examples=3, rollouts_per_example=4, group=True,
                      max_concurrent=3, via=server.url, stream=names.stream)  # fmt: skip
    async with trio.open_nursery() as nursery:
        shut_down = await nursery.start(worker.run, feed())
        with trio.fail_after(20):
            result = await tt.run_eval(feed(), ctx, via)
        shut_down("done")
    rows = trace_rows(result.run_dir)
    assert len(rows) == 12
    assert Grpo.scored == [4, 4, 4]  # scored on the worker (in this process), once per group
    order = [row["group"] for row in rows]
    assert len(set(order)) == 3
    assert all(order[i] == order[i - 1] for i in range(1, 12) if i % 4)  # written together
    assert all(row["advantage"] == 0.0 and row["ok"] for row in rows)
