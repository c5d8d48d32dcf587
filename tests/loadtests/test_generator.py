import asyncio

import pytest

from loadtests.generator import LoadSpec, run_load, zipf_weights


def test_zipf_weights_are_a_decreasing_distribution():
    w = zipf_weights(20, 1.1)
    assert abs(sum(w) - 1) < 1e-12 and all(a > b for a, b in zip(w, w[1:]))


def test_load_targets_loopback_only():
    with pytest.raises(ValueError, match="loopback only"):
        asyncio.run(run_load("http://10.0.0.1:8000", ["a"], {"a": ["x"]}, LoadSpec(duration_s=0.1)))


def test_load_is_bounded_and_counts_failures():
    """Against a port nobody listens on: every request fails fast and is counted, none hangs."""
    spec = LoadSpec(rate_rps=50, duration_s=0.2, timeout_s=2)
    result = asyncio.run(run_load("http://127.0.0.1:9", ["a", "b"], {"a": ["x"], "b": ["y"]}, spec))
    s = result.summary()
    assert s["sent"] == 10 and s["ok"] == 0 and s["errors"] == 10
    assert sum(result.statuses.values()) == 10
