"""A box for each rollout: when an env's sandboxes are made, shared, admitted and destroyed.

An env given a sandbox factory (`tt.ToolEnv(..., sandbox=FACTORY)`, `--sandbox`) holds one
`Sandboxes`: the factory, the scope of a box (`"rollout"`: one per attempt of an episode;
`"group"`: one shared by a group's rollouts, `--group`) and the admission window
(`max_sandboxes`). For each scope the env enters `Sandboxes.attempt()` (around an attempt's
rollout *and* its scoring, so a reward may run the task's tests in the box) or
`Sandboxes.group()` (around a group's rollouts and `score_group`): within it
`tt.current_sandbox()` is a handle (`LazyBox`) that makes the box on its first use (`exec`,
`read_file`, `write_file`): a rollout that never touches it costs nothing. When the scope
ends, however it ends (success, an error, any cancellation: fail-fast, `tt.first`, a
deadline, a policy update's abort), the box is closed, shielded from the cancellation and
bounded in time (`CLOSE_TIMEOUT`), and its place in the admission window is given back.

Admission: at most `max_sandboxes` boxes are alive at once. A rollout waits for a place
*before* its box is made; the wait is one of the runner's own (`parked("sandbox")`), so it
is not working time, and `summary.json["health"]["waited_s"]["sandbox"]` sums it. The
window is apart from the rollout window (`-c`): a burst of new rollouts never makes a burst
of boxes. `MIN-START-MAX` makes it adaptive (`SandboxAdmission`): an `AdaptiveWindow` that
grows from `start` while boxes are made cleanly (slow start, then by steps), is capped at the
boxes alive less one when a creation fails, and is cut (by a fifth, at most once a `hold`)
while the host is under pressure: CPU or memory pressure (the kernel's PSI,
``/proc/pressure/cpu|memory``, where present; else the load average and ``MemAvailable``)
above a threshold, or creations that take `slow` times longer than the quickest seen; no
creation counts toward growth meanwhile. CPU pressure cuts it no lower than the host's
cores: on a machine other work keeps busy, fewer boxes than cores would only leave the
eval's share of the CPUs idle; memory pressure cuts it to its `min`. A creation that fails
is retried (`START_ATTEMPTS` in all, the project's `Backoff` between them) before the
rollout fails with `SandboxStartError`.

The window is the project's `AdaptiveWindow`, driven through its public surface only
(`record` for clean starts and failed ones, `resize` for pressure): one adaptive mechanism
for every window of a run.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from typing import Any, Literal

import attrs
import trio

from .._core.adaptive import AdaptiveBounds, AdaptiveWindow, Outcome, check_window_spec
from .._core.backoff import Backoff
from .._core.exceptions import ConfigError, ConfigTypeError
from .._core.limits import parked
from .._core.window import Window
from ..sandboxes import (
    ExecResult,
    Sandbox,
    SandboxFactory,
    SandboxStartError,
    current_or_none,
    open_sandbox,
    using,
)

__all__ = [
    "CLOSE_TIMEOUT",
    "SCOPES",
    "START_ATTEMPTS",
    "HostPressure",
    "LazyBox",
    "Pressure",
    "SandboxAdmission",
    "SandboxScope",
    "SandboxStartError",
    "Sandboxes",
    "check_scope",
    "default_max_sandboxes",
    "open_box",
]

SandboxScope = Literal["rollout", "group"]
"""What one box serves: an attempt of a rollout, or a group's rollouts together."""
SCOPES: tuple[SandboxScope, ...] = ("rollout", "group")

CLOSE_TIMEOUT = 30.0  # seconds a box's close may take, shielded, before it is abandoned
START_ATTEMPTS = 3  # tries to make one box before its rollout fails
CREATE_TIMEOUT = 120.0  # seconds one creation may take (shielded: a half-made box is closed)


def check_scope(value: object, parameter: str = "sandbox_scope") -> SandboxScope:
    """`value` if it is ``"rollout"`` or ``"group"``; else a `ConfigError` naming
    `parameter`."""
    if value not in SCOPES:
        raise ConfigError(
            f"{{{parameter}}} must be 'rollout' (a box per attempt of a rollout) or 'group' "
            f"(one box shared by a group's rollouts), got {value!r}",
            parameter=parameter,
        )
    return value


