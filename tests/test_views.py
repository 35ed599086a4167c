"""`View`: a read-only view of a part's attribute (an adaptive window's bounds, a client's
settings, a feed's counts)."""

from __future__ import annotations

import pytest

import trio_tasksets as tt
from trio_tasksets._core.views import View


def test_a_view_reads_the_parts_attribute_and_refuses_an_assignment() -> None:
    window = tt.AdaptiveWindow(2, 4, 8)
    assert (window.min, window.max) == (2, 8)
    window.controller.max = 16  # the view follows its part
    assert window.max == 16
    with pytest.raises(AttributeError, match="read-only"):
        window.min = 3
    assert isinstance(type(window).__dict__["min"], View)
    assert type(window).__dict__["min"].__doc__


def test_the_clients_and_feeds_views() -> None:
    client = tt.OpenAIClient("http://127.0.0.1:9/v1", timeout=7.0, max_retries=2)
    assert (client.timeout, client.max_retries, client.throttled) == (7.0, 2, 0)
    feed = tt.testing.FeedTaskset()
    assert (feed.pulled, feed.closed) == (0, False)
