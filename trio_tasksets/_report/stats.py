"""Statistics for the report: a t quantile, a clustered confidence interval, the Wilson
interval and the reward interval built from them, percentiles, pass@k. Plain functions over lists, each checked against a textbook value in the tests."""

from __future__ import annotations

import math
import statistics

import attrs

__all__ = [
    "CONFIDENCE",
    "Interval",
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


def mean_interval(
    values: list[float], clusters: list[int], confidence: float = CONFIDENCE
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


def _clustered_se(values: list[float], clusters: list[int]) -> float:
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
    values: list[float], clusters: list[int], confidence: float = CONFIDENCE
) -> Interval | None:
    """The interval the report shows for a mean reward, inside the rewards' bounds.

    0/1 rewards (pass/fail): the Wilson score interval, its sample size the effective one of
    the clustered standard error (n / design effect, so a task's correlated rollouts count
    for less than independent draws; G, the number of tasks, when every reward is equal).
    Rewards in [0, 1]: the clustered t interval (`mean_interval`) clipped to [0, 1]. Other
    rewards: that t interval as it is. None with fewer than two clusters.
    """
    interval = mean_interval(values, clusters, confidence)
    if interval is None:
        return None
    low, high = interval
    if all(v in (0.0, 1.0) for v in values):
        n = len(values)
        p = math.fsum(values) / n
        clustered = _clustered_se(values, clusters)
        independent = _clustered_se(values, list(range(n)))
        if clustered > 0 and independent > 0:  # n over the design effect (1: no clustering)
            effective = min(float(n), n * (independent / clustered) ** 2)
        else:  # every reward equal: as many draws as tasks
            effective = float(len(set(clusters)))
        low, high = wilson_interval(p * effective, effective, confidence)
        return Interval(low, high, "wilson")
    if all(0.0 <= v <= 1.0 for v in values):
        return Interval(max(0.0, low), min(1.0, high), "t, clipped to [0, 1]")
    return Interval(low, high, "t")


def percentile(ordered: list[float], q: float) -> float:
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
