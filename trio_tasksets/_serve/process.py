"""Serving processes: one worker on a socket, or a supervisor over K workers."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import subprocess
import sys
from typing import Any

import trio

from .._core.drain import stop_on
from .app import ServerApp
from .wire import READY_PREFIX


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only (``localhost`` or a loopback address)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def url_of(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: the OS picks one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    return sock


async def _stop_on_stdin_eof(stop: trio.Event) -> None:
    """The death pipe: the parent holds our stdin's write end; EOF means it is gone."""
    fd = sys.stdin.fileno()
    while True:
        await trio.lowlevel.wait_readable(fd)
        if not os.read(fd, 4096):
            stop.set()
            return


async def _watch(stop: trio.Event, nursery: trio.Nursery, die_with_parent: bool) -> None:
    nursery.start_soon(stop_on, lambda _reason: stop.set())
    if die_with_parent:
        nursery.start_soon(_stop_on_stdin_eof, stop)


APP_QUEUE = 4
"""Messages (or body chunks) hypercorn queues for the app per connection (its default: 10)."""


def _log_to_stderr() -> None:
    """Refusals (`policy.log_refusal`) as one line each on stderr."""
    import logging

    logger = logging.getLogger("trio_tasksets._serve")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("trio-tasksets serve[%(process)d]: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def _announce(url: str) -> None:
    """Tell the parent the URL on stdout (one line); later stdout output goes to stderr."""
    print(f"{READY_PREFIX}{url}", flush=True)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())


async def serve_worker(
    app: ServerApp,
    fd: int,
    *,
    url: str | None,
    die_with_parent: bool,
    graceful: float = 3.0,
    metrics_port: int | None = None,
) -> None:
    """Serve `app` on the listening socket `fd` until SIGTERM/SIGINT (or stdin EOF with
    `die_with_parent`), holding `env.serving()` throughout; announce `url` once listening.
    With `metrics_port`, also serve the worker's metrics there (`trio_tasksets._monitor.metrics`)."""
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = [f"fd://{fd}"]
    config.loglevel = "WARNING"
    config.graceful_timeout = graceful
    # Hypercorn's idle timer runs from a connection's start (or the end of its last answer)
    # until a whole request head has arrived: it is both the header read timeout and the
    # keep-alive idle timeout. (The client's keep-alive is shorter: it closes first.)
    config.keep_alive_timeout = app.limits.header_timeout
    config.websocket_max_message_size = app.max_body  # over it: close code 1009
    # Messages hypercorn holds for the app per connection before it stops reading the socket.
    config.max_app_queue_size = APP_QUEUE
    _log_to_stderr()
    stop = trio.Event()
    try:
        async with app.env.serving(), trio.open_nursery() as nursery:
            await _watch(stop, nursery, die_with_parent)

            async def run_server(task_status: trio.TaskStatus[Any]) -> None:
                asgi: Any = app
                await serve(asgi, config, shutdown_trigger=stop.wait, task_status=task_status)
                nursery.cancel_scope.cancel()

            await nursery.start(run_server)
            nursery.start_soon(app.clients.feed_engines)  # --engine-metrics, if any
            if metrics_port is not None:
                await _serve_metrics(app, nursery, metrics_port)
            if url is not None:
                _announce(url)
    finally:
        await app.aclose()


async def _serve_metrics(app: ServerApp, nursery: trio.Nursery, port: int) -> None:
    from .._core.health import Health
    from .._monitor.metrics import Metrics, serve_metrics

    app.run_health = health = Health()
    stats = app.stats
    app.metrics = metrics = Metrics(health, extra=lambda: {
        "served": stats.served, "failed": stats.failed, "cancelled": stats.cancelled,
        "rejected": stats.rejected,
    }, endpoints=app.clients.endpoint_stats)  # fmt: skip
    nursery.start_soon(health.probe)
    bound = await nursery.start(serve_metrics, metrics, port)
    print(f"metrics on http://127.0.0.1:{bound}/metrics", file=sys.stderr, flush=True)


# --- K workers: a supervisor process that owns the socket ------------------------------------


async def stop_process(proc: trio.Process, grace: float) -> None:
    """Close its stdin (the death pipe), SIGTERM, wait `grace` seconds, then SIGKILL."""
    with trio.CancelScope(shield=True):
        if proc.stdin is not None:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await proc.stdin.aclose()
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        with trio.move_on_after(grace):
            await proc.wait()
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


async def supervise(
    worker_cmd: list[str], sock: socket.socket, workers: int, url: str, die_with_parent: bool
) -> int:
    """Run `workers` worker processes on `sock` until a signal (or stdin EOF, with
    `die_with_parent`); if one dies unasked, stop them all and return 1 (a pool never runs
    degraded). Each worker's stdin is a death pipe from here."""
    fd = sock.fileno()
    procs: list[trio.Process] = []
    failed: list[str] = []
    stop = trio.Event()

    async def reap(proc: trio.Process) -> None:
        code = await proc.wait()
        if not stop.is_set():
            failed.append(f"worker pid {proc.pid} exited with code {code}")
            stop.set()

    try:
        async with trio.open_nursery() as nursery:
            await _watch(stop, nursery, die_with_parent)
            for _ in range(workers):
                proc = await trio.lowlevel.open_process(
                    [*worker_cmd, "--listen-fd", str(fd)],
                    stdin=subprocess.PIPE, stdout=sys.stderr.fileno(), pass_fds=(fd,),
                )  # fmt: skip
                procs.append(proc)
                nursery.start_soon(reap, proc)
            _announce(url)
            await stop.wait()
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as nursery:
                for proc in procs:
                    nursery.start_soon(stop_process, proc, 5.0)
    for line in failed:
        print(f"trio-tasksets serve: {line}; stopping the pool", file=sys.stderr)
    return 1 if failed else 0


# --- the command line -----------------------------------------------------------------------
