"""`Pacer`: call starts spaced at the rate a request-rate (or token-rate) limit lets through,
and held, every one of them, while the limit refuses (issue 32).

An `AdaptiveWindow` owns one (`window.pacer`) and feeds it the outcomes it records; a model
call waits for its turn (`await window.pace()`, `trio_tasksets._core.limits.pace`) before
each attempt. Pure but for `wait` (and `trio.current_time()` there): every other method takes
the time it is told, so a test drives it with plain numbers, and a MockClock makes `wait`
exact.
"""

from __future__ import annotations

import bisect
import math
from collections import deque

import trio

from .exceptions import ConfigError

__all__ = ["Pacer"]

RESPACE = 1.1
"""Calls waiting for their turns are spaced anew once the rate has grown by this factor
since their turns were taken."""

RISE = 0.2
"""How fast a paced rate grows up to its target (a bind's estimate of the limit), a second:
about ``e ** 0.2``, 1.22x."""

LONG_HOLD = 10.0
"""A Retry-After of this many `span`s or more (a per-minute limit spent) is the limit's own
time to reopen, exact but for its rounding to whole seconds: the first rate counts all of
it, and is the limit's long-run rate, not a guess to grow fast from."""


class Pacer:
    """Call starts spread at `rate` a second, once a request-rate limit answered 429, and
    held, all of them, while it refuses. The rules, each on its own:

    * **Hold.** A 429 of a rate limit (`limited`) holds every call start: until its
      Retry-After is over, when it has one (the limit said when; calls sent before then only
      add 429s); without one, for `first_hold` seconds, doubling (up to `max_hold`) while the
      429s keep coming with no call getting through between them, back to `first_hold` after
      one does. After a hold with no Retry-After only *one* call (the probe) starts, until it
      succeeds (`answered`) or as long as a 429 takes to come back has passed
      (`probe_wait`: it was let through); then the others, paced. A limit that stays shut
      (a per-minute window spent) so costs about ``log2(seconds shut / first_hold)``
      refused calls, not one per call in flight.
    * **Fresh and stale.** A 429 (or a success) of a call that started before the last hold
      ended was in flight as it began (given its `latency`; without one, any 429 during a
      hold): it says nothing new, and at most extends a Retry-After's hold. Only a fresh
      429 (a *bind*) begins or doubles a hold; only a fresh success ends a run of binds,
      or a call sent since the hold a 429's round trip before the bind and not refused
      (let through: a 429 comes back at once, its answer after the call's work).
    * **The first rate, a guess.** The first bind after calls succeeded begins a *run* of
      binds (the later ones, probes refused, move only the hold). The first run's rate is
      `margin` times what succeeded since the first call, over that time and the hold the
      bind begins (mostly a hold, a Retry-After longer than the calls took: over the
      geometric mean of the two times); or, when 429s not yet known to be a rate limit's
      (`refused`) kept coming for over half a `span` with 3 successes among them, what
      succeeded since those began (the limit bound all along). It grows fast, 1.65x a
      second (``e ** 0.5``; 7.4x, ``e ** 2``, from under 16 answers), until the next bind,
      which keeps `cut` (0.6) of the rate that bound at least: the limit is within that
      step. With no Retry-After (a bind costs a short hold) the rate then grows (1.22x a
      second) to the middle of the step, ``sqrt(cut)`` of the rate that bound; with one,
      each bind holds the whole endpoint that long, and it stays. But a first Retry-After
      of `LONG_HOLD` spans or more (a per-minute limit spent) is the limit's own time to
      reopen: the first rate counts all of it and is no guess (it creeps, slowly up to what
      it measured), or each reopened minute would be spent in a burst again.
    * **A binding cycle.** At each later run the rate is `margin` times what succeeded since
      the run before began, over that time, holds included but for half of the hold that
      ended it (the limit reopened somewhere within it): the limit's long-run rate, to which
      token buckets, fixed and sliding windows, per second and per minute, converge. A bind
      never raises the rate. A hold that ran past the limit's reopening (a Retry-After in
      whole seconds on a small bucket, a doubled probe's) makes that measure low: the limit
      is between it and the rate that bound, so the rate grows fast (1.22x a second) up to
      their geometric mean, at most 0.9 of the rate that bound. A bind with no Retry-After
      that came while it so grew, for a `span` or more, sets it no lower than `margin` of
      the rate a span before (the cycle's measure averaged the way up, from far below).
    * **A bind after a slow creep.** When the rate had crept (below) for 2 `span`s or more,
      at most 5 % a second, and the cycle was long (its hold at most an eighth of it), the
      limit is just under the rate that bound: the rate goes back at once to `margin` of
      it, less twice what it crept in a `span` (the limit may take that long to answer).
      The cycle's measure reads such a limit low: it averages the creep, and a
      whole-second Retry-After's hold. A rate so set that binds in turn goes to `margin`
      of the rate that bound, and so on down (unless the cycle's measure falls under 0.8
      of it: the limit came down). A short cycle (a bucket that drained at a rate above
      its own) is judged on its measure, as above.
    * **Creep.** Past that, with no bind, the rate creeps up (a limit may have risen): by
      `growth` a second at first, twice that every 5 s without a bind, at most 10 % a
      second; by half of `growth`, not doubling, while under the rate a slow creep last
      bound at (the limit is there); never while calls are held.
    * **Turns.** Waiting calls take turns `1 / rate` apart, in order; once the rate has
      grown by `RESPACE` (1.1x) since they took them, they take them anew (64 calls waiting
      at 12.8 a second held turns 5 s ahead and went out at that rate while it grew).
    * **End.** Pacing ends once the rate is 4x what succeeds (the limit no longer binds);
      and when pacing did not lower the share of calls that bind (still half of what it
      was once paced, and at least 10 %, after 4 runs, with 3 binds at least in the last
      4 spans and the rate that bound at most 1.5 times what succeeds: not while the runs
      still bring a guess down), the 429s do not depend on the rate: pacing ends and they
      are ignored here for `forget` seconds (only retried).

    Reads `trio.current_time()` in `wait`, so it is exact on a MockClock.
    """

    def __init__(
        self,
        *,
        span: float = 1.0,
        margin: float = 0.97,
        growth: float = 0.002,
        min_rate: float = 0.1,
        forget: float = 60.0,
        first_hold: float = 0.25,
        max_hold: float = 30.0,
    ) -> None:
        if (
            not span > 0
            or not 0 < margin <= 1
            or not growth >= 0
            or not min_rate > 0
            or not 0 < first_hold <= max_hold
        ):
            raise ConfigError(
                "need {span} > 0, 0 < {margin} <= 1, {growth} >= 0, {min_rate} > 0 and "
                "0 < {first_hold} <= {max_hold}",
                parameter=("span", "margin", "growth", "min_rate", "first_hold", "max_hold"),
            )
        self.span = span
        self.margin = margin
        self.growth = growth
        self.min_rate = min_rate
        self.forget = forget
        self.cut = 0.6  # what a bind keeps of the first rate (a guess grown fast) at least
        self.first_hold = first_hold
        self.max_hold = max_hold
        self.rate: float | None = None
        self.held_until = -math.inf  # no call starts before (a Retry-After, a hold)
        self.queued = 0  # calls waiting for their turn now
        self.waited = 0.0  # seconds call starts waited, in total
        self.binds = 0  # fresh 429s: holds begun or doubled
        self._opened = -math.inf  # when the last hold ended: calls started since are fresh
        self._next = -math.inf  # the next free start at the rate
        self._spaced = math.inf  # the rate the waiting calls' turns were spaced at
        self._last_turn = -math.inf  # when the last paced call started
        self._hold = first_hold  # the next hold without a Retry-After
        self._probing = False  # after a hold with no Retry-After: one call at a time
        self._probe_at: float | None = None  # when the probe started
        self._refusal = 0.0  # how long a 429 takes to come back, lately (seconds)
        self._ok_n = 0  # successes so far
        self._first_ok: float | None = None
        self._first_start = math.inf  # when the first call that succeeded started
        self._ok: deque[float] = deque()  # successes of the last 4 spans
        self._limited: deque[float] = deque()  # binds of the last 4 spans
        self._bind_ok = -1  # `_ok_n` at the last bind (-1: none yet)
        self._fresh = True  # a call sent since the last hold succeeded (none yet: True)
        self._first_sent = math.inf  # the first call start since the last hold ended
        self._timed = False  # successes come with their latencies (`answered`)
        self._cycle: tuple[float, int] | None = None  # (time, `_ok_n`) the last run began
        self._target = 0.0  # the rate grows fast up to it
        self._guess = False  # the rate is the first run's guess: it grows fast
        self._last_hold = 0.0  # seconds: the last hold
        self._bound_at = -math.inf  # the last bind
        self._grown_at = 0.0
        self._hold_from = -math.inf  # when the hold under way (or the last one) began
        self._fast = 0.5  # the growth a second of a rate from below
        self._ceiling: float | None = None  # the rate a bind found while creeping
        self._passed = -math.inf  # when the rate crept past `_ceiling`
        self._creep_from = -math.inf  # when the rate last grew fast (or was set): creep since
        self._runs = 0
        self._first_share = 0.0
        self._ignore_until = -math.inf
        self._run_from = -math.inf  # the first of the latest run of unrecognised 429s
        self._run_ok = 0  # `_ok_n` then
        self._last_refused = -math.inf
        self._gen = 0  # bumped at each change that moves the call starts
        self._changed: trio.Event | None = None

    # --- what the calls say -------------------------------------------------------------

    def _trim(self, now: float) -> None:
        while self._ok and self._ok[0] < now - 4 * self.span:
            self._ok.popleft()
        while self._limited and self._limited[0] < now - 4 * self.span:
            self._limited.popleft()

    def _ok_since(self, since: float) -> int:
        """Successes after `since` (of those kept: the last `4 * span` seconds)."""
        return len(self._ok) - bisect.bisect_right(self._ok, since)

    def success(self, now: float, latency: float | None = None) -> None:
        """A call succeeded at `now` (its `latency`, if known, tells when it started)."""
        self._ok_n += 1
        if self._first_ok is None:
            self._first_ok = now
        self._ok.append(now)
        self._trim(now)
        if latency is not None:
            self.answered(now, latency)
        if self.rate is None:
            return
        ceiling = self._ceiling
        if ceiling is not None and self.rate >= ceiling and self._passed <= self._bound_at:
            self._passed = now  # crept past the rate the last bind found: the creep restarts
        growth = self._creep(now)
        target = math.inf
        if self._guess:  # the first rate: e ** 0.5 (or e ** 2) a second until the next bind
            growth = self._fast
            self._creep_from = now
        elif self.rate < self._target:  # up to the target: e ** 0.2 a second
            growth, target = RISE, self._target
            self._creep_from = now
        grown = self.rate * (1 + growth * max(0.0, now - max(self._grown_at, self.held_until)))
        self.rate = min(grown, target)
        self._grown_at = now
        if self.queued and self.rate > RESPACE * self._spaced:
            # the turns already taken were spaced at a rate since outgrown: space them anew
            # (64 calls waiting at 12.8 a second held turns 5 s ahead, went out at that rate
            # while it grew to 87, and pacing ended as "far above what succeeds")
            self._spaced = self.rate
            self._next = min(self._next, self._last_turn + 1.0 / self.rate)
            self._notify()
        if (
            self.rate > 4 * self._ok_since(now - self.span) / self.span
            and now - max(self._bound_at, self.held_until) > 4 * self.span
        ):
            self.rate = self._ceiling = None  # far above what succeeds: no longer binds
            self._runs = 0

    def _creep(self, now: float) -> float:
        """The rate's growth a second, with no bind: by `growth` a second at first, twice
        that every 5 s without a bind, at most 10 % a second; half of `growth` while under
        the rate a slow creep last bound at (the limit is there)."""
        assert self.rate is not None
        if self._ceiling is not None and self.rate < self._ceiling:
            return self.growth / 2
        quiet = min(now - max(self._bound_at, self.held_until, self._passed), 120.0)
        return min(0.1, self.growth * 2 ** (max(0.0, quiet) / 5.0))

    def answered(self, now: float, latency: float) -> None:
        """A call answered 200 at `now`, `latency` seconds after it started: a probe's
        answer opens the endpoint again (a call sent before the hold says nothing)."""
        self._timed = True
        self._first_start = min(self._first_start, now - latency)
        if now - latency < self._opened - 1e-9:
            return
        self._fresh = True  # a call sent since the last hold went through
        if self._probing and now >= self.held_until:
            self._probing = False
            self._hold = self.first_hold
            self._next = -math.inf
            self._notify()

    def refused(self, now: float) -> None:
        """A 429 not (yet) known to be a request-rate limit's, at `now`: where a run of
        429s began, from which what succeeded is what the limit let through."""
        if now - self._last_refused > self.span:
            self._run_from = now
            self._run_ok = self._ok_n
        self._last_refused = now

    def limited(
        self, now: float, retry_after: float | None = None, latency: float | None = None
    ) -> None:
        """A 429 of a request-rate limit came at `now`, with its Retry-After if any, and the
        call's `latency` (seconds since it started) if known."""
        if now < self._ignore_until:
            return
        self._trim(now)
        if latency is not None and latency >= 0:
            self._refusal = max(latency, 0.9 * self._refusal)
        fresh = (
            now - latency >= self._opened - 1e-9 if latency is not None else now >= self.held_until
        )
        if not fresh:  # it was in flight as the hold began: nothing new, but its wait
            if retry_after is not None and retry_after > 0 and now + retry_after > self.held_until:
                # (calls sent after the hold began stay fresh: `_opened` is the bind's)
                self._hold_until(now, now + retry_after, opened=False)
            return
        self.binds += 1
        self._limited.append(now)
        self.refused(now)
        # calls sent since the last hold succeeded (those in flight as it began say nothing;
        # without latencies, any success), or one was sent a 429's round trip before this
        # one and not refused: let through, its answer still to come (a 429 comes back at
        # once, a success after the call's work: at a paced rate of several calls a 429's
        # round trip, every bind came before the answers of the calls sent ahead of it, no
        # run was ever new, and the first guess stood: the zoo's tpm 1 per minute, a
        # bucket whose minute of tokens went in 0.4 s, was paced at 743 calls/s, 4.7 let
        # through a second, one refused a second, 14 % of its calls)
        let_through = latency is not None and self._first_sent < now - latency - self._refusal
        new_run = (self._fresh or let_through) if self._timed else self._ok_n > self._bind_ok
        # how it grew as it bound: by how much a second, and since when (before this bind)
        creep = math.inf if self.rate is None else self._creep(now)
        creeping = now - max(self._creep_from, self.held_until)
        self._fresh = False
        last_hold = self._last_hold  # the hold after which calls went through again
        # (a 429 with no Retry-After: with one, a token bucket drained on the way up bound
        # a second or more after the rate passed its refill, and the rate a second before
        # was over it too: one refused call more each time, the zoo's tpm 1 4.9 % against 4.6)
        rising = (
            now - self._opened
            if retry_after is None and self.rate is not None and self.rate < self._target
            else 0.0
        )
        if retry_after is not None and retry_after > 0:
            self._probing = False
            self._hold_until(now, max(self.held_until, now + retry_after))
        else:
            self._hold = self.first_hold if new_run else min(2 * self._hold, self.max_hold)
            self._probing = True
            self._probe_at = None
            self._hold_until(now, max(self.held_until, now + self._hold))
        self._bind_ok = self._ok_n
        self._bound_at = self._grown_at = now
        if new_run:
            timed = retry_after is not None and retry_after > 0
            self._new_run(now, last_hold, creep, creeping, rising, timed)

    def _new_run(
        self,
        now: float,
        last_hold: float,
        creep: float,
        creeping: float,
        rising: float,
        timed: bool,
    ) -> None:
        """The first bind after calls succeeded: the rate from the binding cycle.
        `last_hold`: the hold after which calls went through again; `creep`: the rate's
        growth a second as it bound, which it had been for `creeping` seconds; `rising`:
        how long it had been growing fast to its target (0: it was not, or the 429 had a
        Retry-After); `timed`: the 429 had a Retry-After."""
        # the share of calls that bound (fresh 429s) over the last 4 spans
        refused = len(self._limited)
        share = refused / max(1, refused + len(self._ok))
        succeeding = len(self._ok) / (4 * self.span)  # calls a second, over those spans
        if (
            self._runs >= 4
            and refused >= 3
            and share >= max(0.1, 0.5 * self._first_share)
            and (self.rate is None or self.rate <= 1.5 * succeeding)
        ):
            # pacing did not lower the 429s' share: they do not depend on the rate either.
            # Not on one bind among a few calls (a limit of 2 calls/s refused one call in 9
            # over 4 s, and pacing ended), nor while each run still brings the rate down
            # from a guess far above the limit, when every short cycle binds (the zoo's tpm
            # 1 per minute, at its fourth run, was paced at 9.4 calls/s where 4.7 went
            # through). Once ended, every run retries on its own: most calls are refused.
            self.rate = None
            self._ignore_until = now + self.forget
            self._runs = 0
            self._probing = False
            self._hold_until(now, now)
            return
        if self._first_ok is None:  # nothing succeeded yet: a hold, no rate
            return
        if self._runs == 1:  # the share once paced: what pacing should lower
            self._first_share = share
        bound, run = self.rate, self._run_from
        cycle, self._cycle = self._cycle, (now, self._ok_n)
        self._runs += 1
        self._next = -math.inf
        if bound is None:  # the first run (unpaced): a guess, which grows fast
            if now - run >= self.span / 2 and self._ok_n - self._run_ok >= 3:
                # 429s have kept coming since `run`: the limit bound all along, and what
                # succeeded since is what it lets through
                ok, seconds = self._ok_n - self._run_ok, now - run
            else:  # since the first call, and the hold this bind begins
                ok, held = self._ok_n, max(0.0, self.held_until - now)
                took = now - min(self._first_ok, self._first_start)
                seconds = took + held
                if held > took > 0:
                    # mostly held (a Retry-After longer than the calls took): between what
                    # succeeded over the time they took and over that and the hold
                    seconds = math.sqrt(took * seconds)
            if timed and self.held_until - now >= LONG_HOLD * self.span:
                # a per-minute limit spent, told to wait most of its minute: what went
                # through over the calls' time and the whole wait is what it lets through,
                # and growing fast from it would spend the reopened minute in a burst again
                # (the zoo's tpm 5 per minute, a sliding window of 50 calls a second spent
                # in 2 s: guessed at 225 calls a second over the geometric mean, it spent
                # the next minute in 4 s and waited 57 s, 20 calls a second in all)
                seconds = self.held_until - min(self._first_ok, self._first_start)
                self.rate = self._target = max(self.min_rate, self.margin * self._ok_n / seconds)
                self._ceiling = self.rate / self.margin  # creep slowly: the limit is there
                self._guess = False
                self._creep_from = now
                return
            self.rate = max(self.min_rate, self.margin * ok / max(seconds, self.span / 10))
            self._guess = True
            self._fast = 2.0 if ok < 16 else 0.5  # from a few answers: faster
            return
        assert cycle is not None
        start, before = cycle
        # what succeeded since the last run began, holds included, but for half of the
        # hold that ended it (the limit reopened somewhere within it)
        seconds = now - start - last_hold / 2
        rate = self.margin * (self._ok_n - before) / max(seconds, self.span / 10)
        rate = max(self.min_rate, min(bound, rate))
        # holds that ran past the limit's reopening (a Retry-After in whole seconds on a
        # small bucket, a probe's) make the cycle's measure low: the limit is between it
        # and the rate that bound; the rate grows fast up to their geometric mean (at most
        # 0.9 of the rate that bound)
        target = min(math.sqrt(rate * bound), 0.9 * bound)
        if self._guess:  # the guess grew fast until it bound: the limit is a step below
            rate = max(rate, self.cut * bound)
            # with no Retry-After (a bind costs a short hold) it grows on, up to the middle
            # of that step: each bind with one holds a whole Retry-After (a bucket of 10 at
            # 200 calls a second, told to wait 1 s, lost 200 calls to each)
            target = rate if timed else max(rate, math.sqrt(self.cut) * bound)
            self._ceiling = None
        elif creep <= 0.05 and creeping >= 2 * self.span and last_hold <= (now - start) / 8:
            # it bound after creeping slowly for a while, a long cycle of which the hold was
            # a small part: the limit is just under the rate that bound (the cycle's measure
            # averaged the creep, and a whole-second Retry-After's hold). (A short cycle, a
            # bucket that drained at a rate above its own, says less: its measure decides.)
            # Less twice what it crept in a span: a limit may take that long to answer.
            rate = target = self.margin * bound / (1 + 2 * creep * self.span)
            self._ceiling = bound
        elif self._ceiling is not None and bound <= self._ceiling and rate >= 0.8 * bound:
            # the rate set just under the last such bind bound in turn: the limit is a step
            # under it (the cycle's measure is no closer: the hold was a large part of it)
            rate = target = self.margin * bound
            self._ceiling = bound
        else:
            self._ceiling = None  # the limit came down, or rose
            if rising >= self.span:
                # it bound while growing fast toward its target, for a span or more: the
                # rate a span before went through (a limit takes about that long to answer:
                # a window of a second fills for a second), and the cycle's measure, which
                # averaged the way up from far below, reads it low (a header-less sliding
                # window of 249 calls a second was measured at 141 after binding at 289, and
                # crept up from 202 for the rest of the run)
                rate = max(rate, self.margin * bound * math.exp(-RISE * self.span))
                target = max(target, rate)
        self.rate, self._target = rate, target
        self._guess = False
        self._creep_from = now

    def _hold_until(self, now: float, until: float, *, opened: bool = True) -> None:
        if now >= self.held_until:  # a new hold (else one under way, extended)
            self._hold_from = now
        self._last_hold = max(0.0, until - self._hold_from)
        self.held_until = until
        if opened:
            self._opened = until
            self._first_sent = math.inf
        self._next = -math.inf
        self._notify()

    def _notify(self) -> None:
        """Call starts moved: every waiting call takes its turn afresh."""
        self._gen += 1
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def probe_wait(self) -> float:
        """Seconds a probe is waited for: a 429 comes back at once, so a probe not refused
        by then was let through."""
        return max(0.05, 3 * self._refusal)

    # --- the calls' turns ---------------------------------------------------------------

    async def wait(self) -> float:
        """Wait for this call's turn (at once when unpaced and not held); return the seconds
        waited."""
        begun = trio.current_time()
        queued = False
        try:
            while True:
                now = trio.current_time()
                start = max(now, self.held_until)
                reserved = False
                if self._probing and start <= now:  # the hold is over: one probe at a time
                    if self._probe_at is None:
                        self._probe_at = now  # this call is the probe
                        break
                    lapse = self._probe_at + self.probe_wait()
                    if now < lapse:  # the probe is out: wait for its answer
                        start = lapse
                    else:  # not refused by now: it was let through
                        self._probing = False
                        self._next = -math.inf
                if self.rate is not None and not self._probing:
                    if self._next == -math.inf:
                        self._spaced = self.rate
                    start = max(start, self._next)
                    self._next = start + 1.0 / self.rate
                    reserved = True
                if start <= now:
                    if reserved:
                        self._last_turn = start
                    break
                if not queued:
                    queued = True
                    self.queued += 1
                gen = self._gen
                if self._changed is None:
                    self._changed = trio.Event()
                changed = self._changed
                with trio.move_on_at(start):
                    await changed.wait()
                if reserved and self._gen == gen:
                    self._last_turn = start
                    break  # its turn came, and nothing moved the turns
        finally:
            if queued:
                self.queued -= 1
        now = trio.current_time()
        if now >= self._opened - 1e-9:
            self._first_sent = min(self._first_sent, now)
        waited = now - begun
        self.waited += waited
        return waited

    def __repr__(self) -> str:
        rate = "unpaced" if self.rate is None else f"{self.rate:.1f}/s"
        return f"Pacer({rate})"
