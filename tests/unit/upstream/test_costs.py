"""The measured costs of a server (upstream/costs.py, issue #31): moving averages of the
server's own figures, with samples too small to measure a rate left out; and the bound of a
slot call that follows them (upstream/client.py)."""

from __future__ import annotations

import pytest

from slotkeeper.upstream.client import BATCH_TOKENS, SLOT_CALL_BASE_S, slot_call_timeout
from slotkeeper.upstream.costs import (ALPHA, MIN_DECODE_TOKENS, MIN_PREFILL_TOKENS,
                                       MIN_SLOT_BYTES, Costs, size_line)


def test_nothing_is_known_before_a_measurement():
    rates = Costs().rates()
    assert rates.prefill_tokens_per_s is None and rates.save_bytes_per_s is None
    assert rates.samples == 0
    assert set(rates.as_dict()) == {"prefill_tokens_per_s", "decode_tokens_per_s",
                                    "save_bytes_per_s", "restore_bytes_per_s",
                                    "kv_bytes_per_token", "slot_fixed_bytes", "samples"}


def test_answers_give_prefill_and_decode_speeds_as_a_moving_average():
    costs = Costs()
    costs.answered(prompt_n=300, prompt_ms=2000, predicted_n=10, predicted_ms=500)
    assert costs.rates().prefill_tokens_per_s == pytest.approx(150)
    assert costs.rates().decode_tokens_per_s == pytest.approx(20)
    costs.answered(prompt_n=400, prompt_ms=2000, predicted_n=20, predicted_ms=500)
    assert costs.rates().prefill_tokens_per_s == pytest.approx(150 + ALPHA * (200 - 150))
    assert costs.rates().decode_tokens_per_s == pytest.approx(20 + ALPHA * (40 - 20))
    assert costs.rates().samples == 2


def test_small_answers_and_zero_times_measure_nothing():
    costs = Costs()
    costs.answered(prompt_n=MIN_PREFILL_TOKENS - 1, prompt_ms=10, predicted_n=1,
                   predicted_ms=10)
    costs.answered(prompt_n=500, prompt_ms=0, predicted_n=MIN_DECODE_TOKENS, predicted_ms=0)
    assert costs.rates() == Costs().rates()


def test_slot_calls_give_bytes_per_second_and_bytes_per_token():
    costs = Costs()
    costs.saved(nbytes=20 * MIN_SLOT_BYTES, tokens=1000, ms=10)
    rates = costs.rates()
    assert rates.save_bytes_per_s == pytest.approx(20 * MIN_SLOT_BYTES / 0.010)
    assert rates.kv_bytes_per_token == pytest.approx(20 * MIN_SLOT_BYTES / 1000)
    costs.restored(nbytes=10 * MIN_SLOT_BYTES, tokens=500, ms=20.0)
    rates = costs.rates()
    assert rates.restore_bytes_per_s == pytest.approx(10 * MIN_SLOT_BYTES / 0.020)
    assert rates.kv_bytes_per_token == pytest.approx(20 * MIN_SLOT_BYTES / 1000)  # the same
    assert rates.save_bytes_per_s == pytest.approx(20 * MIN_SLOT_BYTES / 0.010)  # unchanged


def test_a_small_slot_call_is_overhead_not_a_rate_but_its_size_counts():
    costs = Costs()
    costs.saved(nbytes=MIN_SLOT_BYTES - 1, tokens=10, ms=1)
    costs.restored(nbytes=MIN_SLOT_BYTES * 2, tokens=0, ms=0)  # no tokens: no size either
    assert costs.rates().save_bytes_per_s is None
    assert costs.rates().restore_bytes_per_s is None
    assert costs.rates().kv_bytes_per_token == pytest.approx((MIN_SLOT_BYTES - 1) / 10)
    assert costs.rates().slot_fixed_bytes == 0


def test_the_size_of_a_slot_file_is_a_fixed_part_plus_a_cost_per_token():
    """Two saves of the test model (measured: 330 tokens, 6,092,332 bytes; 4,528 tokens,
    21,853,444 bytes): the ratio of the short one would say 18.5 KB a token."""
    costs = Costs()
    costs.saved(nbytes=6_092_332, tokens=330, ms=3)
    costs.saved(nbytes=21_853_444, tokens=4528, ms=10)
    per_token = (21_853_444 - 6_092_332) / (4528 - 330)
    assert costs.rates().kv_bytes_per_token == pytest.approx(per_token)
    assert costs.rates().slot_fixed_bytes == pytest.approx(6_092_332 - 330 * per_token)
    assert size_line([(10, 100.0), (20, 50.0)]) == (None, None)  # no rise: nothing told


def test_a_slot_calls_bound_follows_its_bytes_and_the_servers_measured_speeds():
    """Issue #31: 5 s, plus the bytes at the slower of 50 MB/s and a quarter of the measured
    rate, plus two batches of another slot's prefill at the measured prefill speed."""
    mib = 1024 * 1024
    assert slot_call_timeout(0) == SLOT_CALL_BASE_S
    assert slot_call_timeout(100 * mib) == pytest.approx(SLOT_CALL_BASE_S + 2)  # 50 MB/s
    # A fast disk measured: the floor still bounds it; a slow one: a quarter of its rate.
    assert slot_call_timeout(100 * mib, io_bytes_per_s=2e9) == pytest.approx(SLOT_CALL_BASE_S + 2)
    assert slot_call_timeout(20 * mib, io_bytes_per_s=5 * mib) == pytest.approx(
        SLOT_CALL_BASE_S + 16)
    assert slot_call_timeout(0, prefill_tokens_per_s=200) == pytest.approx(
        SLOT_CALL_BASE_S + 2 * BATCH_TOKENS / 200)
