"""The adaptive window and the controller that moves it.

* `AdaptiveWindow(min, start, max)`: a `Window` that an `AdaptiveController` moves from the
  outcomes you record (success, HTTP 429, 5xx, timeout). A run that must wait out a 429's
  Retry-After lends its place meanwhile (`async with window.rest():`).
* `AdaptiveController`: that controller alone, pure (no clock, no I/O): feed it outcomes with
  the time and the in-flight count, it answers with the new size.
* `Pacer`: calls spaced at the request rate a limit lets through.
* `WindowSpec`: what a window is given as (`N`, `AdaptiveBounds(min, start, max)` or a
  `Window`); `check_window_spec` its one check, `parse_window(text)` its text form (`N` or
  `MIN-START-MAX`), `build_window` the one constructor of a window from it, `window_spec`
  the way back to text.
"""

from __future__ import annotations

import enum
import math
import re
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, NamedTuple

import attrs
import trio

from .exceptions import ConfigError
from .views import View
from .window import Window, check_size

__all__ = [
    "AdaptiveBounds",
    "AdaptiveController",
    "AdaptiveWindow",
    "Change",
    "EngineLoad",
    "Outcome",
    "Pacer",
    "WindowArgumentError",
    "WindowSpec",
    "build_window",
    "check_window_spec",
    "parse_window",
    "window_spec",
]


class Outcome(enum.Enum):
    """What one call told us about the endpoint's capacity."""

    SUCCESS = "success"
    RATE_LIMITED = "rate_limited"  # HTTP 429: too much concurrency (cut)
    REQUEST_RATE = "request_rate"  # HTTP 429 of a request-rate limit: pace the calls, no cut
    SERVER_ERROR = "server_error"  # HTTP 5xx: pause growth, no cut
    TIMEOUT = "timeout"  # the call timed out: pause growth, no cut

    @classmethod
    def from_status(cls, status: int) -> Outcome | None:
        """The outcome of an HTTP status: 2xx/3xx success, 429 rate limited, 408 timeout, 5xx
        server error; None for any other 4xx (the request's fault, not the endpoint's load)."""
        if status == 429:
            return cls.RATE_LIMITED
        if status == 408:
            return cls.TIMEOUT
        if status >= 500:
            return cls.SERVER_ERROR
        if status < 400:
            return cls.SUCCESS
        return None


@attrs.frozen
class Change:
    """A size the controller decided on, and why ("slow start", "grow", "429" for the
    multiplicative cut, "429 cap" for the cap at the calls the endpoint took)."""

    size: int
    reason: str


@attrs.frozen
class EngineLoad:
    """An inference engine's own view of its load, read from its metrics (vLLM's or SGLang's
    `/metrics`, `trio_tasksets._models.engine`): calls running and waiting, the KV cache's
    usage (0 to 1), and the preemptions so far (a counter). None: not reported."""

    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    preemptions: float | None = None
    finished: float | None = None  # requests finished so far (a counter)


