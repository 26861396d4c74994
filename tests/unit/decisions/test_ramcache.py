"""llama-server's RAM prompt cache as slotkeeper predicts it (issue #31): when a pinned
handover swaps through it, what it holds, and the trust answers give or withdraw."""

from __future__ import annotations

import sys
import threading

import pytest

from slotkeeper.decisions.ramcache import (
    FIRST_DISTRUST,
    MAX_DISTRUST,
    RamModel,
    hand_back_pays,
    prefix_load_pays,
    server_swaps,
    swap_predicted,
)


@pytest.mark.parametrize(("slot", "shared", "new", "sps", "swaps"), [
    (1000, 0, 1200, 0.1, True),  # another conversation: nothing kept
    (1000, 5, 1200, 0.1, True),  # a few template tokens: under sps, counted as 0
    (1000, 636, 1100, 0.1, False),  # one system prompt, 64% of the slot kept
    (2000, 636, 1100, 0.1, True),  # the slot's tail is most of it: f_keep 0.32
    (1000, 0, 1200, 0.0, False),  # -sps 0: a pinned request never looks in the cache
    (0, 0, 1200, 0.1, False),  # an empty slot: f_keep 0/0, no lookup
])
def test_server_swaps_as_get_available_slot(slot, shared, new, sps, swaps):
    assert server_swaps(slot, shared, new, sps) is swaps


@pytest.mark.parametrize(("shared", "slot_chars", "request_chars", "sps", "swaps"), [
    (0, 4000, 4400, 0.1, True),  # nothing in common but the template's first tokens
    (None, 4000, 4400, 0.1, False),  # not known: never predicted
    (2400, 3400, 3800, 0.1, False),  # one system block, most of the slot: kept
    (2400, 12000, 3800, 0.1, True),  # the slot's tail is most of it
    (2400, 3400, 3800, 0.8, True),  # similarity 0.65 under -sps 0.8
    (2400, 3400, 3800, 0.0, False),  # -sps 0: never
    (2400, 0, 3800, 0.1, False),  # the slot's characters not known
])
def test_swap_predicted_from_characters(shared, slot_chars, request_chars, sps, swaps):
    assert swap_predicted(shared, slot_chars, 700, request_chars, sps) is swaps
    assert not swap_predicted(shared, slot_chars, 0, request_chars, sps)  # an empty slot


def test_park_take_and_oldest_first_eviction():
    ram = RamModel(limit_bytes=300)
    ram.park("a", 10, 100)
    ram.park("b", 10, 100)
    ram.park("c", 10, 100)
    assert ram.holds("a") and ram.holds("c")
    ram.park("d", 10, 100)  # 400 > 300: the oldest leaves
    assert ram.holds("a") is None and ram.holds("b") and ram.holds("d")
    assert ram.take("b").tokens == 10 and ram.holds("b") is None
    ram.park("c", 20, 150)  # parked again: its newer, longer prompt replaces it, newest
    ram.park("e", 10, 100)
    assert ram.holds("d") is None and ram.holds("c", 20) and ram.holds("e")


def test_an_entry_larger_than_the_cache_is_not_parked_and_unknown_sizes_are():
    ram = RamModel(limit_bytes=100)
    ram.park("big", 10, 101)
    ram.park("unknown", 10, None)
    assert ram.holds("big") is None and ram.holds("unknown")
    assert RamModel(limit_bytes=-1).fits(10**15)  # --cache-ram -1: no limit


def test_off_when_the_cache_or_sps_is_zero():
    for ram in (RamModel(limit_bytes=0), RamModel(sps=0.0)):
        ram.park("a", 10, 1)
        assert not ram.enabled and ram.predicts_hit("a") is None


