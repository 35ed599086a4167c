"""Tests for trio_tasksets._transport.client, against real servers on 127.0.0.1 that each test
starts: an h11 server (plain or TLS with a throwaway trustme CA) scripted per request, and a
small forward proxy. Timeouts run on the autojump clock, in virtual time.
"""

from __future__ import annotations

import functools
import gzip
import json
import random
import socket
import ssl
import struct
import zlib
from collections.abc import Callable
from typing import Any

import attrs
import h11
import hypothesis
import pytest
import trio
import trio.testing
import trustme
from helpers import free_port
from hypothesis import strategies as st

import trio_tasksets._transport.client as http_transport
import trio_tasksets._transport.connection as http_wire
from trio_tasksets._models import ModelConnectionError, ModelResponseError, OpenAIClient, Sampling
from trio_tasksets._transport import (
    ConnectError,
    ConnectionClosed,
    DecodingError,
    HTTPClient,
    HTTPError,
    HTTPTimeout,
    ProtocolError,
    ProxyError,
    Request,
    Response,
    ResponseTooLarge,
    Timeouts,
    UnsupportedProxy,
)
from trio_tasksets._transport.support import Proxies, no_proxy_matches, proxies_from_env

# --- a scripted HTTP/1.1 server --------------------------------------------------------------


@attrs.define
class Reply:
    """What the server does with one request."""

    status: int = 200
    body: bytes = b'{"ok": true}'
    headers: list[tuple[str, str]] = attrs.field(factory=list)
    chunked: bool = False  # no Content-Length: h11 sends the body chunked, in 3 pieces
    delay: float = 0.0  # before the response head
    trickle: float | None = None  # seconds between body bytes
    close: bool = False  # close the connection after the reply, without saying so
    close_when: trio.Event | None = None  # ... once this is set
    reset: bool = False  # ... with a TCP reset (SO_LINGER 0) instead of a FIN
    drop: bool = False  # read the request, then close without answering


@attrs.define
class Seen:
    method: str
    target: str
    headers: dict[str, str]
    body: bytes
    connection: int