@attrs.define
class AdaptiveController:
    """The size of an adaptive window, moved by the outcomes of calls. Pure: no clock, no I/O.

    In the spirit of inspect_ai's adaptive connections:

    * The size grows per *clean round*: a round is `max(size, min_round)` successes; it is
      clean when no 429, 5xx or timeout came in it *and* the calls in flight reached
      `utilization * size` at some point in it (an under-used window proves nothing, so it
      does not grow). Until the first 429 a clean round doubles the size (slow start); after
      it, a clean round adds `max(1, growth * size)`.
    * Every 429 caps the size at `in_flight - 1`, the calls in flight when the endpoint
      refused this one (it took fewer than that), but cuts by no more than the factor in
      one step (`max(in_flight - 1, floor(size * cut))`): reason "429 cap". From a full
      window that is one less per 429, so a window a little over the endpoint's capacity
      comes down to it exactly, one refused call for each place too many. Given the 429's
      `latency`, the calls in flight count those that succeeded while it was under way, up
      to a full window: the endpoint may have refused it before their replies reached the
      caller (on a busy machine the cap otherwise lands below the capacity, by the replies
      in transit).
    * The multiplicative cut, `floor(size * cut)` (reason "429"), comes on the 429 that ends
      slow start (whose last doubling may have overshot by up to half) and after that only
      while 429s persist: when they have kept coming (no gap of `cooldown`
      seconds) for `cooldown` seconds since the first of them, at most once per `cooldown`.
      A growth step that one 429 answers is undone by the cap alone, so probing above the
      capacity costs one refused call per place, not a fifth of the window (with a cut per
      probe, a window probing a capacity of 40 averaged 0.87x of it; with the cap, 1.0x).
    * Growth waits until no 429 has come for `cooldown` seconds (a run waiting out a
      Retry-After still holds its slot unless it rests, `AdaptiveWindow.rest`, so rounds
      may look full while the endpoint is saturated).
    * `Retry-After` is for the caller's retry: it never extends the cooldown (letting it do
      so froze inspect_ai's limit for good, inspect_ai #5137), so cuts go on every
      `cooldown` while 429s do, and growth resumes `cooldown` after the last one.
    * A 5xx or a timeout makes the round unclean (growth pauses); it never cuts.
    * The size never leaves `[min, max]`.

    Against a server that queues instead of answering 429 (a self-hosted engine), the
    *latency signal* (calls' latencies, `latency()` or `record(..., latency=)`; without any,
    or once the endpoint has answered a concurrency 429, whose rules then speak for its
    capacity, none of this applies):

    * Each round's throughput is estimated by Little's law, ``X = mean in flight / mean
      latency`` (latencies average out far better than completion counts). While a round's
      mean latency stays under `probe_above` times the lowest seen, the size grows as it
      would without the latency signal. Past that, a growth step is a probe: the round after it settles (its calls started at the old size), the next
      one measures, and the step is kept only if it paid: ``(X_new / X_old - 1) /
      (size_new / size_old - 1) >= min_gain`` (the throughput rose by at least `min_gain`
      of the proportional rise). Otherwise the size goes back (reason "no gain"); a failed
      doubling ends slow start and probing goes on at once by smaller steps, a failed small
      step makes growth wait `cooldown` seconds before the next probe. After slow start a
      probe adds `max(1, probe * size)` (a step big enough to measure).
    * Queueing at a steady size: two rounds in a row whose mean latency exceeds `queueing`
      times the latency measured when the size was taken cut to `floor(size * cut)` (reason
      "latency"; one such round only pauses growth).

    With the engine's own metrics (`engine()`, e.g. every second), growth also needs the last
    reading to show no waiting calls, KV usage under `kv_grow` and no preemptions too many
    (below), at most one step per reading (each step is seen by the engine before the next),
    and it freezes once the readings are `engine_stale` seconds old; the latency signal's
    probes still apply (an engine whose throughput stops rising long before its batch is
    full, vLLM on a busy CPU, shows nothing waiting); every cut of the engine's makes growth
    wait `cooldown` seconds, as a probe that did not pay does;
    a waiting queue (more than a tenth of the running calls, or one) seen on two readings in
    a row cuts by the calls waiting (reason "engine queue"), new preemptions (more than `preemption_share` of the requests finished since
    the last reading, when the engine counts those; else any) or KV usage at `kv_high` cut
    by a tenth (reasons "preemption", "kv cache"); each cut by at most the factor `cut`.

    429s that do not come from concurrency (`Outcome.REQUEST_RATE`, a request-rate limit
    the server names in its headers) neither cut nor cap: the window's `Pacer` spreads the
    calls instead, and the size does not grow while paced. A 429 without such headers is a
    concurrency 429 unless it comes when the window is already at `min`, with no more than
    `min` calls in flight, and calls have succeeded since the last 429 (at the same
    concurrency the endpoint answers some calls and refuses others): such 429s do not depend
    on the calls in flight, so the size goes back to where it was when those 429s began (reason "429 not
    concurrency"), and for `4 * cooldown` seconds 429s count as `REQUEST_RATE`.
    """

    min: int
    max: int
    size: int
    cut: float = 0.8
    cooldown: float = 15.0
    growth: float = 0.05
    utilization: float = 0.8
    min_round: int = 4
    slow_start: bool = attrs.field(default=True, kw_only=True)
    min_gain: float = attrs.field(default=0.3, kw_only=True)
    probe: float = attrs.field(default=0.25, kw_only=True)
    queueing: float = attrs.field(default=1.5, kw_only=True)
    probe_above: float = attrs.field(default=1.2, kw_only=True)
    kv_grow: float = attrs.field(default=0.95, kw_only=True)
    kv_high: float = attrs.field(default=0.98, kw_only=True)
    preemption_share: float = attrs.field(default=0.01, kw_only=True)
    engine_stale: float = attrs.field(default=5.0, kw_only=True)
    paced: bool = attrs.field(default=False, kw_only=True)  # set by the window's Pacer
    _successes: int = attrs.field(default=0, init=False)
    _peak: int = attrs.field(default=0, init=False)
    _clean: bool = attrs.field(default=True, init=False)
    _last_cut: float = attrs.field(default=-math.inf, init=False)
    _last_429: float = attrs.field(default=-math.inf, init=False)
    _overload_since: float = attrs.field(default=-math.inf, init=False)  # first of a 429 run
    # when the latest successes were recorded (at most `max`: the cap is never above it)
    _succeeded: deque[float] = attrs.field(init=False)
    # the latency signal: this round's samples, the probe under way, the accepted latency
    _lat_sum: float = attrs.field(default=0.0, init=False)
    _lat_n: int = attrs.field(default=0, init=False)
    _load_sum: float = attrs.field(default=0.0, init=False)
    _settle: bool = attrs.field(default=False, init=False)
    _probe_from: tuple[int, float] | None = attrs.field(default=None, init=False)
    _ref_latency: float | None = attrs.field(default=None, init=False)
    _hold_until: float = attrs.field(default=-math.inf, init=False)
    _min_latency: float = attrs.field(default=math.inf, init=False)
    _slow_rounds: int = attrs.field(default=0, init=False)
    # 429s that do not depend on concurrency
    _before_429s: int = attrs.field(default=0, init=False)  # the size when they began
    _ok_since_429: int = attrs.field(default=0, init=False)
    _independent_until: float = attrs.field(default=-math.inf, init=False)
    _answers_429: bool = attrs.field(default=False, init=False)  # a concurrency 429 came
    # the engine's metrics
    _engine_at: float = attrs.field(default=-math.inf, init=False)
    _engine_ok: bool = attrs.field(default=False, init=False)
    _engine_queue: bool = attrs.field(default=False, init=False)
    _preempted: float | None = attrs.field(default=None, init=False)
    _finished: float | None = attrs.field(default=None, init=False)
    _grown_at: float = attrs.field(default=-math.inf, init=False)

    def __attrs_post_init__(self) -> None:
        _check_bounds(self.min, self.size, self.max)
        self._succeeded = deque(maxlen=self.max)
        rules = (
            (0 < self.cut < 1, "cut", "between 0 and 1 (a factor)"),
            (self.cooldown >= 0, "cooldown", ">= 0 seconds"),
            (self.growth > 0, "growth", "> 0 (a fraction of the size)"),
            (0 < self.utilization <= 1, "utilization", "in (0, 1]"),
            (self.min_round >= 1, "min_round", ">= 1"),
            (0 <= self.min_gain <= 1, "min_gain", "in [0, 1]"),
            (self.probe > 0, "probe", "> 0 (a fraction of the size)"),
            (self.probe_above >= 1, "probe_above", ">= 1 (a latency factor)"),
            (self.queueing > 1, "queueing", "> 1 (a latency factor)"),
        )
        for holds, name, rule in rules:
            if not holds:
                raise ConfigError(
                    f"{{{name}}} must be {rule}, got {getattr(self, name)}", parameter=name
                )
        if not 0 < self.kv_grow <= self.kv_high <= 1:
            raise ConfigError(
                f"need 0 < {{kv_grow}} <= {{kv_high}} <= 1, got kv_grow={self.kv_grow}, "
                f"kv_high={self.kv_high}",
                parameter=("kv_grow", "kv_high"),
            )
        if not self.engine_stale > 0:
            raise ConfigError(
                f"{{engine_stale}} must be > 0 seconds, got {self.engine_stale}",
                parameter="engine_stale",
            )

    def classify(self, outcome: Outcome, now: float) -> Outcome:
        """The outcome as the controller counts it: a 429 while 429s were found not to
        depend on concurrency is `REQUEST_RATE`."""
        if outcome is Outcome.RATE_LIMITED and now < self._independent_until:
            return Outcome.REQUEST_RATE
        return outcome

    def latency(self, seconds: float, in_flight: int) -> None:
        """One successful call's latency, with `in_flight` calls in flight as it ended."""
        if seconds >= 0 and math.isfinite(seconds):
            self._lat_sum += seconds
            self._lat_n += 1
            self._load_sum += in_flight

    def record(
        self,
        outcome: Outcome,
        now: float,
        in_flight: int,
        retry_after: float | None = None,
        *,
        latency: float | None = None,
    ) -> Change | None:
        """Take one call's outcome at time `now` (seconds, any monotonic clock), with
        `in_flight` calls in flight as it ended (itself included; for a window whose runs
        rest, the ones not resting). Returns the new size if it changed. `retry_after` is
        accepted and, by design, ignored (see the class). `latency`: the call's seconds (a
        success's feeds the latency signal; a 429's tells when the call started)."""
        del retry_after
        outcome = self.classify(outcome, now)
        self._peak = max(self._peak, in_flight)
        if outcome is Outcome.SUCCESS:
            if latency is not None:
                self.latency(latency, in_flight)
            self._successes += 1
            self._ok_since_429 += 1
            self._succeeded.append(now)
            if self._successes >= max(self.size, self.min_round):
                return self._end_round(now)
            return None
        if outcome is Outcome.REQUEST_RATE:
            return None  # paced (AdaptiveWindow.pacer), never cut
        self._clean = False
        if outcome is not Outcome.RATE_LIMITED:
            return None
        self._answers_429 = True  # its 429s speak for its capacity: no latency signal
        first = self.slow_start
        self.slow_start = False
        if now - self._last_429 >= self.cooldown:
            self._overload_since = now  # the first 429 after a quiet cooldown
            self._before_429s = self.size
        self._last_429 = now
        served, self._ok_since_429 = self._ok_since_429, 0
        if self.size <= self.min and in_flight <= self.min and served:
            # at the least concurrency it may use, the endpoint answers some calls and
            # refuses others: these 429s do not depend on the calls in flight
            self._independent_until = now + 4 * self.cooldown
            self._new_round()
            size = min(self.max, max(self.size, self._before_429s))
            return self._set(size, "429 not concurrency")
        if latency is not None and in_flight < self.size:
            # calls the endpoint may still have held as it refused this one (up to a full
            # window: a 429 that waited on a busy caller saw many succeed after it)
            in_flight += min(self.size - in_flight, self._succeeded_since(now - latency))
        cut = math.floor(self.size * self.cut)
        size, reason = min(self.size, max(in_flight - 1, cut)), "429 cap"
        persists = now - self._overload_since >= self.cooldown
        if (first or persists) and now - self._last_cut >= self.cooldown:
            self._last_cut = now
            size, reason = cut, "429"
        size = max(self.min, size)
        if size < self.size:
            self._new_round()
        return self._set(size, reason)

    def _succeeded_since(self, start: float) -> int:
        count = 0
        for at in reversed(self._succeeded):
            if at <= start:  # (the same instant as the call's start: done before it)
                break
            count += 1
        return count

    def engine(self, load: EngineLoad, now: float) -> Change | None:
        """One reading of the engine's metrics, at `now` (see the class)."""
        self._engine_at = now
        preempted = (
            load.preemptions is not None
            and self._preempted is not None
            and load.preemptions > self._preempted
        )
        if preempted and load.finished is not None and self._finished is not None:
            # a preemption now and then is the engine using its cache; more than
            # `preemption_share` of the requests finished since the last reading is not
            assert load.preemptions is not None
            assert self._preempted is not None
            done = max(1.0, load.finished - self._finished)
            preempted = (load.preemptions - self._preempted) / done > self.preemption_share
        if load.preemptions is not None:
            self._preempted = load.preemptions
        if load.finished is not None:
            self._finished = load.finished
        waiting = load.waiting or 0.0
        # calls that arrived since the engine's last step wait for the next: a queue is more
        # than a tenth of the running ones (or one), on two readings in a row
        queued = waiting > max(1.0, 0.1 * (load.running or 0.0))
        queue = queued and self._engine_queue
        self._engine_queue = queued
        kv = load.kv_usage
        high = kv is not None and kv >= self.kv_high
        self._engine_ok = not queued and not preempted and (kv is None or kv < self.kv_grow)
        if queue:
            excess, reason = math.ceil(waiting), "engine queue"
        elif preempted or high:
            excess, reason = (
                max(1, math.ceil(self.size / 10)),
                "preemption" if preempted else "kv cache",
            )
        else:
            return None
        self.slow_start = False
        size = max(self.min, self.size - excess, math.floor(self.size * self.cut))
        if size < self.size:
            self._new_round()
            self._hold_until = now + self.cooldown  # as after a probe that did not pay
        return self._set(size, reason)

    def _measure(self) -> tuple[float, float] | None:
        """This round's (throughput by Little's law, mean latency), if it has latencies."""
        if self._lat_n == 0:
            return None
        latency = self._lat_sum / self._lat_n
        if latency <= 0:
            return None
        return (self._load_sum / self._lat_n) / latency, latency

    def _end_round(self, now: float) -> Change | None:
        grow = (
            self._clean
            and self._peak >= self.utilization * self.size
            and now - self._last_429 >= self.cooldown
            and not self.paced
        )
        measured = self._measure()
        settle, self._settle = self._settle, False
        probe_from = self._probe_from
        self._new_round()
        if self._engine_at > -math.inf:  # the engine's metrics gate growth too
            grow = (
                grow
                and self._engine_ok
                and now - self._engine_at <= self.engine_stale
                and self._engine_at > self._grown_at  # one step per reading, seen after it
            )
        if measured is not None and not self._answers_429:
            throughput, latency = measured
            self._min_latency = min(self._min_latency, latency)
            if settle:  # its calls started at the old size: measure the next round
                self._probe_from = probe_from
                grow = False
            elif probe_from is not None:
                old, old_throughput = probe_from
                gain = (throughput / old_throughput - 1) / (self.size / old - 1)
                if gain < self.min_gain:
                    # a failed doubling goes on probing by smaller steps at once; a failed
                    # small step waits a cooldown
                    if not self.slow_start:
                        self._hold_until = now + self.cooldown
                    self.slow_start = False
                    self._settle = True
                    self._ref_latency = None
                    return self._set(max(self.min, old), "no gain")
                self._ref_latency = latency
            elif self._ref_latency is None:
                self._ref_latency = latency
            elif latency > self.queueing * self._ref_latency:
                self._slow_rounds += 1
                if self._slow_rounds >= 2:  # two rounds in a row: not one noisy round
                    self._slow_rounds = 0
                    self._ref_latency = None
                    self._settle = True
                    return self._set(max(self.min, math.floor(self.size * self.cut)), "latency")
                grow = False
            else:
                self._slow_rounds = 0
            grow = grow and now >= self._hold_until
        if not grow:
            return None
        self._grown_at = now
        if self._answers_429 or (
            measured is not None
            and probe_from is None
            and measured[1] < self.probe_above * self._min_latency
        ):
            measured = None  # latency as low as ever: grow as without the latency signal
        if self.slow_start:
            change = self._set(min(self.max, 2 * self.size), "slow start", measured)
        else:
            fraction = self.growth if measured is None else self.probe
            step = max(1, math.floor(fraction * self.size))
            change = self._set(min(self.max, self.size + step), "grow", measured)
        return change

    def _new_round(self) -> None:
        self._successes = 0
        self._peak = 0
        self._clean = True
        self._lat_sum = self._load_sum = 0.0
        self._lat_n = 0
        self._probe_from = None

    def _set(
        self, size: int, reason: str, measured: tuple[float, float] | None = None
    ) -> Change | None:
        if size == self.size:
            return None
        if measured is not None and size > self.size:  # a probe: settle, then measure
            self._probe_from = (self.size, measured[0])
            self._settle = True
        elif size < self.size:  # measure the new size afresh, once its calls have turned over
            self._settle = True
            self._ref_latency = None
        self.size = size
        return Change(size, reason)


