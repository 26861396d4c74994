"""The metrics module on its own: the prefill-time estimate, reload safety, reason mapping."""

from __future__ import annotations

import importlib

import pytest
from prometheus_client.parser import text_string_to_metric_families

from slotkeeper.manage import scrape
from slotkeeper.observe import metrics
from slotkeeper.wire.bodies import Timings


def sample(name: str, **labels: str) -> float:
    value = metrics.REGISTRY.get_sample_value(name, labels or None)
    return 0.0 if value is None else value


def timings(cache_n: int, prompt_n: int, prompt_ms: float) -> Timings:
    return Timings(cache_n=cache_n, prompt_n=prompt_n, predicted_n=4, prompt_ms=prompt_ms)


def test_seconds_saved_use_a_moving_average_of_prefill_speed():
    up = "http://test-ema:1"
    before = sample("slotkeeper_prefill_seconds_saved_total")
    # Reused before any measurement: held until the first speed is known.
    metrics.timings(up, timings(cache_n=100, prompt_n=5, prompt_ms=50))  # too few to measure
    assert metrics.prefill_seconds_per_token(up) is None
    assert sample("slotkeeper_prefill_seconds_saved_total") == before
    # First measurement: 10 ms/token; the held 100 and these 200 are credited at it.
    metrics.timings(up, timings(cache_n=200, prompt_n=100, prompt_ms=1000))
    assert metrics.prefill_seconds_per_token(up) == pytest.approx(0.010)
    assert sample("slotkeeper_prefill_seconds_saved_total") - before == pytest.approx(3.0)
    # Second: 20 ms/token moves the average by alpha.
    metrics.timings(up, timings(cache_n=1000, prompt_n=50, prompt_ms=1000))
    speed = 0.010 + metrics.EMA_ALPHA * (0.020 - 0.010)
    assert metrics.prefill_seconds_per_token(up) == pytest.approx(speed)
    assert sample("slotkeeper_prefill_seconds_saved_total") - before == pytest.approx(
        3.0 + 1000 * speed)
    metrics.timings(up, None)  # a response without timings changes nothing
    assert metrics.prefill_seconds_per_token(up) == pytest.approx(speed)


def test_tokens_are_counted_by_kind():
    reused = sample("slotkeeper_prompt_tokens_total", kind="reused")
    prefilled = sample("slotkeeper_prompt_tokens_total", kind="prefilled")
    metrics.timings("http://test-tokens:1", timings(cache_n=7, prompt_n=3, prompt_ms=1))
    assert sample("slotkeeper_prompt_tokens_total", kind="reused") == reused + 7
    assert sample("slotkeeper_prompt_tokens_total", kind="prefilled") == prefilled + 3


def test_reloading_the_module_keeps_the_registry_and_counts():
    registry = metrics.REGISTRY
    metrics.eviction("session", True)
    count = sample("slotkeeper_evictions_total", by="session", saved="true")
    reloaded = importlib.reload(metrics)  # registering twice would raise here
    assert reloaded.REGISTRY is registry
    assert sample("slotkeeper_evictions_total", by="session", saved="true") == count
    reloaded.eviction("session", True)
    assert sample("slotkeeper_evictions_total", by="session", saved="true") == count + 1
    names = [f.name for f in text_string_to_metric_families(reloaded.render().decode())]
    assert len(names) == len(set(names))


@pytest.mark.parametrize(("why", "reason"), [
    ("GET /slots: HTTP 501", "slots_unavailable"),
    ("GET /slots: ConnectTimeout", "slots_unavailable"),
    ("server reports no slots", "no_slots"),
    ("no slot could be locked in time", "lock_timeout"),
])
def test_fallback_reasons_are_a_small_fixed_set(why, reason):
    before = sample("slotkeeper_fallbacks_total", reason=reason)
    metrics.fallback(why)
    assert sample("slotkeeper_fallbacks_total", reason=reason) == before + 1


def test_timed_counts_failures_and_reraises():
    ok = sample("slotkeeper_slot_operations_total", operation="erase", outcome="ok")
    failed = sample("slotkeeper_slot_operations_total", operation="erase", outcome="failed")
    with metrics.timed("erase"):
        pass
    with pytest.raises(OSError), metrics.timed("erase"):
        raise OSError("boom")
    assert sample("slotkeeper_slot_operations_total", operation="erase", outcome="ok") == ok + 1
    assert sample("slotkeeper_slot_operations_total", operation="erase",
                  outcome="failed") == failed + 1


def test_fresh_addons_count_into_the_same_registry():
    """What a completed script reload does: the entry script runs again, new addon objects are
    made and loaded. Counts go on; the scrape-time gauges read the new addon's router."""
    from slotkeeper.addon import SlotKeeper, make_addons

    metrics.request("/v1/test-reload", "kept")
    before = sample("slotkeeper_requests_total", endpoint="/v1/test-reload", action="kept")
    addons = make_addons()
    keeper = next(a for a in addons if isinstance(a, SlotKeeper))
    endpoint = next(a for a in addons if isinstance(a, scrape.MetricsEndpoint))
    endpoint.load(None)
    assert all(metrics.collector(name, make).keeper is keeper for name, make in scrape.GAUGES)
    assert sample("slotkeeper_requests_total", endpoint="/v1/test-reload", action="kept") == before
    metrics.request("/v1/test-reload", "kept")
    assert sample("slotkeeper_requests_total", endpoint="/v1/test-reload",
                  action="kept") == before + 1
    keeper.pool.shutdown()