def test_a_miss_sends_the_next_predictions_to_the_disk_doubling_and_a_hit_restores_trust():
    ram = RamModel()
    ram.park("a", 100, 1)
    # the option says the server keeps a cache: trusted from the start
    assert ram.predicts_hit("a") is not None and ram.confirmed
    assert ram.confirm(100, 80)  # most of it reused: a hit
    assert ram.confirmed and ram.hits == 1
    assert not ram.confirm(100, 10)  # prefilled again: a miss
    assert ram.misses == 1 and ram.distrust == FIRST_DISTRUST and not ram.confirmed
    for _ in range(FIRST_DISTRUST):
        assert ram.predicts_hit("a") is None  # to the disk
    assert ram.predicts_hit("a") is not None
    assert not ram.confirm(100, 0)
    assert ram.distrust == 2 * FIRST_DISTRUST
    for _ in range(10):
        ram.confirm(100, 0)
    assert ram.distrust == MAX_DISTRUST
    assert ram.confirm(100, 100) and ram.distrust == 0 and ram.confirmed


def test_a_model_that_missed_first_is_trusted_only_after_a_hit():
    ram = RamModel()
    ram.park("a", 100, 1)
    assert not ram.confirm(100, 0)  # a server run with --cache-ram 0, say
    ram.distrust = 0
    assert not ram.confirmed
    assert ram.confirm(100, 100) and ram.confirmed


@pytest.mark.parametrize(("entry", "kept", "snapshot", "restore", "pays"), [
    (900, 725, 0, 0.0, True),  # the conversation back, where the slot keeps the system prompt
    (580, 516, 539, 0.0, True),  # 41 tokens beyond a stale snapshot (the persistence test)
    (540, 516, 539, 1.0, False),  # one token more than the snapshot, its restore ~free
    (900, 725, 900, 40.0, True),  # as much as the snapshot: RAM spares its slow read
    (900, 725, 1000, 0.0, False),  # the snapshot holds more
    (735, 725, 0, 0.0, False),  # 10 tokens more than the slot keeps: not worth the call
    (900, 0, 0, 0.0, True),  # nothing known of what the slot keeps
])
def test_a_hand_back_pays_when_ram_gives_back_more_than_slot_and_disk(entry, kept, snapshot,
                                                                      restore, pays):
    assert hand_back_pays(entry, kept, snapshot, restore) is pays


@pytest.mark.parametrize(("shared", "donor", "seed", "pays"), [
    (612, 731, 0, True),  # six-agents' second conversation: the parent keeps 84% of itself
    (612, 731, 610, True),  # a seed of the same prompt would read it from the disk
    (612, 731, 700, False),  # the seed holds more than the parent shares
    (612, 3000, 0, False),  # the parent keeps 20%: the server's "don't trash" skips it
    (10, 12, 0, False),  # too little to pay for the hand-back call
    (0, 0, 0, False),
])
def test_a_prefix_load_pays_when_the_server_will_load_it_and_it_beats_the_seed(shared, donor,
                                                                               seed, pays):
    assert prefix_load_pays(shared, donor, seed) is pays


def test_only_copy_of_names_a_parked_session_of_the_prompt_that_no_slot_holds():
    ram = RamModel(limit_bytes=10_000)
    ram.park("a", 10, 100, "sys1")
    ram.park("b", 10, 100, "sys2")
    assert ram.only_copy_of("sys1", resident={"x"}) == "a"
    assert ram.only_copy_of("sys1", resident={"a"}) is None  # a slot holds it too
    assert ram.only_copy_of("sys3", resident=set()) is None
    ram.park("c", 10, 100)  # its prompt unknown: could share the opening
    assert ram.only_copy_of("sys3", resident=set()) == "c"
    ram.take("c")
    assert ram.only_copy_of("sys3", resident=set()) is None


def test_with_a_higher_similarity_threshold_one_system_prompt_swaps_too():
    """six-agents' handover: the slot holds 856 tokens of another agent, 612 of them the
    shared system prompt, the request 950 tokens. At the default 0.1 the server keeps the
    shared prompt (f_keep 0.71): a hand-back is needed. At 0.8 the request's similarity, 0.64,
    does not count and the server swaps through its cache by itself."""
    assert not server_swaps(856, 612, 950)
    assert server_swaps(856, 612, 950, sps=0.8)
    # a turn that extends its own slot (similarity 0.9) is not swapped at 0.8
    assert not server_swaps(856, 856, 950, sps=0.8)
