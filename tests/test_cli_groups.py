"""`trio-tasksets eval --group` end to end, in a subprocess: rows of a group, resume of a
half-finished group, a group failing after its retries."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import forkserver

ENVS = '''
import statistics
import trio_tasksets as tt


class Words(tt.Taskset):
    def load(self):
        return [tt.Task(prompt=f"say {word}", answer=word) for word in ("red", "green", "blue")]


class Grpo(tt.Env):
    async def score_group(self, task, episodes):
        mean = statistics.fmean(e.reward for e in episodes)
        for e in episodes:
            e.advantage = e.reward - mean


class Flaky(Grpo):
    """Every rollout of "say green" fails; the others succeed."""

    async def rollout(self, task, ctx):
        if "green" in task.prompt:
            raise RuntimeError("the sandbox died")
        return await super().rollout(task, ctx)
'''


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "envs.py").write_text(ENVS)
    return forkserver.run(
        [sys.executable, "-m", "trio_tasksets", "eval", f"{tmp_path / 'envs.py'}:Words",
         "-o", str(tmp_path / "out"), "--no-dashboard", "--run-name", "g", *args],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip


def rows(tmp_path: Path) -> list[dict[str, Any]]:
    text = (tmp_path / "out" / "g" / "traces.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def by_group(found: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in found:
        groups.setdefault(row["group"], []).append(row)
    return groups


def test_group_r4_rows(tmp_path: Path) -> None:
    done = run(tmp_path, "--env-class", f"{tmp_path / 'envs.py'}:Grpo", "--group", "-r", "4",
               "-c", "3")  # fmt: skip
    assert done.returncode == 0, done.stderr
    found = rows(tmp_path)
    assert len(found) == 12
    groups = by_group(found)
    assert len(groups) == 3
    for members in groups.values():
        assert sorted(r["rollout"] for r in members) == [0, 1, 2, 3]
        assert len({r["task"]["key"] for r in members}) == 1
        assert all(r["ok"] and r["advantage"] == 0.0 for r in members)  # echo: all equal
    order = [r["group"] for r in found]
    assert all(order[i] == order[i - 1] for i in range(1, 12) if i % 4)  # written together


def test_resume_reruns_a_half_finished_group_whole(tmp_path: Path) -> None:
    first = run(tmp_path, "--env-class", f"{tmp_path / 'envs.py'}:Grpo", "--group", "-r", "4")
    assert first.returncode == 0, first.stderr
    found = rows(tmp_path)
    victim = found[5]["group"]
    # as a kill mid-write leaves it: the group's last two rows never made it, one torn line
    kept = [r for r in found if not (r["group"] == victim and r["rollout"] >= 2)]
    text = "".join(json.dumps(r) + "\n" for r in kept) + '{"id": "torn'
    (tmp_path / "out" / "g" / "traces.jsonl").write_text(text)
    again = run(tmp_path, "--env-class", f"{tmp_path / 'envs.py'}:Grpo", "--group", "-r", "4",
                "--resume")  # fmt: skip
    assert again.returncode == 0, again.stderr
    after = rows(tmp_path)
    assert len(after) == 12
    groups = by_group(after)
    assert victim not in groups  # its two surviving rows were dropped, the group re-ran
    assert len(groups) == 3
    assert all(len(members) == 4 for members in groups.values())
    summary = json.loads((tmp_path / "out" / "g" / "summary.json").read_text())
    assert summary["kept_from_resume"] == 8


def test_resume_refuses_a_run_saved_without_group(tmp_path: Path) -> None:
    first = run(tmp_path, "-r", "2")
    assert first.returncode == 0, first.stderr
    again = run(tmp_path, "-r", "2", "--group", "--resume")
    assert again.returncode == 2
    assert "group" in again.stderr


def test_a_group_failing_after_retries(tmp_path: Path) -> None:
    done = run(tmp_path, "--env-class", f"{tmp_path / 'envs.py'}:Flaky", "--group", "-r", "3",
               "--retries", "2")  # fmt: skip
    assert done.returncode == 0, done.stderr  # two groups succeeded
    found = rows(tmp_path)
    assert len(found) == 9
    green = [r for r in found if "green" in r["task"]["data"]["prompt"]]
    assert len(green) == 3
    assert not any(r["ok"] for r in green)
    assert len({r["group"] for r in green}) == 1
    own = [r for r in green if r["errors"][-1]["type"] == "RuntimeError"]
    assert own
    assert own[0]["attempts"] == 3  # the retries ran before the group gave up
    assert found.index(own[0]) == min(found.index(r) for r in green)  # the cause first
    for other in green:
        if other not in own:
            assert other["errors"][-1]["type"] == "GroupFailedError"
            assert "RuntimeError: the sandbox died" in other["errors"][-1]["message"]
    summary = json.loads((tmp_path / "out" / "g" / "summary.json").read_text())
    assert summary["failed"] == 3
    assert summary["first_error"]["type"] == "RuntimeError"
    assert "RuntimeError" in done.stdout + done.stderr


def test_group_over_the_served_path(tmp_path: Path) -> None:
    done = run(tmp_path, "--env-class", f"{tmp_path / 'envs.py'}:Grpo", "--group", "-r", "3",
               "--serve")  # fmt: skip
    assert done.returncode == 0, done.stderr
    groups = by_group(rows(tmp_path))
    assert sorted(len(members) for members in groups.values()) == [3, 3, 3]
    assert all(r["advantage"] == 0.0 for members in groups.values() for r in members)
