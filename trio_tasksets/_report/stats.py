"""Statistics for the report: a t quantile, a clustered confidence interval, the Wilson
interval and the reward interval built from them, percentiles, pass@k. Plain functions over
lists, each checked against a textbook value in the tests; and `RunningInterval`, the reward
interval kept up to date one value at a time (the dashboard's named metrics)."""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Sequence

import attrs

__all__ = [
    "CONFIDENCE",
    "Interval",
    "RunningInterval",
    "mean_and_std",
    "mean_interval",
    "nice_step",
    "pass_at_k",
    "percentile",
    "reward_interval",
    "t_quantile",
    "wilson_interval",
]

CONFIDENCE = 0.95


def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t with `df` degrees of freedom: exact for df 1 and 2, the
    Cornish-Fisher expansion (Abramowitz & Stegun 26.7.5) above, within 0.1% from df 3."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    if df == 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    z = statistics.NormalDist().inv_cdf(p)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / df + g2 / df**2 + g3 / df**3 + g4 / df**4


def mean_and_std(values: Sequence[float]) -> tuple[float, float]:
    """The mean and population standard deviation of finite `values` (at least one), finite
    themselves however large the values (`1e308` twice: its sum and its squares overflow a
    float; here every value is scaled by the largest magnitude first)."""
    n = len(values)
    try:
        mean = math.fsum(values) / n
        return mean, math.sqrt(math.fsum((v - mean) ** 2 for v in values) / n)
    except OverflowError:
        pass
    scale = max(abs(v) for v in values)
    scaled = [v / scale for v in values]
    mean = math.fsum(scaled) / n
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in scaled) / n)
    return mean * scale, min(std * scale, sys.float_info.max)


def mean_interval(
    values: Sequence[float], clusters: Sequence[int], confidence: float = CONFIDENCE
) -> tuple[float, float] | None:
    """A t confidence interval for the mean of `values`, its standard error clustered by
    `clusters` (a task's rollouts are not independent draws).

    SE = sqrt(G/(G-1) * sum over clusters g of (sum of (x - mean) in g)^2) / N, df = G - 1,
    with G clusters and N values; with one value per cluster this is the textbook s/sqrt(N).
    None when there are fewer than two clusters.
    """
    groups = len(set(clusters))
    if groups < 2:
        return None
    mean = math.fsum(values) / len(values)
    half = t_quantile(0.5 + confidence / 2, groups - 1) * _clustered_se(values, clusters)
    return (mean - half, mean + half)


def _clustered_se(values: Sequence[float], clusters: Sequence[int]) -> float:
    """The clustered standard error of the mean (see `mean_interval`); >= 2 clusters."""
    groups = len(set(clusters))
    mean = math.fsum(values) / len(values)
    sums: dict[int, float] = {}
    for value, cluster in zip(values, clusters, strict=True):
        sums[cluster] = sums.get(cluster, 0.0) + (value - mean)
    return math.sqrt(groups / (groups - 1) * math.fsum(s * s for s in sums.values())) / len(values)


def wilson_interval(
    successes: float, n: float, confidence: float = CONFIDENCE
) -> tuple[float, float]:
    """The Wilson score interval of a proportion (`successes` of `n` trials; `n` may be an
    effective sample size, not an integer): always inside [0, 1], and not degenerate at 0 or
    n successes, where the normal (Wald) interval collapses to a point."""
    if n <= 0:
        raise ValueError(f"n must be > 0, got {n}")
    z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2)
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    low = 0.0 if successes <= 0 else max(0.0, centre - half)  # exact at the edges
    high = 1.0 if successes >= n else min(1.0, centre + half)
    return (low, high)


@attrs.frozen
class Interval:
    """A confidence interval of the mean reward, and how it was made (`method`): "wilson"
    (every reward is 0 or 1), "t, clipped to [0, 1]" (rewards in [0, 1]), or "t"."""

    low: float
    high: float
    method: str


def reward_interval(
    values: Sequence[float], clusters: Sequence[int], confidence: float = CONFIDENCE
) -> Interval | None:
    """The interval the report shows for a mean reward, inside the rewards' bounds.

    0/1 rewards (pass/fail): the Wilson score interval, its sample size the effective one of
    the clustered standard error (n / design effect, so a task's correlated rollouts count
    for less than independent draws; G, the number of tasks, when every reward is equal).
    Rewards in [0, 1]: the clustered t interval (`mean_interval`) clipped to [0, 1]. Other
    rewards: that t interval as it is. None with fewer than two clusters.
    """
    try:
        interval = mean_interval(values, clusters, confidence)
    except OverflowError:  # values near the float's limit (1e308): no interval to show
        return None
    if interval is None or not all(map(math.isfinite, interval)):
        return None
    n = len(values)
    binary = all(v in (0.0, 1.0) for v in values)
    return _bounded(
        interval, math.fsum(values) / n, n, len(set(clusters)),
        _clustered_se(values, clusters) if binary else 0.0,
        _clustered_se(values, list(range(n))) if binary else 0.0,
        binary=binary, unit=all(0.0 <= v <= 1.0 for v in values), confidence=confidence,
    )  # fmt: skip


