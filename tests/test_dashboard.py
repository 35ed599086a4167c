"""The eval dashboard (SPEC section 4): `Progress` counts and `show`, rendered for real."""

from __future__ import annotations

import io
import re
import threading
import time

import pytest
import trio
from rich.console import Console
from trio.testing import MockClock

from trio_tasksets._core.adaptive import AdaptiveBounds, AdaptiveWindow
from trio_tasksets._core.limits import ConnectionLimiter
from trio_tasksets._core.window import Window
from trio_tasksets._monitor.dashboard import Progress, show

ANSI = re.compile(r"\x1b(\[[0-9;?]*[A-Za-z]|\][^\x07\x1b]*(\x07|\x1b\\))")
TOP = "╭─ "  # the panel's top-left corner: one per drawn frame


def make_console(*, terminal: bool) -> tuple[Console, io.StringIO]:
    buffer = io.StringIO()
    return Console(file=buffer, force_terminal=terminal, width=100), buffer


def plain(buffer: io.StringIO) -> str:
    return ANSI.sub("", buffer.getvalue())


def last_frame(buffer: io.StringIO) -> str:
    return plain(buffer).rsplit(TOP, 1)[-1]


def run_some(progress: Progress, *, ok: int, failed: int = 0, running: int = 0) -> None:
    for _ in range(ok + failed + running):
        progress.started()
    for _ in range(ok):
        progress.finished(True, 1.0)
    for _ in range(failed):
        progress.finished(False, 0.0)


# --- Progress --------------------------------------------------------------------------------


def test_progress_counts() -> None:
    progress = Progress()
    assert (progress.title, progress.total, progress.done, progress.running) == ("eval", 0, 0, 0)
    assert progress.reward_mean is None
    progress.planned()
    progress.planned(4)
    assert progress.total == 5
    progress.started()
    progress.started()
    progress.started()
    assert progress.running == 3
    progress.finished(True, 1.0)
    progress.finished(False, 0.25)
    assert (progress.done, progress.running, progress.failed) == (2, 1, 1)
    assert progress.reward_sum == pytest.approx(1.25)
    assert progress.reward_mean == pytest.approx(0.625)


def test_finished_without_started_does_not_go_negative() -> None:
    progress = Progress()  # e.g. a resumed run's kept episodes
    progress.finished(True, 1.0)
    assert (progress.done, progress.running) == (1, 0)


def test_growing_until_stopped() -> None:
    progress = Progress(growing=True)
    progress.planned(2)
    assert progress.growing
    progress.stop_growing()
    assert not progress.growing
    assert progress.total == 2


def test_rate_is_done_per_elapsed_second() -> None:
    progress = Progress(started_at=time.monotonic() - 10.0)
    assert progress.rate == 0.0
    run_some(progress, ok=5)
    assert progress.elapsed == pytest.approx(10.0, abs=0.5)
    assert progress.rate == pytest.approx(0.5, rel=0.05)
    assert Progress(started_at=time.monotonic() + 60).rate == 0.0  # no time yet, no division


def test_line_format() -> None:
    progress = Progress(started_at=time.monotonic() - 100.5)
    progress.planned(20)
    run_some(progress, ok=9, failed=1, running=3)
    assert progress.line() == (
        "eval: 10/20 done, 3 running, 1 failed, reward 0.900 (failed rows count 0), 0.10/s, 01:40"
    )
    clean = Progress(started_at=time.monotonic() - 100.5)
    run_some(clean, ok=2)
    assert "reward 1.000, " in clean.line()  # nothing failed: nothing to say


def test_named_metrics_are_one_compact_line_only_when_there_are_any() -> None:
    """Issue 35 (4): each named metric with its mean and 95% interval, read once a draw."""
    progress = Progress(started_at=time.monotonic() - 1)
    run_some(progress, ok=2)
    assert "metrics" not in progress.line()
    assert progress.metrics_text() is None
    reads = []

    def figures() -> dict[str, tuple[float, tuple[float, float] | None]]:
        reads.append(1)
        return {"exact": (0.5, (0.1875, 0.8125)), "chars": (12.0, None)}

    progress.metrics = figures
    line = progress.line()
    assert line.endswith("; metrics (95% CI): exact 0.500 [0.188, 0.812], chars 12.000")
    assert len(reads) == 1
    progress.metrics = dict
    assert "metrics" not in progress.line()  # none yet (no episode carried one)