def default_max_sandboxes() -> AdaptiveBounds:
    """The admission window when none is given: adaptive, from the host's cores
    (``1-CORES-256``)."""
    cores = os.cpu_count() or 1
    return AdaptiveBounds(1, min(cores, 256), 256)


# --- the host's pressure ------------------------------------------------------------------


@attrs.frozen
class Pressure:
    """The share of recent time (0 to 1) some task of the host waited for CPU (`cpu`) and
    for memory (`memory`), and where it was read (``"psi"`` or ``"loadavg"``)."""

    cpu: float
    memory: float
    source: str = "psi"


class HostPressure:
    """Reads the host's pressure, at most once per `interval` seconds (of the wall clock):
    the kernel's PSI (``/proc/pressure/cpu`` and ``memory``, the ``some`` line: the share of
    time since the last reading that at least one task waited), else the load average over
    the cores (the share of runnable tasks beyond them) and ``1 - MemAvailable/MemTotal``
    above 0.9 (scaled to 0..1). `read()` returns the latest `Pressure`."""

    def __init__(self, *, interval: float = 0.5, root: str = "/proc") -> None:
        self.interval = interval
        self.root = root
        self._at = -math.inf
        self._totals: tuple[float, float, float] | None = None  # (wall, cpu us, memory us)
        self._last = Pressure(0.0, 0.0, "none")

    def read(self) -> Pressure:
        now = time.monotonic()
        if now - self._at < self.interval:
            return self._last
        self._at = now
        try:
            self._last = self._psi(now)
        except (OSError, ValueError):
            self._last = self._loadavg()
        return self._last

    def _psi(self, now: float) -> Pressure:
        cpu_avg, cpu_total = _psi_some(f"{self.root}/pressure/cpu")
        mem_avg, mem_total = _psi_some(f"{self.root}/pressure/memory")
        before, self._totals = self._totals, (now, cpu_total, mem_total)
        if before is None or now <= before[0]:
            return Pressure(cpu_avg / 100, mem_avg / 100)
        wall = (now - before[0]) * 1e6
        return Pressure(
            min(1.0, max(0.0, (cpu_total - before[1]) / wall)),
            min(1.0, max(0.0, (mem_total - before[2]) / wall)),
        )

    def _loadavg(self) -> Pressure:
        try:
            with open(f"{self.root}/loadavg") as file:
                load = float(file.read().split()[0])
            cores = os.cpu_count() or 1
            cpu = min(1.0, max(0.0, load / cores - 1.0))
            info: dict[str, float] = {}
            with open(f"{self.root}/meminfo") as file:
                for line in file:
                    name, _, rest = line.partition(":")
                    info[name] = float(rest.split()[0])
            used = 1.0 - info["MemAvailable"] / info["MemTotal"]
            return Pressure(cpu, min(1.0, max(0.0, (used - 0.9) / 0.1)), "loadavg")
        except (OSError, ValueError, KeyError, IndexError, ZeroDivisionError):
            return Pressure(0.0, 0.0, "none")


def _psi_some(path: str) -> tuple[float, float]:
    """(avg10, total) of the ``some`` line of a PSI file."""
    with open(path) as file:
        for line in file:
            if line.startswith("some "):
                fields = dict(part.split("=", 1) for part in line.split()[1:])
                return float(fields["avg10"]), float(fields["total"])
    raise ValueError(f"{path}: no 'some' line")


# --- admission ----------------------------------------------------------------------------