def _bounded(
    interval: tuple[float, float], p: float, n: int, groups: int, clustered: float,
    independent: float, *, binary: bool, unit: bool, confidence: float,
) -> Interval:  # fmt: skip
    """`reward_interval`'s choice between the Wilson interval (0/1 values), the t interval
    clipped to [0, 1] and the t interval as it is, from the figures it needs."""
    if binary:
        if clustered > 0 and independent > 0:  # n over the design effect (1: no clustering)
            effective = min(float(n), n * (independent / clustered) ** 2)
        else:  # every reward equal: as many draws as tasks
            effective = float(groups)
        low, high = wilson_interval(p * effective, effective, confidence)
        return Interval(low, high, "wilson")
    low, high = interval
    if unit:
        return Interval(max(0.0, low), min(1.0, high), "t, clipped to [0, 1]")
    return Interval(low, high, "t")


class RunningInterval:
    """`reward_interval` of the values added so far, kept up to date one value at a time:
    O(1) to `add` a value and to read `interval()`, from running sums (what a live display
    redrawn several times a second can afford over a run of any length).

    The sums are of each value less the first one (the variance does not change, and
    values near each other lose no precision); the clustered sum of squares is
    sum over clusters g of (S_g - n_g m)^2 = A - 2 m B + m^2 C, with S_g and n_g each
    cluster's sum and count, A = sum S_g^2, B = sum S_g n_g, C = sum n_g^2. A sum of
    squares within a millionth of a millionth of the values' own counts as 0 (every value,
    or every cluster's mean, equal), where float rounding would leave a trace."""

    __slots__ = ("_a", "_b", "_binary", "_c", "_clusters", "_shift", "_squares", "_sum",
                 "_unit", "n")  # fmt: skip

    def __init__(self) -> None:
        self.n = 0
        self._shift = 0.0
        self._sum = 0.0  # of (value - shift)
        self._squares = 0.0  # of (value - shift)^2
        self._clusters: dict[object, tuple[float, int]] = {}  # g: (S_g, n_g)
        self._a = self._b = self._c = 0.0
        self._binary = self._unit = True

    def add(self, value: float, cluster: object) -> None:
        """One more value, of `cluster` (a task: its key or index)."""
        if not self.n:
            self._shift = value
        d = value - self._shift
        s, k = self._clusters.get(cluster, (0.0, 0))
        self._clusters[cluster] = (s + d, k + 1)
        self._a += d * (2 * s + d)
        self._b += s + d * (k + 1)
        self._c += 2 * k + 1
        self.n += 1
        self._sum += d
        self._squares += d * d
        self._binary = self._binary and value in (0.0, 1.0)
        self._unit = self._unit and 0.0 <= value <= 1.0

    @property
    def mean(self) -> float | None:
        """The mean of the values, None before the first."""
        return self._shift + self._sum / self.n if self.n else None

    def interval(self, confidence: float = CONFIDENCE) -> Interval | None:
        """`reward_interval` of the values so far (None with fewer than two clusters)."""
        n, groups = self.n, len(self._clusters)
        if groups < 2:
            return None
        m = self._sum / n
        noise = 1e-12 * self._squares
        between = self._a - 2 * m * self._b + m * m * self._c
        within = self._squares - n * m * m
        between = between if between > noise else 0.0
        within = within if within > noise else 0.0
        clustered = math.sqrt(groups / (groups - 1) * between) / n
        independent = math.sqrt(n / (n - 1) * within) / n if n > 1 else 0.0
        mean = self._shift + m
        half = t_quantile(0.5 + confidence / 2, groups - 1) * clustered
        return _bounded(
            (mean - half, mean + half), mean, n, groups, clustered, independent,
            binary=self._binary, unit=self._unit, confidence=confidence,
        )  # fmt: skip


def percentile(ordered: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of sorted values, interpolated linearly between ranks (as
    `statistics.quantiles(method="inclusive")` and numpy's default)."""
    if not ordered:
        raise ValueError("percentile of no values")
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of a task with n rollouts, c of them passing: the chance that k
    of them drawn without replacement hold at least one pass (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def nice_step(step: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten that is >= step."""
    power = 10.0 ** math.floor(math.log10(step))
    for factor in (1, 2, 5, 10):
        if factor * power >= step * (1 - 1e-9):
            return factor * power
    return 10 * power
