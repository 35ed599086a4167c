"""The adaptive window's objectives and its reading of servers by behaviour (issue 32).

The controller alone is driven by closed-form models of the zoo's families (pure: no clock);
the window and the eval run against the suite's fake server on a MockClock; two short
real-time runs go against `../shared/servers/zoo.py` processes, when the zoo is there.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import statistics
import subprocess
import sys
from collections import Counter, deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

import trio_tasksets as tt
from trio_tasksets._core.adaptive import (
    AdaptiveBounds,
    AdaptiveController,
    AdaptiveWindow,
    EngineLoad,
    Outcome,
    Pacer,
    build_window,
    check_objective,
    window_spec,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures"
if str(FIXTURES) not in sys.path:
    sys.path.insert(0, str(FIXTURES))

from chat_server import ChatServer, RateLimit, WindowLimit  # noqa: E402

ZOO = Path(__file__).resolve().parent.parent.parent / "shared" / "servers" / "zoo.py"


# --- the objective, as text and as a spec -----------------------------------------------------


def test_an_objective_has_one_text_form_and_a_bad_one_names_its_parameter() -> None:
    assert check_objective("knee") == "knee"
    assert check_objective(" Throughput ") == "throughput"
    assert check_objective("p99=2") == "p99=2"
    assert check_objective("p99=0.250s") == "p99=0.25"
    for bad in ("fast", "p99=", "p99=0", "p99=-1", "p99=nan", 3):
        with pytest.raises(tt.ConfigError, match="objective"):
            check_objective(bad)
    bounds = AdaptiveBounds(1, 8, 64, objective="p99=1.5")
    window = build_window(bounds)
    assert isinstance(window, AdaptiveWindow)
    assert window.controller.objective == "p99=1.5"
    assert window_spec(bounds) == "1-8-64"  # the -c form; the objective is its own flag
    assert build_window((1, 8, 64)).controller.objective == "knee"  # type: ignore[attr-defined]
    with pytest.raises(tt.ConfigError, match="objective"):
        AdaptiveWindow(1, 8, 64, objective="soon")


# --- the controller on models of engines --------------------------------------------------------


def _engine(capacity: int, alpha: float, base: float = 0.2) -> Any:
    """The zoo's engine in closed form: a batch of r <= C calls takes base * (1 + alpha r/C);
    past C the rest queue (FIFO), so a closed loop of w calls sees w / X seconds a call."""

    def latency(size: int) -> float:
        running = min(size, capacity)
        rate = running / (base * (1 + alpha * running / capacity))
        return size / rate

    return latency


def _drive(c: AdaptiveController, latency_of: Any, rounds: int, lag: float = 0.0) -> list[int]:
    """Closed-loop rounds of `c.size` calls; `lag` seconds of the client's own delay are added
    to each call (a busy client). Returns the size after each round."""
    now, sizes = 0.0, []
    for _ in range(rounds):
        size = c.size
        latency = latency_of(size) + lag
        for _ in range(size):
            now += latency / size
            c.record(Outcome.SUCCESS, now, size, latency=latency)
        sizes.append(c.size)
    return sizes


@pytest.mark.parametrize(("capacity", "alpha"), [(40, 1.0), (13, 1.5), (100, 0.1), (24, 2.0)])
def test_knee_settles_at_an_engines_capacity_from_above_and_below(
    capacity: int, alpha: float
) -> None:
    """Slow start overshoots the capacity; its failed doubling probes down to the knee."""
    c = AdaptiveController(1, 1024, 8, cooldown=5.0)
    sizes = _drive(c, _engine(capacity, alpha), 150)
    settled = sorted(sizes[-40:])
    assert settled[0] >= 0.75 * capacity
    assert settled[len(settled) // 2] <= 1.3 * capacity  # where it sits
    assert settled[-1] <= 1.6 * capacity  # a probe up now and then (every cooldown)


def test_calls_that_end_together_count_in_flight_for_their_time() -> None:
    """Issue 32: an engine's batch ends its calls together, and as each ended the calls in
    flight were counted: 18, 17, ... 1, half the window. The zoo's engine 3 at a window of 18
    delivered 73 calls/s and was read as 59, 8 % apart from round to round (so a step of one
    call near the knee was judged on noise and bias). The calls in flight are weighted by
    time now: a burst's ends take no time, and the window was full until it came."""
    c = AdaptiveController(18, 18, 18)  # (held at 18: what it measures, not what it does)
    now, latency = 0.0, 0.25
    for _ in range(6):  # waves of 18 calls of 0.25 s each, ending at once
        now += latency
        for in_flight in range(18, 0, -1):  # each, as it ends, frees its place
            c.record(Outcome.SUCCESS, now, in_flight, latency=latency)
    assert c.measured is not None
    assert c.measured[1] == pytest.approx(18 / latency)
    # an idle client's gap is no call's time: 17 calls end one by one with the window full,
    # then the feed pauses for 10 s and one call, begun at its end, ends alone
    for _ in range(17):
        now += latency / 18
        c.record(Outcome.SUCCESS, now, 18, latency=latency)
    now += 10.0
    c.record(Outcome.SUCCESS, now, 1, latency=0.05)
    assert c.measured[1] > 0.8 * 18 / latency  # (the gap taken at 1 in flight: 4 calls/s)


def test_a_runs_first_calls_that_end_together_count_for_their_time() -> None:
    """Issue 32, the zoo's plateau 1: a run's first 8 calls start together and end together
    1.36 s later. With no call ended before them, no time was counted, so they were counted
    as each ended (8, 7, ... 1: half the window), and the round read 3.3 calls/s where 8
    calls of 1.36 s make 5.9: the doubling to 16 (5.3 calls/s) looked like a gain of 60 %,
    and slow start went on to 32. The first call's latency is the time it counts for."""
    c = AdaptiveController(1, 64, 8)
    for in_flight in range(8, 0, -1):
        c.record(Outcome.SUCCESS, 1.36, in_flight, latency=1.36)
    assert c.measured is not None
    assert c.measured[1] == pytest.approx(8 / 1.36)


def _drive_noisy(
    c: AdaptiveController, latencies_of: Any, rounds: int, noise: float, seed: int
) -> list[int]:
    """Closed-loop rounds of `c.size` calls whose latencies `latencies_of(size, rng)` gives,
    on a noisy server: each round's calls share a factor (1 + N(0, noise)) on their latency
    (an engine's batch waves, a machine's moments), and each call has its own too. Seeded:
    the same draw each time. Returns the size after each round."""
    return [c.size for _ in itertools.islice(_noisy_rounds(c, latencies_of, noise, seed), rounds)]


def _noisy_rounds(
    c: AdaptiveController, latencies_of: Any, noise: float, seed: int
) -> Iterator[tuple[int, list[tuple[float, float]]]]:
    """`_drive_noisy`'s rounds, without end: each round's size and its calls' (end, latency),
    the virtual clock starting at 0."""
    rng = random.Random(seed)
    now = 0.0
    while True:
        size, calls = c.size, []
        factor = 1 + rng.gauss(0, noise)
        for latency in latencies_of(size, rng):
            latency *= factor * (1 + rng.gauss(0, noise))
            now += latency / size
            c.record(Outcome.SUCCESS, now, size, latency=latency)
            calls.append((now, latency))
        yield size, calls


def _uniform(capacity: int, alpha: float) -> Any:
    """`_engine`'s latency, the same for every call of a round."""
    latency_of = _engine(capacity, alpha)
    return lambda size, rng: [latency_of(size)] * size


def _batches(capacity: int, alpha: float, base: float = 0.2, edge: float = 0.01) -> Any:
    """An engine of `capacity` slots as a closed loop sees it: up to C calls, one batch each;
    past C, a call waits m or m + 1 batches of C (m = size // C, so many of them that the
    mean is size / C), the p99 a whole batch over the median. A window of exactly C leaves
    the batch short of full by the client's gap between a reply and the next call, so past
    C throughput is `edge` higher (the zoo's engine at C = 13: 1 %)."""

    def latencies(size: int, rng: random.Random) -> list[float]:
        if size <= capacity:
            return [base * (1 + alpha * size / capacity)] * size
        batch = base * (1 + alpha) / (1 + edge)
        whole, part = divmod(size / capacity, 1)
        return [(whole + (rng.random() < part)) * batch for _ in range(size)]

    return latencies


