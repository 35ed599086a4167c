"""The Redis connection (`trio_tasksets.redis._resp`) against a real redis-server (plain TCP, TLS
with a trustme CA, a unix socket, an ACL user) and against servers that misbehave on purpose.
What it wrote is checked with redis-py, a client we did not write."""

from __future__ import annotations

import ssl
import sys
from pathlib import Path

import forkserver
import pytest
import trio
from helpers import free_port, needs
from redis_server import RedisServer

from trio_tasksets.redis._link import Link, server_run_id
from trio_tasksets.redis._resp import Address, Connection, ReplyError, Unreachable, pack

needs_server = needs("redis-server", why="the Redis connection against a real Redis")
USER, PASSWORD = "alice", "s3cret:@/%"  # characters a URL must escape
ESCAPED = "s3cret%3A%40%2F%25"


@pytest.fixture(scope="module")
def servers(redis_server: RedisServer) -> RedisServer:
    """The session's redis-server (TCP, TLS with a trustme CA, a unix socket), with an ACL
    user added."""
    client = redis_server.client()
    client.acl_setuser(USER, enabled=True, passwords=[f"+{PASSWORD}"], keys="*",
                       commands=["+@all"])  # fmt: skip
    client.close()
    return redis_server


# --- URLs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://h", Address(host="h")),
        ("redis://h:7000/3", Address(host="h", port=7000, db=3)),
        ("redis://h?db=2", Address(host="h", db=2)),
        (f"redis://{USER}:{ESCAPED}@h/0", Address(host="h", username=USER, password=PASSWORD)),
        ("redis://:pw@h", Address(host="h", password="pw")),
        ("rediss://h", Address(host="h", tls=True)),
        ("rediss://h?ssl_cert_reqs=none", Address(host="h", tls=True, cert_reqs=ssl.CERT_NONE)),
        ("rediss://h?ssl_ca_certs=/ca.pem", Address(host="h", tls=True, ca_certs="/ca.pem")),
        ("unix:///run/redis.sock?db=4", Address(path="/run/redis.sock", db=4)),
    ],
)
def test_address_parse(url: str, expected: Address) -> None:
    assert Address.parse(url) == expected


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://h", "scheme 'http'"),
        ("redis://h?timeout=3", "unknown query parameter timeout"),
        ("redis://h/x", "bad db or port"),
        ("redis://h:99999", "bad db or port"),
        ("redis://", "no host"),
        ("unix://", "needs a socket path"),
        ("rediss://h?ssl_cert_reqs=maybe", "ssl_cert_reqs must be"),
    ],
)
def test_address_parse_refuses(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        Address.parse(url)


def test_pack_is_binary_safe() -> None:
    assert pack(["SET", "k", b"a\r\nb", 7, 0.5]) == (
        b"*5\r\n$3\r\nSET\r\n$1\r\nk\r\n$4\r\na\r\nb\r\n$1\r\n7\r\n$3\r\n0.5\r\n"
    )


# --- a real server ---------------------------------------------------------------------------


@needs_server
async def test_commands_pipelines_and_errors(servers: RedisServer) -> None:
    connection = await Connection.open(Address.parse(servers.url))
    try:
        value = "é\r\n✓ " * 1000
        assert await connection.execute("SET", "resp:k", value) == "OK"
        assert await connection.execute("GET", "resp:k") == value
        assert await connection.execute("DEL", "resp:n") in (0, 1)
        replies = await connection.pipeline([("INCR", "resp:n"), ("INCR", "resp:n")])
        assert replies == [1, 2]
        # An error reply is raised after every reply is read: the connection stays usable.
        with pytest.raises(ReplyError, match="WRONGTYPE"):
            await connection.pipeline([("LPUSH", "resp:k", "x"), ("INCR", "resp:n")])
        assert await connection.execute("GET", "resp:n") == "3"
        mixed = await connection.pipeline([("LPUSH", "resp:k", "x"), ("PING",)], raise_errors=False)
        assert isinstance(mixed[0], ReplyError)
        assert mixed[1] == "PONG"
        assert connection.closed is False
    finally:
        connection.close()
    assert connection.closed


@needs_server
async def test_invalid_utf8_is_replaced_not_fatal(servers: RedisServer) -> None:
    servers.client().set("resp:bytes", b"ok\xff\xfe")
    connection = await Connection.open(Address.parse(servers.url))
    try:
        assert await connection.execute("GET", "resp:bytes") == "ok\ufffd\ufffd"
    finally:
        connection.close()


@needs_server
async def test_transaction_runs_together_or_not_at_all(servers: RedisServer) -> None:
    plain = servers.client()
    plain.delete("resp:s", "resp:str")
    plain.set("resp:str", "v")
    connection = await Connection.open(Address.parse(servers.url))
    try:
        # A command failing while EXEC runs: its error in place, the others applied.
        replies = await connection.pipeline(
            [("XADD", "resp:s", "*", "f", "1"), ("XADD", "resp:str", "*", "f", "2")],
            transaction=True,
            raise_errors=False,
        )
        assert isinstance(replies[0], str)
        assert isinstance(replies[1], ReplyError)
        assert "WRONGTYPE" in str(replies[1])
        assert plain.xlen("resp:s") == 1
        # A command refused while queueing: the whole transaction is discarded.
        with pytest.raises(ReplyError):
            await connection.pipeline(
                [("XADD", "resp:s", "*", "f", "3"), ("NOSUCHCOMMAND",)], transaction=True
            )
        assert plain.xlen("resp:s") == 1
        assert await connection.execute("PING") == "PONG"
    finally:
        connection.close()
        plain.close()


@needs_server
async def test_db_and_acl_login(servers: RedisServer) -> None:
    url = f"redis://{USER}:{ESCAPED}@127.0.0.1:{servers.port}/3"
    connection = await Connection.open(Address.parse(url))
    try:
        await connection.execute("SET", "resp:in-db-3", "yes")
        assert await connection.execute("ACL", "WHOAMI") == USER
    finally:
        connection.close()
    assert servers.client(db=3).get("resp:in-db-3") == b"yes"
    assert servers.client(db=0).get("resp:in-db-3") is None


@needs_server
async def test_refused_login_is_raised_not_retried(servers: RedisServer) -> None:
    url = f"redis://{USER}:wrong@127.0.0.1:{servers.port}/0"
    with pytest.raises(ReplyError, match="WRONGPASS"):
        await Connection.open(Address.parse(url))
    logged: list[str] = []
    link = Link(url, read_timeout=1.0, log=logged.append)

    async def ping(connection: Connection, _attempt: int) -> object:
        return await connection.execute("PING")

    with trio.fail_after(5), pytest.raises(ReplyError, match="WRONGPASS"):
        await link.call("pinging", ping)
    assert logged == []  # no retry loop on a refusal
    with pytest.raises(ReplyError, match="WRONGPASS"):
        await server_run_id(url)


@needs_server
async def test_unix_socket_and_tls(servers: RedisServer) -> None:
    for url in (
        f"unix://{servers.unix}?db=1",
        f"rediss://127.0.0.1:{servers.tls_port}/1?ssl_ca_certs={servers.ca}",
        f"rediss://127.0.0.1:{servers.tls_port}/1?ssl_cert_reqs=none",
    ):
        connection = await Connection.open(Address.parse(url))
        try:
            assert await connection.execute("SET", "resp:via", url) == "OK"
        finally:
            connection.close()
        assert servers.client(db=1).get("resp:via") == url.encode()
    # A certificate nobody vouches for: refused, named.
    with pytest.raises(Unreachable, match="CERTIFICATE_VERIFY_FAILED"):
        await Connection.open(Address.parse(f"rediss://127.0.0.1:{servers.tls_port}"))


@needs_server
async def test_cancelled_call_closes_its_connection_and_the_link_goes_on(
    servers: RedisServer,
) -> None:
    link = Link(servers.url, read_timeout=30.0, log=print)
    held: list[Connection] = []

    async def block(connection: Connection, _attempt: int) -> object:
        held.append(connection)
        return await connection.execute("BLPOP", "resp:never", 30)

    with trio.move_on_after(0.2) as scope:
        await link.call("blocking", block)
    assert scope.cancelled_caught
    assert held[0].closed  # its reply would come later: it can never be reused

    async def ping(connection: Connection, _attempt: int) -> object:
        held.append(connection)
        return await connection.execute("PING")

    with trio.fail_after(5):
        assert await link.call("pinging", ping) == "PONG"
    assert held[1] is not held[0]
    link.close()
    assert held[1].closed


@needs_server
async def test_an_attempt_not_abandoned_runs_to_its_end(servers: RedisServer) -> None:
    link = Link(servers.url, read_timeout=5.0, log=print)

    async def slow(connection: Connection, _attempt: int) -> object:
        return await connection.execute("BLPOP", "resp:never", 0.3)

    with trio.CancelScope() as scope:
        scope.cancel()
        assert await link.call("waiting", slow, abandon=False) is None  # BLPOP timed out
    link.close()


# --- servers that misbehave on purpose -------------------------------------------------------


async def _serve(handler: object, nursery: trio.Nursery) -> int:
    listeners = await nursery.start(trio.serve_tcp, handler, 0)
    return int(listeners[0].socket.getsockname()[1])


async def test_no_reply_times_out_and_closes(autojump_clock: trio.testing.MockClock) -> None:
    async def silent(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        port = await _serve(silent, nursery)
        connection = await Connection.open(
            Address.parse(f"redis://127.0.0.1:{port}"), read_timeout=2.0
        )
        start = trio.current_time()
        with pytest.raises(Unreachable, match=r"no reply from 127\.0\.0\.1:\d+ within 2 s"):
            await connection.execute("PING")
        assert trio.current_time() - start == pytest.approx(2.0)
        assert connection.closed
        with pytest.raises(Unreachable, match="closed"):
            await connection.execute("PING")
        # A peer that never reads: the send itself is under the deadline.
        connection = await Connection.open(
            Address.parse(f"redis://127.0.0.1:{port}"), read_timeout=2.0
        )
        with trio.fail_after(30), pytest.raises(Unreachable, match="within 2 s"):
            await connection.execute("SET", "k", b"x" * (64 << 20))
        assert connection.closed
        # A TLS handshake nobody answers: bounded by the connect timeout.
        with pytest.raises(Unreachable, match=r"no connection to 127\.0\.0\.1:\d+ within 3 s"):
            await Connection.open(Address.parse(f"rediss://127.0.0.1:{port}"), connect_timeout=3)
        nursery.cancel_scope.cancel()


async def test_a_server_that_hangs_up_or_talks_nonsense(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def half(stream: trio.SocketStream) -> None:
        await stream.receive_some()
        await stream.send_all(b"$10\r\nabc")  # a bulk string cut short, then gone
        await stream.aclose()

    async def nonsense(stream: trio.SocketStream) -> None:
        await stream.receive_some()
        await stream.send_all(b"?what\r\n")

    async with trio.open_nursery() as nursery:
        for handler, says in ((half, "closed the connection"), (nonsense, "broke the protocol")):
            port = await _serve(handler, nursery)
            connection = await Connection.open(Address.parse(f"redis://127.0.0.1:{port}"))
            with trio.fail_after(5), pytest.raises(Unreachable, match=says):
                await connection.execute("PING")
            assert connection.closed
        nursery.cancel_scope.cancel()


async def test_nothing_listening_is_unreachable_and_the_link_retries(
    autojump_clock: trio.testing.MockClock,
) -> None:
    port = free_port()
    with pytest.raises(Unreachable, match=r"cannot connect to 127\.0\.0\.1"):
        await Connection.open(Address.parse(f"redis://127.0.0.1:{port}"))
    logged: list[str] = []
    link = Link(f"redis://127.0.0.1:{port}", read_timeout=1.0, log=logged.append)

    async def ping(connection: Connection, _attempt: int) -> object:
        return await connection.execute("PING")

    with trio.move_on_after(10.0):
        await link.call("pinging", ping)
    assert len(logged) >= 4  # backing off: 0.1 s, 0.2, 0.4, ... (jittered)
    assert all(f"redis at redis://127.0.0.1:{port} unreachable while pinging" in m for m in logged)


@needs_server
async def test_an_idle_connection_redis_dropped_is_replaced_quietly(servers: RedisServer) -> None:
    logged: list[str] = []
    link = Link(servers.url, read_timeout=5.0, log=logged.append)
    used: list[Connection] = []

    async def whoami(connection: Connection, _attempt: int) -> int:
        used.append(connection)
        return int(await connection.execute("CLIENT", "ID"))

    with trio.fail_after(5):
        first = await link.call("asking", whoami)
    killer = servers.client()
    assert killer.client_kill_filter(_id=str(first)) == 1  # as Redis's `timeout` setting would
    killer.close()
    with trio.fail_after(5):
        second = await link.call("asking", whoami)
    assert second != first
    assert used[0].closed
    assert logged == []  # no failed call, no "unreachable" line
    link.close()


@needs_server
@pytest.mark.parametrize(
    "command",
    [
        ["worker", "echo", "--stream", "t", "--group", "g", "--results", "r", "--no-dashboard",
         "--feed"],
        ["enqueue", "echo", "--stream", "t", "--feed"],
        ["eval", "echo", "--no-dashboard", "--via"],
    ],
)  # fmt: skip
def test_a_refused_login_exits_2_naming_the_flag_and_the_fix(
    servers: RedisServer, command: list[str], tmp_path: Path
) -> None:
    url = f"redis://{USER}:not-it@127.0.0.1:{servers.port}/0"
    done = forkserver.run(
        [sys.executable, "-m", "trio_tasksets", *command, url],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    flag = command[-1]
    assert f"{flag} redis://{USER}:***@127.0.0.1:{servers.port}/0: Redis refused the login" in line
    assert "WRONGPASS" in line
    assert "give the password in the URL" in line
    assert "not-it" not in done.stderr
