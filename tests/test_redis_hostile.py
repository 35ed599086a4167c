"""The Redis client against misbehaving and odd Redis-compatible servers (issue 26): raw
socket servers that speak just enough RESP to misbehave on purpose, and a real redis-server
started with TLS. Every wait is bounded (`trio.fail_after`, or a subprocess timeout).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import forkserver
import pytest
import trio
from helpers import RawServer

from trio_tasksets.redis._link import Link
from trio_tasksets.redis._resp import Address, Connection, Unreachable

pytest.importorskip("hiredis")

Answer = Callable[[list[bytes], int], bytes]  # a command and its number (from 1): the bytes sent


class RawRedis(RawServer):
    """Reads RESP commands and answers each with `answer(command, n)` (n counts commands over
    all connections, from 1); counts `connections`."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.commands: list[list[bytes]] = []
        super().__init__()
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def serve(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        with conn, reader:
            try:
                while True:
                    line = reader.readline()
                    if not line.startswith(b"*"):
                        return
                    command = []
                    for _ in range(int(line[1:])):
                        size = int(reader.readline()[1:])
                        command.append(reader.read(size + 2)[:-2])
                    with self._lock:
                        self.commands.append(command)
                        n = len(self.commands)
                    conn.sendall(self.answer(command, n))
            except OSError:  # the client hung up: what the tests expect of it
                return


def bulk(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return b"$%d\r\n%s\r\n" % (len(data), data)


# --- D3: a reply nobody asked for ------------------------------------------------------------


def one_extra_reply(command: list[bytes], n: int) -> bytes:
    """GET k is "v"; the first command's reply is followed by one nobody asked for."""
    reply = bulk("v") if command[0].upper() == b"GET" else b"+OK\r\n"
    return reply + (b"+EXTRA\r\n" if n == 1 else b"")


async def test_a_connection_with_an_unasked_reply_is_closed_not_reused() -> None:
    """D3: an unasked reply stayed in the parser's buffer, the stale check looked only at the
    socket, and every later reply on the connection was off by one (GET k returned EXTRA).
    Now the round trip that finds it fails as `Unreachable` and closes the connection."""
    with RawRedis(one_extra_reply) as server, trio.fail_after(10):
        connection = await Connection.open(Address.parse(server.url))
        with pytest.raises(Unreachable, match="more replies than it was sent commands"):
            await connection.execute("GET", "k")
        assert connection.closed
        assert connection.stale()


async def test_a_link_never_hands_one_commands_reply_to_the_next() -> None:
    """D3 through `Link` (what the feed, the worker and the coordinator use): every GET
    answers "v", on a new connection after the unasked reply, which is logged."""
    logged: list[str] = []
    with RawRedis(one_extra_reply) as server, trio.fail_after(10):
        link = Link(server.url, read_timeout=5.0, log=logged.append)
        replies = [await link.call("reading", lambda c, _: c.execute("GET", "k")) for _ in "abc"]
        link.close()
    assert replies == ["v", "v", "v"]
    assert server.connections == 2
    assert len(logged) == 2
    assert "more replies than it was sent commands" in logged[0]


# --- a cap on a reply's size -----------------------------------------------------------------


def endless_bulk(command: list[bytes], n: int) -> bytes:
    """A bulk that says 1 GB and sends 4 MiB of it (then waits: the client must not)."""
    return b"$1000000000\r\n" + b"a" * (4 << 20)


async def test_a_reply_over_max_reply_bytes_fails_at_once_not_at_the_read_timeout() -> None:
    """A hostile Redis could make the client buffer a huge bulk until the read timeout: a
    reply is now capped (`max_reply_bytes`, 64 MiB by default), as HTTP bodies are."""
    with RawRedis(endless_bulk) as server, trio.fail_after(10):
        connection = await Connection.open(
            Address.parse(server.url), read_timeout=60.0, max_reply_bytes=1 << 20
        )
        with pytest.raises(Unreachable, match=r"a reply over 1,048,576 bytes \(max_reply_bytes\)"):
            await connection.execute("GET", "k")
        assert connection.closed
    with pytest.raises(ValueError, match="max_reply_bytes"):
        Link("redis://127.0.0.1/0", read_timeout=1.0, log=print, max_reply_bytes=0)


# --- D6: odd Redis-compatible servers --------------------------------------------------------


def ok_to_everything(command: list[bytes], n: int) -> bytes:
    return b"+OK\r\n"


def info_without_run_id(command: list[bytes], n: int) -> bytes:
    if command[0].upper() == b"INFO":
        return bulk("# Server\r\nredis_version:7.2.0\r\nredis_mode:standalone\r\n")
    return b"+OK\r\n"


def streams_answer_ok(command: list[bytes], n: int) -> bytes:
    """INFO as Redis answers it; every other command +OK (XREADGROUP included)."""
    if command[0].upper() == b"INFO":
        return bulk("# Server\r\nredis_version:7.2.0\r\nrun_id:0123abcd\r\n")
    return b"+OK\r\n"


def run_cli(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return forkserver.run(
        [sys.executable, "-m", "trio_tasksets", *argv],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip


@pytest.mark.parametrize(
    ("command", "answer", "said"),
    [
        ("eval", ok_to_everything, "answered INFO server with 'OK', which has no run_id"),
        ("eval", info_without_run_id, "which has no run_id"),
        ("worker", ok_to_everything, "answered INFO server with 'OK', which has no run_id"),
        ("worker", info_without_run_id, "which has no run_id"),
        ("worker", streams_answer_ok, "answered a stream read with 'OK'"),
    ],
)
def test_an_odd_redis_compatible_server_is_named_with_what_it_answered(
    tmp_path: Path, command: str, answer: Answer, said: str
) -> None:
    """D6: `eval --via` against a server whose INFO has no run_id exited 1 with KeyError and
    a fix line pointing at a run dir that did not exist; a `worker` against a server that
    answers +OK to everything exited 1 with IndexError. Now both exit 2 naming the server,
    what it answered and a fix, and no run dir is made or named."""
    with RawRedis(answer) as server:
        out = tmp_path / "runs"
        if command == "eval":
            argv = ["eval", "echo", "--via", server.url, "-o", str(out), "--no-dashboard"]
            flag = "--via"
        else:
            argv = ["worker", "--feed", server.url, "--stream", "s", "--group", "g",
                    "--results", "r", "--no-dashboard"]  # fmt: skip
            flag = "--feed"
        done = run_cli(tmp_path, *argv)
    error = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2, done.stderr
    assert error.startswith(f"trio-tasksets {command}: error: {flag} {server.url}: "), error
    assert f"127.0.0.1:{server.port}" in error
    assert said in error
    assert f"point {flag} at a redis-server" in error
    assert "Traceback" not in done.stderr
    assert not out.exists() or not any(out.iterdir())  # no run dir, and none named
    assert "traces.jsonl" not in done.stderr


# --- a Redis still loading its data -----------------------------------------------------------


def loading_twice(command: list[bytes], n: int) -> bytes:
    if n <= 2:
        return b"-LOADING Redis is loading the dataset in memory\r\n"
    return bulk("v")


async def test_a_link_retries_while_redis_loads_its_data() -> None:
    """A Redis restarted from its AOF answers LOADING to every command until its data is
    loaded (it ran nothing): a `Link` call waits it out, as for an unreachable Redis, instead
    of raising it (a worker died of it after a restart)."""
    logged: list[str] = []
    with RawRedis(loading_twice) as server, trio.fail_after(10):
        link = Link(server.url, read_timeout=5.0, log=logged.append)
        assert await link.call("reading", lambda c, _: c.execute("GET", "k")) == "v"
        link.close()
    assert len(server.commands) == 3
    assert "LOADING" in logged[0]
    assert "reachable again after 2 failed attempts" in logged[-1]
