"""What taking each slot from its owner costs (routing/slotcosts.py): the rankings' input.
Records as the state file holds them; `left_to_ram` is a plain function standing for the
server's RAM cache (Handover.left_to_ram, tested with a real server in test_ram_cache_real)."""

from __future__ import annotations

from slotkeeper.decisions import policy
from slotkeeper.decisions.choice import SlotView
from slotkeeper.routing.slotcosts import free_to_take, side_costs
from slotkeeper.store.state import SlotRecord, UpstreamRecord
from slotkeeper.upstream.client import Upstream
from slotkeeper.upstream.registry import UpstreamInfo

INFO = UpstreamInfo(Upstream("http://127.0.0.1:9"))


def record(owner: str, tokens: int, saved: int, stale: bool = False) -> SlotRecord:
    return SlotRecord(owner=owner, claimed=0.0, last_used=1.0, stale=stale, tokens=tokens,
                      saved_tokens=saved)


def in_ram(*owners: str):
    return lambda info, rec, live_tokens: rec.owner in owners


def test_an_owner_loses_nothing_when_saved_as_it_is_or_in_the_servers_ram_cache():
    up = UpstreamRecord(slots={
        0: record("saved", 900, 900),
        1: record("grew", 900, 700),  # grew since its snapshot: a save on the path
        2: record("parked", 900, 0),  # never saved, but the server copied it to RAM
        3: record("gone", 900, 0, stale=True),  # stale: free, not a claim at all
    })
    slots = [SlotView(i, n_tokens=900) for i in range(4)]
    assert free_to_take(slots, up, INFO, in_ram("parked")) == {0, 2}
    assert free_to_take(slots, up, INFO, in_ram()) == {0}
    assert free_to_take(slots, None, INFO, in_ram("parked")) == frozenset()


def test_a_slot_that_grew_past_the_snapshot_the_record_knows_is_not_free():
    """/slots says what the slot holds now: more than the record's tokens means the owner's
    last turn is not in its snapshot yet."""
    up = UpstreamRecord(slots={0: record("a", 900, 900)})
    assert free_to_take([SlotView(0, n_tokens=1000)], up, INFO, in_ram()) == frozenset()


def test_a_side_request_counts_an_owner_in_the_ram_cache_as_current():
    up = UpstreamRecord(slots={0: record("parked", 900, 0), 1: record("grew", 900, 100)})
    slots = [SlotView(0, n_tokens=900), SlotView(1, n_tokens=900, is_processing=True),
             SlotView(2)]
    assert side_costs(slots, up, INFO, in_ram("parked")) == {
        0: (False, policy.CURRENT), 1: (True, policy.SAVE), 2: (False, policy.FREE)}
    assert side_costs(slots, up, INFO, in_ram())[0] == (False, policy.SAVE)
