"""Real middlemen (issue 26): HTTP and HTTPS through a real forward proxy (Debian's tinyproxy
on 127.0.0.1; https through its CONNECT tunnel to a local TLS server with a throwaway trustme
CA), and ``rediss://`` against a real redis-server started with TLS. Every wait is bounded.
"""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trustme
from chat_server import ChatServer
from helpers import free_port, need, until, which

import trio_tasksets as tt
from trio_tasksets._transport import ConnectError, HTTPClient
from trio_tasksets.redis._link import Link
from trio_tasksets.redis._resp import Address, Connection, Unreachable

TINYPROXY = which("tinyproxy")
REDIS_SERVER = which("redis-server")


def accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


# --- a real forward proxy --------------------------------------------------------------------


class Proxy:
    def __init__(self, port: int, log: Path, process: subprocess.Popen[bytes]) -> None:
        self.port, self.log, self.process = port, log, process
        self.url = f"http://127.0.0.1:{port}"

    def requests(self) -> list[str]:
        """The request lines tinyproxy logged (``CONNECT host:port HTTP/1.1``, ``GET url ...``)."""
        return [line.split("): ", 1)[1] for line in self.log.read_text().splitlines()
                if "Request (file descriptor" in line]  # fmt: skip


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[Proxy]:
    need("tinyproxy", why="HTTP through a real forward proxy")
    assert TINYPROXY is not None
    port = free_port()
    config = tmp_path / "tinyproxy.conf"
    config.write_text(
        f"Port {port}\nListen 127.0.0.1\nTimeout 30\nMaxClients 32\nAllow 127.0.0.1\n"
        "LogLevel Connect\n"
    )
    log = tmp_path / "tinyproxy.log"
    with log.open("wb") as out:
        process = subprocess.Popen([TINYPROXY, "-d", "-c", str(config)], stdout=out, stderr=out)
    try:
        until(lambda: accepts(port), f"tinyproxy on port {port}")
        yield Proxy(port, log, process)
    finally:
        process.terminate()
        process.wait(timeout=10)


def server_context(ca: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost", "127.0.0.1").configure_cert(context)
    return context


def client_context(ca: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return context


async def test_https_through_a_real_proxy_goes_through_its_connect_tunnel(
    proxy: Proxy, ca: trustme.CA, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``HTTPS_PROXY`` from the environment: a CONNECT tunnel through tinyproxy, TLS to the
    origin inside it (the origin's certificate verified against the test CA)."""
    monkeypatch.setenv("HTTPS_PROXY", proxy.url)
    for name in ("NO_PROXY", "no_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    with trio.fail_after(20):
        async with (
            ChatServer(answer=lambda _: "4", tls=server_context(ca)) as origin,
            HTTPClient(ssl_context=client_context(ca)) as http,
        ):
            url = f"https://localhost:{origin.port}/v1/chat/completions"
            for _ in range(3):
                response = await http.request("POST", url, body=b"{}")
                assert response.status == 200
                assert json.loads(response.body)["choices"][0]["message"]["content"] == "4"
            assert http.stats.opened == 1  # one tunnel, kept alive
    assert proxy.requests() == [f"CONNECT localhost:{origin.port} HTTP/1.1"]


async def test_an_openai_client_reaches_http_through_a_real_proxy(
    proxy: Proxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``HTTP_PROXY``: plain http goes to the proxy in absolute form; what the client
    sees is the origin's answer. Without the proxy running, the error names it."""
    monkeypatch.setenv("HTTP_PROXY", proxy.url)
    for name in ("NO_PROXY", "no_proxy", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    with trio.fail_after(20):
        async with (
            ChatServer(answer=lambda _: "4") as origin,
            tt.OpenAIClient(origin.url, max_retries=0) as client,
        ):
            completion = await client.chat([], model="m", sampling=tt.Sampling())
        url = origin.url
        assert completion.content == "4"
        assert proxy.requests() == [f"POST {url}/chat/completions HTTP/1.1"]
        proxy.process.terminate()
        proxy.process.wait(timeout=10)
        async with HTTPClient() as http:
            with pytest.raises(ConnectError, match=f"through proxy http://127.0.0.1:{proxy.port}"):
                await http.request("GET", url)


# --- rediss:// against a real redis-server with TLS --------------------------------------------


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory, ca: trustme.CA) -> Iterator[int]:
    need("redis-server", why="rediss:// against a real Redis with TLS")
    assert REDIS_SERVER is not None
    directory = tmp_path_factory.mktemp("tls-redis")
    cert = ca.issue_cert("localhost", "127.0.0.1")
    cert.private_key_pem.write_to_path(str(directory / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(directory / "cert.pem"))
    ca.cert_pem.write_to_path(str(directory / "ca.pem"))
    port = free_port()
    process = subprocess.Popen(
        [REDIS_SERVER, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", str(directory / "cert.pem"),
         "--tls-key-file", str(directory / "key.pem"),
         "--tls-ca-cert-file", str(directory / "ca.pem"), "--tls-auth-clients", "no",
         "--save", "", "--appendonly", "no", "--dir", str(directory)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        until(lambda: accepts(port), f"redis-server with TLS on port {port}")
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)


async def test_rediss_reaches_a_real_redis_with_tls(
    tls_redis: int, ca: trustme.CA, tmp_path: Path
) -> None:
    """``rediss://`` with ``ssl_ca_certs``: commands and a `Link` round trip over TLS; the
    certificate is verified (a client that does not trust the CA cannot connect)."""
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    url = f"rediss://localhost:{tls_redis}/0?ssl_ca_certs={ca_file}"
    with trio.fail_after(20):
        connection = await Connection.open(Address.parse(url))
        try:
            assert await connection.execute("PING") == "PONG"
            await connection.execute("SET", "tls:k", "over tls")
            assert await connection.execute("GET", "tls:k") == "over tls"
        finally:
            connection.close()
        link = Link(url, read_timeout=5.0, log=print)
        info = await link.call("asking", lambda c, _: c.execute("INFO", "server"))
        link.close()
        assert "run_id:" in info
        untrusted = f"rediss://localhost:{tls_redis}/0"  # the system's CAs only
        with pytest.raises(Unreachable, match=r"CERTIFICATE_VERIFY_FAILED|certificate verify"):
            await Connection.open(Address.parse(untrusted))