@attrs.define
class Server:
    """Counts connections (``opened``, ``open``) and the requests it has read (``seen``)."""

    handler: Callable[[Seen], Reply] = lambda seen: Reply()
    tls: ssl.SSLContext | None = None
    url: str = ""
    port: int = 0
    opened: int = 0
    open: int = 0
    seen: list[Seen] = attrs.field(factory=list)
    changed: trio.Event = attrs.field(factory=trio.Event)

    def _touch(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def wait_open(self, count: int) -> None:
        with trio.fail_after(5):
            while self.open != count:
                await self.changed.wait()

    async def serve(self, stream: trio.abc.Stream) -> None:
        self.opened += 1
        self.open += 1
        number = self.opened
        self._touch()
        try:
            if self.tls is not None:
                stream = trio.SSLStream(stream, self.tls, server_side=True)
                await stream.do_handshake()
            await self._requests(stream, number)
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.RemoteProtocolError):
            pass
        finally:
            self.open -= 1
            self._touch()
            await trio.aclose_forcefully(stream)

    async def _requests(self, stream: trio.abc.Stream, number: int) -> None:
        state = h11.Connection(h11.SERVER)
        while True:
            request: h11.Request | None = None
            body = b""
            while True:
                event = state.next_event()
                if event is h11.NEED_DATA:
                    state.receive_data(bytes(await stream.receive_some(65536)))
                elif isinstance(event, h11.Request):
                    request = event
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                    break
            if request is None:
                return
            seen = Seen(
                request.method.decode(),
                request.target.decode(),
                {k.decode(): v.decode() for k, v in request.headers},
                body,
                number,
            )
            self.seen.append(seen)
            reply = self.handler(seen)
            if reply.drop:
                return
            await trio.sleep(reply.delay)
            headers = [(k.encode(), v.encode()) for k, v in reply.headers]
            if not reply.chunked:
                headers.append((b"content-length", str(len(reply.body)).encode()))
            await stream.send_all(
                state.send(h11.Response(status_code=reply.status, headers=headers)) or b""
            )
            if reply.trickle is not None:
                for byte in reply.body:
                    await stream.send_all(state.send(h11.Data(data=bytes([byte]))) or b"")
                    await trio.sleep(reply.trickle)
            elif reply.chunked:
                third = max(1, len(reply.body) // 3)
                for at in range(0, len(reply.body), third):
                    piece = reply.body[at : at + third]
                    await stream.send_all(state.send(h11.Data(data=piece)) or b"")
            else:
                await stream.send_all(state.send(h11.Data(data=reply.body)) or b"")
            await stream.send_all(state.send(h11.EndOfMessage()) or b"")
            if reply.close or state.our_state is not h11.DONE:
                if reply.close_when is not None:
                    await reply.close_when.wait()
                if reply.reset and isinstance(stream, trio.SocketStream):
                    stream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return
            state.start_next_cycle()


async def start(nursery: trio.Nursery, server: Server, scheme: str = "http") -> Server:
    listeners = await nursery.start(
        functools.partial(trio.serve_tcp, server.serve, 0, host="127.0.0.1")
    )
    server.port = listeners[0].socket.getsockname()[1]
    server.url = f"{scheme}://127.0.0.1:{server.port}"
    return server


@pytest.fixture
async def server(nursery: trio.Nursery) -> Server:
    return await start(nursery, Server())


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
async def tls_server(nursery: trio.Nursery, ca: trustme.CA) -> Server:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1", "localhost").configure_cert(context)
    return await start(nursery, Server(tls=context), "https")


@pytest.fixture(autouse=True)
def no_proxy_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests run with no proxy set unless they set one."""
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)


# --- requests and responses -------------------------------------------------------------------


async def test_post_sends_headers_and_body_and_reads_the_reply(server: Server) -> None:
    server.handler = lambda seen: Reply(201, b"made", [("x-reply", "yes"), ("Retry-After", "3")])
    async with HTTPClient(headers={"X-Default": "d"}) as http:
        response = await http.request(
            "POST", server.url + "/v1/things?x=1", headers={"X-Mine": "m"}, body=b'{"a": 1}'
        )
    assert (response.status, response.body, response.header("X-Reply")) == (201, b"made", "yes")
    assert response.retry_after == 3.0
    assert response.url == server.url + "/v1/things?x=1"
    [seen] = server.seen
    assert (seen.method, seen.target, seen.body) == ("POST", "/v1/things?x=1", b'{"a": 1}')
    assert seen.headers["host"] == f"127.0.0.1:{server.port}"
    assert seen.headers["content-length"] == "8"
    assert seen.headers["accept-encoding"] == "gzip, deflate"
    assert (seen.headers["x-default"], seen.headers["x-mine"]) == ("d", "m")


async def test_get_has_no_body_framing(server: Server) -> None:
    async with HTTPClient() as http:
        response = await http.request("GET", server.url)
    assert response.json() == {"ok": True}
    assert server.seen[0].target == "/"
    assert "content-length" not in server.seen[0].headers


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "raw-deflate", "gzip-twice"])
async def test_compressed_replies_are_decoded(server: Server, encoding: str) -> None:
    text = json.dumps({"content": "hello " * 200}).encode()
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    body, header = {
        "gzip": (gzip.compress(text), "gzip"),
        "deflate": (zlib.compress(text), "deflate"),
        "raw-deflate": (raw.compress(text) + raw.flush(), "deflate"),
        "gzip-twice": (gzip.compress(gzip.compress(text)), "gzip, gzip"),
    }[encoding]
    server.handler = lambda seen: Reply(body=body, headers=[("content-encoding", header)])
    async with HTTPClient() as http:
        response = await http.request("GET", server.url)
    assert response.body == text


async def test_chunked_reply_is_read_whole_and_the_connection_reused(server: Server) -> None:
    body = bytes(range(256)) * 40
    server.handler = lambda seen: Reply(body=body, chunked=True)
    async with HTTPClient() as http:
        for _ in range(3):
            assert (await http.request("GET", server.url)).body == body
        assert http.stats.opened == 1
    assert server.opened == 1


async def test_gzip_and_chunked_together(server: Server) -> None:
    text = b"x" * 5000
    server.handler = lambda seen: Reply(
        body=gzip.compress(text), chunked=True, headers=[("content-encoding", "gzip")]
    )
    async with HTTPClient() as http:
        assert (await http.request("GET", server.url)).body == text


async def test_unknown_or_broken_encoding_is_an_error_naming_the_url(server: Server) -> None:
    replies = iter(
        [
            Reply(body=b"abc", headers=[("content-encoding", "br")]),
            Reply(body=b"not gzip", headers=[("content-encoding", "gzip")]),
        ]
    )
    server.handler = lambda seen: next(replies)
    async with HTTPClient() as http:
        with pytest.raises(DecodingError, match="'br'") as info:
            await http.request("GET", server.url + "/a")
        assert info.value.url == server.url + "/a"
        assert str(info.value).startswith(server.url + "/a: ")
        with pytest.raises(DecodingError, match="gzip"):
            await http.request("GET", server.url + "/a")


# --- size limit -------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["content-length", "chunked", "gzip bomb"])
async def test_a_response_over_the_size_limit_is_refused(server: Server, how: str) -> None:
    big = b"z" * 5000
    server.handler = lambda seen: {
        "content-length": Reply(body=big),
        "chunked": Reply(body=big, chunked=True),
        "gzip bomb": Reply(body=gzip.compress(big * 100), headers=[("content-encoding", "gzip")]),
    }[how]
    async with HTTPClient(max_response_bytes=4096) as http:
        with pytest.raises(ResponseTooLarge, match="4,096 bytes") as info:
            await http.request("GET", server.url)
        assert info.value.limit == 4096
        assert http.stats.open == (1 if how == "gzip bomb" else 0)  # the bomb was read whole


async def test_openai_client_reports_a_too_large_reply_as_a_response_error(server: Server) -> None:
    server.handler = lambda seen: Reply(body=b"{" + b" " * 10_000 + b"}")
    async with HTTPClient(max_response_bytes=1000) as http:
        client = OpenAIClient(server.url + "/v1", http_client=http, max_retries=3)
        with pytest.raises(ModelResponseError, match="over the limit"):
            await client.chat([{"role": "user", "content": "hi"}], model="m", sampling=Sampling())
        await client.aclose()
        assert not http.is_closed  # a caller's client is left open
    assert len(server.seen) == 1  # not retried


# --- timeouts ---------------------------------------------------------------------------------


async def test_read_timeout(server: Server, autojump_clock: trio.testing.MockClock) -> None:
    server.handler = lambda seen: Reply(delay=100)
    async with HTTPClient(timeouts=Timeouts(read=2.0)) as http:
        start = trio.current_time()
        with pytest.raises(HTTPTimeout, match=r"read timeout \(2s\)") as info:
            await http.request("GET", server.url + "/slow")
        assert trio.current_time() - start == pytest.approx(2.0)
        assert (info.value.phase, info.value.timeout) == ("read", 2.0)
        assert info.value.url == server.url + "/slow"
        assert http.stats.open == 0  # a connection mid-response is not reused


async def test_read_timeout_is_per_read_total_is_per_request(
    server: Server, autojump_clock: trio.testing.MockClock
) -> None:
    server.handler = lambda seen: Reply(body=b"0123456789", trickle=1.0)
    async with HTTPClient(timeouts=Timeouts(read=2.0)) as http:
        assert (await http.request("GET", server.url)).body == b"0123456789"  # ~10 s in all
        start = trio.current_time()
        with pytest.raises(HTTPTimeout) as info:
            await http.request("GET", server.url, timeouts=Timeouts(read=2.0, total=4.5))
        assert info.value.phase == "total"
        assert trio.current_time() - start == pytest.approx(4.5)


async def test_connect_timeout_covers_the_tls_handshake(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    async def mute(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    listeners = await nursery.start(functools.partial(trio.serve_tcp, mute, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    async with HTTPClient(timeouts=Timeouts(connect=3.0)) as http:
        with pytest.raises(HTTPTimeout) as info:
            await http.request("GET", f"https://127.0.0.1:{port}/")
    assert (info.value.phase, info.value.timeout) == ("connect", 3.0)
    assert http.stats.open == 0


async def test_write_timeout(nursery: trio.Nursery, autojump_clock: trio.testing.MockClock) -> None:
    async def deaf(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    listeners = await nursery.start(functools.partial(trio.serve_tcp, deaf, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    async with HTTPClient(timeouts=Timeouts(write=1.0)) as http:
        with pytest.raises(HTTPTimeout) as info:
            await http.request("POST", f"http://127.0.0.1:{port}/", body=b"x" * 64_000_000)
    assert info.value.phase == "write"


# --- the pool ---------------------------------------------------------------------------------


async def run_calls(http: HTTPClient, url: str, count: int, window: int) -> list[Any]:
    """``count`` POSTs, ``window`` at a time; each call's outcome (a Response or an error)."""
    outcomes: list[Any] = [None] * count
    limiter = trio.CapacityLimiter(window)

    async def one(i: int) -> None:
        try:
            outcomes[i] = await http.request("POST", url, body=str(i).encode())
        except HTTPError as exc:
            outcomes[i] = exc
        finally:
            limiter.release_on_behalf_of(i)

    async with trio.open_nursery() as nursery:
        for i in range(count):
            await limiter.acquire_on_behalf_of(i)
            nursery.start_soon(one, i)
    return outcomes


async def test_connections_follow_the_window_over_2000_calls(
    server: Server, autojump_clock: trio.testing.MockClock
) -> None:
    window = 32
    server.handler = lambda seen: Reply(body=seen.body, delay=0.01)
    async with HTTPClient() as http:
        outcomes = await run_calls(http, server.url + "/echo", 2000, window)
        assert [o.body for o in outcomes] == [str(i).encode() for i in range(2000)]
        assert http.stats.opened == window
        assert http.stats.idle == window
    assert server.opened == window
    await server.wait_open(0)  # and all closed on exit


async def test_max_connections_makes_requests_wait(
    server: Server, autojump_clock: trio.testing.MockClock
) -> None:
    server.handler = lambda seen: Reply(delay=1.0)
    async with HTTPClient(max_connections=2) as http:
        start = trio.current_time()
        outcomes = await run_calls(http, server.url, 6, window=6)
        assert all(o.status == 200 for o in outcomes)
        assert trio.current_time() - start == pytest.approx(3.0)
        assert http.stats.opened == 2
    async with HTTPClient(max_connections=1, timeouts=Timeouts(total=1.5)) as http:
        first, second = await run_calls(http, server.url, 2, window=2)
    assert first.status == 200
    assert isinstance(second, HTTPTimeout)
    assert second.phase == "total"  # waited for the connection the first one held


async def test_idle_connections_expire(
    server: Server, autojump_clock: trio.testing.MockClock
) -> None:
    async with HTTPClient(keepalive_expiry=5.0) as http:
        await run_calls(http, server.url, 4, window=4)
        await trio.sleep(4.0)
        await http.request("GET", server.url)  # reuses the newest
        assert http.stats == http_transport.PoolStats(opened=4, open=4, idle=4, stale=0)
        await trio.sleep(6.0)
        await http.request("GET", server.url)  # all expired: closed, a new one
        assert (http.stats.opened, http.stats.open) == (5, 1)
    await server.wait_open(0)


async def test_a_server_connection_close_is_honoured(server: Server) -> None:
    server.handler = lambda seen: Reply(headers=[("connection", "close")])
    async with HTTPClient() as http:
        for _ in range(3):
            await http.request("GET", server.url)
        assert (http.stats.opened, http.stats.open) == (3, 0)


async def test_pooled_connections_closed_by_the_server_are_replaced(
    server: Server, autojump_clock: trio.testing.MockClock
) -> None:
    """The server closes every connection after its reply, without saying so: the next
    requests find the pooled connections dead before sending, and go on fresh ones."""
    server.handler = lambda seen: Reply(close=True, delay=1.0)  # 8 in flight at once
    async with HTTPClient() as http:
        await run_calls(http, server.url, 8, window=8)
        await server.wait_open(0)
        outcomes = await run_calls(http, server.url, 8, window=8)
        assert all(o.status == 200 for o in outcomes)
        assert (http.stats.opened, http.stats.stale) == (16, 8)
    assert len(server.seen) == 16  # each request reached the server once


async def test_a_request_that_reached_the_server_is_never_resent(server: Server) -> None:
    replies = iter([Reply(), Reply(drop=True), Reply()])
    server.handler = lambda seen: next(replies)
    async with HTTPClient() as http:
        await http.request("POST", server.url, body=b"first")
        with pytest.raises(ConnectionClosed, match="without answering") as info:
            await http.request("POST", server.url, body=b"second")  # on the pooled connection
        assert info.value.request_sent
        assert (await http.request("POST", server.url, body=b"third")).status == 200
    assert [s.body for s in server.seen] == [b"first", b"second", b"third"]


@pytest.mark.parametrize("reset", [False, True])
async def test_a_dead_connection_the_probe_missed(
    server: Server, monkeypatch: pytest.MonkeyPatch, reset: bool
) -> None:
    """With the idle probe blind: a connection the server reset refuses our bytes (nothing
    sent, so the request goes once more on a fresh connection); one it closed takes them,
    so the request may have reached the server and is not resent."""
    monkeypatch.setattr(http_wire, "prober", lambda fd: lambda: False)
    answered = trio.Event()
    server.handler = lambda seen: Reply(close=True, close_when=answered, reset=reset)
    async with HTTPClient() as http:
        assert (await http.request("GET", server.url)).status == 200
        answered.set()
        await server.wait_open(0)
        if reset:
            assert (await http.request("GET", server.url)).status == 200
            assert (http.stats.opened, http.stats.stale) == (2, 1)
            assert len(server.seen) == 2
        else:
            with pytest.raises(ConnectionClosed) as info:
                await http.request("GET", server.url)
            assert info.value.request_sent
            assert (http.stats.opened, len(server.seen)) == (1, 1)


async def test_random_closes_under_load(
    server: Server, autojump_clock: trio.testing.MockClock
) -> None:
    """1,000 calls, 16 at a time; the server closes a connection after a reply at random
    (without saying so) and now and then reads a request and hangs up. No request reaches
    the server twice; every call that failed may have reached it (request_sent), and every
    one it dropped failed."""
    rng = random.Random(15)
    dropped: set[bytes] = set()

    def handler(seen: Seen) -> Reply:
        roll = rng.random()
        if roll < 0.02:
            dropped.add(seen.body)
            return Reply(drop=True)
        return Reply(body=seen.body, close=roll < 0.3, delay=rng.choice([0, 0.001]))

    server.handler = handler
    async with HTTPClient() as http:
        outcomes = await run_calls(http, server.url, 1000, window=16)
        stats = http.stats
    bodies = [s.body for s in server.seen]
    assert len(bodies) == len(set(bodies))  # never resent
    failed = {str(i).encode() for i, o in enumerate(outcomes) if isinstance(o, HTTPError)}
    assert all(
        isinstance(o, ConnectionClosed) and o.request_sent
        for o in outcomes
        if isinstance(o, HTTPError)
    )
    assert failed & set(bodies) == dropped  # the other failures never reached the server:
    # a close racing a reuse, the request taken by the kernel but not by the server
    assert len(failed) < 200
    answered = {o.body for o in outcomes if not isinstance(o, HTTPError)}
    assert answered == set(bodies) - dropped
    assert stats.stale > 50  # pooled connections found closed and replaced before sending
    assert stats.opened <= 16 + stats.stale + len(failed) + len(dropped)


async def test_aclose_closes_connections_and_refuses_more(server: Server) -> None:
    http = HTTPClient()
    await run_calls(http, server.url, 5, window=5)
    assert server.open == 5
    await http.aclose()
    await server.wait_open(0)
    assert http.is_closed
    with pytest.raises(RuntimeError, match="closed"):
        await http.request("GET", server.url)
    await http.aclose()  # idempotent


async def test_cancelled_request_drops_its_connection(
    server: Server, autojump_clock: trio.testing.MockClock
) -> None:
    server.handler = lambda seen: Reply(delay=10)
    async with HTTPClient() as http:
        with trio.move_on_after(1):
            await http.request("GET", server.url)
        assert http.stats.open == 0
        server.handler = lambda seen: Reply()
        assert (await http.request("GET", server.url)).status == 200


async def test_a_request_in_a_cancelled_scope_sends_nothing(server: Server) -> None:
    async with HTTPClient() as http:
        await http.request("GET", server.url)
        with trio.CancelScope() as scope:
            scope.cancel()
            await http.request("GET", server.url)
        assert scope.cancelled_caught
        assert (len(server.seen), http.stats.idle) == (1, 1)  # and the connection is kept


# --- errors -----------------------------------------------------------------------------------


async def test_refused_connection_names_the_url() -> None:
    url = f"http://127.0.0.1:{free_port()}/v1/x"
    async with HTTPClient() as http:
        with pytest.raises(ConnectError) as info:
            await http.request("GET", url)
    assert str(info.value).startswith(url + ": cannot connect")
    assert info.value.url == url


async def test_bad_urls_and_headers_are_refused(server: Server) -> None:
    async with HTTPClient() as http:
        for url in ["ftp://127.0.0.1/", "/relative", "http://127.0.0.1:99999/"]:
            with pytest.raises(ValueError, match="URL"):
                await http.request("GET", url)
        with pytest.raises(ValueError, match="bad header"):
            await http.request("GET", server.url, headers={"x-evil": "a\r\nx-injected: 1"})
        with pytest.raises(ValueError, match="bad header"):
            await http.request("GET", server.url, headers={"bad name": "v"})
    assert server.seen == []


def test_arguments_are_checked(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="max_connections"):
        HTTPClient(max_connections=0)
    with pytest.raises(ValueError, match=r"Timeouts\.read"):
        Timeouts(read=0)
    with pytest.raises(ValueError, match="ca_bundle"):
        HTTPClient(ca_bundle=tmp_path / "missing.pem")
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate")
    with pytest.raises(ValueError, match="ca_bundle"):
        HTTPClient(ca_bundle=bad)


# --- https ------------------------------------------------------------------------------------


async def test_https_with_a_ca_bundle(tls_server: Server, ca: trustme.CA, tmp_path: Any) -> None:
    bundle = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    async with HTTPClient(ca_bundle=bundle) as http:
        for _ in range(3):
            assert (await http.request("POST", tls_server.url, body=b"x")).status == 200
        assert http.stats.opened == 1  # kept alive over TLS too


async def test_https_refuses_an_unknown_ca(tls_server: Server) -> None:
    async with HTTPClient() as http:
        with pytest.raises(ConnectError, match=r"certificate verif.*ca_bundle") as info:
            await http.request("GET", tls_server.url + "/x")
    assert info.value.url == tls_server.url + "/x"
    assert len(tls_server.seen) == 0


async def test_https_with_an_ssl_context(tls_server: Server, ca: trustme.CA) -> None:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    async with HTTPClient(ssl_context=context) as http:
        assert (await http.request("GET", tls_server.url)).json() == {"ok": True}


# --- proxies ----------------------------------------------------------------------------------


@attrs.define
class ForwardProxy:
    """Answers plain-http requests itself ("via proxy <target>"); tunnels CONNECT."""

    seen: list[tuple[str, str, str | None]] = attrs.field(factory=list)
    refuse: int | None = None
    url: str = ""

    async def serve(self, stream: trio.SocketStream) -> None:
        state = h11.Connection(h11.SERVER)
        while True:
            event = state.next_event()
            if event is h11.NEED_DATA:
                state.receive_data(await stream.receive_some(65536))
                continue
            assert isinstance(event, h11.Request)
            break
        target = event.target.decode()
        auth = dict(event.headers).get(b"proxy-authorization")
        self.seen.append((event.method.decode(), target, auth.decode() if auth else None))
        if event.method != b"CONNECT":
            body = b"via proxy " + event.target
            while not isinstance(state.next_event(), h11.EndOfMessage):
                state.receive_data(await stream.receive_some(65536))
            head = h11.Response(
                status_code=200, headers=[(b"content-length", str(len(body)).encode())]
            )
            await stream.send_all(
                b"".join(
                    state.send(e) or b"" for e in (head, h11.Data(data=body), h11.EndOfMessage())
                )
            )
            return
        if self.refuse:
            await stream.send_all(
                state.send(
                    h11.Response(status_code=self.refuse, headers=[(b"content-length", b"0")])
                )
                or b""
            )
            return
        host, port = target.rsplit(":", 1)
        upstream = await trio.open_tcp_stream(host, int(port))
        await stream.send_all(state.send(h11.Response(status_code=200, headers=[])) or b"")
        async with upstream, trio.open_nursery() as nursery:

            async def pipe(a: trio.abc.Stream, b: trio.abc.Stream) -> None:
                try:
                    while data := await a.receive_some(65536):
                        await b.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
                nursery.cancel_scope.cancel()

            nursery.start_soon(pipe, stream, upstream)
            nursery.start_soon(pipe, upstream, stream)


@pytest.fixture
async def proxy(nursery: trio.Nursery) -> ForwardProxy:
    found = ForwardProxy()
    listeners = await nursery.start(
        functools.partial(trio.serve_tcp, found.serve, 0, host="127.0.0.1")
    )
    found.url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
    return found


async def test_http_proxy_from_the_environment(
    server: Server, proxy: ForwardProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTP_PROXY", proxy.url.replace("http://", "http://user:p%40ss@"))
    async with HTTPClient() as http:
        response = await http.request("GET", server.url + "/a?b=1")
    assert response.body == f"via proxy {server.url}/a?b=1".encode()
    [(method, target, auth)] = proxy.seen
    assert (method, target) == ("GET", f"{server.url}/a?b=1")
    assert auth == "Basic dXNlcjpwQHNz"  # user:p@ss
    assert server.seen == []
    async with HTTPClient(trust_env=False) as http:
        await http.request("GET", server.url)
    assert len(server.seen) == 1


async def test_no_proxy_exempts_a_host(
    server: Server, proxy: ForwardProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("http_proxy", proxy.url)
    monkeypatch.setenv("NO_PROXY", "example.com, 127.0.0.0/8")
    async with HTTPClient() as http:
        await http.request("GET", server.url)
    assert proxy.seen == []
    assert len(server.seen) == 1


async def test_https_through_a_connect_tunnel(
    tls_server: Server,
    proxy: ForwardProxy,
    ca: trustme.CA,
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bundle = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    monkeypatch.setenv("HTTPS_PROXY", proxy.url)
    async with HTTPClient(ca_bundle=bundle) as http:
        for _ in range(2):
            assert (await http.request("POST", tls_server.url + "/v1", body=b"x")).status == 200
    assert proxy.seen == [("CONNECT", f"127.0.0.1:{tls_server.port}", None)]  # one tunnel, reused
    assert [s.target for s in tls_server.seen] == ["/v1", "/v1"]


async def test_a_proxy_refusing_the_tunnel(tls_server: Server, proxy: ForwardProxy) -> None:
    proxy.refuse = 407
    async with HTTPClient(proxy=proxy.url) as http:
        with pytest.raises(ProxyError, match=r"407 \(proxy authentication required") as info:
            await http.request("GET", tls_server.url)
    assert info.value.status == 407


@pytest.mark.parametrize(
    ("variable", "value"),
    [("ALL_PROXY", "socks5://127.0.0.1:1080"), ("https_proxy", "https://u:secret@proxy:443")],
)
def test_unsupported_proxies_are_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(UnsupportedProxy, match=f"^{variable}=") as info:
        HTTPClient()
    assert "secret" not in str(info.value)
    assert "trust_env=False" in str(info.value)
    HTTPClient(trust_env=False)  # the way out
    with pytest.raises(UnsupportedProxy):
        OpenAIClient("http://127.0.0.1:1/v1")  # refused when the model client is made


def test_proxy_variables() -> None:
    env = {"HTTP_PROXY": "proxy:3128", "all_proxy": "http://other:8080", "no_proxy": "a.com"}
    proxies = proxies_from_env(env)
    assert proxies.http is not None
    assert (proxies.http.host, proxies.http.port) == ("proxy", 3128)
    assert proxies.https is not None
    assert proxies.https.host == "other"
    assert proxies.for_url("http", "x.a.com", 80) is None
    assert proxies_from_env({"HTTP_PROXY": "http://p:1", "REQUEST_METHOD": "GET"}) == Proxies()


@pytest.mark.parametrize(
    ("entries", "host", "port", "bypassed"),
    [
        ("*", "anything", 80, True),
        ("example.com", "example.com", 80, True),
        ("example.com", "api.example.com", 80, True),
        (".example.com", "api.example.com", 80, True),
        ("example.com", "badexample.com", 80, False),
        ("example.com:8080", "example.com", 80, False),
        ("example.com:8080", "example.com", 8080, True),
        ("10.0.0.0/8", "10.1.2.3", 80, True),
        ("10.0.0.0/8", "11.1.2.3", 80, False),
        ("::1", "[::1]", 80, True),
        ("localhost", "127.0.0.1", 80, False),
    ],
)
def test_no_proxy_entries(entries: str, host: str, port: int, bypassed: bool) -> None:
    assert no_proxy_matches(tuple(e.strip() for e in entries.split(",")), host, port) is bypassed


# --- reading responses: the fast path and h11 ------------------------------------------------


async def canned_server(nursery: trio.Nursery, reply: bytes) -> str:
    """Answers every request (read up to its blank line) with ``reply``, then waits."""

    async def serve(stream: trio.SocketStream) -> None:
        buffer = b""
        while True:
            while b"\r\n\r\n" not in buffer:
                data = await stream.receive_some(65536)
                if not data:
                    return
                buffer += data
            buffer = buffer.split(b"\r\n\r\n", 1)[1]
            await stream.send_all(reply)

    listeners = await nursery.start(functools.partial(trio.serve_tcp, serve, 0, host="127.0.0.1"))
    return f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}/"


# duplicates: a table of raw responses; its rows are alike by design, each a case of its own
@pytest.mark.parametrize(
    ("reply", "method", "body", "kept"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi", "GET", b"hi", True),
        (b"HTTP/1.1 503\r\ncontent-length:2\r\nRetry-After:  1 \r\n\r\nno", "GET", b"no", True),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nhi", "GET", b"hi", False),
        (
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi",
            "GET",
            b"hi",
            True,
        ),
        (b"HTTP/1.1 204 No Content\r\n\r\n", "GET", b"", True),
        (b"HTTP/1.1 200 OK\nContent-Length: 2\n\nhi", "GET", b"hi", True),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\n\r\nhi", "GET", b"hi", True),
        (b"HTTP/1.1 200 OK\r\nX-A: 1\r\n  2\r\nContent-Length: 2\r\n\r\nhi", "GET", b"hi", True),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhiEXTRA", "GET", b"hi", False),
        (
            b"HTTP/1.1 200 OK\r\nConnection: keep-alive, Close\r\nContent-Length: 2\r\n\r\nhi",
            "GET",
            b"hi",
            False,
        ),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n", "HEAD", b"", True),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n",
            "GET",
            b"hi",
            True,
        ),
    ],
)
async def test_responses_of_every_shape(
    nursery: trio.Nursery, reply: bytes, method: str, body: bytes, kept: bool
) -> None:
    url = await canned_server(nursery, reply)
    async with HTTPClient() as http:
        response = await http.request(method, url)
        assert (response.body, http.stats.idle) == (body, 1 if kept else 0)


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nhi",
        b"SMTP ready\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-Bad\r\n\r\n",
    ],
)
async def test_invalid_responses_are_protocol_errors(nursery: trio.Nursery, reply: bytes) -> None:
    url = await canned_server(nursery, reply)
    async with HTTPClient() as http:
        with pytest.raises(ProtocolError, match=r"not valid HTTP/1\.1") as info:
            await http.request("GET", url)
        assert info.value.url == url
        assert http.stats.open == 0


