"""The README's test command passes on a machine without the optional system programs
(issue 35): a test that needs redis-server, tinyproxy, chromium or chromedriver skips, naming
the program, what the test needs it for and the package to install.

Here: a pytest run, in a process of its own, of tests that need each program, on a PATH
without any of them (`.ci/path-without`: a directory of links to every other command). The
whole suite on such a PATH is a step of `.ci/run`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from helpers import OTHER_NAMES, PROGRAMS

ROOT = Path(__file__).resolve().parent.parent

# A test that needs each program: in a sync fixture, in a module's mark, in an async test's
# body, in a parametrized fixture (test id: the program it needs).
NEEDING = {
    "tests/test_proxy_tls.py::test_https_through_a_real_proxy_goes_through_its_connect_tunnel": (
        "tinyproxy"
    ),
    "tests/test_proxy_tls.py::test_an_openai_client_reaches_http_through_a_real_proxy": (
        "tinyproxy"
    ),
    "tests/test_proxy_tls.py::test_rediss_reaches_a_real_redis_with_tls": "redis-server",
    "tests/test_redis_resp.py::test_unix_socket_and_tls": "redis-server",
    "tests/test_health.py::test_worker_metrics_port": "redis-server",
    "tests/test_backends.py::test_rows_equal_an_in_process_evals[via]": "redis-server",
    "tests/test_queues.py::test_an_entrys_deadline_is_enforced[redis]": "redis-server",
    "tests/test_report.py::test_in_chromium_the_page_shows_the_run_and_its_table_works": (
        "chromium"
    ),
    "tests/test_agents.py::test_in_chromium_an_expanded_row_shows_the_tool_calls": "chromium",
}
REASON = re.compile(r"^.+: needs (?P<programs>.+) on PATH \(Debian: apt-get install -y [a-z -]+\)$")


def test_tests_that_need_a_missing_program_skip_saying_which_and_how_to_install_it(
    tmp_path: Path,
) -> None:
    view = tmp_path / "bin"
    names = [*PROGRAMS, *(name for other in OTHER_NAMES.values() for name in other)]
    subprocess.run([ROOT / ".ci" / "path-without", view, *names], check=True, timeout=60)
    for program in PROGRAMS:
        assert not (view / program).exists()
    report = tmp_path / "junit.xml"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
         f"--junitxml={report}", *NEEDING],
        cwd=ROOT, env={**os.environ, "PATH": str(view)}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    skipped = {}
    for case in ET.parse(report).iter("testcase"):
        node = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        for skip in case.iter("skipped"):
            skipped[node] = skip.get("message", "")
    assert set(skipped) == set(NEEDING), done.stdout[-3000:]
    for node, program in NEEDING.items():
        reason = REASON.match(skipped[node])
        assert reason is not None, (node, skipped[node])
        assert program in reason["programs"], (node, skipped[node])
