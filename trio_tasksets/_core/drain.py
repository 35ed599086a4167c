"""`stop_on`: the one way a long run hears that it must stop (SIGINT, SIGTERM, a time limit).

An eval, a worker and an env server all drain the same way: something asks them to stop,
they stop taking work and let what runs finish (or cancel it). What asks is one task of
theirs, ``await nursery.start(stop_on, stop, ...)``, which calls `stop(reason)`:

* on SIGINT or SIGTERM, with the signal's name (``"SIGINT"``, ``"SIGTERM"``); with
  ``once=True`` it stops listening after the first, which restores the default handlers, so
  a second Ctrl-C interrupts the drain itself (KeyboardInterrupt); else every signal calls
  `stop` again (a worker cancels what runs on the second);
* after `time_limit` seconds (trio's clock, so a MockClock test jumps to it), with
  `time_reason` (default ``"time_limit"``).

`nursery.start` returns once the signal handlers are installed, so no signal that comes
after it is lost. The task runs until cancelled (cancel it when the run ends).
"""

from __future__ import annotations

import signal
from collections.abc import Callable

import trio

__all__ = ["stop_on"]


async def stop_on(
    stop: Callable[[str], object],
    *,
    signals: bool = True,
    once: bool = False,
    time_limit: float | None = None,
    time_reason: str = "time_limit",
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Call `stop(reason)` on SIGINT/SIGTERM (`signals`) and after `time_limit` seconds
    (see the module docstring); runs until cancelled. Signals need the main thread."""
    async with trio.open_nursery() as nursery:
        if signals:
            await nursery.start(_on_signals, stop, once)
        if time_limit is not None:
            nursery.start_soon(_after, time_limit, stop, time_reason)
        task_status.started()
        await trio.sleep_forever()


async def _on_signals(
    stop: Callable[[str], object], once: bool, *, task_status: trio.TaskStatus[None]
) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as received:
        task_status.started()
        async for signum in received:
            stop(signal.Signals(signum).name)
            if once:
                return


async def _after(seconds: float, stop: Callable[[str], object], reason: str) -> None:
    await trio.sleep(seconds)
    stop(reason)
