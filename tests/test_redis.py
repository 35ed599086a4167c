"""The Redis Streams feed, results sink and worker (issue 6), against a real redis-server.

The session starts its own `redis-server` on a free loopback port (no persistence) and stops it
at the end; the restart test runs a second, persistent one (AOF) that it stops and starts on
the same port. Workers are real processes (`python -m trio_tasksets worker`).
Every wait polls Redis state (XLEN, XPENDING, XINFO) or a worker's log under a deadline.
"""

from __future__ import annotations

import functools
import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import attrs
import pytest
import redis
import trio

import trio_tasksets as tt
from trio_tasksets.cli import main as cli_main
from trio_tasksets.redis import (
    TASK_FIELD,
    EntryRef,
    RedisResults,
    RedisStreamTaskset,
    RedisTask,
    encode_task,
    enqueue,
)
from trio_tasksets.redis.worker import WorkerConfig, run_worker
from trio_tasksets.testing import Gate

REDIS_SERVER = shutil.which("redis-server")
pytestmark = pytest.mark.skipif(
    REDIS_SERVER is None, reason="redis-server is not on PATH (apt-get install -y redis-server)"
)
WORKER = [sys.executable, "-m", "trio_tasksets", "worker", "--no-dashboard"]


# --- servers, names and polling ---------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def until(predicate: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Poll `predicate` until it holds; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


@attrs.define
class Server:
    """A redis-server process on a fixed port; `stop()` and `start()` again keep its data if
    started with `persistent=True` (AOF, fsync always; SIGTERM makes it flush)."""

    port: int
    directory: Path
    persistent: bool = False
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert REDIS_SERVER is not None
        aof = ["--appendonly", "yes", "--appendfsync", "always"] if self.persistent else []
        self.process = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", *aof, "--dir", str(self.directory)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        client = redis.Redis.from_url(self.url, socket_timeout=1.0)
        until(lambda: _pings(client), f"redis-server on port {self.port}", timeout=10)
        client.close()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
        self.process = None


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(_free_port(), tmp_path_factory.mktemp("redis"))
    srv.start()
    yield srv
    srv.stop()


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

    def start(url: str, names: Names, consumer: str, *options: str) -> Worker:
        log_path = tmp_path / f"{consumer}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [*WORKER, "--feed", url, "--stream", names.stream, "--group", names.group,
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


def test_sigterm_finishes_in_flight_episodes_within_the_grace_and_exits_0(
    server: Server, r: redis.Redis, names: Names, workers: Callable[..., Worker]
) -> None:
    push(r, names.stream, make_tasks(10))
    worker = workers(server.url, names, "w", "-c", "4", "--echo-delay", "1.0", "--grace", "20")
    until(lambda: pending_of(r, names).get("w") == 4, "4 episodes in flight")
    began = time.monotonic()
    assert worker.stop(signal.SIGTERM) == 0, worker.log
    assert time.monotonic() - began < 5  # the episodes' own second, not the 20 s grace
    assert r.xlen(names.results) == 4  # the in-flight four finished and were published...
    assert pending(r, names) == 0  # ...and acknowledged; nothing else was pulled
    group = r.xinfo_groups(names.stream)[0]
    assert group["lag"] == 6
    assert "SIGTERM: stopping" in worker.log
    assert "published 4 episodes" in worker.log


def test_past_the_grace_in_flight_episodes_are_cancelled_and_left_pending(
    server: Server, r: redis.Redis, names: Names, workers: Callable[..., Worker]
) -> None:
    push(r, names.stream, make_tasks(3))
    worker = workers(server.url, names, "w", "-c", "2", "--echo-delay", "60", "--grace", "0.3")
    until(lambda: pending_of(r, names).get("w") == 2, "2 episodes in flight")
    began = time.monotonic()
    assert worker.stop(signal.SIGTERM) == 0, worker.log
    assert time.monotonic() - began < 5
    assert r.xlen(names.results) == 0
    assert pending_of(r, names) == {"w": 2}  # left for another worker; so is its name
    assert "2 cancelled at the grace deadline" in worker.log


def test_a_redis_restart_mid_run_is_retried_and_loses_nothing(
    r: redis.Redis, names: Names, workers: Callable[..., Worker], tmp_path: Path
) -> None:
    own = Server(_free_port(), tmp_path, persistent=True)
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
    from trio_tasksets.builtin import EchoTaskset

    source = list(EchoTaskset())
    ids = await enqueue(server.url, names.stream, source, batch=3)
    assert len(ids) == len(source) == r.xlen(names.stream)
    feed = RedisStreamTaskset(server.url, names.stream, names.group, "c", block=0.1)
    async with feed.channel() as tasks:
        got: list[RedisTask] = [await tasks.receive() for _ in source]
    assert [(t.key, t.data) for t in got] == [(t.key, t.data) for t in source]
    assert all(isinstance(t, tt.Task) for t in got)


async def test_run_worker_in_process_stops_when_told(
    server: Server, r: redis.Redis, names: Names
) -> None:
    push(r, names.stream, make_tasks(5))
    config = WorkerConfig(server.url, names.stream, names.group, names.results, consumer="me",
                          max_concurrent=2, dashboard=False)  # fmt: skip
    lines: list[str] = []
    # Episodes that take a while overlap, so the window fills (peak 2) whatever the timing.
    ctx = tt.ModelContext(tt.EchoClient(delay=0.2), "echo")
    async with trio.open_nursery() as nursery:
        start = functools.partial(run_worker, config, ctx, handle_signals=False, log=lines.append)
        shut_down = await nursery.start(start)
        await wait_for(lambda: r.xlen(names.results) >= 5)
        shut_down("told")
    assert pending(r, names) == 0
    assert lines[-1].startswith("stopped: published 5 episodes; peak in flight 2/2")
    assert any(line.startswith("told: stopping") for line in lines)


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
        (["worker", "--feed", "redis://h", "--stream", "s", "--results", "r"], "--group"),
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