async def test_the_live_panel_shows_the_metrics_line_and_that_failed_rows_count_0(
    autojump_clock: MockClock,
) -> None:
    console, buffer = make_console(terminal=True)
    progress = Progress(title="m", metrics=lambda: {"exact": (0.75, (0.25, 1.0))})
    progress.planned(4)
    async with show(progress, live=True, console=console):
        run_some(progress, ok=3, failed=1)
        await trio.sleep(0.3)
        frame = last_frame(buffer)
        assert "metrics (95% CI): exact 0.750 [0.250, 1.000]" in frame
        assert "reward: failed rows count 0" in frame
    console, buffer = make_console(terminal=True)
    async with show(Progress(title="plain"), live=True, console=console):
        await trio.sleep(0.3)
    assert "metrics" not in last_frame(buffer)
    assert "count 0" not in last_frame(buffer)


def test_line_growing_and_before_any_result() -> None:
    progress = Progress(title="stream", growing=True)
    progress.planned(5)
    assert progress.line().startswith("stream: 0/5+ done, 0 running, 0 failed, reward -, 0.0/s, ")


async def test_the_window_and_connection_limit_are_shown_as_they_move(
    autojump_clock: MockClock,
) -> None:
    window = AdaptiveWindow(1, 8, 512)
    connections = ConnectionLimiter(AdaptiveBounds(1, 4, 64))
    progress = Progress(started_at=time.monotonic(), window=window, connections=connections)
    assert progress.line().endswith("; window 8 (adapts 1-512), connections 4 (adapts 1-64)")
    window.rate_limited()  # the first 429: cut to 6
    connections.window("http://127.0.0.1:8000/v1").resize(12)
    assert progress.limits_text() == "window 6 (adapts 1-512), connections 12 (adapts 1-64)"
    fixed = Progress(window=Window(32), connections=ConnectionLimiter(16))
    assert fixed.limits_text() == "window 32, connections 16"
    assert Progress().limits_text() is None
    boxes = AdaptiveWindow(1, 2, 256)
    await boxes.acquire("a box")
    alive = Progress(window=Window(64), sandboxes=boxes)
    assert alive.limits_text() == "window 64, sandboxes 1/2 (adapts 1-256)"  # alive / window
    boxes.release("a box")
    console, buffer = make_console(terminal=True)
    async with show(progress, live=True, console=console):
        pass
    assert "window 6 (adapts 1-512), connections 12" in last_frame(buffer)


def test_line_shows_hours() -> None:
    progress = Progress(started_at=time.monotonic() - 3605.5)
    assert progress.line().endswith(", 1:00:05")


# --- show(live=True) on a terminal ----------------------------------------------------------


async def test_live_panel_redraws_on_trio_time(autojump_clock: MockClock) -> None:
    console, buffer = make_console(terminal=True)
    progress = Progress(title="live-test")
    progress.planned(10)
    threads = threading.active_count()
    async with show(progress, live=True, console=console, refresh_per_second=4):
        assert threading.active_count() == threads  # no rich refresh thread
        assert plain(buffer).count(TOP) == 1  # the first frame, drawn on entry
        frame = last_frame(buffer)
        for word in ("live-test", "total", "done", "running", "failed", "reward", "rate"):
            assert word in frame
        assert "0/10" in frame

        run_some(progress, ok=3, failed=1, running=2)
        await trio.sleep(1.1)  # redraws at 0.25, 0.5, 0.75 and 1.0
        assert plain(buffer).count(TOP) == 5
        frame = last_frame(buffer)
        assert "4/10" in frame
        assert "40%" in frame
        assert "0.750" in frame  # reward mean
        assert re.search(r"\b10\s+4\s+2\s+1\s+0\.750\b", frame)  # total done running failed

        run_some(progress, ok=6)
        await trio.sleep(0.3)
        assert "10/10" in last_frame(buffer)
    assert plain(buffer).count(TOP) == 7  # one more redraw, then the final frame
    assert "\x1b[" in buffer.getvalue()  # a terminal gets colour and cursor control


async def test_live_growing_total_shows_plus(autojump_clock: MockClock) -> None:
    console, buffer = make_console(terminal=True)
    progress = Progress(title="stream", growing=True)
    async with show(progress, live=True, console=console):
        progress.planned(3)
        run_some(progress, ok=1, running=1)
        await trio.sleep(0.3)
        frame = last_frame(buffer)
        assert "1/3+" in frame
        assert "(streaming)" in frame
        assert "%" not in frame  # no percentage of an unknown total
        progress.planned(2)
        await trio.sleep(0.3)
        assert "1/5+" in last_frame(buffer)
        progress.stop_growing()
        run_some(progress, ok=3)
        await trio.sleep(0.3)
    frame = last_frame(buffer)
    assert "4/5" in frame
    assert "80%" in frame
    assert "+" not in frame
    assert "(streaming)" not in frame


