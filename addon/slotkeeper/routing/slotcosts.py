"""What taking each slot of a server from its owner costs now, for the walk's rankings
(choice.rank_slots, policy.order_for_side): nothing when the slot holds nobody's KV, nothing
but a later restore when the owner's snapshot holds what the slot holds or the server's RAM
cache does, else a save on the request's path. Reads the state file's records and the
server's info; decides nothing itself."""

from __future__ import annotations

from collections.abc import Callable

from ..decisions import policy
from ..decisions.choice import SlotView
from ..store.state import SlotRecord
from ..upstream.registry import UpstreamInfo

# (server, the slot's record, tokens in the slot now) -> would the server's RAM cache keep the
# owner if its slot were taken now (Handover.left_to_ram)
LeftToRam = Callable[[UpstreamInfo, SlotRecord, int], bool]


def loses_nothing(rec: SlotRecord, view: SlotView, info: UpstreamInfo,
                  left_to_ram: LeftToRam) -> bool:
    """The owner of a live claim loses nothing if its slot is taken now: its snapshot holds
    what the slot holds, or the server copied it to its RAM cache while it sat idle."""
    return (rec.saved_tokens >= max(rec.tokens, view.n_tokens)
            or left_to_ram(info, rec, view.n_tokens))


def free_to_take(slots: list[SlotView], up, info: UpstreamInfo,
                 left_to_ram: LeftToRam) -> frozenset[int]:
    """The claimed slots whose owner loses nothing if taken now (choice.rank_slots)."""
    if up is None:
        return frozenset()
    return frozenset(
        view.id for view in slots
        if (rec := up.slots.get(view.id)) is not None and not rec.stale
        and loses_nothing(rec, view, info, left_to_ram))


def side_costs(slots: list[SlotView], up, info: UpstreamInfo,
               left_to_ram: LeftToRam) -> dict[int, tuple[bool, int]]:
    """What running a request that claims nothing on each slot costs (policy.order_for_side):
    busy or not, and FREE (nobody's KV), CURRENT (its owner loses nothing: it pays one
    restore, from disk or from the server's RAM cache) or SAVE (its owner must be saved
    first)."""
    costs = {}
    for view in slots:
        rec = up.slots.get(view.id) if up is not None else None
        if rec is None or rec.stale:
            cost = policy.FREE
        elif loses_nothing(rec, view, info, left_to_ram):
            cost = policy.CURRENT
        else:
            cost = policy.SAVE
        costs[view.id] = (view.is_processing, cost)
    return costs
