"""Slot choice: the pure ordering function."""

from slotkeeper.decisions.choice import Claim, SlotView, fallback_slot, is_abandoned, rank_slots

NOW = 10_000.0
TTL = 120.0


def test_empty_slots_come_first_fewest_tokens_first():
    slots = [SlotView(0, n_tokens=50), SlotView(1, n_tokens=0), SlotView(2, n_tokens=10)]
    claims = {0: Claim("a", NOW - 5)}
    assert rank_slots(slots, claims, NOW, TTL) == [1, 2, 0]


def test_abandoned_claim_counts_as_free():
    slots = [SlotView(0, n_tokens=900), SlotView(1, n_tokens=100)]
    claims = {0: Claim("old", NOW - TTL - 1), 1: Claim("live", NOW - 1)}
    assert rank_slots(slots, claims, NOW, TTL) == [0, 1]
    assert is_abandoned(claims[0], NOW, TTL) and not is_abandoned(claims[1], NOW, TTL)


def test_coldest_claimed_slot_when_all_live():
    slots = [SlotView(i, n_tokens=100) for i in range(3)]
    claims = {0: Claim("a", NOW - 3), 1: Claim("b", NOW - 30), 2: Claim("c", NOW - 10)}
    assert rank_slots(slots, claims, NOW, TTL) == [1, 2, 0]


def test_never_a_busy_slot_while_an_idle_one_qualifies():
    slots = [SlotView(0, is_processing=True), SlotView(1, n_tokens=5000)]
    claims = {1: Claim("hot", NOW - 1)}
    assert rank_slots(slots, claims, NOW, TTL)[0] == 1


def test_ties_break_by_tokens_then_id():
    slots = [SlotView(3), SlotView(1), SlotView(2, n_tokens=1)]
    assert rank_slots(slots, {}, NOW, TTL) == [1, 3, 2]


def test_fallback_is_stable_and_in_range():
    picks = {fallback_slot(f"s{i}", 4) for i in range(200)}
    assert picks == {0, 1, 2, 3}
    assert fallback_slot("same", 4) == fallback_slot("same", 4)
    assert fallback_slot("x", 0) is None
