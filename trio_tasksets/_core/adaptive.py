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
import itertools
import math
import re
import statistics
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, NamedTuple

import attrs
import trio

from .exceptions import ConfigError
from .pacing import Pacer
from .views import View
from .window import Window, check_size

__all__ = [
    "OBJECTIVES",
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
    "check_objective",
    "check_window_spec",
    "parse_window",
    "window_spec",
]


MIN_GAIN = {"knee": 0.08, "throughput": 0.03, "p99": 0.03}
"""Per objective: the least elasticity of throughput (d log X / d log size) a step up must
show to be kept. A knee is where more window adds less than `knee`'s share of itself."""


KNEE_DOWN = 1.5
"""`knee`: a step down goes back only if it cost more than this times the elasticity a step
up must show (`MIN_GAIN`): a band where neither step moves the window, so that noise at the
knee's edge does not push it up. On the zoo's plateau 1 (soft capacity 6, flat past it),
the step from 8 to 7 cost an elasticity of 0.063 and the step from 7 to 6 0.10, both near
0.08: a noisy round took the window back to 8 in one `--quick` run of three (p99 1.47x the
smallest fixed window within 5 % of the best rate)."""


DOUBLING_GAIN = 0.15
"""The least elasticity a doubling (slow start) must show to be kept, whatever the
objective (past it, the objective's quarter steps go on)."""


PROBE_ROUND = 24
"""The fewest successes in the round that judges a probe (a small window's rounds are
otherwise a few calls, and one stalled call decides it)."""


NOISE_Z = 2.0
"""How many standard deviations of the rounds' own noise a probe's change in throughput
must exceed to count as a change at all (see `AdaptiveController`, "noise")."""


PROBE_ROUNDS = 4
"""An inconclusive probe measures again, up to this many rounds, or for longer while it has
lasted less than `PROBE_TIME` of a `cooldown` (a fast server's rounds are cheap, and more
of them tell a smaller change), up to `PROBE_ROUNDS_MAX`."""

PROBE_TIME = 0.25
"""See `PROBE_ROUNDS`."""

PROBE_ROUNDS_MAX = 64
"""See `PROBE_ROUNDS`."""


QUEUE_TAIL = 1.25
"""`knee`: a size whose p99 latency exceeds a smaller one's by more than this times the
ratio of their sizes is past the knee, whatever its throughput: its calls queue (on an
engine of C slots, a window of C + 1 gains a percent of throughput, by the client's gaps
between calls, and makes one call in C + 1 wait a whole batch: the p99 doubles). A size
with no queue has latencies that grow no faster than the size (Little's law, throughput not
falling)."""


KNEE_SHARE = 0.05
"""`knee` with the engine's metrics: how much less than the best throughput there is a knee
may deliver. Slow start's first doubling that does not pay, where the engine shows no call
waiting, is followed by one doubling more (reason "explore"), kept when it delivers more
than the doubling that did not pay by more than this share of it: a real vLLM's throughput
was flat from 64 to 128 calls in flight (nothing waiting: its batch holds 256) and 7 %
higher at 256, and the knee, found by the step that did not pay, stopped at 64 with 0.89x
of `-c 256`'s rate. Without the engine's metrics nothing tells a flat stretch from an
engine's capacity, past which the probe queues its calls: on a model of the zoo's engine 1
(C 13, calls of 0.8 s) it delayed the knee by 20 rounds or more."""

TAIL_CAP = 4.0
"""A call's latency counts in a round's throughput (Little's law) at most this times the last
round's typical call (a flaky server's slow calls made every round's rate a draw of how many
of them it held)."""

SCALES = 0.8
"""See `TAIL_CHANCE` (an engine's latency grows with its batch: below its capacity, the
elasticity of its throughput is 0.5-0.9 already, and past it far less)."""

TAIL_CHANCE = 0.05
"""`knee`'s queue test against smaller sizes (`_queues_below`): the tail of the larger size's
calls is a queue's only if the smaller one's calls had less than this chance of missing it
(sizes far apart: a flaky server's slow calls, 2-5 % of every size's, under 128's line
against 16's two dozen calls, which had none of them, read as 128 queueing against 16)."""

QUEUE_FAR = 2.0
"""`knee`'s queue test (`QUEUE_TAIL`) counts a larger size's calls up to this times the ratio
of the sizes over the smaller one's p99: a queue delays a call by the calls ahead of it, at
most that ratio in batches; one slower than twice that is the server's own slowness. A
server whose slow calls are a share of every size's (the zoo's flaky draws: 2-5 % of calls
0.5-10 s long, where the rest take 10-200 ms) shows them in one sample of a few dozen calls
and not in the next: read as the larger size's queue, slow start's doubling went back for
"no gain" at an elasticity of 0.8."""


P99_AIM = 0.97
"""`p99=SECONDS`: a call counts as over the bound past this share of it. A size whose p99
sits at the bound straddles it, and the window settles at the largest size its tally lets
through: the zoo's plateau 2 (a CPU-bound server whose calls all slow down together) held
`p99=1.1` at 1.102 s."""


HIDDEN = 1.5
"""`knee`: the window's places held over a round (the time-weighted calls in flight), over the
time its calls' latencies account for, above which the rounds do not show what holds the
places (retries' backoffs, calls far slower than the round: a flaky server's) and `knee`'s
first search, run in the run's first seconds while those fill the places, is checked again
soon (`SEARCH_AGAIN`). Smoothed over rounds; an engine's or a plateau's read 0.95-1.05
(1.5 in one second of slow start), the zoo's flaky draws 1.8-80."""

SEARCH_AGAIN = 0.25
"""The share of `cooldown` that growth waits after `knee`'s first search when the places
were held by more than its rounds showed (`HIDDEN`): on the zoo's flaky draws the search
ended within 2 s, at 58-195 where 256 makes 1.3-30 times as much, before any 3.5 s call had
ended, and growth waited the whole `cooldown` (probed again at 17 s, the steps up paid at
once: 58 to 140 in 0.5 s)."""