async def test_a_host_header_of_the_callers_wins(server: Server) -> None:
    async with HTTPClient() as http:
        await http.request("GET", server.url, headers=[("Host", "example.test")])
    assert server.seen[0].headers["host"] == "example.test"


def h11_reading(raw: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes, bool] | None:
    """What h11 reads from ``raw`` as the response to a GET: status, headers, body and
    keep-alive; None if it refuses it or it is incomplete."""
    state = h11.Connection(h11.CLIENT)
    state.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
    state.send(h11.EndOfMessage())
    state.receive_data(raw)
    status, headers, body = 0, [], b""
    try:
        while True:
            event = state.next_event()
            if isinstance(event, h11.Response):
                status, headers = event.status_code, list(event.headers)
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return status, headers, body, state.their_state is h11.DONE
            elif not isinstance(event, h11.InformationalResponse):
                return None
    except h11.RemoteProtocolError:
        return None


_GOOD_NAMES = [b"X-Thing", b"Date", b"server", b"Connection", b"Content-Type", b"Retry-After"]
_ODD_NAMES = [b"Transfer-Encoding", b"Bad Name", b" Folded", b"", b"X\x01"]
_GOOD_VALUES = [b"close", b"keep-alive", b"Keep-Alive, close", b"abc  def", b"caf\xc3\xa9", b""]
_ODD_VALUES = [b"chunked", b"a\x01b", b"\x7f", b"a\rb"]
_LENGTHS = [b"%d"] * 15 + [b"0%d", b"+%d", b"%d, %d", b"-%d", b"%dx"]
_STATUS_LINES = [b"HTTP/1.1 200 OK", b"HTTP/1.1 404", b"HTTP/1.1 200 ", b"HTTP/1.1 503 Busy",
                 b"HTTP/1.0 200 OK", b"HTTP/1.1 204 x", b"HTTP/1.1 100 x", b"HTTP/1.1 200 O\x01K",
                 b"HTTP/2 200 OK", b"http/1.1 200 OK"]  # fmt: skip