@pytest.mark.parametrize(("capacity", "alpha"), [(40, 1.0), (13, 1.5), (100, 0.1), (24, 2.0)])
def test_noise_does_not_ratchet_the_knee_up(capacity: int, alpha: float) -> None:
    """Rounds whose throughput varies by a few percent at one size (every real server's):
    judged on one round, a lucky one kept a step up now and then and refused a step back
    down, and the window climbed to several times the capacity (2-27x here). A change
    within the rounds' own noise is measured again, and past a failed probe up the next goes
    down: `knee` settles near the capacity, draw after draw."""
    settled = []
    for seed in range(6):
        c = AdaptiveController(1, 1024, 8, cooldown=5.0)
        sizes = _drive_noisy(c, _uniform(capacity, alpha), 400, 0.02, seed)
        settled.append(statistics.median(sizes[-100:]) / capacity)
    assert statistics.median(settled) <= 1.1
    assert max(settled) <= 1.5
    assert min(settled) >= 0.8


@pytest.mark.parametrize(("capacity", "alpha"), [(13, 1.5), (40, 1.0), (24, 2.0)])
def test_knee_stops_where_calls_begin_to_queue(capacity: int, alpha: float) -> None:
    """Issue 32 (the zoo's engine, C = 13): a window of C + 1 gains 1 % of throughput (an
    elasticity of 0.13, over `knee`'s 0.08) and makes one call in C + 1 wait a whole batch,
    the p99 twice C's. `knee` settled at C + 1 to C + 3. Its p99 rising faster than the size
    says the calls queue: the knee is C (with no noise, where it spends most rounds), with
    noise within a few."""
    c = AdaptiveController(1, 1024, 8, cooldown=5.0)
    sizes = _drive_noisy(c, _batches(capacity, alpha), 400, 0.0, 0)
    (size, rounds), *_ = Counter(sizes[-100:]).most_common(1)
    assert size == capacity  # (the probes take it elsewhere a round or a few at a time)
    assert rounds >= 35
    settled = []
    for seed in range(6):
        c = AdaptiveController(1, 1024, 8, cooldown=5.0)
        sizes = _drive_noisy(c, _batches(capacity, alpha), 400, 0.02, seed)
        settled.append(statistics.median(sizes[-100:]) / capacity)
    assert statistics.median(settled) >= 0.9
    assert statistics.median(settled) <= 1.05
    assert min(settled) >= 0.8


def _kv_edge(size: int, capacity: int) -> float:
    """How much more than C's a window of `size` delivers, on `_kv_batches`."""
    return 0.01 + 0.1 * min(0.35, max(0.0, size / capacity - 1))


def _kv_batches(capacity: int, alpha: float, base: float = 0.2) -> Any:
    """`_batches` whose throughput past C still rises a little (the zoo's engine with a KV
    budget: fewer preemptions in a fuller queue), 4.5 % of it at 1.35 C and on."""

    def latencies(size: int, rng: random.Random) -> list[float]:
        waves: list[float] = _batches(capacity, alpha, base, _kv_edge(size, capacity))(size, rng)
        return waves

    return latencies


def test_the_knee_search_goes_below_two_sizes_that_both_queue() -> None:
    """Issue 32, the zoo's engine 3 (C 18, a KV budget): throughput still rises a few
    percent past C, so a probe down from 32 to 23 lost throughput, the search's lower end
    stayed at 23, and both sizes of every later probe queued (a p99 twice C's): the queue
    rule compares the two, and saw nothing. Now the smaller of a probe's sizes is compared
    with the smaller sizes measured lately too: queueing against them, it is past the knee."""
    capacity, alpha, base = 18, 1.5, 0.1
    latencies = _kv_batches(capacity, alpha, base)
    rate = {  # each size's rate, the waves' mean
        size: size / (base * (1 + alpha * size / capacity))
        if size <= capacity
        else capacity * (1 + _kv_edge(size, capacity)) / (base * (1 + alpha))
        for size in range(1, 65)
    }
    best = max(rate.values())
    least = min(size for size in rate if rate[size] >= 0.95 * best)  # the bench's knee
    assert least == capacity
    settled = []
    for seed in range(12):
        c = AdaptiveController(1, 256, 8, cooldown=5.0)
        sizes = _drive_noisy(c, latencies, 150, 0.01, seed)
        settled.append(statistics.fmean(sizes[30:]) / capacity)  # once the search has run
    assert max(settled) <= 1.2, settled  # (1.57 on one draw without: the search held at 23-38)
    assert 0.9 <= statistics.median(settled) <= 1.1, settled


def test_a_search_below_a_size_that_queues_stays_above_one_that_delivers_less() -> None:
    """Issue 32, the zoo's engine 1 (C 13, calls of 0.8 s): the search after slow start went
    from 16 (its calls queue) to 11, and as a step down from a size that queues stays, on to
    9, then back up a call at a time: 20 rounds of 1.5 s to reach 13, past half of a 38 s
    run (0.88-0.94x the best fixed rate). 11 delivered clearly less than 16, so the knee is
    between the two: the search goes on there."""
    settled: list[float] = []
    for seed in range(6):
        c = AdaptiveController(1, 256, 8)
        sizes = _drive_noisy(c, _batches(13, 1.53, base=0.306), 40, 0.01, seed)
        at = [i for i in range(len(sizes)) if all(s in (12, 13, 14) for s in sizes[i:])]
        settled.append(at[0] if at else math.inf)
    assert statistics.median(settled) <= 15, settled  # (20 without)


def test_a_fast_engines_knee_is_not_left_a_step_short_by_the_noise() -> None:
    """Issue 32, the zoo's engine 5 (C 69): a step of a sixteenth below the knee gains a few
    percent, within 4 noisy rounds' spread, and the tie went to the smaller size: `knee`
    settled at 0.81-0.99 of C (median 0.89). A probe still unclear after 4 rounds measures
    on while it has lasted less than a quarter cooldown (a fast engine's rounds are cheap)."""
    settled = []
    for seed in range(6):
        c = AdaptiveController(1, 256, 8)  # cooldown 15 s; calls of some 80 ms
        sizes = _drive_noisy(c, _batches(69, 1.59, base=0.03), 1200, 0.03, seed)
        settled.append(statistics.median(sizes[-400:]) / 69)
    assert statistics.median(settled) >= 0.95
    assert min(settled) >= 0.85


def test_a_flat_doubling_is_undone_once_its_rounds_show_it_cannot_pay() -> None:
    """Issue 32, `bench.zoo --quick`'s engine (C 13, calls of 30-76 ms): slow start's
    doubling from 16 to 32 delivers what 16 did. No change to tell from the rounds' noise,
    it was measured on for 3.75 s (a quarter cooldown) and half of an 8 s run sat at 32, at
    2.9x the p99. After 4 rounds, no number of rounds more can tell a change that small
    from the noise of 16's one round (or it is clearly short of what a doubling must gain):
    it is undone then, and the knee is found as before."""
    at_32, settled = [], []
    for seed in range(6):
        c = AdaptiveController(1, 256, 8)  # cooldown 15 s
        begun, spent, sizes = 0.0, 0.0, []
        for size, calls in _noisy_rounds(c, _batches(13, 1.53, base=0.03), 0.03, seed):
            spent += calls[-1][0] - begun if size == 32 else 0.0
            begun = calls[-1][0]
            sizes.append(c.size)
            if begun >= 20.0:
                break
        at_32.append(spent)
        settled.append(statistics.median(sizes[-50:]))
    assert max(at_32) < 1.5, at_32  # (3.7-3.9 s: measured on for a quarter cooldown)
    assert statistics.median(settled) == 13, settled


def _vllm_rising(size: int) -> float:
    """A real vLLM on a busy machine (`bench.real_engine`, sixteenth pass): its rate at `size`
    in flight, from those measured at 8 to 256, log-linear between them; from 64 to 128 an
    elasticity of 0.25 (`_vllm_pinned`'s, on a quiet one: 0.03)."""
    measured = {8: 120.0, 16: 160.0, 32: 205.0, 64: 240.0, 128: 285.0, 256: 290.0}
    return _log_linear(measured, size)


