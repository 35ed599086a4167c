"""The CLI's own process freezes its set-up heap (`gc.freeze`); `main([...])` called from a
program, and the library, leave the process's collector as it was."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CHILD = """
import gc, json, sys
from trio_tasksets._cli.main import main

out = sys.argv[1]
args = ["eval", "echo-stream", "-n", "3", "--no-dashboard", "-o", out]
seen = {}
seen["main_argv_code"] = main([*args, "--run-name", "a"])
seen["main_argv_frozen"] = gc.get_freeze_count()
seen["enabled_after_argv"] = gc.isenabled()
sys.argv = ["trio-tasksets", *args, "--run-name", "b"]
seen["console_code"] = main()
seen["console_frozen"] = gc.get_freeze_count()
seen["enabled_after_console"] = gc.isenabled()
print(json.dumps(seen))
"""


def test_only_the_clis_own_process_freezes_its_heap(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["main_argv_code"] == 0
    assert seen["console_code"] == 0
    assert seen["main_argv_frozen"] == 0  # a program's main([...]): its collector untouched
    assert seen["console_frozen"] > 10_000  # the console script: imports and set-up frozen
    assert seen["enabled_after_argv"]
    assert seen["enabled_after_console"]
    for name in ("a", "b"):
        assert len((tmp_path / "out" / name / "traces.jsonl").read_text().splitlines()) == 3