MEMORY = 400
"""The most calls that a size's pooled rounds count (its throughput, and with `p99=` its
calls over the bound): past it, every sum is halved, so older rounds weigh less. A size's
rounds are forgotten `4 * cooldown` seconds after it was last measured."""


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
    * A 5xx or a timeout makes the round unclean (growth pauses); it never cuts. With the
      latency signal (below) it pauses nothing: the round's throughput counts only the
      share of its calls that succeeded, and the steps are judged on that (a flaky
      server fails a share of calls whatever the window; one that fails under load
      shows it as a step that does not pay).
    * The size never leaves `[min, max]`.

    Against a server that queues instead of answering 429 (a self-hosted engine), the
    *latency signal* (calls' latencies, `latency()` or `record(..., latency=)`; without any,
    once the endpoint has answered a concurrency 429, whose rules then speak for its
    capacity, or while a request-rate limit's pacing binds, none of this applies) serves
    the `objective`:

    * Each round's throughput is estimated by Little's law, ``X = mean in flight / mean
      latency`` (latencies average out far better than completion counts, which come in
      waves from an engine's batches), the calls in flight weighted by time (`_load`:
      counted as each call ended, a batch's calls ending together read as half the
      window). Sizes are kept or given up for that throughput
      alone: a busy client (its own CPU, other processes beside it) makes every call
      slower, but a smaller size then delivers less too, so the client's lag is never read
      as the engine's queue.
    * Every step is a probe: the round after it settles (its calls started at the old size;
      `max(size, min_round)` successes, and after a step down until every call the larger
      size started is done, as they queued ahead), the next one (of at least `PROBE_ROUND`
      successes) measures,
      and the step is judged by the *elasticity* of throughput,
      ``e = log(X_new / X_old) / log(size_new / size_old)``, where X_old is the old size's
      throughput over its recent rounds pooled (its in-flight and latency sums over the
      rounds measured at it in the last `4 * cooldown` seconds, at most `MEMORY` calls:
      one round of an engine's batches, or of a busy machine, is noisy) and X_new the new
      size's rounds since the step (a noisy round of an earlier probe to it must not decide
      this one). A change of throughput within `NOISE_Z` times the rounds' own noise (the
      median difference of successive rounds at one size, at the probe's two sizes or
      else every size measured in the last `4 * cooldown` seconds: robust to a change of
      conditions; before three differences, the probe's calls' coefficient of variation
      over the root of their number), scaled to the rounds on each side, says nothing
      yet: the probe measures
      another round, up to `PROBE_ROUNDS` (more while it has lasted less than `PROBE_TIME`
      of a cooldown), and if it stays within the noise, `knee` takes
      the smaller size (judged on one round, a lucky one kept a step up now and then and
      refused a step back down, and the window ratcheted up to several times an engine's
      capacity), `throughput` the larger (a flat stretch, vLLM's on a busy CPU, held it
      below the rise), unless a smaller size measured in the last `4 * cooldown` seconds
      delivered clearly more (by `NOISE_Z` times the noise): back to that one (ties taken
      a step at a time would walk down a plateau whose throughput falls past its peak).
      With `knee`, the larger of the two sizes is past the knee, whatever it delivers,
      when its p99 latency exceeds the smaller one's by more than `QUEUE_TAIL` times the
      sizes' ratio: its calls queue (an engine's C + 1 gains a percent and doubles the
      p99); a step up whose settling round shows it already goes back at once. Only calls
      a queue can explain count (`QUEUE_FAR`), and against a smaller size measured lately,
      a tail its calls may have missed by chance (`TAIL_CHANCE`) queues only if the
      throughput did not grow nearly as fast as the size (`SCALES`): a flaky server's slow
      calls are not a queue. A call's latency counts in a round's throughput at most
      `TAIL_CAP` times the round before's typical call. A step up
      is kept if ``e >= min_gain`` (a doubling, but with `throughput`, needs
      `DOUBLING_GAIN` at least; by default per
      objective, `MIN_GAIN`: `knee` 0.08, `throughput` and `p99` 0.03), else it goes back
      (reason "no gain"; with `knee`, a slow-start doubling short of its bar by less than
      the spread of the noise is first measured again, up to `PROBE_ROUNDS`). Slow start
      doubles. With `knee`, a doubling that does not pay
      (or one that paid reached `max`) starts a *search*: the knee lies above the size
      the last step that paid came from and below the first size whose step did not pay;
      the window probes their geometric middle (from the middle itself, halfway to the side
      not tried), down (reason "probe down") or up ("grow"). A step up that pays, or a
      step down that costs more than `min_gain` of its share (reason "lost throughput":
      back), raises the lower end; a step up that does not pay, or a step down that costs
      less, lowers the upper end. No cooldown between these probes; the search ends when
      the ends are within a sixteenth (or one) of each other, and growth then waits
      `cooldown` seconds (the other objectives go on up by `probe` steps); after the first
      search, `SEARCH_AGAIN` of it when the places were held for longer than the rounds'
      latencies account for (`HIDDEN`: a flaky server's backoffs and slow calls fill the
      places over the first seconds, and the search ran before they had). A failed
      small step up waits half a `cooldown` (a wrong "no gain", a noisy round's, is
      probed again soon), and a whole one when the step before failed too; after that
      second one, `knee`'s and `throughput`'s next probe goes down by `probe` (with
      `knee`, one that loses throughput searches again, between it and the last size a step
      up to which did not pay; with `throughput`, one that gains is kept: past a falling
      plateau's peak, steps up fail and nothing else brings the window back), then up
      again: probes only up would let noise ratchet the size. After slow
      start a step adds `max(1, probe * size)`.
    * `p99=SECONDS`: each size keeps a tally of its calls and of those slower than SECONDS
      (than `P99_AIM` of it: a p99 at the bound straddles it) over its measured rounds
      (the same memory); its p99 is over the bound when more than 1 % of its calls, and
      more than one call, were (one slow call alone, a busy machine's, never decides). A
      step up to such a size goes back (and is not probed again while its tally stands),
      as soon as its own calls say so (reason "p99": calls queued past the bound go on
      costing the p99 until they are done); at a steady size, a cut to
      `floor(size * cut)` (reason "p99").
    * Slower at a steady size (two rounds in a row whose typical latency, the mean without
      the slowest tenth of the round's calls, exceeds `queueing` times the one measured
      when the size was taken): a probe down by `cut` (reason "latency"), given up if it
      lost throughput against the rate measured when the size was taken, not pooled (a
      client's own stall slows every size alike: never a queue).

    With the engine's own metrics (`engine()`, e.g. every second), growth also needs the last
    reading to show no waiting calls, KV usage under `kv_grow` and no preemptions too many
    (below), at most one step per reading (each step is seen by the engine before the next),
    and it freezes once the readings are `engine_stale` seconds old; the latency signal's
    probes still apply (an engine whose throughput stops rising long before its batch is
    full, vLLM on a busy CPU, shows nothing waiting; with `knee`, slow start's first doubling
    that does not pay, with nothing waiting at its size (a reading taken there, waited for),
    is followed by one more, `_explore`, kept if it delivers `KNEE_SHARE` more: a flat
    doubling with the batch not full, a real vLLM's, may rise again past it); every cut of
    the engine's makes growth wait `cooldown` seconds, and cuts in a row that each undid a
    step up (growth came between them, and no step up paid) 2 and then 4 times that, as
    probes that did not pay do (while `knee` searches, a cut marks the size it cut from as
    past the knee instead);
    a waiting queue (more than a tenth of the running calls, or one) seen on two readings in
    a row cuts by the calls waiting (reason "engine queue"), new preemptions (more than
    `preemption_share` of the requests finished since the last reading, when the engine
    counts those; else any) cut by a tenth (reason "preemption"), KV usage at `kv_high`
    with calls waiting by a tenth or the calls waiting if fewer (reason "kv cache": a full
    cache with nothing waiting is a full batch, and the batch is where the window
    belongs); each cut by at most the factor `cut`.

    429s that do not come from concurrency (`Outcome.REQUEST_RATE`: a request-rate limit
    the server names in its headers, or found by behaviour) neither cut nor cap: the
    window's `Pacer` holds and spreads the calls at the rate the limit lets through, and
    the size does not grow while the pacing binds. A 429 without such headers is taken for
    a concurrency 429 (capped as above) until its behaviour says otherwise: 429s that keep
    coming, with calls succeeding since they began, once the size is down to half of what
    it was then, times `utilization` (a concurrency limit's stop there: a slow start
    doubles once that share of the size is in flight, so it overshoots a limit by at most
    2 / `utilization`) or to `min` with no more than `min` calls in flight; or three in a
    row with at most half the calls in flight that the endpoint once took all at once (the
    peak in flight of a round with no 429 so far, unpaced: a concurrency limit refuses only
    above what it takes), do not depend on the calls in flight; nor do 429s that no success broke
    for over 4 times the calls' latency (the slowest of the round), found at the first
    success after them (a concurrency limit's calls end within their latency, and then it
    takes more; a rate limit spent when the run began refuses until it reopens, and the
    caps meanwhile take the size to `min`). The size then goes back to where it was when
    those 429s began (reason "429 not concurrency"), and for `max(4 * cooldown, 120)`
    seconds, renewed by each, 429s count as `REQUEST_RATE`.
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
    min_gain: float | None = attrs.field(default=None, kw_only=True)  # None: the objective's
    probe: float = attrs.field(default=0.25, kw_only=True)
    queueing: float = attrs.field(default=1.5, kw_only=True)
    probe_above: float = attrs.field(default=1.2, kw_only=True)
    kv_grow: float = attrs.field(default=0.95, kw_only=True)
    kv_high: float = attrs.field(default=0.98, kw_only=True)
    preemption_share: float = attrs.field(default=0.01, kw_only=True)
    engine_stale: float = attrs.field(default=5.0, kw_only=True)
    paced: bool = attrs.field(default=False, kw_only=True)  # set by the window's Pacer
    pace_binds: bool = attrs.field(default=False, kw_only=True)  # calls wait for their turn
    objective: str = attrs.field(default="knee", kw_only=True)
    _successes: int = attrs.field(default=0, init=False)
    _peak: int = attrs.field(default=0, init=False)
    _clean: bool = attrs.field(default=True, init=False)  # no 429 in the round
    _errors: int = attrs.field(default=0, init=False)  # the round's 5xx and timeouts
    _last_cut: float = attrs.field(default=-math.inf, init=False)
    _last_429: float = attrs.field(default=-math.inf, init=False)
    _overload_since: float = attrs.field(default=-math.inf, init=False)  # first of a 429 run
    # when the latest successes were recorded (at most `max`: the cap is never above it)
    _succeeded: deque[float] = attrs.field(init=False)
    # the latency signal: this round's samples, the probe under way, the accepted latency
    _lat_sum: float = attrs.field(default=0.0, init=False)
    # a call's latency counted in the throughput at most (`TAIL_CAP` times the last round's
    # typical call)
    _lat_cap: float = attrs.field(default=math.inf, init=False)
    _lat_n: int = attrs.field(default=0, init=False)
    _lat_max: float = attrs.field(default=0.0, init=False)  # the round's slowest call
    _lat_over: int = attrs.field(default=0, init=False)  # the round's calls over the bound
    # p99=SECONDS: per size, [calls, calls over the bound, when last measured]
    _tally: dict[int, list[float]] = attrs.field(factory=dict, init=False)
    # per size, its measured rounds pooled: [sum of in-flight, sum of latencies, calls, when
    # last measured]
    _seen: dict[int, list[float]] = attrs.field(factory=dict, init=False)
    _pooled: bool = attrs.field(default=True, init=False)  # the probe's old size: pooled
    _no_gains: int = attrs.field(default=0, init=False)  # steps up given up in a row
    _down_next: bool = attrs.field(default=False, init=False)  # probe down next
    _past: int = attrs.field(default=0, init=False)  # the last step up that did not pay
    _worst: float = attrs.field(default=0.0, init=False)  # the last round's
    _bound: float | None = attrs.field(default=None, init=False)  # p99=SECONDS
    _gain: float = attrs.field(default=0.0, init=False)  # min_gain, resolved
    # `knee`'s search after slow start: the largest size known below the knee (a step up
    # from it paid) and the smallest known past it (a step up to it did not); 0: no search
    _lo: int = attrs.field(default=0, init=False)
    _hi: int = attrs.field(default=0, init=False)
    # `knee`: slow start's one doubling past the first that did not pay (`KNEE_SHARE`):
    # done, under way, and the size of the doubling that did not pay
    _explored: bool = attrs.field(default=False, init=False)
    _exploring: bool = attrs.field(default=False, init=False)
    _doubled: int = attrs.field(default=0, init=False)
    _explore_from: int = attrs.field(default=0, init=False)  # the size that paid before it
    _may_explore: bool = attrs.field(default=False, init=False)  # (see `_end_round`)
    # a flat doubling waiting for the engine's reading at its size: (old, its throughput)
    _explore_wait: tuple[int, float] | None = attrs.field(default=None, init=False)
    # the last round measured: (size, calls/s by Little's law, mean and worst latency)
    measured: tuple[int, float, float, float] | None = attrs.field(default=None, init=False)
    _load_sum: float = attrs.field(default=0.0, init=False)
    # this round's calls in flight weighted by time: their integral over the round's span
    # (`_load`), and when the last latency came (any round's)
    _area: float = attrs.field(default=0.0, init=False)
    _span: float = attrs.field(default=0.0, init=False)
    _load_at: float | None = attrs.field(default=None, init=False)
    _settle: bool = attrs.field(default=False, init=False)
    _settle_need: int = attrs.field(default=0, init=False)  # the size before a step down
    _probe_from: tuple[int, float] | None = attrs.field(default=None, init=False)
    _now: float = attrs.field(default=0.0, init=False)  # the last call's time (`record`)
    _changed_at: float = attrs.field(default=-math.inf, init=False)  # the last step down's
    _probe_at: float = attrs.field(default=0.0, init=False)  # when the probe began
    # the probe's measured rounds so far: [sum of in-flight, sum of latencies, rounds]
    _probe_sums: list[float] = attrs.field(factory=lambda: [0.0, 0.0, 0.0], init=False)
    # per size, its recent measured rounds' log throughputs (the noise: `_noise`)
    _rounds: dict[int, deque[tuple[float, float]]] = attrs.field(factory=dict, init=False)
    # `knee`: this round's latencies, the probe's so far, and per size its recent ones
    _round_lats: list[float] = attrs.field(factory=list, init=False)
    _probe_lats: list[float] = attrs.field(factory=list, init=False)
    _tails: dict[int, deque[float]] = attrs.field(factory=dict, init=False)
    _ref_latency: float | None = attrs.field(default=None, init=False)
    _ref_throughput: float = attrs.field(default=0.0, init=False)  # measured with it
    _hold_until: float = attrs.field(default=-math.inf, init=False)
    _min_latency: float = attrs.field(default=math.inf, init=False)
    _slow_rounds: int = attrs.field(default=0, init=False)
    _hidden: float = attrs.field(default=0.0, init=False)  # log of `HIDDEN`'s ratio, smoothed
    _searched: bool = attrs.field(default=False, init=False)  # `knee`'s first search ended
    # 429s that do not depend on concurrency
    _before_429s: int = attrs.field(default=0, init=False)  # the size when they began
    _ok_since_429: int = attrs.field(default=0, init=False)
    _ok_in_run: int = attrs.field(default=0, init=False)  # since these 429s began
    _refused_in_run: int = attrs.field(default=0, init=False)  # their number
    _independent_until: float = attrs.field(default=-math.inf, init=False)
    _answers_429: bool = attrs.field(default=False, init=False)  # a concurrency 429 came
    _clean_peak: int = attrs.field(default=0, init=False)  # in flight in a 429-free round
    _below: int = attrs.field(default=0, init=False)  # 429s in a row at half of it
    # the engine's metrics
    _engine_at: float = attrs.field(default=-math.inf, init=False)
    _engine_ok: bool = attrs.field(default=False, init=False)
    _engine_queue: bool = attrs.field(default=False, init=False)
    _preempted: float | None = attrs.field(default=None, init=False)
    _finished: float | None = attrs.field(default=None, init=False)
    _grown_at: float = attrs.field(default=-math.inf, init=False)
    _engine_cut_at: float = attrs.field(default=-math.inf, init=False)  # the last cut's time

    def __attrs_post_init__(self) -> None:
        _check_bounds(self.min, self.size, self.max)
        self.objective = check_objective(self.objective)
        self._bound = objective_bound(self.objective)
        if self.min_gain is None:
            self.min_gain = MIN_GAIN[self.objective.split("=")[0]]
        self._gain = self.min_gain
        self._succeeded = deque(maxlen=self.max)
        rules = (
            (0 < self.cut < 1, "cut", "between 0 and 1 (a factor)"),
            (self.cooldown >= 0, "cooldown", ">= 0 seconds"),
            (self.growth > 0, "growth", "> 0 (a fraction of the size)"),
            (0 < self.utilization <= 1, "utilization", "in (0, 1]"),
            (self.min_round >= 1, "min_round", ">= 1"),
            (0 <= self._gain <= 1, "min_gain", "in [0, 1]"),
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
            # still a request-rate limit's: recognised for as long again
            self._independent_until = max(self._independent_until, now + 4 * self.cooldown)
            return Outcome.REQUEST_RATE
        return outcome

    def latency(self, seconds: float, in_flight: int, now: float | None = None) -> None:
        """One successful call's latency, with `in_flight` calls in flight as it ended (at
        `now`, if given: the calls in flight are then weighted by time, `_load`)."""
        if seconds >= 0 and math.isfinite(seconds):
            self._lat_sum += min(seconds, self._lat_cap)
            self._lat_n += 1
            self._lat_max = max(self._lat_max, seconds)
            if now is None or now - seconds >= self._changed_at:
                # a call begun before the last step down waited (or not) at the old
                # size: not this size's tail (a step down's settling round may end before the
                # larger size's queued calls do)
                self._round_lats.append(seconds)
            self._load_sum += in_flight
            if now is not None:
                if self._load_at is None or now > self._load_at:
                    # since the last call ended none did, so at most `in_flight` calls were
                    # in flight, this one among them (so for at most its latency: an idle
                    # client's gap must not count as `in_flight` calls' time); before the
                    # first call ended, for its latency (a run's first calls start together
                    # and, on an engine's first batch, end together: with no time before
                    # them counted, they were counted as each ended, half the window, and
                    # the zoo's plateau 1 at 8 read as 3.3 calls/s, not 5.9: slow start's
                    # doubling to 16, which delivers less, looked like a gain of 60 %)
                    span = seconds if self._load_at is None else min(now - self._load_at, seconds)
                    self._area += in_flight * span
                    self._span += span
                self._load_at = now
            if self._bound is not None and seconds > P99_AIM * self._bound:
                self._lat_over += 1

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
        self._now = now
        outcome = self.classify(outcome, now)
        self._peak = max(self._peak, in_flight)
        if outcome is Outcome.SUCCESS:
            if latency is not None:
                self.latency(latency, in_flight, now)
            if self._spent_limit(now):
                self._independent_until = now + max(4 * self.cooldown, 120.0)
                self._ok_in_run += 1
                self._new_round()
                size = min(self.max, max(self.size, self._before_429s))
                return self._set(size, "429 not concurrency")
            self._successes += 1
            self._ok_since_429 += 1
            self._ok_in_run += 1
            self._succeeded.append(now)
            if self._clean and not self.paced:  # calls in flight that the endpoint took
                self._clean_peak = max(self._clean_peak, self._peak)
            signal = not self._answers_429 and not self.paced  # the latency signal's
            if (
                signal
                and self._bound is not None
                and self._probe_from is not None
                and self._probe_from[0] < self.size
                and self._lat_over > 1 + 0.01 * self._lat_n
            ):
                return self._give_up_step(now)
            need = max(self.size, self.min_round)
            if self._probe_from is not None and not self._settle and signal:
                # the round that judges a probe: enough calls that one stalled call (a busy
                # machine's) does not decide it
                need = max(need, PROBE_ROUND)
            if self._settle and not self._answers_429 and not self.paced:
                # the round that settles a step down lasts until the calls the larger size
                # started (queued, on an engine) are done
                need = max(need, self._settle_need)
            if self._successes >= need and (
                self._probe_from is None
                or self._settle
                or len(self._round_lats) >= PROBE_ROUND
                or latency is None
            ):
                # (a probe's round: `PROBE_ROUND` calls begun at its size, for its tail)
                return self._end_round(now)
            return None
        if outcome is Outcome.REQUEST_RATE:
            return None  # paced (AdaptiveWindow.pacer), never cut
        if outcome is not Outcome.RATE_LIMITED:  # a 5xx or a timeout: never a cut
            self._errors += 1
            return None
        self._clean = False
        self._answers_429 = True  # its 429s speak for its capacity: no latency signal
        first = self.slow_start
        self.slow_start = False
        if now - self._last_429 >= self.cooldown:
            self._overload_since = now  # the first 429 after a quiet cooldown
            self._before_429s = self.size
            self._ok_in_run = self._refused_in_run = 0
        self._last_429 = now
        self._refused_in_run += 1
        served, self._ok_since_429 = self._ok_since_429, 0
        lowest = self.size <= self.min and in_flight <= self.min
        if latency is not None and in_flight < self.size:
            # calls the endpoint may still have held as it refused this one (up to a full
            # window: a 429 that waited on a busy caller saw many succeed after it)
            in_flight += min(self.size - in_flight, self._succeeded_since(now - latency))
        # 429s with at most half the calls in flight that the endpoint once took all at
        # once (a 429-free round's), three in a row
        # (a peak of 2 at least: half of one call, or of none, is no concurrency to be below)
        below = self._clean_peak >= 2 and 2 * in_flight <= self._clean_peak
        self._below = self._below + 1 if below else 0
        # calls succeeded since the last 429 (at the least size), or since these 429s began
        # (at `utilization` of half the size: a limit's 429s may come in a run, a sliding
        # window's), or they keep coming well below the concurrency the endpoint took
        if (
            (lowest and served)
            or (self._ok_in_run and 2 * self.size <= self.utilization * self._before_429s)
            or self._below >= 3
        ):
            # at the least concurrency it may use, at `utilization` of half the size at
            # which 429s began, or at half the concurrency the endpoint took, it refuses
            # calls: these 429s do not depend on the calls in flight (a concurrency limit's
            # stop once the window is down to it, and it refuses only above what it took; a
            # slow start doubles once `utilization` of the size is in flight, so it
            # overshoots a limit by at most 2 / `utilization`: the zoo's concurrency limit
            # of 110, a client-bound loop, went 128 to 256, and at 116 it still refused)
            self._independent_until = now + max(4 * self.cooldown, 120.0)
            self._new_round()
            size = min(self.max, max(self.size, self._before_429s))
            return self._set(size, "429 not concurrency")
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

    def _spent_limit(self, now: float) -> bool:
        """Whether this success is the first for over 4 times the calls' latency (the slowest
        of this round) since a run of 429s began, which went on that long or counted 3 or
        more (one 429 and its retry's backoff say nothing): a concurrency limit holds calls
        that end within it, and then takes more; a spent rate limit (a sliding window whose
        calls have yet to slide out) refuses until it reopens, whatever the calls in flight.
        (Not the 429s' span alone: at `min`, where a resting run keeps its place, the few
        runs refused back off, and their 429s ended 0.4 s into a spent second.)"""
        return (
            self._ok_in_run == 0
            and self._lat_max > 0
            and now - self._last_429 < self.cooldown
            and now - self._overload_since > 4 * self._lat_max
            and (
                self._last_429 - self._overload_since > 4 * self._lat_max
                or self._refused_in_run >= 3
            )
            and now >= self._independent_until
        )

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
        # a full cache with calls waiting for it (a full cache and nothing waiting is a full
        # batch: an engine without a KV gauge reports its batch's share as its usage)
        high = kv is not None and kv >= self.kv_high and waiting > 0
        self._engine_ok = not queued and not preempted and (kv is None or kv < self.kv_grow)
        if self._explore_wait is not None:  # a flat doubling waited for this reading
            (old, throughput), self._explore_wait = self._explore_wait, None
            if self._engine_ok:
                return self._explore(old, throughput)
            return self._undo_step(now, old, over=False)
        if queue:
            excess, reason = math.ceil(waiting), "engine queue"
        elif preempted:
            excess, reason = max(1, math.ceil(self.size / 10)), "preemption"
        elif high:  # a tenth, but no more than the calls waiting for the cache
            excess, reason = max(1, min(math.ceil(self.size / 10), math.ceil(waiting))), "kv cache"
        else:
            return None
        self.slow_start = False
        size = max(self.min, self.size - excess, math.floor(self.size * self.cut))
        if size < self.size:
            self._new_round()
            if self._hi:  # searching for the knee: it is below this size
                self._hi = min(self._hi, self.size)
            else:
                # as after a probe that did not pay; after cuts that each undid a step up
                # (growth came between them) for longer and longer: 1, 2, then 4 cooldowns
                # (a step up that pays ends the run; each probe past the engine's batch
                # queues calls, and at one cooldown each, on the zoo's engine 1, they kept
                # its p99 at 2x -c 13's; the engine's readings are not noise, so the holds
                # double from the first, where a `knee` probe's start at half a cooldown)
                if self._grown_at > self._engine_cut_at:
                    self._no_gains += 1
                hold = min(4.0, 2.0 ** max(0, self._no_gains - 1))
                self._hold_until = now + self.cooldown * hold
            self._engine_cut_at = now
        return self._set(size, reason)

    def _measure(self) -> tuple[float, float] | None:
        """This round's (throughput by Little's law, mean latency), if it has latencies."""
        if self._lat_n == 0:
            return None
        latency = self._lat_sum / self._lat_n
        if latency <= 0:
            return None
        return (self._load() / self._lat_n) / latency, latency

    def _load(self) -> float:
        """This round's calls in flight, summed over its calls (its mean times `_lat_n`):
        their mean over the round's time when its calls' ends span any (before the run's
        first call ended, its latency), else their mean as each call ended. (As each
        ended, a burst of k calls ending at once counts k - 1 fewer, k - 2, ... down to
        one: an engine's batch of calls ending together read as half the window, and the
        zoo's engine 3 at a window of 18 delivered 73 calls/s and was read as 59, +-8 % a
        round; by time, 73.4 +-0.2 %.) Of those, the share that succeeded: the round's 5xx
        and timeouts held places too (their calls, and their retries' backoff), so by
        Little's law the calls that succeeded are the calls in flight times the share of
        the round's calls that did (a step to a size where the server fails more does not
        pay by the calls it fails)."""
        load = self._area / self._span * self._lat_n if self._span > 0 else self._load_sum
        if self._errors:
            load *= self._lat_n / (self._lat_n + self._errors)
        return load

    def _end_round(self, now: float) -> Change | None:
        measured = self._measure()
        signal = measured is not None and not self._answers_429 and not self.paced
        grow = (
            self._clean
            # with the latency signal, a 5xx or a timeout pauses nothing: its calls are
            # counted out of the round's throughput (`_load`), and every step is judged
            # on that (a flaky server's errors, a tenth of its calls whatever the window,
            # made nearly every round unclean: the zoo's flaky draws stayed at 25-64 where
            # -c 128 made 2-6x the calls)
            and (self._errors == 0 or signal)
            and self._peak >= self.utilization * self.size
            and now - self._last_429 >= self.cooldown
            and not self.pace_binds
        )
        sums = (self._load(), self._lat_sum)
        lats = self._round_lats
        settle, self._settle = self._settle, False
        self._settle_need = 0
        probe_from = self._probe_from
        self._worst = self._lat_max
        if measured is not None and not settle:
            self.measured = (self.size, measured[0], measured[1], self._worst)
            self._pool_round(now)
        if measured is not None and self._span > 0:
            # the places held over the time the calls' latencies account for (`HIDDEN`)
            held = measured[0] * self._span / self._lat_n
            if held > 0:
                self._hidden += 0.25 * (math.log(held) - self._hidden)
        self._new_round()
        # `knee`'s look past a flat doubling (`_explore`): a round that may grow, the
        # engine's readings fresh and the last one showing nothing waiting
        self._may_explore = grow and self._engine_ok and now - self._engine_at <= self.engine_stale
        if self._explore_wait is not None:  # waiting for a reading taken at this size
            if now - self._grown_at <= self.engine_stale:
                return None
            (old, _), self._explore_wait = self._explore_wait, None  # none came: as without
            return self._undo_step(now, old, over=False)
        if self._engine_at > -math.inf:  # the engine's metrics gate growth too
            grow = (
                grow
                and self._engine_ok
                and now - self._engine_at <= self.engine_stale
                and self._engine_at > self._grown_at  # one step per reading, seen after it
            )
        if measured is not None and signal:
            change, grow = self._latency_signal(now, measured, sums, lats, settle, probe_from, grow)
            if change is not None or not grow:
                return change
            self._grown_at = now
            if self.slow_start and self.size >= self.max and self.objective == "knee":
                # a doubling that paid reached `max`: the knee may be below it
                self.slow_start = False
                self._hi = self.max + 1
            if self._hi:  # searching for the knee
                return self._search(now, measured)
            if self.slow_start:  # every step is a probe: measured, kept only if it paid
                return self._set(min(self.max, 2 * self.size), "slow start", measured)
            if self._down_next:
                # at a knee (or `throughput`'s peak) two probes up have confirmed: the next
                # probe is down (up alone, noise would ratchet it up: a lucky round keeps a
                # step up now and then, and nothing would ever bring it back); then up again
                self._down_next = False
                self._hold_until = now + self.cooldown
                size = max(self.min, round(self.size / (1 + self.probe)))
                if size < self.size:
                    return self._set(size, "probe down", measured)
            step = max(1, math.floor(self.probe * self.size))
            size = min(self.max, self.size + step)
            if self._bound is not None and self._over_bound(
                now, size
            ):  # p99=: a size found over the bound lately
                return None
            return self._set(size, "grow", measured)
        if not grow:
            return None
        self._grown_at = now
        if self.slow_start:
            return self._set(min(self.max, 2 * self.size), "slow start")
        step = max(1, math.floor(self.growth * self.size))
        return self._set(min(self.max, self.size + step), "grow")

    def _elasticity(
        self, old: int, old_throughput: float, throughput: float, size: int | None = None
    ) -> float:
        """d log(throughput) / d log(size) between the old size and this one (or `size`)."""
        size = self.size if size is None else size
        if old == size or old_throughput <= 0 or throughput <= 0:
            return 0.0
        return math.log(throughput / old_throughput) / math.log(size / old)

    def _least(self, old: int) -> float:
        """The least elasticity a step up from `old` to this size must show to be kept:
        the objective's `min_gain`; for a doubling (slow start), unless `throughput`, at
        least `DOUBLING_GAIN` (a saturated engine's doubling gains nothing, and a busy
        machine's noise must not pass it)."""
        if self.size >= 1.5 * old and self.objective != "throughput":
            return max(self._gain, DOUBLING_GAIN)
        return self._gain

    def _pool_round(self, now: float) -> None:
        """Add this measured round to its size's pooled rounds: its in-flight and latency
        sums (the size's throughput over every recent round, `_estimate`) and with `p99=`
        its calls over the bound (`_over_bound`)."""
        seen = self._seen.get(self.size)
        if seen is None or now - seen[3] > 4 * self.cooldown:  # forgotten: start anew
            seen = self._seen[self.size] = [0.0, 0.0, 0.0, now]
            self._tails[self.size] = deque(maxlen=256)
        self._tails.setdefault(self.size, deque(maxlen=256)).extend(self._round_lats)
        load = self._load()
        seen[0] += load
        seen[1] += self._lat_sum
        seen[2] += self._lat_n
        seen[3] = now
        if load > 0 and self._lat_sum > 0:
            rounds = self._rounds.setdefault(self.size, deque(maxlen=16))
            rounds.append((now, math.log(load / self._lat_sum)))
        if seen[2] > MEMORY:
            seen[0] /= 2
            seen[1] /= 2
            seen[2] /= 2
        if self._bound is None:
            return
        tally = self._tally.get(self.size)
        if tally is None or now - tally[2] > 4 * self.cooldown:
            tally = self._tally[self.size] = [0.0, 0.0, now]
        tally[0] += self._lat_n
        tally[1] += self._lat_over
        tally[2] = now
        if tally[0] > MEMORY:
            tally[0] /= 2
            tally[1] /= 2

    def _estimate(self, size: int, now: float) -> float | None:
        """`size`'s throughput by Little's law over its recent measured rounds, pooled."""
        seen = self._seen.get(size)
        if seen is None or now - seen[3] > 4 * self.cooldown or seen[1] <= 0:
            return None
        return seen[0] / seen[1]

    def _noise(self, now: float, sizes: tuple[int, ...] = ()) -> float | None:
        """The rounds' own noise: the standard deviation of a measured round's log
        throughput, from the differences between successive rounds at one size (their last
        16 rounds, measured in the last `4 * cooldown` seconds), by their median (robust: a
        change of conditions, a busy machine's, is one large difference, not noise). From
        `sizes`' rounds when they have three differences (a queue's sizes are noisier than
        those below it), else every size's; None until three differences say anything."""
        for chosen in (sizes, tuple(self._rounds)):
            steps: list[float] = []
            for size in chosen:
                values = [
                    x for at, x in self._rounds.get(size, ()) if now - at <= 4 * self.cooldown
                ]
                steps.extend(abs(b - a) for a, b in itertools.pairwise(values))
            if len(steps) >= 3:
                # |x - y| of two draws of N(0, s): median 0.6745 * sqrt(2) * s
                return statistics.median(steps) / (0.6745 * math.sqrt(2))
        return None

    def _clearly_better(
        self, now: float, noise: float | None, throughput: float, rounds: float
    ) -> int | None:
        """`throughput`: the smaller size measured in the last `4 * cooldown` seconds whose
        pooled throughput is the most, if it exceeds this size's (`throughput`, over
        `rounds` rounds) by more than `NOISE_Z` times the rounds' noise."""
        if noise is None:  # (not known yet: nothing is clear)
            return None
        best: tuple[float, int] | None = None
        for size in self._seen:
            x = self._estimate(size, now) if size < self.size else None
            if x is None or throughput <= 0:
                continue
            spread = NOISE_Z * noise * math.sqrt(1 / self._count(size, now) + 1 / rounds)
            margin = math.log(x / throughput) - spread
            if margin > 0 and (best is None or x > best[0]):
                best = (x, size)
        return None if best is None else best[1]

    def _queues(self, old: int, here: list[float] | None = None) -> bool:
        """`knee`: whether the larger of the probe's two sizes queues (`QUEUE_TAIL`): its p99
        latency over the smaller one's, by more than `QUEUE_TAIL` times the sizes' ratio.
        The probe's size: its rounds' calls (or `here`); the size it left: its recent calls
        (both at least `PROBE_ROUND`)."""
        here = self._probe_lats if here is None else here
        there = list(self._tails.get(old, ()))
        if len(here) < PROBE_ROUND or len(there) < PROBE_ROUND or old == self.size:
            return False
        small, large = (there, here) if old < self.size else (here, there)
        ratio = max(old, self.size) / min(old, self.size)
        return _tail_over(large, small, QUEUE_TAIL * ratio)

    def _queues_below(self, old: int, now: float, delivered: float) -> bool:
        """`knee`: whether the smaller of the probe's two sizes queues (`QUEUE_TAIL`, as
        `_queues`) against some smaller size measured in the last `4 * cooldown` seconds,
        each with `PROBE_ROUND` calls at least: then both sizes are past the knee. Unless
        that size's calls were too few to have seen that tail (`TAIL_CHANCE`) and the
        smaller probe size `delivered` nearly as many times its throughput as it is larger
        (`SCALES`): a queue's calls wait, they are not served. (A flaky server's slow calls,
        2-5 % of every size's, under 128's line and not in 16's two dozen calls, read as 128
        queueing against 16, where 128 delivered 6-8 times as much.)"""
        small = min(old, self.size)
        here = self._probe_lats if small == self.size else list(self._tails.get(old, ()))
        if len(here) < PROBE_ROUND:
            return False
        for size, lats in self._tails.items():
            seen = self._seen.get(size)
            if (
                size < small
                and len(lats) >= PROBE_ROUND
                and seen is not None
                and now - seen[3] <= 4 * self.cooldown
                and _tail_over(here, list(lats), QUEUE_TAIL * small / size)
                and (
                    _tail_seen(here, list(lats), QUEUE_TAIL * small / size)
                    or not self._scales(size, small, delivered, now)
                )
            ):
                return True
        return False

    def _scales(self, size: int, larger: int, delivered: float, now: float) -> bool:
        """Whether `larger`, which `delivered` that throughput, delivered nearly as many times
        `size`'s (by their pooled rounds) as it is larger: an elasticity of `SCALES`."""
        throughput = self._estimate(size, now)
        if throughput is None or throughput <= 0 or delivered <= 0:
            return False
        return math.log(delivered / throughput) >= SCALES * math.log(larger / size)

    def _count(self, size: int, now: float) -> int:
        """How many recent measured rounds `size`'s pooled throughput stands on (at least 1)."""
        rounds = self._rounds.get(size, ())
        return max(1, sum(1 for at, _ in rounds if now - at <= 4 * self.cooldown))

    def _over_bound(self, now: float, size: int | None = None) -> bool:
        """`p99=SECONDS`: is this size's (or `size`'s) p99 over the bound, as its tally
        estimates it? More than 1 % of its calls, and more than one call, were over: one
        slow call alone (a busy machine's) never gives a size up. A tally is forgotten
        `4 * cooldown` seconds after its size was last measured."""
        tally = self._tally.get(self.size if size is None else size)
        if tally is None or now - tally[2] > 4 * self.cooldown:
            return False
        return tally[1] > 1 + 0.01 * tally[0]

    def _give_up_step(self, now: float) -> Change | None:
        """`p99=`: a step up whose calls went over the bound (more than 1 % of them, and more
        than one) is given up at once, before its rounds end (calls queued past the bound
        would go on costing the p99 until they are done); its size's tally says so."""
        assert self._probe_from is not None
        old = self._probe_from[0]
        self._tally[self.size] = [float(self._lat_n), float(self._lat_over), now]
        self._new_round()
        if not self.slow_start:
            self._hold(now)
        self.slow_start = False
        self._settle = True
        self._ref_latency = None
        return self._set(max(self.min, old), "p99")

    def _search(self, now: float, measured: tuple[float, float]) -> Change | None:
        """`knee`'s next probe between `_lo` (below the knee) and `_hi` (past it), at their
        geometric middle, or, from the middle, halfway to the side it has not tried; once
        they are within a sixteenth (or one) of each other, the search ends where the
        window is, and growth waits `cooldown` seconds (after the first search, a share of
        it when the rounds did not show what held the places: `HIDDEN`)."""
        low, high, size = max(1, self._lo), self._hi, self.size
        middle = round(math.sqrt(low * high))
        if middle == size:  # here already: try below it (or above, if below is known)
            middle = round(math.sqrt(low * size)) if low < size - 1 else size + 1
        target = min(self.max, max(self.min, middle))
        if high - low <= max(1, low // 16) or not low < target < high or target == size:
            self._lo = self._hi = 0
            again = not self._searched and self._hidden > math.log(HIDDEN)
            self._hold_until = now + self.cooldown * (SEARCH_AGAIN if again else 1.0)
            self._searched = True
            return None
        return self._set(target, "probe down" if target < size else "grow", measured)

    def _explore(self, old: int, throughput: float) -> Change | None:
        """`knee` with the engine's metrics, none waiting at this size: slow start's first
        doubling that did not pay (from `old` to this size, which delivered `throughput`) is
        followed by one more, once (reason "explore"): kept, and slow start goes on, if it
        delivers more than this size by `KNEE_SHARE` of it (then this size is not within
        that share of the best: the knee is above it); else back to `old`, and the search
        runs below this size, as without it. (A throughput flat for a doubling may rise
        again past it: a real vLLM's did, its batch not full; an engine's past its capacity
        does not, and it shows calls waiting.)"""
        doubled = self.size
        change = self._set(min(self.max, 2 * self.size), "explore", (throughput, 0.0))
        self._explored = self._exploring = True
        self._explore_from, self._doubled = old, doubled
        return change

    def _undo_step(self, now: float, old: int, *, over: bool) -> Change | None:
        """A step up that did not pay goes back to `old` (reason "no gain"). `knee`: the knee
        is below this size; a failed doubling starts the search between it and the size the
        last step that paid started from (the other objectives want all the throughput there
        is: they go on by smaller steps)."""
        past = self.size
        if self._exploring:  # back below the doubling that did not pay
            old, past = self._explore_from, self._doubled
        self._exploring = False
        if self.objective == "knee" and not over and (self.slow_start or self._hi):
            self._hi = min(self._hi or past, past)
        elif not self.slow_start:
            self._hold(now)
            self._past = self.size
        self.slow_start = False
        self._settle = True
        self._ref_latency = None
        return self._set(max(self.min, old), "no gain")

    def _hold(self, now: float) -> None:
        """Growth waits after a step up that did not pay: half `cooldown` the first time,
        `cooldown` after a second one in a row, then twice and four times that (a wrong "no
        gain", a noisy round's, is probed again soon; a knee that stays where it is is
        probed less and less, as each probe past it costs the p99 its queued calls). From
        the second, `knee`'s and `throughput`'s next probe goes down."""
        self._no_gains += 1
        self._hold_until = now + self.cooldown * min(4.0, 2.0 ** (self._no_gains - 2))
        # (`throughput` too: past a falling plateau's peak, found by slow start with nothing
        # smaller measured lately, it had no way back below it: the zoo's plateau 1 sat at
        # twice its peak, 0.86x)
        self._down_next = self._no_gains >= 2 and self.objective in ("knee", "throughput")

    def _latency_signal(
        self,
        now: float,
        measured: tuple[float, float],
        sums: tuple[float, float],
        lats: list[float],
        settle: bool,
        probe_from: tuple[int, float] | None,
        grow: bool,
    ) -> tuple[Change | None, bool]:
        """The objective's rules on one measured round: (a change, whether growth may go
        on). See the class."""
        throughput, latency = measured
        self._min_latency = min(self._min_latency, latency)
        # "slower at a steady size" reads the round's typical call: its latencies' mean
        # without their slowest tenth (a flaky server's slow calls, 2 % of them at 3.5 s
        # where the rest take 12 ms, put the mean of most rounds of 64 calls at several
        # times the last one's: the zoo's flaky draws went down by "latency" and back by
        # "lost throughput" every second, and each return held growth a cooldown)
        typical = _trimmed_mean(lats) if lats else latency
        self._lat_cap = TAIL_CAP * typical
        bound = self._bound
        if settle:  # its calls started at the old size: measure the next round
            if (
                self.objective == "knee"
                and probe_from is not None
                and probe_from[0] < self.size
                and self._pooled
                and self._queues(probe_from[0], lats)
            ):
                # a step up whose first calls already queue: undone now, not after rounds
                # more of them (each costs the p99 a whole batch)
                return self._undo_step(now, probe_from[0], over=False), False
            self._probe_from = probe_from
            return None, False
        over = bound is not None and self._over_bound(now)
        if probe_from is not None:
            old, old_throughput = probe_from
            # the size it left: its throughput over its recent rounds (one round's is noisy;
            # but the "latency" probe is judged against the rate when the size was taken);
            # the step's own size: this probe's rounds (a noisy round of an earlier probe of
            # it must not decide this one)
            n_old = 1
            if self._pooled:
                old_throughput = self._estimate(old, now) or old_throughput
                n_old = self._count(old, now)
            probe = self._probe_sums
            probe[0] += sums[0]
            probe[1] += sums[1]
            probe[2] += 1
            if probe[0] > 0 and probe[1] > 0:
                throughput = probe[0] / probe[1]
            gain = self._elasticity(old, old_throughput, throughput)
            # a change within the rounds' own noise says nothing yet: measure again (up to
            # `PROBE_ROUNDS`, the rounds pooled); still within it, `knee` takes the smaller
            # size (judged on one round, a lucky one kept a step up now and then, or
            # refused a step back down, and the size ratcheted up)
            self._probe_lats.extend(lats)
            noise = self._noise(now, (old, self.size))
            if noise is None and len(lats) > 1:
                # before three differences of rounds say it, the calls' own spread: a
                # round's mean latency varies by their coefficient of variation over the
                # root of their number (a doubling judged on slow start's first rounds,
                # a real vLLM's, went by the point estimate of two noisy rounds)
                mean = statistics.fmean(lats)
                noise = statistics.pstdev(lats) / mean / math.sqrt(len(lats)) if mean > 0 else 0.0
            spread = NOISE_Z * (noise or 0.0) * math.sqrt(1 / n_old + 1 / probe[2])
            change = math.log(throughput / old_throughput) if old_throughput > 0 else math.inf
            unclear = abs(change) < spread
            queued = below = False  # `knee`: the larger of the two sizes queues; both do
            lost = not unclear and change < 0 and gain > self._gain  # (a step down's loss)
            if self.objective == "knee" and self._pooled and self._queues(old):
                # the larger of the two sizes queues: past the knee, whatever it delivers
                gain, unclear, queued = (-math.inf if old < self.size else 0.0), False, True
            elif (
                self.objective == "knee"
                and self._pooled
                and self._queues_below(old, now, old_throughput if old < self.size else throughput)
            ):
                # so does the smaller, against a smaller size measured lately: both are
                # past the knee (an engine whose throughput still rises a little past its
                # batch, a KV budget's, held a search's lower end at a size that queued)
                gain, unclear, below = (-math.inf if old < self.size else 0.0), False, True
            if self._exploring and old < self.size and not (queued or below):
                # slow start's doubling past the first that did not pay: kept if it
                # delivers more than that one by `KNEE_SHARE` of it (on the point estimate,
                # once its rounds are spent)
                margin = change - math.log(1 / (1 - KNEE_SHARE))
                unclear = abs(margin) < spread
                gain = math.inf if margin > 0 else -math.inf
            more = probe[2] < PROBE_ROUNDS or (
                probe[2] < PROBE_ROUNDS_MAX and now - self._probe_at < PROBE_TIME * self.cooldown
            )
            if (
                unclear
                and more
                and self.objective == "knee"
                and old < self.size
                and not self._exploring
                and probe[2] >= PROBE_ROUNDS
                and (
                    change + spread < self._least(old) * math.log(self.size / old)
                    or abs(change) < NOISE_Z * (noise or 0.0) * math.sqrt(1 / n_old)
                )
            ):
                # still no change to tell from the noise after `PROBE_ROUNDS`, and measuring
                # on cannot keep the step: it is clearly short of what a step up must gain,
                # or the size it left was measured too few rounds for any number of rounds
                # here to tell a change this small (a flat doubling past the zoo's engine 1
                # in --quick, 16 measured once, was measured at 32 for the whole 3.75 s of
                # `PROBE_TIME`, and half of the run sat at twice the knee)
                more = False
            if unclear and more:
                self._probe_from = probe_from
                return None, False
            if (
                not unclear
                and probe[2] < PROBE_ROUNDS
                and self.objective == "knee"
                and self.slow_start
                and not (queued or below or self._exploring)
                and self.size >= 1.5 * old
                and gain < self._least(old)
                and abs(gain - self._least(old)) * math.log(self.size / old) < spread
            ):
                # slow start's doubling short of its bar, but within the noise of it: measure
                # again (a real vLLM's doubling from 64 to 128, an elasticity of 0.26 over its
                # steady rounds, read 0.11 on one round at each size, and the knee settled at
                # 48-70)
                self._probe_from = probe_from
                return None, False
            if unclear and self.objective == "knee" and not self._exploring:
                gain = -math.inf if old < self.size else 0.0
            elif unclear and self.objective == "throughput":
                # all the throughput there is: the larger size (more window never
                # delivers less unless it says so clearly; on a flat stretch, vLLM's on a
                # busy CPU, a tie to the smaller size stopped the window below the rise)
                gain = math.inf
            if self.objective == "throughput" and old < self.size and self._pooled:
                # ...unless a smaller size measured lately clearly delivered more: ties
                # taken one step at a time would walk down a slope a little at each
                better = self._clearly_better(now, noise, throughput, probe[2])
                if better is not None:
                    return self._undo_step(now, better, over=False), False
            if old < self.size:  # a step up: kept if throughput rose by `min_gain` of it
                least = self._least(old)
                if (
                    gain < least
                    and not over
                    and not (queued or below)
                    and self._may_explore
                    and self.objective == "knee"
                    and self.slow_start
                    and not self._explored
                    and self.size >= 1.5 * old
                    and self.size < self.max
                ):
                    if self._engine_at > self._grown_at:  # a reading at this size said so
                        return self._explore(old, throughput), False
                    # the last reading is older than this size: wait for one (`engine`)
                    self._explore_wait = (old, throughput)
                    return None, False
                if gain < least or over:
                    return self._undo_step(now, old, over=over), False
                self._exploring = False
                self._no_gains = 0
                self._lo = max(self._lo, old)  # the knee is above the size it came from
            elif gain > self._gain * (KNEE_DOWN if self.objective == "knee" else 1.0) and not over:
                # a step down that cost throughput
                if self._hi:  # the knee is above this size: back, and the search goes on
                    self._lo = max(self._lo, self.size)
                elif self.objective == "knee" and self._pooled:
                    # `knee`'s probe down (a quarter) lost: the knee lies between, searched
                    # (up to the last step up that did not pay: the knee may be above old)
                    self._lo, self._hi = self.size, max(old + 1, self._past)
                    self._hold_until = -math.inf
                else:
                    self._hold_until = now + self.cooldown
                self._settle = True
                self._ref_latency = None
                return self._set(min(self.max, old), "lost throughput"), False
            elif self._hi and old > self.size:  # a step down that cost little: past the knee
                self._hi = min(self._hi, self.size if below else old)
                if queued and lost:
                    # or one from a size that queues to one that clearly delivers less: the
                    # knee is between the two (the search went on below the smaller one:
                    # on the zoo's engine 1, C 13, from 16 to 11 and then 9, a probe of
                    # 1.5 s calls lost)
                    self._lo = max(self._lo, self.size)
            self._ref_latency, self._ref_throughput = typical, throughput
            self._slow_rounds = 0
            return None, grow and now >= self._hold_until
        if self._ref_latency is None:
            self._ref_latency, self._ref_throughput = typical, throughput
        elif over:
            # over the p99 bound, as this size's tally estimates it: a cut, kept
            self._slow_rounds = 0
            self.slow_start = False
            self._settle = True
            self._ref_latency = None
            size = max(self.min, math.floor(self.size * self.cut))
            return self._set(size, "p99"), False
        elif typical > self.queueing * self._ref_latency:
            # slower than when this size was taken: two rounds in a row try a smaller size,
            # measured like a step up (undone if it cost throughput)
            self._slow_rounds += 1
            if self._slow_rounds >= 2:
                self._slow_rounds = 0
                self.slow_start = False
                size = max(self.min, math.floor(self.size * self.cut))
                # judged against the throughput when this size was taken, not the slowed
                # one: a client's own stall (its CPU taken) slows every size alike, and a
                # smaller size must not look as good as a slowed larger one
                return self._set(size, "latency", (self._ref_throughput, latency)), False
            return None, False
        else:
            self._slow_rounds = 0
        return None, grow and now >= self._hold_until

    def _new_round(self) -> None:
        self._successes = 0
        self._peak = 0
        self._clean = True
        self._errors = 0
        self._lat_sum = self._load_sum = self._lat_max = self._area = self._span = 0.0
        self._round_lats = []
        self._lat_n = self._lat_over = 0
        self._probe_from = None

    def _set(
        self, size: int, reason: str, measured: tuple[float, float] | None = None
    ) -> Change | None:
        if size == self.size:
            return None
        self._exploring = False  # (any step ends an exploration; `_explore` begins one)
        self._explore_wait = None
        if measured is not None:  # a probe (either way): settle, then measure
            self._probe_from = (self.size, measured[0])
            self._probe_at = self._now
            self._probe_sums = [0.0, 0.0, 0.0]
            self._probe_lats = []
            self._pooled = reason != "latency"
            self._settle = True
        elif size < self.size:  # measure the new size afresh, once its calls have turned over
            self._settle = True
            self._ref_latency = None
        # the settling round of a step down lasts until the calls the larger size started
        # are done: they would count their queueing against the smaller size (that of a
        # step up is the new size's calls: the first of them met a queue still growing)
        self._settle_need = self.size if self._settle and size < self.size else 0
        self._changed_at = self._now if size < self.size else -math.inf
        self.size = size
        return Change(size, reason)


def _trimmed_mean(values: list[float]) -> float:
    """The mean of `values` without their largest tenth (rounded down)."""
    kept = sorted(values)[: len(values) - len(values) // 10]
    return statistics.fmean(kept)


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def _tail_over(large: list[float], small: list[float], factor: float) -> bool:
    """Whether the calls of `large` (a larger size's) queue against those of `small`: their
    p99 over `factor` times `small`'s, counting only calls a queue can explain, under
    `QUEUE_FAR` / `QUEUE_TAIL` times that line (see `QUEUE_FAR`)."""
    line = factor * _p99(small)
    kept = [x for x in large if x <= QUEUE_FAR / QUEUE_TAIL * line]
    return bool(kept) and _p99(kept) > line


def _tail_seen(large: list[float], small: list[float], factor: float) -> bool:
    """Whether `small`'s calls were too many to miss by chance the tail of `large`'s over
    `factor` times their p99, were it as common among them (`TAIL_CHANCE`)."""
    line = factor * _p99(small)
    share = sum(x > line for x in large) / len(large)
    seen, n = sum(x > line for x in small), len(small)
    chance = sum(math.comb(n, k) * share**k * (1 - share) ** (n - k) for k in range(seen + 1))
    return chance < TAIL_CHANCE


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
    `min_round`, and the keyword-only ones of `AdaptiveController`) are keyword arguments;
    `objective` (``knee``, ``throughput`` or ``p99=SECONDS``, `check_objective`) is what it
    serves against an engine that queues. Each change is in `history` with its reason, and
    `report()` says where it settled. Bounds that are not ints with
    ``1 <= min <= start <= max``, a bad objective or a bad option raise a `ConfigError`
    naming them.
    """

    # duplicates: keyword options with defaults, as the Pacer's: each class's own settings
    def __init__(
        self,
        min: int,  # public names: AdaptiveWindow(min, start, max)
        start: int,
        max: int,
        objective: str = "knee",
        *,
        cut: float = 0.8,
        cooldown: float = 15.0,
        growth: float = 0.05,
        utilization: float = 0.8,
        min_round: int = 4,
        **options: Any,
    ) -> None:
        self.controller = AdaptiveController(
            min, max, start, cut, cooldown, growth, utilization, min_round,
            objective=check_objective(objective), **options,
        )  # fmt: skip
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
            self.pacer.limited(now, retry_after, latency)
        elif outcome is Outcome.RATE_LIMITED:
            self.pacer.refused(now)
        elif outcome is Outcome.SUCCESS:
            self.pacer.success(now, latency)
        active = self.in_flight - self._lent
        change = self.controller.record(outcome, now, active, retry_after, latency=latency)
        if change is not None:
            self._apply(change.size, change.reason)
        if outcome is Outcome.RATE_LIMITED and self.controller.classify(outcome, now) is (
            Outcome.REQUEST_RATE
        ):  # this very 429 showed it: a request-rate limit, found by behaviour
            self.pacer.limited(now, retry_after, latency)
        # paced: the limit's rate, not the window, sets the throughput (no latency signal);
        # and while the pacer binds (calls wait for their turn) the size does not grow
        self.controller.paced = self.pacer.rate is not None
        self.controller.pace_binds = self.controller.paced and self.pacer.queued > 0

    def observe_latency(self, seconds: float) -> None:
        """One call's latency, apart from the success it may count for (a rollout window hears
        each model call's latency, and one success per episode)."""
        self.pacer.answered(trio.current_time(), seconds)
        self.controller.latency(seconds, self.in_flight - self._lent, trio.current_time())

    def engine_load(self, load: EngineLoad) -> None:
        """One reading of the engine's metrics (see `AdaptiveController.engine`)."""
        change = self.controller.engine(load, trio.current_time())
        if change is not None:
            self._apply(change.size, change.reason)

    def report(self) -> dict[str, Any]:
        """Where the window settled and what it measured there (`summary.json["window"]`):
        `objective`, `size` (now), `min`, `max`, and of the last round measured, `at` (the
        size then), `throughput` (calls/s), `latency_mean` and `latency_max` (seconds;
        None before any), `paced` (calls/s a request-rate limit let through; None when
        unpaced) and `changes` (the sizes it had)."""
        measured = self.controller.measured
        at, throughput, mean, worst = measured if measured is not None else (None,) * 4
        rate = self.pacer.rate
        return {
            "objective": self.controller.objective,
            "size": self.size, "min": self.min, "max": self.max, "at": at,
            "throughput": None if throughput is None else round(throughput, 3),
            "latency_mean": None if mean is None else round(mean, 4),
            "latency_max": None if worst is None else round(worst, 4),
            "paced": None if rate is None else round(rate, 3),
            "changes": len(self._history) - 1,
        }  # fmt: skip

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
        never starved by fresh ones. Leaving by an exception gives the place back at once.

        Lending cannot pile runs up: the 429 that sent the run to rest also capped the size
        at the calls then in flight, less one (see `AdaptiveController`), and at `min`, where
        no cap goes lower, a run rests in its place. (Against an endpoint that refuses every
        call, a token budget smaller than one call, each rest at `min` once lent its place to
        a fresh run whose 429 sent it to rest in turn: 5,288 runs piled up in 5 s.)
        """
        if self.size <= self.min:
            yield
            return
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
    """`MIN-START-MAX` of an adaptive window, and the objective it serves (`knee`,
    `throughput` or `p99=SECONDS`: see `check_objective`): `AdaptiveWindow(*bounds)`."""

    min: int
    start: int
    max: int
    objective: str = "knee"


OBJECTIVES = ("knee", "throughput", "p99=SECONDS")
"""What an adaptive window can serve (`--window-objective`)."""


def check_objective(objective: object, *, parameter: str = "objective") -> str:
    """`objective` in its one text form: ``knee`` (the most throughput at the least
    queueing), ``throughput`` (grow while throughput still rises at all) or ``p99=SECONDS``
    (the most throughput whose p99 latency stays under SECONDS, e.g. ``p99=2``).

    Raises:
        ConfigError: naming `parameter`, for anything else (a p99 bound not > 0).
    """
    text = objective.strip().lower() if isinstance(objective, str) else None
    if text in ("knee", "throughput"):
        return text
    if text is not None and text.startswith("p99="):
        try:
            bound = float(text.removeprefix("p99=").removesuffix("s"))
        except ValueError:
            bound = math.nan
        if math.isfinite(bound) and bound > 0:
            return f"p99={bound:g}"
    raise ConfigError(
        f"{{{parameter}}}: expected knee, throughput or p99=SECONDS (e.g. p99=2), got "
        f"{objective!r}",
        parameter=parameter,
    )


def objective_bound(objective: str) -> float | None:
    """The p99 bound of a ``p99=SECONDS`` objective (checked), else None."""
    return float(objective.removeprefix("p99=")) if objective.startswith("p99=") else None


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
        and len(spec) in (3, 4)
        and all(isinstance(n, int) and not isinstance(n, bool) for n in spec[:3])
    ):
        bounds = AdaptiveBounds(*spec[:3])
        if len(spec) == 4:
            bounds = bounds._replace(objective=check_objective(spec[3], parameter=parameter))
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
        return AdaptiveWindow(*checked)  # the objective too
    return Window(checked)


def window_spec(window: WindowSpec | tuple[int, int, int]) -> str:
    """The text form of a window spec (`parse_window`'s way back): `N`, or `MIN-START-MAX`
    (an `AdaptiveWindow`: its bounds and the size it started at; a `Window`: its size now)."""
    if isinstance(window, AdaptiveWindow):
        return f"{window.min}-{window.start}-{window.max}"
    if isinstance(window, Window):
        return str(window.size)
    if isinstance(window, tuple):
        return "-".join(str(part) for part in window[:3])
    return str(window)