def test_a_doubling_read_short_of_its_bar_within_the_noise_is_measured_again() -> None:
    """Issue 32, a real vLLM: slow start's doubling from 64 to 128 (an elasticity of 0.25
    over the two sizes' steady rates) read 0.11 on one round at each size (128's first round
    at 233 calls/s, its steady rate 285), short of the 0.15 a doubling must gain, and the
    knee settled at 48-70, 0.70-0.89x of the best rate. Short of the bar by less than the
    rounds' noise, a doubling is measured again (up to `PROBE_ROUNDS`) before it is judged."""
    c = AdaptiveController(1, 256, 8)
    now, slow = 0.0, 2  # 128's first two rounds (settling, then measured) 10 % slower
    while now < 6.0 and c.size <= 128:
        size = c.size
        latency = size / _vllm_rising(size)
        if size == 128 and slow:
            latency, slow = 1.1 * latency, slow - 1
        for i in range(size):  # each call 20 % either side of the round's latency
            now += latency / size
            c.record(Outcome.SUCCESS, now, size, latency=latency * (1.2 if i % 2 else 0.8))
        if size == 128 and not slow:
            break
    assert c.size >= 128
    # and over noisy rounds (3.5 % a round, each call's own spread 0.2), judged on the
    # second half of 30 s as `bench.real_engine` judges it
    shares = []
    for seed in range(24):
        rng, c, now, rates = random.Random(seed), AdaptiveController(1, 256, 8), 0.0, []
        while now < 30.0:
            size = c.size
            latency = size / _vllm_rising(size) * (1 + rng.gauss(0, 0.035))
            for _ in range(size):
                now += latency / size
                c.record(
                    Outcome.SUCCESS, now, size, latency=latency * max(0.2, 1 + rng.gauss(0, 0.2))
                )
                if now >= 15.0:
                    rates.append(_vllm_rising(size))
        shares.append(statistics.fmean(rates) / _vllm_rising(256))
    assert statistics.median(shares) >= 0.945, sorted(shares)  # (0.93 without)


def test_probes_past_a_steady_knee_come_less_and_less_often() -> None:
    """Each probe past the knee costs the p99 the calls it queues. At a knee that stays where
    it is, failed steps up in a row hold growth for longer and longer, up to 4 cooldowns
    (they were at most 1: a probe past the capacity every couple of cooldowns, for good)."""
    c = AdaptiveController(1, 1024, 8, cooldown=5.0)
    _, changes = _steps(c, _engine(40, 1.0), 400.0)
    probes = [t for t, size, reason in changes if reason == "grow" and size > 40]
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert len(probes) >= 10
    assert max(gaps) >= 4 * c.cooldown
    assert [size for _, size, reason in changes if reason == "no gain"][-5:] == [40] * 5


def test_throughput_grows_on_a_plateau_as_long_as_it_still_rises() -> None:
    """The plateau (gamma 1): throughput r / (base (1 + r/C)) keeps rising, ever less. `knee`
    stops where a step adds less than 0.12 of itself; `throughput` goes on further."""

    def plateau(size: int) -> float:
        return 0.2 * (1 + size / 16)

    knee = AdaptiveController(1, 1024, 8, cooldown=5.0)
    most = AdaptiveController(1, 1024, 8, cooldown=5.0, objective="throughput")
    knee_size = _drive(knee, plateau, 150)[-1]
    most_size = _drive(most, plateau, 150)[-1]
    assert 32 <= knee_size < most_size


def _curve(rate_of: Any) -> Any:
    """A closed loop's latencies on a server whose throughput at size r is `rate_of(r)`."""
    return lambda size, rng: [size / rate_of(size)] * size


def test_throughput_crosses_a_flat_stretch_to_where_throughput_rises_again() -> None:
    """Issue 32, a real vLLM on a busy CPU: throughput flat from 8 to 40 calls, then rising
    up to 256. Ties within the noise went to the smaller size, and `throughput` stopped at
    16-25, 0.33x of `-c 256`. They go to the larger size now: it ends at the top. (Two steps
    up that fail by chance on the flat stretch make the next probe go down, and it costs a
    cooldown: over 16 draws of this model the window reaches 256 at round 726 (median; 3,060
    at the latest), where with no probe down it did at 573 (2,691).)"""

    def rate_of(size: int) -> float:
        return 100.0 * min(size, 8) * float(max(1.0, size / 40) ** 0.2)

    for seed in range(4):
        c = AdaptiveController(1, 256, 8, cooldown=5.0, objective="throughput")
        sizes = _drive_noisy(c, _curve(rate_of), 4000, 0.03, seed)
        assert statistics.median(sizes[-500:]) == 256, seed


def _falling_plateau(base: float) -> tuple[Any, float]:
    """The zoo's plateau 1 in closed form (C 6, gamma 1.76): throughput at size r is
    r / (base (1 + r/C)^gamma), which peaks at C / (gamma - 1), 8; and that peak."""
    capacity, gamma = 6, 1.76

    def rate_of(size: int) -> float:
        return size / (base * float((1 + size / capacity) ** gamma))

    return rate_of, max(rate_of(size) for size in range(1, 257))


def test_throughput_does_not_walk_down_a_falling_plateau_by_ties() -> None:
    """The zoo's plateau with gamma 1.76: throughput r / (1 + r/C)^gamma peaks at
    C / (gamma - 1) and falls past it. Ties go to the larger size, one step at a time; a
    smaller size measured lately that clearly delivered more takes the window back, so it
    stays within a few percent of the peak (it walked to 2x the peak, 0.91x, without). (The
    sizes' throughputs are remembered for 4 cooldowns: here some 40 calls' latency, about
    the zoo's plateaus' at the CLI's cooldown of 15 s.)"""
    rate_of, peak = _falling_plateau(0.1)
    for seed in range(4):
        c = AdaptiveController(1, 256, 8, cooldown=5.0, objective="throughput")
        sizes = _drive_noisy(c, _curve(rate_of), 1200, 0.03, seed)
        assert statistics.mean(rate_of(size) for size in sizes[-300:]) >= 0.95 * peak, seed


def test_throughput_past_a_falling_plateaus_peak_probes_back_down_to_it() -> None:
    """Issue 32, the zoo's plateau 1 (C 6, gamma 1.76: the peak at 8): slow start took 8 to
    16 (a tie on its first rounds) and 32 (back to 16); with 8 forgotten after 4 cooldowns
    nothing smaller was measured lately, and the window went 16, 20, 16, 20 for good (0.86x
    the best fixed window). Two failed steps up in a row probe down next, as `knee`'s do.
    Here the window starts at 16 with nothing smaller measured: it gets back to the peak."""
    rate_of, peak = _falling_plateau(0.306)
    for seed in range(4):
        c = AdaptiveController(1, 256, 16, cooldown=15.0, objective="throughput")
        sizes = _drive_noisy(c, _curve(rate_of), 1500, 0.05, seed)
        assert min(sizes) < 16, seed
        assert statistics.mean(rate_of(size) for size in sizes[-750:]) >= 0.95 * peak, seed


def test_knee_on_a_flat_plateau_is_not_pushed_up_by_noise_at_its_edge() -> None:
    """Issue 32, `bench.zoo --quick`'s plateau (soft capacity 6, gamma 1.76, 30 ms calls):
    6 delivers 0.98 of the peak (at 8), 7 0.996. The steps from 8 to 7 and from 7 to 6 cost
    elasticities of 0.063 and 0.10, both near `knee`'s 0.08, and a noisy round judged the
    step down to 7 a loss: back to 8, at 1.3x the p99 of 6 (and its probes up past it,
    1.47x, in one run of three). A step down now goes back only if it cost 1.5x what a step
    up must gain: over 16 draws of 8 s, each second half within the goals (>= 0.95x the
    peak's rate, p99 <= 1.3x that of the bench's smallest fixed window within 5 % of it)."""
    rate_of, peak = _falling_plateau(0.03)
    sweep = (3, 4, 6, 8, 12, 16)  # the bench's fixed windows for this draw
    smallest = min(size for size in sweep if rate_of(size) >= 0.95 * peak)
    bound = 1.3 * smallest / rate_of(smallest)  # (a closed loop's latency: size / rate)
    over = []
    for seed in range(16):
        c = AdaptiveController(1, 256, 8)  # cooldown 15 s
        late: list[float] = []
        for _, calls in _noisy_rounds(c, _curve(rate_of), 0.03, seed):
            late += [latency for end, latency in calls if end > 4.0]
            if calls[-1][0] >= 8.0:
                break
        assert len(late) / 4.0 >= 0.95 * peak, seed
        p99 = sorted(late)[int(0.99 * len(late))]
        over += [seed] if p99 > bound else []
    assert not over, over  # (seeds 10, 11 and 12 without)


def test_p99_keeps_the_slowest_call_under_its_bound() -> None:
    latency_of = _engine(40, 1.0)  # 0.4 s a call at 40, queueing past it
    c = AdaptiveController(1, 1024, 8, cooldown=5.0, objective="p99=0.3")
    sizes = _drive(c, latency_of, 150)
    assert all(latency_of(size) <= 0.3 * 1.001 for size in sizes[-40:])
    assert max(sizes[-40:]) >= 15  # and as much throughput as that allows (0.3 s: ~20)


