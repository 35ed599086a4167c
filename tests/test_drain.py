"""`drain.stop_on`: signals and a time limit, the one drain trigger of eval, worker and serve."""

from __future__ import annotations

import functools
import os
import signal

import trio
import trio.testing
from trio.testing import MockClock

from trio_tasksets._core.drain import stop_on


async def test_a_time_limit_stops_at_that_virtual_time(autojump_clock: MockClock) -> None:
    heard: list[tuple[str, float]] = []
    start = trio.current_time()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            run = functools.partial(
                stop_on, lambda why: heard.append((why, trio.current_time() - start)),
                signals=False, time_limit=7.5,
            )  # fmt: skip
            await nursery.start(run)
            await trio.sleep(10)
            nursery.cancel_scope.cancel()
    assert heard == [("time_limit", 7.5)]


async def test_each_signal_is_heard_by_name_and_once_stops_listening() -> None:
    heard: list[str] = []
    two = trio.Event()

    def stop(why: str) -> None:
        heard.append(why)
        if len(heard) == 2:
            two.set()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(stop_on, stop)  # handlers installed: nothing is lost
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)
            await two.wait()
            nursery.cancel_scope.cancel()
    assert heard == ["SIGTERM", "SIGINT"]

    once: list[str] = []
    first = trio.Event()
    before = signal.getsignal(signal.SIGINT)  # trio's own, in a trio run

    def heard_once(why: str) -> None:
        once.append(why)
        first.set()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(functools.partial(stop_on, heard_once, once=True))
            os.kill(os.getpid(), signal.SIGTERM)
            await first.wait()
            await trio.testing.wait_all_tasks_blocked()  # the listener has returned
            # Its receiver is left: the handler is back (a second Ctrl-C interrupts).
            assert signal.getsignal(signal.SIGINT) == before
            nursery.cancel_scope.cancel()
    assert once == ["SIGTERM"]
