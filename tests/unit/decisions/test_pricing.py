"""Saves, restores and seeds priced with measured speeds (issue #31): the test bed's figures
must keep "always save, always restore", a GPU's must not."""

from __future__ import annotations

from slotkeeper.decisions import pricing, ramcache
from slotkeeper.decisions.pricing import Rates

MiB = 2**20
# Measured here (docs/DESIGN.md, "Measured costs"): the test model on 2 cores.
TEST_BED = Rates(prefill_tokens_per_s=600, save_bytes_per_s=1.4e9, restore_bytes_per_s=2.8e9,
                 kv_bytes_per_token=3754, slot_fixed_bytes=4.6 * MiB)
# The same model with its slot folder capped at 5 MB/s (tests/bed/throttlefs.py).
SLOW_FOLDER = Rates(prefill_tokens_per_s=600, save_bytes_per_s=5e6, restore_bytes_per_s=5e6,
                    kv_bytes_per_token=3754, slot_fixed_bytes=4.6 * MiB)
# Llama-3.1-8B f16 KV (128 KiB a token) on one GPU: ~10^4 tokens/s prefill, NVMe ~2 GB/s.
GPU_8B = Rates(prefill_tokens_per_s=10_000, save_bytes_per_s=2e9, restore_bytes_per_s=2e9,
               kv_bytes_per_token=128 * 1024, slot_fixed_bytes=0)
# Llama-3.3-70B (320 KiB a token) on three GPUs: ~10^3 tokens/s prefill.
GPU_70B = Rates(prefill_tokens_per_s=1_000, save_bytes_per_s=2e9, restore_bytes_per_s=2e9,
                kv_bytes_per_token=320 * 1024, slot_fixed_bytes=0)


def restore_pays(rates: Rates, tokens: int) -> bool:
    return pricing.restore_pays(rates, rates.file_bytes(tokens), tokens)


def test_on_the_test_bed_every_snapshot_is_restored_and_every_session_saved():
    for tokens in (300, 2_000, 30_000):
        assert restore_pays(TEST_BED, tokens)
        assert pricing.save_pays(TEST_BED, tokens, 0, None)


def test_on_a_slow_folder_a_short_session_is_prefilled_and_a_long_one_restored():
    # 4.6 MiB of fixed part at 5 MB/s is ~1 s: more than prefilling 300 tokens (0.5 s).
    assert not restore_pays(SLOW_FOLDER, 300)
    assert restore_pays(SLOW_FOLDER, 4_000)


def test_an_8b_model_on_a_gpu_prefills_rather_than_saves_or_restores():
    # 2k tokens: 256 MiB, 0.13 s to read, 0.2 s to prefill: a restore still pays...
    assert restore_pays(GPU_8B, 2_000)
    # ...but writing it and reading it back (0.27 s) does not.
    assert not pricing.save_pays(GPU_8B, 2_000, 0, None)


def test_a_70b_model_on_three_gpus_saves_and_restores():
    assert restore_pays(GPU_70B, 30_000)
    assert pricing.save_pays(GPU_70B, 30_000, 0, None)


def test_an_unchanged_slot_is_never_written_again():
    assert not pricing.save_pays(TEST_BED, 2_000, 2_000, TEST_BED.file_bytes(2_000))
    assert not pricing.save_pays(Rates(), 2_000, 2_000, None)


def test_a_little_growth_is_not_worth_rewriting_a_big_snapshot():
    # 20 new tokens on a 4,000-token snapshot on the slow folder, 2k on a 30k-token one of a
    # 70B model: restoring the old snapshot and prefilling what it lacks costs less than
    # writing and reading the new one.
    assert not pricing.save_pays(SLOW_FOLDER, 4_020, 4_000, SLOW_FOLDER.file_bytes(4_000))
    assert not pricing.save_pays(GPU_70B, 32_000, 30_000, GPU_70B.file_bytes(30_000))
    # Doubling it is worth a write.
    assert pricing.save_pays(GPU_70B, 60_000, 30_000, GPU_70B.file_bytes(30_000))