def test_a_busy_client_is_not_read_as_the_engines_queue() -> None:
    """Once settled, the client's own lag (its CPU taken by two busy loops) slows every call;
    a probe down may follow, but the size comes back: a smaller one delivers less."""
    latency_of = _engine(40, 1.0)
    c = AdaptiveController(1, 1024, 8, cooldown=5.0)
    before = _drive(c, latency_of, 150)[-1]
    after = _drive(c, latency_of, 60, lag=0.3)
    assert after[-1] >= 0.75 * before
    assert min(after[-20:]) >= 0.7 * before


def _closed_loop(
    c: AdaptiveController,
    attempt: Any,
    until: float,
    seed: int,
    *,
    client: tuple[float, float] | None = None,
) -> float:
    """A closed loop of `c.size` places, event by event until `until` seconds: each place
    makes a call, `attempt(rng)` -> (outcome, latency, backoff: seconds the place stays
    taken after it), and the next one when it is free, as long as the places taken are
    fewer than the size. `client`: (until, calls a second): until then the client itself
    starts no more calls a second than that (its CPU bound: a call waits its turn, and the
    wait is in its latency). Returns the successes a second."""
    rng = random.Random(seed)
    now, taken, ok, turn = 0.0, 0, 0, 0.0
    ends: list[tuple[float, Outcome | None, float, float]] = []
    while now < until:
        while taken < c.size:
            outcome, latency, backoff = attempt(rng)
            if client is not None and now < client[0]:
                turn = max(turn, now) + 1 / client[1]
                latency += turn - now
            heapq.heappush(ends, (now + latency, outcome, latency, backoff))
            taken += 1
        now, outcome, latency, backoff = heapq.heappop(ends)
        if outcome is None:  # a backoff over: the place is free
            taken -= 1
            continue
        c.record(outcome, now, taken, latency=latency)
        ok += outcome is Outcome.SUCCESS
        if backoff > 0:
            heapq.heappush(ends, (now + backoff, None, 0.0, 0.0))
        else:
            taken -= 1
    return ok / now


def _flaky(errors: float, slow: float, base: float, slow_latency: float) -> Any:
    """The zoo's flaky family: no limit (every call `base` seconds, 5 % noise, whatever the
    window), but a share `errors` of the calls answer 5xx after `base` (the place then
    sleeps a backoff of 0-1 s) and a share `slow` take `slow_latency`."""

    def attempt(rng: random.Random) -> tuple[Outcome, float, float]:
        draw = rng.random()
        if draw < errors:
            return Outcome.SERVER_ERROR, base, rng.random()
        if draw < errors + slow:
            return Outcome.SUCCESS, slow_latency, 0.0
        return Outcome.SUCCESS, base * (1 + rng.gauss(0, 0.05)), 0.0

    return attempt


@pytest.mark.parametrize("seed", range(4))
def test_a_flaky_servers_errors_and_slow_calls_do_not_hold_the_window_down(seed: int) -> None:
    """Issue 32, the zoo's flaky draws: a server that fails a share of its calls whatever the
    window (and delays a few by seconds) has no knee below `max`: every place more is calls
    more. 5xx made nearly every round unclean (no growth), and the slow calls' share of a
    round's mean latency read as "slower at a steady size" (a probe down, then back, and a
    cooldown's hold): the window stayed at 7-64 where `-c 128` made 2-25x the calls. The
    round's throughput now counts only the calls that succeeded, and "slower" reads the
    round's typical call. (The zoo's flaky seed 1: 12 % errors, 2.25 % of calls 3.5 s.)"""
    attempt = _flaky(0.12, 0.0225, 0.008, 3.5)
    best = _closed_loop(AdaptiveController(256, 256, 256), attempt, 15.0, seed)
    c = AdaptiveController(1, 256, 8)
    rate = _closed_loop(c, attempt, 15.0, seed)
    assert rate >= 0.9 * best
    assert c.size >= 0.9 * 256


@pytest.mark.parametrize("seed", range(4))
def test_a_flaky_servers_knee_is_searched_again_once_its_places_have_filled(seed: int) -> None:
    """Issue 32, the zoo's flaky draws of calls of 8-12 ms: slow start reached 64-256 in
    0.3 s, and `knee`'s search ran in the first 2 s, while the client was the bottleneck
    (256 places opening connections at once) and before the backoffs and the 3.5 s calls
    had filled the places they hold at any size: it ended at 58-195 where 256 makes 1.3-30
    times as much, and growth waited a whole `cooldown` (15 s, the whole bench run). The
    rounds' Little's law read 5-15 times the calls that ended (the places are held by what
    their latencies do not show), so that first search is probed again after a quarter of
    it (`SEARCH_AGAIN`): the window's first pause (over 3 s: its search's steps came faster)
    lasts under half a cooldown. (On this model the first search ended at 46-108 each time,
    and without the rule three of these four seeds then stayed there for 15 s.)"""
    attempt = _flaky(0.12, 0.0225, 0.008, 3.5)
    c = AdaptiveController(1, 256, 8)  # cooldown 15 s
    steps: list[float] = []

    class Recorded:  # the loop's view of the window, which notes when it moved
        @property
        def size(self) -> int:
            return c.size

        def record(self, outcome: Outcome, now: float, in_flight: int, **kw: Any) -> None:
            if c.record(outcome, now, in_flight, **kw) is not None:
                steps.append(now)

    until = 25.0
    client = (2.0, 2000.0)  # for 2 s the client starts 2,000 calls a second at most
    _closed_loop(Recorded(), attempt, until, seed, client=client)  # type: ignore[arg-type]
    pauses = [b - a for a, b in itertools.pairwise([*steps, until]) if b - a > 3.0]
    assert pauses, steps
    assert pauses[0] < c.cooldown / 2, steps


@pytest.mark.parametrize("seed", range(4))
def test_a_flaky_servers_slow_calls_are_not_read_as_a_queue(seed: int) -> None:
    """Issue 32, the zoo's flaky seed 5: 16 % of calls fail, 4.6 % take 0.6 s where the rest
    take 50 ms. A sample of a few dozen calls (slow start's 16 and 32) has none of the slow
    ones, the next one has a few: the larger size's p99, 12 times the smaller's, read as its
    queue, and slow start's doubling went back for "no gain" at an elasticity of 0.8 (the
    window stayed at 10-18, 0.06x of `-c 256`). A queue delays a call by the calls ahead of
    it, so a call slower than twice the sizes' ratio times the smaller size's p99 is the
    server's own slowness (`QUEUE_FAR`); against a size measured too few calls to have seen
    that tail (`TAIL_CHANCE`), a size that delivered nearly as many times more as it is
    larger does not queue (`SCALES`); and a slow call counts in a round's throughput at most
    4 times the round before's typical call (`TAIL_CAP`), so a round's rate is not its
    share of slow calls."""
    attempt = _flaky(0.16, 0.046, 0.05, 0.6)
    best = _closed_loop(AdaptiveController(256, 256, 256), attempt, 15.0, seed)
    c = AdaptiveController(1, 256, 8)
    rate = _closed_loop(c, attempt, 15.0, seed)
    assert rate >= 0.5 * best
    assert c.size >= 128


def _steps(
    c: AdaptiveController, latency_of: Any, until: float, slow: Any = None, now: float = 0.0
) -> tuple[float, list[tuple[float, int, str]]]:
    """Closed-loop calls at `c.size` until `until` seconds; `slow(now, size)` is a factor on
    the latency of the calls of the round it starts (a noisy round; default 1). Returns the
    time and every change (time, size, reason)."""
    changes: list[tuple[float, int, str]] = []
    while now < until:
        size = c.size
        latency = latency_of(size) * (slow(now, size) if slow is not None else 1.0)
        for _ in range(size):
            now += latency / size
            change = c.record(Outcome.SUCCESS, now, size, latency=latency)
            if change is not None:
                changes.append((now, change.size, change.reason))
                break
    return now, changes