_SEPARATORS = [b": ", b":", b":  ", b":\t", b" : ", b"\t:"]


@st.composite
def response_heads(draw: st.DrawFn) -> bytes:
    """Mostly heads the fast path takes, with now and then one thing wrong or unusual."""
    lines = [draw(st.sampled_from(_STATUS_LINES[:4] * 6 + _STATUS_LINES[4:]))]
    names = st.sampled_from(_GOOD_NAMES * 12 + _ODD_NAMES)
    values = st.sampled_from(_GOOD_VALUES * 12 + _ODD_VALUES)
    separators = st.sampled_from(_SEPARATORS[:4] * 8 + _SEPARATORS[4:])
    for name, value, separator in draw(st.lists(st.tuples(names, values, separators), max_size=5)):
        lines.append(name + separator + value)
    length = draw(st.integers(0, 12))
    for _ in range(draw(st.sampled_from([1] * 10 + [0, 2]))):
        spelled = draw(st.sampled_from(_LENGTHS))
        value = spelled % ((length,) * spelled.count(b"%d"))
        lines.insert(draw(st.integers(1, len(lines))), b"Content-Length" + draw(separators) + value)
    return b"\r\n".join(lines)


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(head=response_heads(), body=st.binary(min_size=12, max_size=12))
def test_the_fast_path_reads_only_what_h11_reads_the_same(head: bytes, body: bytes) -> None:
    """Differential: whatever `parse_simple_head` accepts, h11 reads to the same status,
    headers, body and keep-alive."""
    simple = http_wire.parse_simple_head(head)
    hypothesis.event(f"fast path: {simple is not None}")
    if simple is None:
        return
    status, headers, length, keep = simple
    raw = head + b"\r\n\r\n" + body[:length]
    assert h11_reading(raw) == (status, headers, body[:length], keep)