async def test_live_final_frame_when_cancelled(autojump_clock: MockClock) -> None:
    console, buffer = make_console(terminal=True)
    progress = Progress(title="cancel-me")
    progress.planned(8)
    with trio.CancelScope() as scope:
        async with show(progress, live=True, console=console, refresh_per_second=1):
            await trio.sleep(0.5)
            run_some(progress, ok=5, failed=2, running=1)  # never drawn by the refresher
            scope.cancel()
            await trio.sleep_forever()
    assert scope.cancelled_caught
    frame = last_frame(buffer)
    assert "7/8" in frame
    assert re.search(r"\b8\s+7\s+1\s+2\b", frame)
    assert plain(buffer).endswith("╯\n")  # the cursor is left below the panel


# --- plain logs ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("live", "terminal"), [(False, False), (True, False), (False, True)], ids=str
)
async def test_plain_logs_every_log_every_seconds(
    autojump_clock: MockClock, live: bool, terminal: bool
) -> None:
    console, buffer = make_console(terminal=terminal)
    progress = Progress(title="plain")
    progress.planned(6)
    async with show(progress, live=live, console=console, log_every=5.0):
        run_some(progress, ok=1)
        await trio.sleep(7)  # a line at t=5
        run_some(progress, ok=2, failed=1)
        await trio.sleep(5)  # a line at t=10, then the final one at t=12
    lines = buffer.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == [
        "plain: 1/6 done",
        "plain: 4/6 done",
        "plain: 4/6 done",
    ]
    assert lines[-1].startswith(
        "plain: 4/6 done, 0 running, 1 failed, reward 0.750 (failed rows count 0), "
    )
    assert TOP not in buffer.getvalue()
    if not terminal:
        assert "\x1b" not in buffer.getvalue()


async def test_plain_final_line_when_cancelled(autojump_clock: MockClock) -> None:
    console, buffer = make_console(terminal=False)
    progress = Progress(title="plain")
    progress.planned(3)
    with trio.move_on_after(2):
        async with show(progress, live=False, console=console, log_every=5.0):
            run_some(progress, ok=2)
            await trio.sleep_forever()
    (line,) = buffer.getvalue().splitlines()
    assert line.startswith("plain: 2/3 done, 0 running, 0 failed, reward 1.000, ")


async def test_default_console_is_stderr(
    autojump_clock: MockClock, capsys: pytest.CaptureFixture[str]
) -> None:
    progress = Progress(title="quiet")
    progress.planned(1)
    async with show(progress, live=True):  # captured stderr is not a terminal: plain lines
        run_some(progress, ok=1)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("quiet: 1/1 done, 0 running, 0 failed, reward 1.000, ")
    assert "\x1b" not in captured.err


# --- the eval's exceptions and the dashboard's own failures ---------------------------------


@pytest.mark.parametrize("terminal", [True, False], ids=["live", "plain"])
@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
async def test_body_exception_leaves_unchanged_after_final_frame(
    autojump_clock: MockClock, terminal: bool, error: type[BaseException]
) -> None:
    console, buffer = make_console(terminal=terminal)
    progress = Progress(title="boom")
    progress.planned(2)
    raised = error("from the eval")

    async def eval_that_fails() -> None:
        async with show(progress, live=True, console=console):
            await trio.sleep(1)
            run_some(progress, ok=1)
            raise raised

    with pytest.raises(error) as info:
        await eval_that_fails()
    assert info.value is raised  # not wrapped in an ExceptionGroup
    assert "1/2" in (last_frame(buffer) if terminal else buffer.getvalue().splitlines()[-1])


class BrokenFile(io.StringIO):
    def write(self, text: str) -> int:
        raise OSError("the terminal went away")


@pytest.mark.parametrize("terminal", [True, False], ids=["live", "plain"])
async def test_rendering_failures_never_reach_the_eval(
    autojump_clock: MockClock, terminal: bool
) -> None:
    console = Console(file=BrokenFile(), force_terminal=terminal, width=100)
    progress = Progress()
    progress.planned(2)
    finished = False
    async with show(progress, live=True, console=console, log_every=1.0):
        await trio.sleep(3)
        run_some(progress, ok=2)
        finished = True
    assert finished


@pytest.mark.parametrize("option", ["refresh_per_second", "log_every"])
@pytest.mark.parametrize("value", [0.0, -1.0])
async def test_periods_must_be_positive(option: str, value: float) -> None:
    console, buffer = make_console(terminal=True)
    with pytest.raises(ValueError, match=option):
        async with show(Progress(), live=True, console=console, **{option: value}):
            pass
    assert buffer.getvalue() == ""
