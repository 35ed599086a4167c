"""The service example (examples/service.py) run for real against echo-stream."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import forkserver

ROOT = Path(__file__).resolve().parent.parent
SERVICE = [sys.executable, str(ROOT / "examples" / "service.py"), "--gap", "0.02"]


def test_service_publishes_a_bounded_number_of_episodes() -> None:
    done = forkserver.run(
        [*SERVICE, "--max-episodes", "5", "-c", "3"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(rows) >= 5  # runs already in flight when the fifth arrives still publish
    assert all(row["ok"] and row["reward"] == 1.0 for row in rows)
    assert len({row["id"] for row in rows}) == len(rows)


def test_sigterm_stops_pulling_finishes_in_flight_and_exits_0() -> None:
    proc = forkserver.popen(
        [*SERVICE, "-c", "4"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()  # the service is up and publishing
    assert json.loads(first)["ok"]
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "SIGTERM: stopping" in err
    published = 1 + len(out.splitlines())
    assert f"published {published} episodes" in err