def _read_on_both_paths(raw: bytes) -> list[tuple[int, list[tuple[bytes, bytes]], bytes, bool]]:
    """`read_response` (the fast path where it applies) and h11's path alone, each reading
    ``raw`` (sent whole, the connection left open) as the response to a GET."""
    head = http_wire.RequestHead(b"GET / HTTP/1.1\r\n", "GET", False)
    results = []

    async def read(fast: bool) -> tuple[int, list[tuple[bytes, bytes]], bytes, bool]:
        ours, theirs = socket.socketpair()
        with ours, theirs:
            theirs.sendall(raw)
            ours.setblocking(False)
            connection = http_wire.Connection(ours, None)
            with trio.fail_after(10):
                if fast:
                    return await http_wire.read_response(connection, head, 1 << 20, lambda: None)
                return await http_wire._read_with_h11(
                    connection, head, 1 << 20, lambda: None, bytearray(), False
                )

    for fast in (True, False):
        results.append(trio.run(read, fast))
    return results


_AFTER = [b"", b"", b"junk", b"HTTP/1.1 200", b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
          b"\r\n", b"\x00\xff", b"0\r\n\r\n"]  # fmt: skip


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(
    head=response_heads(),
    body=st.binary(min_size=12, max_size=12),
    after=st.sampled_from(_AFTER) | st.binary(min_size=1, max_size=8),
)
def test_both_paths_return_a_complete_response_whatever_bytes_follow_it(
    head: bytes, body: bytes, after: bytes
) -> None:
    """Differential, with bytes after a complete response (issue 26, D4): whenever h11 reads
    a complete response, the fast path and h11's path both return it, whatever follows it,
    and neither calls the connection reusable when anything does (it is closed, never
    reused with those bytes, and the request is not sent again)."""
    complete = None
    for length in range(13):
        candidate = head + b"\r\n\r\n" + body[:length]
        reading = h11_reading(candidate)
        if reading is not None and reading[2] == body[:length]:
            complete = candidate, reading
            break
    hypothesis.assume(complete is not None)
    assert complete is not None
    raw, (status, headers, content, keep) = complete
    for result in _read_on_both_paths(raw + after):
        assert result == (status, headers, content, keep and not after)