class Pacer:
    """Call starts spread at `rate` a second, once a request-rate limit answered 429.

    Unpaced (`rate` None) until `limited()` hears such a 429; then `rate` is `margin` times
    the calls of the last `span` seconds (or since the first call, if sooner), and `wait()` spaces call starts `1 / rate` apart,
    in arrival order. Each further 429, at most once per `span`, lowers it to `margin` times
    the successes of the last `span` (what the limit evidently lets through); with no 429
    the rate grows by `growth` a second (10x that after the first 429, a rough guess, until
    the second), a limit may have risen, and pacing ends once the rate is 4x what
    succeeds. If pacing did
    not lower the 429s' share of calls (still at least half of it, and at least 10 %), the
    429s do not depend on the rate either: pacing ends and 429s are ignored here for
    `forget` seconds (they are only retried). Reads `trio.current_time()`, so it is exact on
    a MockClock.
    """

    def __init__(
        self,
        *,
        span: float = 1.0,
        margin: float = 0.95,
        growth: float = 0.05,
        min_rate: float = 1.0,
        forget: float = 60.0,
    ) -> None:
        if not span > 0 or not 0 < margin <= 1 or not growth >= 0 or not min_rate > 0:
            raise ConfigError(
                "need {span} > 0, 0 < {margin} <= 1, {growth} >= 0 and {min_rate} > 0",
                parameter=("span", "margin", "growth", "min_rate"),
            )
        self.span = span
        self.margin = margin
        self.growth = growth
        self.min_rate = min_rate
        self.forget = forget
        self.rate: float | None = None
        self.waited = 0.0  # seconds call starts waited, in total
        self._next = -math.inf
        self._grown_at = 0.0
        self._ok: deque[float] = deque()
        self._limited: deque[float] = deque()
        self._cut_at = -math.inf
        self._cut_share = 0.0
        self._ignore_until = -math.inf
        self._cuts = 0

    def _trim(self, now: float) -> None:
        for times in (self._ok, self._limited):
            while times and times[0] < now - self.span:
                times.popleft()

    def success(self, now: float) -> None:
        self._ok.append(now)
        self._trim(now)
        if self.rate is None:
            return
        growth = self.growth if self._cuts > 1 else 10 * self.growth  # first: a rough guess
        self.rate *= 1 + growth * max(0.0, now - self._grown_at)
        self._grown_at = now
        if self.rate > 4 * len(self._ok) / self.span and now - self._cut_at > 4 * self.span:
            self.rate = None  # far above what succeeds: the limit no longer binds
            self._cuts = 0

    def limited(self, now: float) -> None:
        """A 429 of a request-rate limit came at `now`."""
        if now < self._ignore_until:
            return
        self._limited.append(now)
        self._trim(now)
        if now - self._cut_at < self.span:
            return
        share = len(self._limited) / (len(self._limited) + len(self._ok))
        if self.rate is not None and share >= max(0.1, 0.5 * self._cut_share):
            self.rate = None  # pacing did not help: these 429s do not depend on the rate
            self._ignore_until = now + self.forget
            self._cuts = 0
            return
        # over the last span, or since the oldest call heard of if that is shorter
        oldest = min(times[0] for times in (self._ok, self._limited) if times)
        seconds = max(now - oldest, self.span / 10)
        if self.rate is None:  # start at the calls' rate; the next span measures the limit
            calls = len(self._ok) + len(self._limited)
            self.rate = max(self.min_rate, self.margin * calls / seconds)
        elif self._ok:
            measured = self.margin * len(self._ok) / seconds
            self.rate = max(self.min_rate, min(self.rate, measured))
        self._grown_at = now
        self._cut_at = now
        self._cut_share = share
        self._cuts += 1

    async def wait(self) -> float:
        """Wait for this call's turn (at once when unpaced); return the seconds waited."""
        if self.rate is None:
            return 0.0
        now = trio.current_time()
        start = max(now, self._next)
        self._next = start + 1.0 / self.rate
        if start > now:
            await trio.sleep_until(start)
        waited = trio.current_time() - now
        self.waited += waited
        return waited

    def __repr__(self) -> str:
        rate = "unpaced" if self.rate is None else f"{self.rate:.1f}/s"
        return f"Pacer({rate})"


