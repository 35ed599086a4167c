"""One backoff formula (`trio_tasksets._core.backoff.Backoff`) behind every retry loop."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

import trio_tasksets as tt
from trio_tasksets._core.backoff import Backoff
from trio_tasksets.redis import _link as link

seconds = st.floats(min_value=0, max_value=1e6, allow_nan=False)


@given(first=seconds, most=seconds, jitter=st.floats(0, 1), retry=st.integers(1, 5000))
def test_a_delay_lies_within_the_jittered_cap(
    first: float, most: float, jitter: float, retry: int
) -> None:
    backoff = Backoff(first, most, jitter)
    cap = backoff.cap(retry)
    assert cap <= most
    assert cap == min(most, first * 2.0 ** min(retry - 1, 60))
    delay = backoff.delay(retry)
    assert cap * (1 - jitter) - 1e-9 <= delay <= cap + 1e-9


def test_the_cap_doubles_until_the_maximum() -> None:
    backoff = Backoff(0.5, 3.0, jitter=0)
    assert [backoff.delay(k) for k in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_retry_after_is_honoured_up_to_the_maximum() -> None:
    backoff = Backoff(0.5, 30.0)
    assert backoff.delay(1, retry_after=7.5) == 7.5
    assert backoff.delay(9, retry_after=120.0) == 30.0


@pytest.mark.parametrize(
    ("kw", "name"),
    [({"first": -1}, "first"), ({"max": float("nan")}, "max"), ({"jitter": 1.5}, "jitter")],
)
def test_bad_settings_name_the_field(kw: dict[str, float], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        Backoff(**kw)


def _draws(fn: object, *args: object, **kw: object) -> list[float]:
    random.seed(1234)
    return [fn(*args, **kw) for _ in range(20)]  # type: ignore[operator]


def test_every_retry_loop_uses_the_one_formula() -> None:
    """An episode's retries, a model call's and a Redis call's waits are `Backoff` draws."""
    policy = tt.RetryPolicy(max_retries=5, backoff=0.25, max_backoff=4.0)
    assert _draws(policy.delay, 3) == _draws(Backoff(0.25, 4.0).delay, 3)
    client = tt.OpenAIClient("http://127.0.0.1:1/v1", backoff=0.25, max_backoff=4.0)
    assert _draws(client._calls.retry_delay, 2, None) == _draws(Backoff(0.25, 4.0).delay, 3)
    assert client._calls.retry_delay(0, 9.0) == 4.0  # Retry-After, capped
    assert _draws(link.REDIS_BACKOFF.delay, 4) == _draws(Backoff(0.1, 3.0, 0.5).delay, 4)