# --- answering in memory: HTTPClient(handler=...) ---------------------------------------------


async def test_a_handler_sees_the_request_as_it_would_be_sent() -> None:
    seen: list[Request] = []

    def handler(request: Request) -> Response:
        seen.append(request)
        return Response(201, [(b"x-n", b"1")], b"made")

    async with HTTPClient(handler=handler, headers={"X-Base": "b"}) as http:
        response = await http.request(
            "POST",
            "http://model.invalid/v1/x",
            headers={"X-Own": "o", "x-base": "mine"},
            body=b"{}",
        )
        assert http.stats.opened == 0  # no socket
    assert (response.status, response.body, response.header("x-n")) == (201, b"made", "1")
    assert response.url == "http://model.invalid/v1/x"  # filled in from the request
    (request,) = seen
    assert (request.method, request.url, request.body) == (
        "POST",
        "http://model.invalid/v1/x",
        b"{}",
    )
    assert request.header("user-agent") == "trio-tasksets"  # the client's defaults
    assert request.header("X-Own") == "o"
    assert request.header("x-base") == "mine"  # a request's own header wins


async def test_a_late_handler_runs_into_the_timeouts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def slow(request: Request) -> Response:
        await trio.sleep(100)
        return Response(200)

    async with HTTPClient(handler=slow, timeouts=Timeouts(read=3.0)) as http:
        start = trio.current_time()
        with pytest.raises(HTTPTimeout, match=r"read timeout \(3s\)") as info:
            await http.request("GET", "http://model.invalid/")
        assert trio.current_time() - start == pytest.approx(3.0)
        assert info.value.phase == "read"
        with pytest.raises(HTTPTimeout, match="total") as info:
            await http.request("GET", "http://model.invalid/", timeouts=Timeouts(total=1.5))
        assert info.value.timeout == 1.5