def _check_bounds(low: int, start: int, high: int) -> None:
    for name, value in (("min", low), ("start", start), ("max", high)):
        check_size(value, name)
    if not low <= start <= high:
        raise ConfigError(
            f"an adaptive window needs {{min}} <= {{start}} <= {{max}}, got {low}-{start}-{high}",
            parameter=("min", "start", "max"),
        )


class AdaptiveWindow(Window):
    """A Window moved by an `AdaptiveController` between `min` and `max`, from `start`.

    Record each call's outcome where the call ends (`success()`, `rate_limited(retry_after)`,
    `server_error()`, `timeout()`, or `record(outcome_or_http_status)`), while its slot is
    still held, so that `in_flight` counts it; pass its `latency=` (seconds) for the latency
    signal, or feed an engine's metrics to `engine_load()`. A 429 of a request-rate limit
    (`Outcome.REQUEST_RATE`) goes to the window's `pacer`: call `await window.pace()` before
    each call. The controller's options (`cut`, `cooldown`, `growth`, `utilization`,
    `min_round`, and the keyword-only ones of `AdaptiveController`) are keyword arguments.
    Each change is in `history` with its reason. Bounds that are not ints with
    ``1 <= min <= start <= max``, or a bad option, raise a `ConfigError` naming them.
    """

    # duplicates: keyword options with defaults, as the Pacer's: each class's own settings
    def __init__(
        self,
        min: int,  # public names: AdaptiveWindow(min, start, max)
        start: int,
        max: int,
        *,
        cut: float = 0.8,
        cooldown: float = 15.0,
        growth: float = 0.05,
        utilization: float = 0.8,
        min_round: int = 4,
        **options: Any,
    ) -> None:
        self.controller = AdaptiveController(
            min, max, start, cut, cooldown, growth, utilization, min_round, **options
        )
        self.start = start  # the size it started at (its CLI form is min-start-max)
        self.pacer = Pacer()
        super().__init__(start)

    min = View[int]("controller", "The smallest size the controller sets.")
    max = View[int]("controller", "The largest size the controller sets.")

    def resize(self, size: int, reason: str = "set") -> None:
        """Set the size by hand (within `[min, max]`); the controller goes on from there.
        Raises a `ConfigError` naming `size` outside `[min, max]` or not an int."""
        check_size(size, "size")
        if not self.min <= size <= self.max:
            raise ConfigError(
                f"{{size}} must be within [{self.min}, {self.max}], got {size}", parameter="size"
            )
        self.controller.size = size
        self._apply(size, reason)

    def record(
        self,
        outcome: Outcome | int,
        *,
        retry_after: float | None = None,
        latency: float | None = None,
    ) -> None:
        """Feed one call's outcome (an `Outcome`, or an HTTP status: see
        `Outcome.from_status`; a status that says nothing about capacity is ignored), and
        its `latency` in seconds if known. The controller is told the runs in flight that are
        not resting."""
        if isinstance(outcome, int):
            status = outcome
            found = Outcome.from_status(status)
            if found is None:
                return
            outcome = found
        now = trio.current_time()
        outcome = self.controller.classify(outcome, now)
        if outcome is Outcome.REQUEST_RATE:
            self.pacer.limited(now)
        elif outcome is Outcome.SUCCESS:
            self.pacer.success(now)
        self.controller.paced = self.pacer.rate is not None
        active = self.in_flight - self._lent
        change = self.controller.record(outcome, now, active, retry_after, latency=latency)
        if change is not None:
            self._apply(change.size, change.reason)

    def observe_latency(self, seconds: float) -> None:
        """One call's latency, apart from the success it may count for (a rollout window hears
        each model call's latency, and one success per episode)."""
        self.controller.latency(seconds, self.in_flight - self._lent)

    def engine_load(self, load: EngineLoad) -> None:
        """One reading of the engine's metrics (see `AdaptiveController.engine`)."""
        change = self.controller.engine(load, trio.current_time())
        if change is not None:
            self._apply(change.size, change.reason)

    async def pace(self) -> float:
        """Wait for this call's turn under the window's `Pacer` (at once when unpaced)."""
        return await self.pacer.wait()

    @asynccontextmanager
    async def rest(self) -> AsyncIterator[None]:
        """For a run that holds a place and must wait (out a 429's Retry-After) before it
        calls again: ``async with window.rest(): await trio.sleep(retry_after)``.

        Its place is lent meanwhile: one more run may start (the window holds `size` runs
        that are not resting, plus the resting ones). On leaving, the run waits for a place
        to free up, in turn with the runners' pulls, and takes it back: a resting run is
        never starved by fresh ones. Lending cannot pile runs up: the 429 that sent the run
        to rest also capped the size at the calls then in flight, less one (see
        `AdaptiveController`). Leaving by an exception gives the place back at once.
        """
        async with self.lend():
            yield

    def success(self) -> None:
        self.record(Outcome.SUCCESS)

    def rate_limited(self, retry_after: float | None = None) -> None:
        """An HTTP 429. `retry_after` (seconds) delays the caller's retry, never the cooldown."""
        self.record(Outcome.RATE_LIMITED, retry_after=retry_after)

    def server_error(self) -> None:
        self.record(Outcome.SERVER_ERROR)

    def timeout(self) -> None:
        self.record(Outcome.TIMEOUT)

    def __repr__(self) -> str:
        return (
            f"AdaptiveWindow(min={self.min}, size={self.size}, max={self.max}, "
            f"in_flight={self.in_flight})"
        )