def test_unknown_speeds_count_as_paying_so_the_first_call_measures_them():
    assert pricing.restore_pays(Rates(), 10 * MiB, 10)
    assert pricing.save_pays(Rates(), 10, 0, None)
    assert pricing.restore_pays(Rates(prefill_tokens_per_s=600), None, 10)


def test_a_restore_not_yet_measured_is_priced_at_the_save_speed_never_as_free():
    saved_only = Rates(prefill_tokens_per_s=150, save_bytes_per_s=7.7e6,
                       kv_bytes_per_token=3754, slot_fixed_bytes=4.6 * MiB)
    nbytes = saved_only.file_bytes(731)
    assert saved_only.restore_seconds(nbytes) is None
    assert saved_only.read_back_seconds(nbytes) == saved_only.save_seconds(nbytes)
    assert SLOW_FOLDER.read_back_seconds(nbytes) == SLOW_FOLDER.restore_seconds(nbytes)
    assert Rates().read_back_seconds(nbytes) is None
    # six-agents' first return: the RAM cache and the disk hold the same 731 tokens, and the
    # disk's read (~1 s at this save speed) is what the hand-back spares
    spared = saved_only.read_back_seconds(nbytes) * saved_only.prefill_tokens_per_s
    assert ramcache.hand_back_pays(731, 0, 731, spared)
    assert not ramcache.hand_back_pays(731, 0, 731, 0.0)


def test_a_save_that_would_stall_another_stream_past_the_budget_waits():
    assert not pricing.save_now(predicted_stall=2.0, others_generating=True, budget=0.5)


def test_a_save_runs_when_the_server_is_quiet_whatever_it_costs():
    assert pricing.save_now(predicted_stall=60.0, others_generating=False, budget=0.5)
    # nothing generating, but a request was sent or answered just now: the next turn is near
    assert not pricing.save_now(predicted_stall=4.0, others_generating=False, budget=0.5,
                                quiet=False)


def test_a_long_save_never_holds_an_answers_end():
    # the growth save after an answer: measured on mixed-agents at the bench's cap, 4.1 s
    # between a 5,880-token answer's last token and its end
    assert not pricing.save_now(predicted_stall=4.0, others_generating=False, budget=0.5,
                                holds_answer=True)
    assert pricing.save_now(predicted_stall=0.2, others_generating=False, budget=0.5,
                            holds_answer=True)


def test_a_save_within_the_budget_runs_beside_other_streams():
    assert pricing.save_now(predicted_stall=0.007, others_generating=True, budget=0.5)


def test_a_save_of_unknown_cost_runs_on_a_quiet_server_and_so_measures_the_speed():
    assert pricing.save_now(predicted_stall=None, others_generating=False, budget=0.5)
    # not while another slot streams: it may take seconds
    assert not pricing.save_now(predicted_stall=None, others_generating=True, budget=0.5)
    # nor between two turns of a busy server: the next turn would wait for it
    assert not pricing.save_now(predicted_stall=None, others_generating=False, budget=0.5,
                                quiet=False)
    # but not on an answer's path: the idle save measures it, off that path
    assert not pricing.save_now(predicted_stall=None, others_generating=False, budget=0.5,
                                holds_answer=True)


def test_the_write_budget_counts_the_hour_and_the_save_to_come():
    assert pricing.within_write_budget(0, 100, budget=100)
    assert not pricing.within_write_budget(50, 51, budget=100)
    assert pricing.within_write_budget(10**15, 10**9, budget=0)  # 0: no limit
    assert pricing.within_write_budget(99, None, budget=100)


def test_a_young_parent_is_copied_for_its_prefix_where_that_beats_prefilling_it():
    # The test bed: a 600-token parent copied for its 500 shared tokens (ms against ~0.8 s).
    assert pricing.copy_pays(TEST_BED, 600, 500)
    # An 8B model on a GPU: writing and reading 600 tokens (75 MiB, ~80 ms) against 50 ms of
    # prefill: not worth it.
    assert not pricing.copy_pays(GPU_8B, 600, 500)
    assert pricing.copy_pays(Rates(), 600, 500)  # unknown: run it, which measures