class SandboxAdmission:
    """The window that admits boxes: at most `window.size` alive at once (see the module).

    `window` is a `tt.Window` (fixed; one of your own is used as is) or an `AdaptiveWindow`,
    which this moves: successes grow it through its controller, a failed creation caps it,
    pressure (`pressure`, a callable returning a `Pressure`: `HostPressure().read` by
    default) above `cpu_high` / `memory_high`, or a creation slower than `slow` times the
    quickest seen (and than `slow_after` seconds), cuts it by a fifth at most once per
    `hold` seconds and withholds growth; CPU pressure and slow creations never cut it below
    the host's `cores` (default: `os.cpu_count()`), memory pressure down to its `min`.
    """

    def __init__(
        self,
        window: Window,
        *,
        pressure: Callable[[], Pressure] | None = None,
        cpu_high: float = 0.6,
        memory_high: float = 0.1,
        slow: float = 4.0,
        slow_after: float = 0.1,
        hold: float = 1.0,
        cores: int | None = None,
    ) -> None:
        self.window = window
        self.pressure = pressure if pressure is not None else HostPressure().read
        self.cpu_high = cpu_high
        self.memory_high = memory_high
        self.slow = slow
        self.slow_after = slow_after
        self.hold = hold
        self.cores = cores if cores is not None else os.cpu_count() or 1
        self.alive = 0
        self.peak = 0
        self.made = 0
        self.failed = 0
        self.close_failed = 0
        self.creation: list[float] = []  # the newest creation times (seconds)
        self.quickest = math.inf
        self._cut_at = -math.inf

    @property
    def adaptive(self) -> bool:
        return isinstance(self.window, AdaptiveWindow)

    async def acquire(self, holder: object) -> None:
        """Wait for a place (`parked("sandbox")`: not working time), then hold it."""
        self._check_pressure(None)
        with parked("sandbox"):
            await self.window.acquire(holder)
        self.alive += 1
        self.peak = max(self.peak, self.alive)

    def release(self, holder: object) -> None:
        self.alive -= 1
        self.window.release(holder)

    def created(self, seconds: float) -> None:
        """A box was made in `seconds` (its place still held)."""
        self.made += 1
        self.creation.append(seconds)
        del self.creation[:-256]
        quickest, self.quickest = self.quickest, min(self.quickest, seconds)
        slow = self.made > 1 and seconds > max(self.slow * quickest, self.slow_after)
        if not self._check_pressure("slow start-up" if slow else None) and isinstance(
            self.window, AdaptiveWindow
        ):
            self.window.record(Outcome.SUCCESS)

    def start_failed(self) -> None:
        """A creation failed (its place still held): an adaptive window is capped."""
        self.failed += 1
        if isinstance(self.window, AdaptiveWindow):
            self.window.record(Outcome.RATE_LIMITED)

    def _check_pressure(self, reason: str | None) -> bool:
        """Whether the host is under pressure now; an adaptive window is cut for it (at most
        once per `hold`): memory pressure down to its `min`; CPU pressure and slow start-ups
        down to the host's cores at the least (`cores`: fewer boxes than cores would leave
        CPUs idle that other work holds no less, and the eval's own loop keeps its share)."""
        window = self.window
        if not isinstance(window, AdaptiveWindow):
            return False
        floor = max(window.min, min(window.max, self.cores))
        if reason is None:
            found = self.pressure()
            if found.memory > self.memory_high:
                reason, floor = "memory pressure", window.min
            elif found.cpu > self.cpu_high:
                reason = "cpu pressure"
            else:
                return False
        now = trio.current_time()
        if now - self._cut_at >= self.hold and window.size > floor:
            self._cut_at = now
            window.resize(max(floor, math.floor(window.size * 0.8)), reason)
        return True

    def stats(self) -> dict[str, Any]:
        """What the admission did: boxes made and failed, alive now and at most, creation
        times (median, max), the window's size."""
        times = sorted(self.creation)
        return {
            "made": self.made,
            "failed": self.failed,
            "close_failed": self.close_failed,
            "alive": self.alive,
            "peak_alive": self.peak,
            "window": self.window.size,
            "creation_p50_s": times[len(times) // 2] if times else None,
            "creation_max_s": times[-1] if times else None,
        }


# --- one box, made on first use ---------------------------------------------------------------


async def open_box(factory: SandboxFactory, stack: AsyncExitStack) -> Sandbox:
    """Make one box with `factory` (`tt.sandboxes.open_sandbox`: either kind of factory),
    its destruction pushed onto `stack`. Raises `ConfigTypeError` naming ``sandbox`` for a
    factory that makes something else."""
    box = await stack.enter_async_context(open_sandbox(factory))
    if not _is_box(box):
        raise ConfigTypeError(
            f"{{sandbox}}: the factory gave a {type(box).__name__}, not a tt.Sandbox (an "
            f"object with exec, read_file, write_file and aclose); a factory is called with "
            f"no argument: tt.sandboxes.local(), not tt.sandboxes.local",
            parameter="sandbox",
        )
    found: Sandbox = box
    return found


def _is_box(value: object) -> bool:
    return all(callable(getattr(value, name, None)) for name in _METHODS)


_METHODS = ("exec", "read_file", "write_file", "aclose")


class LazyBox:
    """The current sandbox of one scope: a `tt.Sandbox` whose box is made on first use
    (waiting for a place in the admission window first) and closed by `finish` when the
    scope ends (or by `aclose`, early). Concurrent first uses make one box."""

    def __init__(self, sandboxes: Sandboxes) -> None:
        self.sandboxes = sandboxes
        self._box: Sandbox | None = None
        self._lock = trio.Lock()
        self._stack: AsyncExitStack | None = None
        self._held = False
        self._closed = False

    @property
    def made(self) -> bool:
        """Whether the box has been made (and not closed)."""
        return self._box is not None

    async def box(self) -> Sandbox:
        """The box, made now if it was not."""
        box = self._box
        if box is not None:
            return box
        async with self._lock:
            if self._box is None:
                if self._closed:
                    raise SandboxStartError("the sandbox was closed: its scope has ended")
                await self._make()
            assert self._box is not None
            return self._box

    async def _make(self) -> None:
        admission = self.sandboxes.admission
        await admission.acquire(self)
        self._held = True
        backoff = Backoff()
        attempt = 0
        while True:
            attempt += 1
            stack = AsyncExitStack()
            began = trio.current_time()
            problem: BaseException | None = None
            # Shielded (and bounded): a box half made when the scope is cancelled is made
            # whole and then closed, never leaked by a factory that does not clean up.
            with trio.CancelScope(shield=True):
                try:
                    with trio.fail_after(self.sandboxes.create_timeout):
                        box = await open_box(self.sandboxes.factory, stack)
                except ConfigTypeError:
                    await _close(stack)
                    self._give_back()
                    raise
                except (Exception, trio.TooSlowError) as exc:
                    problem = exc
                    await _close(stack)
            if problem is None:
                admission.created(trio.current_time() - began)
                self._box, self._stack = box, stack
                await trio.lowlevel.checkpoint_if_cancelled()  # (finish closes it)
                return
            admission.start_failed()
            if attempt >= START_ATTEMPTS:
                self._give_back()
                raise SandboxStartError(
                    f"the sandbox could not be made ({attempt} attempts): "
                    f"{type(problem).__name__}: {problem}"
                ) from problem
            with parked("sandbox"):
                await trio.sleep(backoff.delay(attempt))

    def _give_back(self) -> None:
        if self._held:
            self._held = False
            self.sandboxes.admission.release(self)

    async def finish(self) -> None:
        """Close the box (if it was made) and give its place back: shielded from
        cancellation, the close bounded by `CLOSE_TIMEOUT`. Idempotent."""
        self._closed = True
        stack, self._stack, self._box = self._stack, None, None
        with trio.CancelScope(shield=True):
            try:
                problem = None if stack is None else await _close(stack)
            finally:
                self._give_back()
        if problem is not None:  # loud, but no failure of the rollout it served
            self.sandboxes.admission.close_failed += 1
            print(
                f"trio_tasksets: a sandbox did not close ({problem}); its backend removes "
                f"what it left at the next start",
                file=sys.stderr,
            )

    # duplicates: Sandbox.exec's signature (SPEC 14), which this implements
    async def exec(
        self,
        command: str | Sequence[str],
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (the tt.Sandbox protocol's)
        input: bytes | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> ExecResult:
        box = await self.box()
        return await box.exec(command, timeout=timeout, input=input, env=env, cwd=cwd)

    async def read_file(self, path: str) -> bytes:
        return await (await self.box()).read_file(path)

    async def write_file(self, path: str, data: bytes) -> None:
        await (await self.box()).write_file(path, data)

    async def aclose(self) -> None:
        """Close the box now (the scope's end would); later uses raise
        `SandboxStartError`."""
        async with self._lock:
            await self.finish()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "made" if self._box is not None else "not made"
        return f"<sandbox of this {self.sandboxes.scope} ({state}): {self._box!r}>"


async def _close(stack: AsyncExitStack) -> str | None:
    """Close what `stack` holds within `CLOSE_TIMEOUT`; None, or why it did not close (the
    backend's own sweep at the next start finds what it left)."""
    with trio.move_on_after(CLOSE_TIMEOUT) as scope:
        try:
            await stack.aclose()
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
    return f"its close took over {CLOSE_TIMEOUT:g}s" if scope.cancelled_caught else None


# --- an env's sandboxes -----------------------------------------------------------------------


class _Scope:
    """`Sandboxes.attempt()` / `.group()`: a `LazyBox` current for the block, finished on
    leaving it (a class, not a generator: one per attempt)."""

    __slots__ = ("_box", "_sandboxes", "_using")

    def __init__(self, sandboxes: Sandboxes | None) -> None:
        self._sandboxes = sandboxes
        self._box: LazyBox | None = None

    async def __aenter__(self) -> None:
        if self._sandboxes is not None:
            self._box = LazyBox(self._sandboxes)
            self._using = using(self._box)
            self._using.__enter__()

    async def __aexit__(self, *exc_info: object) -> None:
        box = self._box
        if box is not None:
            self._using.__exit__()
            await box.finish()


@attrs.define(eq=False)
class Sandboxes:
    """An env's sandboxes: the `factory`, the `scope` a box serves (``"rollout"`` or
    ``"group"``), the admission (`SandboxAdmission`, built from `max_sandboxes`), and
    `spec`, the `--sandbox` form the factory came from when it did (what travels to another
    process). See the module."""

    factory: SandboxFactory
    scope: SandboxScope = "rollout"
    admission: SandboxAdmission = attrs.field(
        factory=lambda: SandboxAdmission(_window(default_max_sandboxes(), "max_sandboxes"))
    )
    spec: Any = None
    create_timeout: float = CREATE_TIMEOUT

    @classmethod
    def of(
        cls,
        factory: object,
        *,
        scope: object = "rollout",
        max_sandboxes: object = None,
        spec: Any = None,
    ) -> Sandboxes:
        """The arrangement an env is given (`sandbox=`, `sandbox_scope=`, `max_sandboxes=`:
        an int, ``(min, start, max)`` bounds, a `tt.Window`, or None for the default
        adaptive one). Raises `ConfigError` naming the parameter that is wrong."""
        if not callable(factory):
            raise ConfigTypeError(
                f"{{sandbox}} must be a sandbox factory (tt.sandboxes.local(), "
                f"tt.sandboxes.bwrap(), an async callable returning a tt.Sandbox), got "
                f"{type(factory).__name__}",
                parameter="sandbox",
            )
        limit = default_max_sandboxes() if max_sandboxes is None else max_sandboxes
        window = _window(limit, "max_sandboxes")
        return cls(factory, check_scope(scope), SandboxAdmission(window), spec)

    def report(self, since: float | None = None) -> dict[str, Any]:
        """`summary.json["sandboxes"]`: the backend (its `--sandbox` form when it has one),
        the scope, the admission's figures (`SandboxAdmission.stats`) and its window's
        history (seconds since `since`, size, reason). Boxes made in another process (an
        env server's) are counted there."""
        window = self.admission.window
        return {
            "sandbox": getattr(self.spec, "text", None),
            "scope": self.scope,
            **self.admission.stats(),
            "window_history": window.history_since(since),
        }

    def attempt(self) -> _Scope:
        """The scope of one attempt of a rollout: a box of its own (``"rollout"``), or
        none new when a group's box is current (``"group"``, within `group()`)."""
        if self.scope == "group":
            current = current_or_none()
            if isinstance(current, LazyBox) and current.sandboxes is self:
                return _Scope(None)
        return _Scope(self)

    def group(self) -> _Scope:
        """The scope of a group's rollouts: one box shared (``"group"``), or nothing (each
        attempt makes its own)."""
        return _Scope(self if self.scope == "group" else None)


def _window(limit: object, parameter: str) -> Window:
    checked = check_window_spec(limit, parameter=parameter)
    if isinstance(checked, Window):
        return checked
    if isinstance(checked, AdaptiveBounds):
        return AdaptiveWindow(*checked, cooldown=5.0)
    return Window(checked)
