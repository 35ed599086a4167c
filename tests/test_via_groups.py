"""`eval --via --group` (issue 22): a group is one entry, run by one worker as a group.

Real parts: the session's redis-server, worker processes (`tests/fixtures/redis_worker.py`
running `tests/fixtures/redis_env.py:GroupedTurns`, whose `score_group` changes rewards and
sets advantages) and the coordinator as a process (`python -m trio_tasksets eval --via`).
Each row names the worker that ran it (`worker`, its consumer name).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import forkserver
import pytest
import redis
import trio
from helpers import needs
from test_redis import (
    REDIS_ENV,
    Names,
    Server,
    Worker,
    eval_config,
    graded_env,
    in_process_worker,
    names,
    r,
    server,
    trace_rows,
    workers,
)

import trio_tasksets as tt

pytestmark = needs("redis-server", why="eval --via --group over a real Redis")
__all__ = ["names", "r", "server", "workers"]  # the fixtures, used by name

SPEC = f"{REDIS_ENV}:GroupedTurns"
SAME = ("task", "rollout", "ok", "reward", "completion", "messages", "errors", "advantage")


def eval_via(url: str, names: Names, out: Path, *options: str) -> list[str]:
    return [
        sys.executable, "-m", "trio_tasksets", "eval", SPEC, "--via", url, "--stream", names.stream,
        "-o", str(out), "--no-dashboard", "--group", *options,
    ]  # fmt: skip


def by_group(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[row["group"]].append(row)
    return groups


def comparable(rows: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    """Rows by slot, without what differs between two runs (id, timing, group id, worker)."""
    return {(row["task"]["key"], row["rollout"]): {k: row[k] for k in SAME} for row in rows}


def local_rows(tmp_path: Path, n: int, r: int) -> list[dict[str, Any]]:
    """An in-process `--group` eval of the same env with the echo model."""
    config = eval_config(tmp_path, f"local-{n}", num_examples=n, rollouts_per_example=r,
                         group=True)  # fmt: skip
    ctx = tt.ModelContext(tt.EchoClient(), "echo")
    result = trio.run(tt.run_eval, graded_env("GroupedTurns"), ctx, config)
    return trace_rows(result.run_dir)


def start_workers(start: Callable[..., Worker], server: Server, names: Names) -> list[Worker]:
    return [start(server.url, names, f"w{i}", "-c", "4", "--echo-delay", "0.02", taskset=SPEC)
            for i in range(2)]  # fmt: skip


def test_each_group_runs_on_one_worker_and_its_rows_come_back_together(
    server: Server, r: redis.Redis, names: Names, workers: Callable[..., Worker], tmp_path: Path
) -> None:
    pair = start_workers(workers, server, names)
    argv = eval_via(server.url, names, tmp_path, "-n", "8", "-r", "4", "-c", "8",
                    "--run-name", "via")  # fmt: skip
    coordinator = forkserver.popen(argv, stderr=subprocess.PIPE, text=True)
    most = 0
    while coordinator.poll() is None:  # this eval's entries enqueued and not yet answered
        most = max(most, int(r.xlen(names.stream)))
    _, err = coordinator.communicate()
    assert coordinator.returncode == 0, err
    rows = trace_rows(tmp_path / "via")
    assert len(rows) == 32
    # -c 8 counts live rollouts: two groups of 4 out at most, one entry each.
    assert 1 <= most <= 2
    groups = by_group(rows)
    assert len(groups) == 8
    for group in groups.values():
        assert len(group) == 4
        assert len({row["worker"] for row in group}) == 1  # one worker ran the whole group
        assert len({row["task"]["key"] for row in group}) == 1
        assert sorted(row["rollout"] for row in group) == [0, 1, 2, 3]
        assert all(row["advantage"] is not None for row in group)
        # written together: a group's rows are consecutive lines of traces.jsonl
        lines = [i for i, row in enumerate(rows) if row["group"] == group[0]["group"]]
        assert lines == list(range(lines[0], lines[0] + 4))
    # The same rows as an in-process --group run: scored once, on the worker.
    assert comparable(rows) == comparable(local_rows(tmp_path, 8, 4))
    assert {row["advantage"] for row in rows} == {-0.15, -0.05, 0.05, 0.15}
    assert all(worker.stop() == 0 for worker in pair)
    published = [int(w.log.split("published ")[1].split()[0]) for w in pair]
    assert sum(published) == 32


def test_resume_reruns_a_half_finished_group_whole(
    server: Server, r: redis.Redis, names: Names, workers: Callable[..., Worker], tmp_path: Path
) -> None:
    start_workers(workers, server, names)
    argv = eval_via(server.url, names, tmp_path, "-n", "4", "-r", "3", "-c", "6",
                    "--run-name", "run")  # fmt: skip
    first = forkserver.run(argv, stderr=subprocess.PIPE, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    traces = tmp_path / "run" / "traces.jsonl"
    rows = trace_rows(tmp_path / "run")
    assert len(rows) == 12
    groups = list(by_group(rows))
    missing, failed = groups[0], groups[1]  # one row lost, one row failed: both owed whole
    kept: list[dict[str, Any]] = []
    dropped = False
    for row in rows:
        if row["group"] == missing and not dropped:
            dropped = True
            continue
        if row["group"] == failed and row["rollout"] == 2:
            row = {**row, "ok": False, "errors": [{"type": "X", "message": "x", "attempt": 1}]}
        kept.append(row)
    traces.write_text("".join(json.dumps(row) + "\n" for row in kept))
    second = forkserver.run([*argv, "--resume"], stderr=subprocess.PIPE, text=True, timeout=60)
    assert second.returncode == 0, second.stderr
    after = trace_rows(tmp_path / "run")
    assert len(after) == 12
    assert len(comparable(after)) == 12  # one row per slot
    regrouped = by_group(after)
    assert missing not in regrouped  # re-run whole, not patched
    assert failed not in regrouped
    assert set(groups[2:]) <= set(regrouped)  # the whole groups are kept as they were
    assert len(regrouped) == 4
    for group in regrouped.values():
        assert len(group) == 3
        assert len({row["worker"] for row in group}) == 1
        assert all(row["ok"] for row in group)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["kept_from_resume"] == 6
    assert comparable(after) == comparable(local_rows(tmp_path, 4, 3))


async def test_a_worker_gives_an_env_without_score_group_the_evals_advantage(
    server: Server, names: Names, tmp_path: Path
) -> None:
    """`--advantage std` travels in the group entry: the worker (this process, its env
    rebuilt from nothing but its own class) divides by the group's standard deviation."""
    import statistics

    class Counted(tt.Env[Any]):  # no score_group: the default advantage
        # per prompt: a group's rewards differ in any interleaving of groups
        rewards: ClassVar[Counter[str]] = Counter()

        async def score(self, task: Any, completion: str) -> float:
            Counted.rewards[task.prompt] += 1
            return float(Counted.rewards[task.prompt] % 3)

    worker = in_process_worker(server, names)
    ctx = tt.ModelContext(tt.EchoClient(), "echo")
    via = eval_config(tmp_path, "std", num_examples=3, rollouts_per_example=4, group=True,
                      advantage="std", max_concurrent=4, via=server.url, stream=names.stream)  # fmt: skip
    async with trio.open_nursery() as nursery:
        shut_down = await nursery.start(worker.run, Counted(tt.EchoTaskset()))
        with trio.fail_after(20):
            result = await tt.run_eval(Counted(tt.EchoTaskset()), ctx, via)
        shut_down("done")
    groups = by_group(trace_rows(result.run_dir))
    assert len(groups) == 3
    for rows in groups.values():
        rewards = [row["reward"] for row in rows]
        assert len(set(rewards)) > 1
        mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
        assert [row["advantage"] for row in rows] == pytest.approx(
            [(reward - mean) / std for reward in rewards]
        )
        assert all(row["worker"] == "w" for row in rows)