# --- the spec of a window, and its text form ------------------------------------------------


class AdaptiveBounds(NamedTuple):
    """`MIN-START-MAX` of an adaptive window: `AdaptiveWindow(*bounds)`."""

    min: int
    start: int
    max: int


class WindowArgumentError(ConfigError):
    """A bad window spec: text that is neither `N` nor `MIN-START-MAX`, or a size or bounds
    out of range (a `ConfigError`, so a ValueError, naming the setting the spec came from)."""


WindowSpec = int | AdaptiveBounds | Window
"""What a window is given as: a size `N`, `AdaptiveBounds(min, start, max)` (the text form
``MIN-START-MAX``) for an `AdaptiveWindow`, or a `Window` of one's own."""

_FORM = re.compile(r"\s*(\d+)\s*(?:-\s*(\d+)\s*-\s*(\d+)\s*)?")


def check_window_spec(spec: object, *, parameter: str = "window") -> WindowSpec:
    """`spec` as a `WindowSpec` (a `(min, start, max)` tuple as `AdaptiveBounds`), checked:
    the one check of a window spec, which `parse_window`, `build_window` and the settings
    that hold a spec (`EvalConfig.max_concurrent`) all make.

    Raises:
        WindowArgumentError: naming `parameter`, for a size below 1, bounds that are not
            ``1 <= min <= start <= max``, or anything else.
    """
    return _checked(spec, parameter, text=None)