async def test_a_handlers_body_is_decoded_and_held_to_the_size_limit() -> None:
    def gzipped(request: Request) -> Response:
        return Response(200, [(b"content-encoding", b"gzip")], gzip.compress(b"a" * 2000))

    async with HTTPClient(handler=gzipped) as http:
        assert (await http.request("GET", "http://model.invalid/")).body == b"a" * 2000
    async with HTTPClient(handler=gzipped, max_response_bytes=1000) as http:
        with pytest.raises(ResponseTooLarge):
            await http.request("GET", "http://model.invalid/")


async def test_a_handler_must_answer_with_a_response_and_its_errors_propagate() -> None:
    def wrong(request: Request) -> Any:
        return b"not a response"

    def refused(request: Request) -> Response:
        raise ConnectError("refused (in memory)", url=request.url)

    async with HTTPClient(handler=wrong) as http:
        with pytest.raises(TypeError, match="must return a Response, got bytes"):
            await http.request("GET", "http://model.invalid/")
    async with HTTPClient(handler=refused) as http:
        with pytest.raises(ValueError, match="absolute"):
            await http.request("GET", "/relative")
        client = OpenAIClient("http://model.invalid/v1", http_client=http, max_retries=2, backoff=0)
        with pytest.raises(ModelConnectionError, match=r"refused \(in memory\) \(3 attempts\)"):
            await client.chat([{"role": "user", "content": "hi"}], model="m", sampling=Sampling())
