"""Which slot a session gets. Pure: no I/O, no clock (the caller passes `now`)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from . import returns


@dataclass(frozen=True)
class SlotView:
    """One slot as llama-server's GET /slots reports it."""

    id: int
    is_processing: bool = False
    n_tokens: int = 0  # tokens cached in the slot (n_prompt_tokens; 0 for a never-used slot)
    n_ctx: int = 0


@dataclass(frozen=True)
class Claim:
    """A session's claim on a slot, as kept in the shared state file."""

    owner: str
    last_used: float
    stale: bool = False  # the slot no longer holds the owner's KV (side request, restart)


class SlotOutOfRange(ValueError):
    """A client's id_slot names no slot of the server: answered 400, never a lock file."""


def check_client_slot(slot: int, total_slots: int) -> None:
    """A client-chosen id_slot must name one of the server's slots (-1, "any", never gets
    here). Each accepted value makes a lock file and an entry in memory, so an unchecked one
    let a client make them without end (issue #21, item 5: slots 1000000, -7, 2**62)."""
    if not 0 <= slot < total_slots:
        raise SlotOutOfRange(f"id_slot {slot} is out of range: this server has slots "
                             f"0-{total_slots - 1} (or -1 for any)")


def is_abandoned(claim: Claim | None, now: float, ttl: float) -> bool:
    return claim is None or now - claim.last_used > ttl


def _preference(slot: SlotView, claim: Claim | None, now: float, ttl: float,
                expected_return: Callable[[Claim], float], free_to_take: bool) -> tuple:
    """Sort key, smallest first:
    1. an idle slot before one that is processing (taking a busy slot makes us wait for it);
    2. empty or abandoned slots (no claim, or last use older than the TTL), fewest cached
       tokens first: taking them costs nobody anything;
    3. then claimed slots whose owner loses nothing if taken now (`free_to_take`: its
       snapshot holds what the slot holds, or the server's RAM cache does), the owner
       expected back last first (decisions/returns.py): the others of this group will not
       have to change hands before it returns;
    4. then the other claimed slots (taking one saves its owner on the request's path),
       coldest first, the order of old: ranked by expected return, the session that had just
       spoken went first and a one-off waited 7.5 s for its save (DESIGN, "Which slot");
    5. then fewest cached tokens, then lowest id, so the order is total and deterministic."""
    abandoned = is_abandoned(claim, now, ttl)
    if abandoned or claim is None:
        group, when = 0, 0.0
    elif free_to_take:
        group, when = 1, -expected_return(claim)
    else:
        group, when = 2, claim.last_used
    return (
        slot.is_processing,
        group,
        slot.n_tokens if group == 0 else 0,
        when if when == when else 0.0,  # a NaN would break the order: ties instead
        slot.n_tokens,
        slot.id,
    )


def rank_slots(
    slots: Sequence[SlotView], claims: Mapping[int, Claim], now: float, ttl: float,
    expected_return: Callable[[Claim], float] | None = None,
    free_to_take: Collection[int] = frozenset(),
) -> list[int]:
    """Slot ids in the order a session without a slot should try them. The one function to
    swap for another policy. `expected_return`: when a claim's owner is expected back; by
    default as late as it has been idle (least recently used first). `free_to_take`: the
    claimed slots whose owner loses nothing if taken now."""
    back = expected_return or (lambda claim: returns.expected_return(claim.last_used, 0.0, now))
    ordered = sorted(slots, key=lambda s: _preference(s, claims.get(s.id), now, ttl, back,
                                                      s.id in free_to_take))
    return [s.id for s in ordered]


def fallback_slot(session_id: str, slot_count: int) -> int | None:
    """When /slots cannot be read: a stable hash of the session over the slot count, so a
    session still lands on the same slot every time (and other processes agree)."""
    if slot_count <= 0:
        return None
    digest = hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") % slot_count