def test_p99_does_not_give_up_a_size_for_one_slow_call() -> None:
    """Issue 32: `p99=` gave up a size for one call over the bound in its round (the round's
    slowest call stood for its p99). One call of the round that judges a step up stalls (a
    busy machine's): the step is kept, and the window grows to where the calls' own latency
    reaches the bound; then, over the run, one call in 110 stalls and the size holds."""
    latency_of = _engine(40, 1.0, base=0.1)  # 0.2 s at 40, 0.3 s at 60 (queueing past 40)
    c = AdaptiveController(1, 1024, 20, objective="p99=0.3", slow_start=False, probe_above=1.0)
    now, count, changes = 0.0, 0, []
    sizes = []
    for _ in range(300):
        size = c.size
        latency = latency_of(size)
        for _ in range(size):
            now += latency / size
            count += 1
            stalled = count == 60 or count % 110 == 0  # (call 60: the step to 25's round)
            change = c.record(
                Outcome.SUCCESS, now, size, latency=3 * latency if stalled else latency
            )
            if change is not None:
                changes.append((now, change.size, change.reason))
        sizes.append(c.size)
    assert [(s, r) for _, s, r in changes[:4]] == [
        (25, "grow"),
        (31, "grow"),
        (38, "grow"),
        (47, "grow"),
    ]
    settled = sorted(sizes[-100:])
    assert settled[len(settled) // 2] >= 40
    assert all(latency_of(size) <= 0.3 * 1.001 for size in settled[:-5])


def test_p99_gives_up_a_size_whose_calls_are_over_the_bound_too_often() -> None:
    """The estimate spans a size's rounds: a size whose calls are over the bound one time in
    twenty (p99 over, though no single round shows more than a call or two) is given up."""
    c = AdaptiveController(1, 1024, 30, cooldown=5.0, objective="p99=0.3", slow_start=False)
    now, count = 0.0, 0
    for _ in range(60):
        size = c.size
        for _ in range(size):
            now += 0.25 / size
            count += 1
            late = size >= 30 and count % 20 == 0  # 30 and more: 5 % of calls over
            c.record(Outcome.SUCCESS, now, size, latency=0.5 if late else 0.25)
    assert c.size < 30


@pytest.mark.parametrize(
    ("capacity", "alpha", "base"), [(40, 2.0, 0.2), (13, 1.53, 0.306), (220, 0.113, 0.423)]
)
def test_after_slow_start_the_knee_is_searched_to_the_capacity(
    capacity: int, alpha: float, base: float
) -> None:
    """Issue 32: the knee settled a quarter below an engine's capacity and waited a cooldown
    there (its quarter steps cannot reach a capacity between them), or above it, where calls
    queue (p99 1.5x that of a window of the capacity). After slow start (a doubling that did
    not pay, or `max` reached), the knee is searched between the last size that paid and
    the first that did not, halving the gap, with no cooldown between the probes: the window
    ends at the capacity, within a sixteenth."""
    latency_of = _engine(capacity, alpha, base)
    c = AdaptiveController(1, 256, 8)  # cooldown 15 s
    _, changes = _steps(c, latency_of, 60.0)
    times = [t for t, _, _ in changes]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    ended = next(i for i, gap in enumerate(gaps) if gap >= c.cooldown)  # the search's end
    assert max(gaps[:ended]) < 5.0  # no cooldown between its probes
    settled = changes[ended][1]
    assert capacity <= settled <= capacity * (1 + 1 / 16)  # (a queue of a sixteenth at most)


def test_p99_gives_up_a_step_over_the_bound_as_soon_as_its_calls_say_so() -> None:
    """A step up whose calls are slower than the bound costs the p99 for as long as it lasts
    (a round to settle, one to measure: hundreds of calls on a big engine). The step is
    given up once its calls over the bound are more than one and more than 1 % of them."""

    def latency_of(size: int) -> float:  # throughput still rises; 0.3 s at 80
        return 0.1 * (1 + size / 40)

    # (0.31: 77's 0.29 s is under `P99_AIM` of it, 96's 0.34 s over)
    c = AdaptiveController(1, 1024, 40, objective="p99=0.31", slow_start=False, probe_above=1.0)
    _, changes = _steps(c, latency_of, 10.0)
    assert [(size, reason) for _, size, reason in changes[:5]] == [
        (50, "grow"), (62, "grow"), (77, "grow"), (96, "grow"), (77, "p99"),
    ]  # fmt: skip
    seconds = changes[4][0] - changes[3][0]
    assert seconds <= 2.01 * latency_of(96) / 96  # two calls at 96, not two rounds of 96


def _with_metrics(
    c: AdaptiveController, capacity: int, latency_of: Any, until: float, kv: float | None = None
) -> list[tuple[float, int, str]]:
    """`_steps` with the engine's metrics read every second: C running, the rest waiting,
    the KV gauge `kv` (None: the batch's share, as the zoo's engine without a KV budget)."""
    now, read = 0.0, -1.0
    changes: list[tuple[float, int, str]] = []
    while now < until:
        size = c.size
        latency = latency_of(size)
        for _ in range(size):
            now += latency / size
            change = None
            if now - read >= 1.0:
                read = now
                running = min(size, capacity)
                usage = running / capacity if kv is None else kv
                change = c.engine(EngineLoad(running, max(0, size - capacity), usage, 0), now)
            change = change or c.record(Outcome.SUCCESS, now, size, latency=latency)
            if change is not None:
                changes.append((now, change.size, change.reason))
                break
    return changes


def test_with_the_engines_metrics_the_knee_search_ends_at_its_batch() -> None:
    """The zoo's engine of 18 (no KV budget: its cache gauge is the batch's share), read
    every second: a size whose calls wait is past the knee, and the search goes on at once
    (not a cooldown later, as after a cut of the engine's outside a search)."""
    capacity = 18
    c = AdaptiveController(1, 256, 8)
    changes = _with_metrics(c, capacity, _engine(capacity, 0.79, 0.028), 10.0)
    assert c.size == capacity
    assert changes[-1][0] < 6.0
    # its doubling to 32 did not pay, and the engine's reading at 32 shows calls waiting:
    # no look past it (the zoo's engine 4 was explored to 64 on a reading taken at 16)
    assert "explore" not in [reason for _, _, reason in changes]


def _vllm_pinned(size: int) -> float:
    """A closed loop's latency on the real vLLM of `bench.real_engine` (its engine on a core
    of its own): the rates measured at 8 to 256 in flight, log-linear between them. Flat
    from 64 to 128 (+2 %), then 7 % more at 256; its batch holds 256, so nothing waits."""
    measured = {8: 127.0, 16: 200.0, 32: 241.0, 64: 294.0, 128: 300.0, 256: 322.0}
    return size / _log_linear(measured, size)


def _log_linear(measured: dict[int, float], size: int) -> float:
    """The rate at `size` from rates `measured` at some sizes: log-linear between the two
    around it, the nearest one's outside them."""
    sizes = sorted(measured)
    low = max([s for s in sizes if s <= size] or [sizes[0]])
    high = min([s for s in sizes if s >= size] or [sizes[-1]])
    if low == high:
        return measured[low]
    share = math.log(size / low) / math.log(high / low)
    rate: float = measured[low] * (measured[high] / measured[low]) ** share
    return rate


def test_with_the_engines_metrics_the_knee_looks_past_a_flat_doubling() -> None:
    """Issue 32, a real vLLM: slow start's doubling from 64 to 128 gained 2 % and the knee
    stopped at 64, 0.89x of `-c 256`'s rate, where the bench's knee (the smallest window
    within 5 % of the best rate) is 256. With the engine's metrics saying nothing waits, the
    first doubling that does not pay is followed by one more: it delivered 7 % more, so
    the knee is above 128. An engine whose calls wait past its capacity shows them, and
    is not explored (`test_with_the_engines_metrics_the_knee_search_ends_at_its_batch`);
    without the metrics, nothing tells the two apart, and the knee stays where it was."""
    best = 256 / _vllm_pinned(256)
    c = AdaptiveController(1, 256, 8)
    changes = _with_metrics(c, 256, _vllm_pinned, 120.0)
    assert "explore" in [reason for _, _, reason in changes]
    assert c.size / _vllm_pinned(c.size) >= 0.95 * best, changes
    blind = AdaptiveController(1, 256, 8)
    _steps(blind, _vllm_pinned, 120.0)
    assert blind.size / _vllm_pinned(blind.size) < 0.95 * best  # (the case it was)


def test_a_flat_doubling_with_no_reading_at_its_size_goes_back_as_without_the_metrics() -> None:
    """The look past a flat doubling waits for a reading taken at the doubled size; when the
    engine's metrics stop coming (a dead `/metrics`), it waits `engine_stale` seconds at
    most, then goes back as without them: no look on a reading taken at a smaller size."""
    c = AdaptiveController(1, 256, 8)
    now, read, grown = 0.0, -1.0, None
    changes: list[tuple[float, int, str]] = []
    while now < 60.0:
        size = c.size
        latency = _vllm_pinned(size)
        for _ in range(size):
            now += latency / size
            change = None
            if size < 128 and now - read >= 1.0:  # the metrics stop once the window is at 128
                read = now
                change = c.engine(EngineLoad(size, 0, size / 256, 0), now)
            change = change or c.record(Outcome.SUCCESS, now, size, latency=latency)
            if change is not None:
                changes.append((now, change.size, change.reason))
                if (change.size, change.reason) == (128, "slow start"):
                    grown = now
                break
    assert grown is not None, changes
    assert "explore" not in [reason for _, _, reason in changes]
    at, size, _ = next(change for change in changes if change[2] == "no gain")
    assert size == 64
    assert at - grown >= c.engine_stale  # it waited for a reading that never came


def test_probes_past_an_engines_queue_come_less_and_less_often() -> None:
    """Issue 32, `--engine-metrics` on the zoo's engine 1 (C 13, calls of 0.8 s): each probe
    up a quarter from C queued a quarter of a batch until the engine's metrics cut it, and
    the cut held growth for one cooldown, every time: a probe each 15-17 s for good, each
    costing the p99 (1.99x -c 13's). Cuts in a row hold growth for longer and longer, as
    failed probes do (a step up that pays ends the run of them)."""
    capacity = 13
    c = AdaptiveController(1, 256, 8)
    # (its KV cache half used: a budget's)
    changes = _with_metrics(c, capacity, _engine(capacity, 1.53, 0.306), 300.0, kv=0.5)
    probes = [t for t, size, reason in changes if reason == "grow" and size > capacity]
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert len(probes) >= 4
    assert max(gaps) >= 3 * c.cooldown, gaps  # (16-18 s each without)
    assert len(probes) <= 10, probes
    assert c.size == capacity


def test_after_a_no_gain_the_next_probe_comes_sooner_than_a_cooldown() -> None:
    """A step up judged on a slow round (its own calls stalled) is given up, and the size's
    next rounds do not contradict it; the next probe up comes after half a cooldown, not a
    whole one (a second "no gain" in a row waits the whole cooldown)."""
    latency_of = _engine(40, 1.0)
    c = AdaptiveController(1, 1024, 16, slow_start=False, probe_above=1.0)
    stalled = {"done": False}

    def slow(now: float, size: int) -> float:
        if size == 20 and not stalled["done"]:
            stalled["done"] = True
            return 1.0  # the settling round
        if size == 20 and stalled["done"] and stalled.get("judged") is None:
            stalled["judged"] = True
            return 1.6  # the round that judges the step: slow
        return 1.0

    _, changes = _steps(c, latency_of, 30.0, slow)
    reasons = [reason for _, _, reason in changes]
    first = reasons.index("no gain")
    assert reasons[first + 1] == "grow"
    assert changes[first + 1][0] - changes[first][0] <= 0.5 * c.cooldown + 2.0
    assert c.size >= 32


# --- request-rate limits found by behaviour, Retry-After holds ----------------------------------


async def test_a_retry_after_holds_every_call_start(autojump_clock: Any) -> None:
    pacer = Pacer()
    now = trio.current_time()
    for i in range(20):
        pacer.success(now - 1 + i / 20)
    pacer.limited(now, retry_after=2.0)
    assert pacer.rate is not None
    waited = await pacer.wait()
    assert waited == pytest.approx(2.0)
    assert trio.current_time() - now == pytest.approx(2.0)


class Calls(tt.Taskset[tt.Task, tt.TasksetConfig]):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def load(self) -> list[tt.Task]:
        return [tt.Task("say 7", answer="7", key=str(i)) for i in range(self.n)]


async def _eval(url: str, window: tt.Window, n: int, out: Path) -> tuple[float, dict[str, Any]]:
    async with tt.OpenAIClient(url, max_retries=50) as model:
        config = tt.EvalConfig(
            max_concurrent=window, output_dir=str(out), run_name=f"run{id(window)}",
            dashboard=False,
        )  # fmt: skip
        start = trio.current_time()
        result = await tt.run_eval(tt.Env(Calls(n)), tt.ModelContext(model, "sim"), config)
        return n / (trio.current_time() - start), result.summary


async def test_a_rate_limit_without_rate_headers_is_paced_not_collapsed(
    autojump_clock: Any, tmp_path: Path
) -> None:
    """429s with only a Retry-After (no x-ratelimit-*): the window finds they do not depend
    on concurrency, paces the calls at the limit's rate and goes back to its size."""
    async with ChatServer(0.05, policy=RateLimit(100, headers=False)) as server:
        window = AdaptiveWindow(1, 8, 256)
        rate, summary = await _eval(server.url, window, 3000, tmp_path)
        share = server.limited / (server.ok + server.limited)
    reasons = [reason for _, _, reason in summary["window_history"]]
    assert "429 not concurrency" in reasons
    assert min(size for _, size, _ in summary["window_history"][-1:]) >= 8  # not collapsed
    assert rate >= 0.8 * 100  # each Retry-After (1 s) holds every call while it finds the rate
    assert share < 0.01
    assert window.pacer.rate is not None
    assert 0.9 * 100 <= window.pacer.rate <= 1.05 * 100
    found = summary["window"]
    assert found["objective"] == "knee"
    assert found["paced"] == pytest.approx(window.pacer.rate, rel=0.01)
    assert found["size"] == window.size


async def test_a_429_without_retry_after_holds_the_endpoint_and_lets_one_probe_through(
    autojump_clock: Any,
) -> None:
    """While a rate limit's 429s keep coming with no Retry-After, every call start is held,
    and one probe call goes through at doubling intervals; a success opens the endpoint."""
    pacer = Pacer()
    start = trio.current_time()
    for i in range(20):
        pacer.success(start - 1 + i / 20, 0.01)
    pacer.limited(start, latency=0.001)
    assert pacer.held_until == pytest.approx(start + 0.25)
    started: list[float] = []

    async def call() -> None:
        await pacer.wait()
        started.append(trio.current_time() - start)

    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(call)
        await trio.sleep(0.26)
        assert started == [pytest.approx(0.25)]  # the probe, alone
        pacer.limited(trio.current_time(), latency=0.01)  # refused at once: the hold doubles
        assert pacer.held_until == pytest.approx(start + 0.76)
        await trio.sleep_until(start + 0.77)
        assert started[1:] == [pytest.approx(0.76)]  # the next probe, alone again
        pacer.success(trio.current_time(), 0.01)  # it went through: the others follow
    assert len(started) == 5
    assert pacer.rate is not None


def test_a_429_of_a_call_sent_before_the_hold_says_nothing_new() -> None:
    """The calls in flight as a hold began get their 429s after it: they neither double the
    hold nor set the rate again."""
    pacer = Pacer()
    for i in range(20):
        pacer.success(i / 20, 0.01)
    pacer.limited(1.0, latency=0.01)
    rate, held = pacer.rate, pacer.held_until
    for k in range(10):  # sent before 1.0, refused after it
        pacer.limited(1.0 + k / 100, latency=0.05)
    assert (pacer.rate, pacer.held_until, pacer.binds) == (rate, held, 1)


async def _sliding_window(
    pacer: Pacer,
    limit: int,
    latency: float,
    *,
    callers: int,
    seconds: float,
    retry_after: bool,
    period: float = 1.0,
) -> list[float]:
    """`callers` calling through `pacer` for `seconds` against a sliding window of `limit`
    calls in any `period` seconds (calls of `latency`; a refused call's 429 comes back at
    once, with a Retry-After in whole seconds, which the caller then waits, or with nothing
    said). Returns when each call that went through ended."""
    admitted: deque[float] = deque()
    ok: list[float] = []

    async def caller() -> None:
        while True:
            await pacer.wait()
            now = trio.current_time()
            while admitted and admitted[0] <= now - period:
                admitted.popleft()
            if len(admitted) >= limit:
                await trio.sleep(0.0005)
                wait = math.ceil(admitted[0] + period - now) if retry_after else None
                pacer.limited(trio.current_time(), retry_after=wait, latency=0.0005)
                await trio.sleep(wait or 0.0)
                continue
            admitted.append(now)
            await trio.sleep(latency)
            pacer.success(trio.current_time(), latency)
            ok.append(trio.current_time())

    with trio.move_on_after(seconds):
        async with trio.open_nursery() as nursery:
            for _ in range(callers):
                nursery.start_soon(caller)
    return ok


async def test_a_limit_found_by_a_slow_creep_is_paced_just_under_it(autojump_clock: Any) -> None:
    """zoo tpm --seed 5: a sliding window of 42 calls in any second, 94 ms calls, and a
    Retry-After in whole seconds (1 s, where the window reopens within milliseconds). Each
    bind holds the whole endpoint for that second, and the cycle's measure, a second short,
    read the limit 10 % low: the rate came back at 0.9 of the rate that bound, crept up
    and bound again, 0.83x the calls of a fixed `-c 64` in the second half. A bind after a
    slow creep says the limit is just under the rate that bound: the rate goes back to just
    under it, and creeps on there slowly."""
    limit, pacer = 42, Pacer()
    start = trio.current_time()
    ok = await _sliding_window(pacer, limit, 0.094, callers=32, seconds=60, retry_after=True)
    second_half = sum(start + 30 <= at for at in ok) / 30
    assert second_half >= 0.93 * limit  # 0.95 measured (0.88 before)
    assert pacer.binds <= 10


async def test_a_minute_spent_at_once_is_paced_over_the_next_not_spent_at_once_again(
    autojump_clock: Any,
) -> None:
    """zoo tpm --seed 5 per minute: a sliding window of a minute's tokens (50 calls a
    second), 94 ms calls, a Retry-After. The first calls spent the minute in 2 s and were
    told to wait 58 s; the first rate, over the geometric mean of the 2 s and the wait, was
    225 calls a second, and grew fast from there as a guess does: the reopened minute went in
    4 s, and a wait of 57 s followed, over and over (20 calls a second in the second half of
    150 s, 0.40x a fixed `-c 8`; on this model, a whole minute's calls in every minute's
    first seconds). A wait of many seconds is the limit's own: the first rate
    is what went through over all of it, and it creeps up from there."""
    limit, period, pacer = 3000, 60.0, Pacer()
    start = trio.current_time()
    ok = await _sliding_window(
        pacer, limit, 0.094, callers=64, seconds=150, retry_after=True, period=period
    )
    second_half = sum(start + 75 <= at for at in ok) / 75
    assert second_half >= 0.9 * limit / period, second_half  # 0.98 (0.80 before: bursts)
    later = [at for at in ok if at >= start + 62]
    assert max(b - a for a, b in itertools.pairwise(later)) < 5.0  # (waits of 56 s before)
    assert pacer.binds <= 20


async def test_a_limit_bound_on_the_way_up_is_paced_near_the_rate_a_span_before(
    autojump_clock: Any,
) -> None:
    """zoo ratelimit --seed 6: a sliding window of 249 calls in any second, 5 ms calls, 429s
    at once with no header at all. After its third bind the pacer grew from 167 calls a
    second toward its target, 1.22x a second, and bound again at 289; the cycle's measure,
    what succeeded on that way up, read 141, and the rate came back to 202 and crept from
    there for the rest of the run: 0.82 of the limit in the second half of 20 s (the zoo:
    0.85). A window of a second takes that long to answer a rate over it: the rate a second
    before the bind went through, and is the floor now."""
    limit, pacer = 249, Pacer()
    start = trio.current_time()
    ok = await _sliding_window(pacer, limit, 0.005, callers=64, seconds=20, retry_after=False)
    second_half = sum(start + 10 <= at for at in ok) / 10
    assert second_half >= 0.93 * limit  # 0.96 measured (0.82 before)
    assert second_half <= limit


async def test_calls_waiting_their_turns_go_out_at_the_rate_they_grew_to(
    autojump_clock: Any,
) -> None:
    """64 callers through a pacer alone (no window to cap them), a header-less sliding
    window of 27 calls a second, 111 ms calls. Paced from a guess of 12.8, the waiting calls
    took turns 1/12.8 s apart, 5 s ahead; the rate grew to 87 while they went out at 12.8,
    and pacing ended as "far above what succeeds", over and over: 0.63 of the limit in the
    second half of 30 s, the rate left at 79. Turns are spaced anew as the rate grows."""
    limit, pacer = 27, Pacer()
    start = trio.current_time()
    ok = await _sliding_window(pacer, limit, 0.111, callers=64, seconds=30, retry_after=False)
    second_half = sum(start + 15 <= at for at in ok) / 15
    assert second_half >= 0.85 * limit  # 0.88 measured (0.63 before)
    assert pacer.rate is not None
    assert pacer.rate < 1.5 * limit


@pytest.mark.parametrize(
    ("burst", "refill", "latency", "refused_at_most"),
    [(280.0, 4.7, 0.0077, 0.05), (100.0, 2.0, 0.05, 0.15)],
)
async def test_a_pacer_learns_past_its_first_guess_when_429s_beat_the_answers(
    autojump_clock: Any, burst: float, refill: float, latency: float, refused_at_most: float
) -> None:
    """zoo tpm --seed 1 per minute: a bucket of a minute's calls (280), full at start,
    refilled at 4.7 a second; calls of 8 ms; a 429 comes back at once, with a Retry-After in
    whole seconds. The bucket went in 0.4 s and the first guess was some 700 calls/s. After
    each hold about 5 calls went out in 7 ms, 4 or 5 went through and the next was refused,
    its 429 back before the answers of the calls sent ahead of it: no call sent since the
    hold had answered yet, so no bind started a new run, the guess stood for the whole
    run, and one call in 7 was refused. A call sent a 429's round trip before the refused
    one, and not refused, was let through: the run is new, and the rate is measured again.
    (A bucket of 2 calls a second: main refused 31 % of its calls, each bind at the guess;
    measured again, the runs come down to the limit, and one bind among 8 calls in 4 s
    does not end pacing as 429s that pacing does not lower: after that, 90 %.)"""
    pacer = Pacer()
    tokens, filled = burst, trio.current_time()
    ok = refused = 0

    async def caller() -> None:
        nonlocal tokens, filled, ok, refused
        while True:
            await pacer.wait()
            now = trio.current_time()
            tokens, filled = min(burst, tokens + (now - filled) * refill), now
            if tokens < 1:  # refused at once, told to come back in whole seconds
                refused += 1
                wait = (1 - tokens) / refill
                await trio.sleep(0.0005)
                pacer.limited(trio.current_time(), retry_after=math.ceil(wait), latency=0.0005)
                await trio.sleep(math.ceil(wait))
                continue
            tokens -= 1
            await trio.sleep(latency)
            ok += 1
            pacer.success(trio.current_time(), latency)

    with trio.move_on_after(150):
        async with trio.open_nursery() as nursery:
            for _ in range(32):
                nursery.start_soon(caller)
    assert refused / (ok + refused) < refused_at_most  # 0.14 and 0.31 before
    assert pacer.rate is not None
    assert 0.8 * refill <= pacer.rate <= 1.2 * refill
    assert ok >= 0.9 * (burst + 150 * refill)


async def test_a_header_less_sliding_window_is_paced_not_collapsed(
    autojump_clock: Any, tmp_path: Path
) -> None:
    """The issue's case: a sliding window of 27 calls in any second, 111 ms calls, 429s with
    no header at all. It refuses in a run once its 27 calls are in (no success until they
    slide out): those 429s come with far fewer calls in flight than the endpoint took before,
    so they are not a concurrency limit's; the window is not ratcheted down, the calls are
    paced near the limit, and few are refused."""
    async with ChatServer(0.111, policy=WindowLimit(27, 1.0, sliding=True)) as server:
        window = AdaptiveWindow(1, 8, 256)
        async with tt.OpenAIClient(server.url, max_retries=1000) as model:
            config = tt.EvalConfig(max_concurrent=window, output_dir=str(tmp_path),
                                   dashboard=False)  # fmt: skip
            start = trio.current_time()
            with trio.move_on_after(30):
                await tt.run_eval(tt.Env(Calls(10_000)), tt.ModelContext(model, "sim"), config)
            rate = server.ok / (trio.current_time() - start)
        share = server.limited / (server.ok + server.limited)
    assert "429 not concurrency" in [reason for _, _, reason in window.history]
    assert window.size >= 8
    assert rate >= 0.85 * 27
    assert share < 0.05


async def test_a_sliding_window_spent_when_the_run_starts_is_found_at_the_first_success(
    autojump_clock: Any, tmp_path: Path
) -> None:
    """The limit was used up by another client when the run starts: 429s with no header and
    no success until its calls slide out, a second later, and the concurrency caps take the
    window to its minimum meanwhile. A concurrency limit's calls would have ended within a
    call's latency: the first success after a run of 429s over four times as long says they
    were a rate limit's, and the window goes back to its size and is paced."""
    policy = WindowLimit(27, 1.0, sliding=True, spent=True)
    calls: list[tuple[float, Outcome]] = []

    class Calls_(tt.CallObserver):
        def on_call(
            self, outcome: Outcome, retry_after: float | None, latency: float | None
        ) -> None:
            calls.append((trio.current_time(), outcome))

    async with ChatServer(0.111, policy=policy) as server:
        window = AdaptiveWindow(1, 8, 256)
        start = trio.current_time()
        with tt.observe_calls(Calls_()):
            await _eval(server.url, window, 300, tmp_path)
    sizes = [(reason, size) for _, size, reason in window.history]
    assert ("429 cap", 1) in sizes  # capped down while nothing succeeded
    assert sizes[-1] == ("429 not concurrency", 8), " ".join(f"{r}:{z}" for r, z in sizes)
    # The spent second, then a retry's backoff (header-less 429s: up to a second or so),
    # then paced near the limit, with few refused. (Not timed as a whole: that rate swung
    # with the backoff's random draw, and, real sockets under the MockClock, with the
    # machine's load: 20.2-21.4 calls/s.)
    first = next(at for at, outcome in calls if outcome is Outcome.SUCCESS)
    assert 1.0 <= first - start <= 4.0  # nothing succeeds before the spent calls slide out
    assert window.pacer.rate is not None
    assert 0.85 * 27 <= window.pacer.rate <= 1.05 * 27
    refused = [at for at, outcome in calls if outcome is Outcome.RATE_LIMITED and at > first]
    assert len(refused) <= 0.05 * 300


def test_a_spent_limit_is_found_though_its_429s_end_early() -> None:
    """A sliding window spent when the run starts: 429s, then none, then the first success a
    second later. At `min`, where a resting run keeps its place, the few runs refused back
    off, so their 429s ended 0.4 s into the spent second (under 4 calls' latency), and the
    first success was taken for a concurrency limit's: the window stayed at 1 and grew back
    a step a cooldown. Over 4 calls' latency since the 429s began with no success, and 3
    or more of them, says a rate limit's."""
    c = AdaptiveController(1, 256, 8)
    for at in (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.05, 0.18, 0.38):
        c.record(Outcome.RATE_LIMITED, at, c.size, latency=0.001)  # capped, a call a 429
    assert c.size == 1
    change = c.record(Outcome.SUCCESS, 1.1, 1, latency=0.111)
    assert change is not None
    assert (change.size, change.reason) == (8, "429 not concurrency")
    # one 429 and a retry's backoff say nothing
    c = AdaptiveController(1, 8, 4)
    c.record(Outcome.RATE_LIMITED, 0.0, 4, latency=0.001)
    change = c.record(Outcome.SUCCESS, 0.6, 1, latency=0.01)
    assert change is None or change.reason != "429 not concurrency"


async def test_a_header_less_fixed_window_per_minute_costs_a_few_refusals_a_minute(
    autojump_clock: Any, tmp_path: Path
) -> None:
    """A fixed window of 600 calls a minute, 429s with no header: once a minute's calls are
    spent, the endpoint is held and one probe a time goes through at doubling intervals, so
    a minute costs about log2(60 / 0.25) refused calls after the first, not one per call
    in flight; every minute's 600 calls are made."""
    async with ChatServer(0.05, policy=WindowLimit(600, 60.0)) as server:
        window = AdaptiveWindow(1, 8, 32)
        async with tt.OpenAIClient(server.url, max_retries=1000) as model:
            config = tt.EvalConfig(max_concurrent=window, output_dir=str(tmp_path),
                                   dashboard=False)  # fmt: skip
            with trio.move_on_at(240.0):  # (the fixed windows are the clock's minutes)
                await tt.run_eval(tt.Env(Calls(10_000)), tt.ModelContext(model, "sim"), config)
        first = server.limited
    assert server.ok == 4 * 600
    assert first <= 32 + 4 * 12  # the first minute's calls in flight, then ~9 a minute


# --- real processes, real time: the zoo -----------------------------------------------------------


def _zoo(*args: str) -> tuple[subprocess.Popen[str], str]:
    if not ZOO.exists():
        pytest.skip(f"the zoo is not at {ZOO}")
    proc = subprocess.Popen(
        [sys.executable, str(ZOO), *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


async def _for(url: str, window: tt.Window, seconds: float, out: Path) -> int:
    """Successful calls of an eval of single-call rollouts run for `seconds`."""
    done = 0

    class Count(tt.CallObserver):
        def on_call(
            self, outcome: Outcome, retry_after: float | None, latency: float | None
        ) -> None:
            nonlocal done
            done += outcome is Outcome.SUCCESS

    async with tt.OpenAIClient(url, max_retries=1000) as model:
        config = tt.EvalConfig(max_concurrent=window, output_dir=str(out), dashboard=False)
        with tt.observe_calls(Count()), trio.move_on_after(seconds):
            await tt.run_eval(tt.Env(Calls(100_000)), tt.ModelContext(model, "zoo"), config)
    return done


async def test_zoo_a_header_less_token_bucket_is_paced_in_real_time(tmp_path: Path) -> None:
    proc, url = _zoo("ratelimit", "--kind", "bucket", "--rate", "50", "--burst", "10",
                     "--headers", "none", "--latency", "0.02")  # fmt: skip
    try:
        window = AdaptiveWindow(1, 8, 256)
        done = await _for(url, window, 4.0, tmp_path)
    finally:
        proc.terminate()
        proc.wait(10)
    # found by behaviour (no header said so), and paced near the limit; loose bounds: the
    # machine may be busy (bench.zoo measures the figures), and a rate above the limit comes
    # down to it a bind at a time (each one refused call): in a fresh-clone CI run beside
    # the suite's other worker it was still at 67/s after the run's 4 s
    assert window.pacer.rate is not None
    assert 0.5 * 50 <= window.pacer.rate <= 1.5 * 50
    assert done >= 0.4 * 50 * 4
    assert window.size >= 8  # the window was not collapsed


async def test_zoo_a_concurrency_limit_keeps_its_cap_in_real_time(tmp_path: Path) -> None:
    proc, url = _zoo("concurrency", "--capacity", "12", "--latency", "0.05",
                     "--headers", "none")  # fmt: skip
    try:
        window = AdaptiveWindow(1, 8, 256)
        await _for(url, window, 3.0, tmp_path)
    finally:
        proc.terminate()
        proc.wait(10)
    assert window.pacer.rate is None or math.isfinite(window.pacer.rate)
    assert 6 <= window.size <= 16


def test_a_run_of_header_less_429s_gives_the_limits_rate_at_once() -> None:
    """A bucket of 50/s whose burst is spent: 200 calls a second, 50 succeed, the rest are
    refused (no header says why). Once those 429s are known to be a rate limit's, the
    first rate is what succeeded since they began, not a guess from every call."""
    pacer = Pacer()
    now = 0.0
    for i in range(200):  # one second of 429s with successes among them, 1 in 4
        now += 0.005
        if i % 4 == 0:
            pacer.success(now)
        else:
            pacer.refused(now)
    pacer.limited(now)
    assert pacer.rate is not None
    assert 0.9 * 50 <= pacer.rate <= 50


def _late_queue_rounds(
    c: AdaptiveController, capacity: int, alpha: float, base: float, until: float
) -> list[tuple[float, int, str]]:
    """Closed-loop rounds of `c.size` calls on an engine of `capacity` slots (`_batches`
    without noise), except that after a step down from past `capacity`, the larger size's
    queued calls (one per place past it, each two batches long) end after the settling
    round, among the smaller size's first calls: the order the zoo's engine 1 sent them in
    now and then (its queued calls and the smaller size's first ones end in one burst).
    Returns every change (time, size, reason)."""
    latencies = _batches(capacity, alpha, base)
    rng = random.Random(0)
    now, changes = 0.0, []
    late, due = 0, 0  # the queued calls of the size left, and after how many calls they end
    while now < until:
        size = c.size
        for latency in latencies(size, rng):
            now += latency / size
            change = c.record(Outcome.SUCCESS, now, size, latency=latency)
            due -= 1
            if late and due == 0:  # the larger size's queued calls, a batch late
                for _ in range(late):
                    c.record(Outcome.SUCCESS, now, size, latency=2 * base * (1 + alpha))
                late = 0
            if change is not None:
                changes.append((now, change.size, change.reason))
                if change.size < size and size > capacity:
                    late, due = size - capacity, size + 2
    return changes


def test_a_step_downs_queued_calls_that_end_late_are_not_the_smaller_sizes() -> None:
    """Issue 32, the zoo's engine 1 (C 13): the probe from 16 down to 11 went back to 16 for
    "lost throughput" in 2 of 4 runs, and the window spent the run at 15-19, the p99 twice
    `-c 13`'s. 16's queued calls, begun before the step and a batch late, ended after 11's
    settling round: their 1.5 s read as 11's p99 (so 16 did not queue against it) and their
    seconds as 11's throughput. A call begun before a step down is not the smaller size's
    tail, and a probe's round lasts until `PROBE_ROUND` calls begun at its size. (Here they
    held a probe down at 10 or 12 for 15 s, twice in 200.)"""
    changes = _late_queue_rounds(AdaptiveController(1, 256, 8), 13, 1.53, 0.306, 200.0)
    held = [
        (end - at, size)
        for (at, size, _), (end, _, _) in itertools.pairwise(changes)
        if at > 15.0 and size != 13
    ]
    assert changes[-1][1] == 13, changes
    assert held
    assert max(held)[0] < 8.0, held  # only probes and the search leave the knee