def _checked(spec: object, parameter: str, *, text: str | None) -> WindowSpec:
    """`check_window_spec`; a spec read from `text` is said as its text form is written."""
    if isinstance(spec, Window):
        return spec
    if isinstance(spec, int) and not isinstance(spec, bool):
        if spec < 1:
            said = (
                f"{{{parameter}}} must be an integer >= 1, got {spec!r}"
                if text is None
                else f"{{{parameter}}}: N must be >= 1, got {text!r}"
            )
            raise WindowArgumentError(said, parameter=parameter)
        return spec
    if (
        isinstance(spec, tuple)
        and len(spec) == 3
        and all(isinstance(n, int) and not isinstance(n, bool) for n in spec)
    ):
        bounds = AdaptiveBounds(*spec)
        if not 1 <= bounds.min <= bounds.start <= bounds.max:
            said = (
                f"{{{parameter}}}: adaptive bounds (min, start, max) need 1 <= min <= start "
                f"<= max, got {spec!r}"
                if text is None
                else f"{{{parameter}}}: MIN-START-MAX needs 1 <= MIN <= START <= MAX, got {text!r}"
            )
            raise WindowArgumentError(said, parameter=parameter)
        return bounds
    raise WindowArgumentError(
        f"{{{parameter}}} must be an integer >= 1, (min, start, max) bounds or a tt.Window, "
        f"got {spec!r}",
        parameter=parameter,
    )


def parse_window(text: str, *, parameter: str = "window") -> int | AdaptiveBounds:
    """Read the text form of a window: `N` (a fixed window) or `MIN-START-MAX` (adaptive).

    Raises:
        WindowArgumentError: naming `parameter`, for text of neither form, or numbers that
            `check_window_spec` refuses.
    """
    match = _FORM.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise WindowArgumentError(
            f"{{{parameter}}}: expected N or MIN-START-MAX (e.g. 64, or 1-8-512 to adapt), "
            f"got {text!r}",
            parameter=parameter,
        )
    low, start, high = match.groups()
    spec = int(low) if start is None else AdaptiveBounds(int(low), int(start), int(high))
    checked = _checked(spec, parameter, text=text)
    assert not isinstance(checked, Window)
    return checked


def build_window(spec: WindowSpec | tuple[int, int, int], *, parameter: str = "window") -> Window:
    """The one constructor of a window from its spec: a `Window` given is used as is; `N`
    makes `Window(N)`; `(min, start, max)` (an `AdaptiveBounds`, as `parse_window` reads
    ``MIN-START-MAX``) makes `AdaptiveWindow(min, start, max)`.

    Raises:
        WindowArgumentError: naming `parameter` (the setting the spec came from, e.g.
            ``max_concurrent``) for a spec that `check_window_spec` refuses.
    """
    checked = check_window_spec(spec, parameter=parameter)
    if isinstance(checked, Window):
        return checked
    if isinstance(checked, AdaptiveBounds):
        return AdaptiveWindow(*checked)
    return Window(checked)


def window_spec(window: WindowSpec | tuple[int, int, int]) -> str:
    """The text form of a window spec (`parse_window`'s way back): `N`, or `MIN-START-MAX`
    (an `AdaptiveWindow`: its bounds and the size it started at; a `Window`: its size now)."""
    if isinstance(window, AdaptiveWindow):
        return f"{window.min}-{window.start}-{window.max}"
    if isinstance(window, Window):
        return str(window.size)
    if isinstance(window, tuple):
        return "-".join(str(part) for part in window)
    return str(window)
