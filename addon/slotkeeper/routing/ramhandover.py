"""The RAM side of a handover (issue #31): when the incoming session is in llama-server's own
RAM prompt cache, the slot changes hands through that cache instead of the disk. Two ways in:

- **The server swaps by itself**: the slot holds a session the request shares little with
  (different system blocks), so the pinned request keeps under half of the slot and the server
  parks it in RAM and loads the incoming session's entry (ramcache.server_swaps).
- **Handed back**: the two share a long prefix (the same system prompt), so the server would
  keep the slot as it is and never look in its cache. slotkeeper first sends a one-token
  completion pinned to the slot (`Upstream.hand_back`): it shares nothing with the slot, so the
  server parks the slot's prompt in RAM and clears it; the request then finds the slot holding
  only those few tokens and loads its own entry from RAM. Measured on b11434 (DESIGN, "Handing
  a slot back to the server's RAM cache"): ~35 ms for the extra call on the bed, and the
  session's whole conversation back (888 of 893 tokens) where the pinned request alone reused
  the 725 of the system prompt.

Only for a session the model says the cache holds: a request without an entry of its own
would load another session's entry (the server takes it out of the cache) and keep only the
shared system prompt of it. Blocking: worker threads, under the slot's exclusive lease."""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..decisions import pricing, ramcache
from ..decisions.ramcache import Entry
from ..identity.identity import Identity
from ..observe import metrics
from ..snapshots.saves import Saves
from ..snapshots.snapshots import Snapshots, hand_back_id, seed_id
from ..store.locks import SlotLease
from ..store.state import SlotRecord, UpstreamRecord
from ..upstream.client import UpstreamError
from ..upstream.registry import UpstreamInfo
from .routes import ASSIGNED, Route

log = logging.getLogger("slotkeeper")

SharedChars = Callable[[Identity, SlotRecord], int | None]


class RamHandover:
    """Owns: whether a handover goes through the server's RAM cache, the hand-back call, and
    the RAM model's bookkeeping of what was parked and taken. Does not touch: disk restores,
    seeds and prefixes (handover.py), which slot (the walk)."""

    def __init__(self, saves: Saves, snapshots: Snapshots | None, erase_on_handover: bool,
                 shared_chars: SharedChars = lambda ident, rec: None) -> None:
        self.saves = saves
        # the sessions room's: what a request shares with the conversation a slot holds
        self.shared_chars = shared_chars
        self.snapshots = snapshots
        self.erase_on_handover = erase_on_handover

    def server_swaps(self, info: UpstreamInfo, ident: Identity, previous: SlotRecord | None,
                     live_tokens: int) -> bool:
        """Will the request, pinned to this slot as it is now (holding `previous`'s session),
        go through llama-server's RAM cache (ramcache.swap_predicted)? Only when what the two
        share is known: from the slot's conversation as this process remembers it, else
        nothing when their system blocks differ (DESIGN, issue #31)."""
        if (previous is None or previous.stale or previous.owner == ident.session_id
                or not info.ram.enabled):
            return False
        shared = self.shared_chars(ident, previous)
        if shared is None:
            parent = ident.prefix is not None and ident.prefix.session == previous.owner
            differ = (not parent and bool(previous.system_key) and bool(ident.seed_key)
                      and previous.system_key != ident.seed_key)
            shared = 0 if differ else None
        return ramcache.swap_predicted(shared, previous.chars, max(previous.tokens, live_tokens),
                                       ident.prompt_chars, info.ram.sps)

    def nothing_to_restore(self, ident: Identity) -> bool:
        """No file of the session's own, of its seed or of a parent: nothing the handover could
        restore over the slot (and no erase: keep_prefix)."""
        if self.erase_on_handover:
            return False
        folder = self.snapshots.folder if self.snapshots is not None else None
        if folder is None:
            return True
        seed = folder.read_meta(seed_id(ident.seed_key)) if ident.seed_key else None
        return (ident.prefix is None and seed is None
                and folder.read_meta(ident.session_id) is None)

    def park(self, info: UpstreamInfo, previous: SlotRecord, live_tokens: int) -> None:
        """The outgoing session is in the server's RAM cache now. Only modelled with a slot
        folder: without one there is no disk save or restore for the model to spare."""
        if self.snapshots is None:
            return
        tokens = max(previous.tokens, live_tokens)
        info.ram.park(previous.owner, tokens, info.client.costs.rates().file_bytes(tokens),
                      previous.system_key)

    def keeps(self, info: UpstreamInfo, previous: SlotRecord, live_tokens: int) -> bool:
        """May the outgoing session be left to the server's RAM cache with no disk save? When
        the model is trusted and the cache has room for it without dropping another entry."""
        tokens = max(previous.tokens, live_tokens)
        return (self.snapshots is not None and info.ram.confirmed and info.ram.has_room(
            previous.owner, info.client.costs.rates().file_bytes(tokens)))

    def hand_back(self, url: str, info: UpstreamInfo, ident: Identity, slot: int,
                  lease: SlotLease, previous: SlotRecord | None, live_tokens: int,
                  resident_tokens: int) -> Route | None:
        """The slot's session and the incoming one share a prefix the server would keep, and
        the cache holds more of the incoming session than that prefix and its snapshot: hand
        the slot back to the cache, then let the request load its entry. None: not this way
        (the disk's handover runs)."""
        session = ident.session_id
        if (previous is None or previous.stale or previous.owner == session
                or self.erase_on_handover or self.snapshots is None or not info.ram.enabled):
            return None
        held = info.ram.holds(session)
        rates = info.client.costs.rates()
        if held is None or not info.ram.fits(rates.file_bytes(max(previous.tokens,
                                                                   live_tokens))):
            return None
        meta = self.snapshots.folder.read_meta(session)
        snapshot = meta.n_tokens if meta is not None else 0
        restore = rates.read_back_seconds(meta.size_bytes) if meta is not None else None
        if restore is not None and not pricing.restore_pays(rates, meta.size_bytes,
                                                            snapshot - resident_tokens):
            snapshot, restore = 0, None  # the disk's way would prefill, not restore
        as_tokens = (restore or 0.0) * (rates.prefill_tokens_per_s or 0.0)
        if not ramcache.hand_back_pays(held.tokens, resident_tokens, snapshot, as_tokens):
            return None
        entry = info.ram.predicts_hit(session)  # None while answers distrust the model
        if entry is None:
            return None
        return self.from_ram(url, info, ident, slot, lease, previous, live_tokens, entry,
                             hand_back=True)

    def from_ram(self, url: str, info: UpstreamInfo, ident: Identity, slot: int,
                 lease: SlotLease, previous: SlotRecord, live_tokens: int, entry: Entry,
                 hand_back: bool = False) -> Route:
        """The incoming session is in llama-server's RAM cache and the request will swap
        (after the hand-back call, when `hand_back`): no disk save of the outgoing session
        while the model is trusted (the server parks it in RAM; its growth since its last
        snapshot is saved by a priced idle save once it is back in a slot) and no disk
        restore of the incoming one (it would overwrite the slot, and the server would then
        never look in its cache). The answer's cache_n confirms it (accounting)."""
        session = ident.session_id
        # while answers distrust the model, or the cache would drop it, the outgoing session
        # is saved as before: then only the disk would have it
        saved = (not self.keeps(info, previous, live_tokens)
                 and self.saves.save_if_worth(url, info, slot, previous, live_tokens))
        how = f"{previous.owner} left to the server's RAM cache"
        if hand_back:
            failed, way = self._hand_back(url, info, ident, slot, lease, previous, live_tokens,
                                          saved)
            if failed is not None:
                return failed
            how = f"slot {slot} handed back{way} to the server's RAM cache with {previous.owner}"
        self.park(info, previous, live_tokens)
        info.ram.take(session)
        metrics.eviction("session", saved)
        meta = self.snapshots.folder.read_meta(session) if self.snapshots else None
        self.saves.mark_fresh(url, slot, session, entry.tokens,
                              saved_tokens=meta.n_tokens if meta is not None else 0)
        return Route(url, session, ident.rule, slot, ASSIGNED, lease=lease,
                     detail=f"{how}; {entry.tokens:,} tokens expected back from it",
                     ram_tokens=entry.tokens)

    def prefix_from_ram(self, url: str, info: UpstreamInfo, ident: Identity, slot: int,
                        lease: SlotLease, previous: SlotRecord | None, live_tokens: int,
                        up: UpstreamRecord | None, idle_slots: frozenset[int]) -> Route | None:
        """A new conversation whose parent sits idle in another slot: hand this slot back, so
        that the call's start copies the idle parent into the server's RAM cache, and the
        request then loads the parent's copy and keeps the opening they share. What
        llama-server alone does with one slot, where slotkeeper copied the parent through
        the disk (six-agents: 1.31 s to the first token against 0.31 s at the bench's cap).
        The load takes the parent's entry out of the cache, and the next start of a request
        copies the parent back while it is idle: nothing is lost, as long as no session whose
        only copy is in the cache shares the opening (`RamModel.only_copy_of`). None: not
        this way (the disk's handover runs)."""
        session, prefix, key = ident.session_id, ident.prefix, ident.seed_key
        if (prefix is None or up is None or key is None or self.erase_on_handover
                or self.snapshots is None or not info.ram.confirmed
                or info.ram.holds(session) is not None
                or self.snapshots.folder.read_meta(session) is not None):
            return None
        leaving = previous is not None and not previous.stale and previous.owner != session
        if previous is not None and not previous.stale and (
                previous.owner == session or previous.system_key == key):
            return None  # the slot holds the opening already: the server keeps it
        donor = up.slot_of(prefix.session)
        if donor is None or donor == slot or donor not in idle_slots or up.slots[donor].stale:
            return None
        seen = info.last_seen.get(prefix.session)
        tokens = max(up.slots[donor].tokens, seen.tokens if seen is not None else 0)
        shared = min(tokens, tokens * prefix.chars // max(prefix.parent_chars, 1))
        seed = self.snapshots.folder.read_meta(seed_id(key))
        resident = {rec.owner for rec in up.slots.values() if not rec.stale}
        if (not ramcache.prefix_load_pays(shared, tokens, seed.n_tokens if seed else 0)
                or info.ram.only_copy_of(key, resident) is not None):
            return None
        saved = leaving and not self.keeps(info, previous, live_tokens) and \
            self.saves.save_if_worth(url, info, slot, previous, live_tokens)
        source = prefix.session
        if prefix.items == 1 and not info.published(source):
            # it shares only the system block, and the parent has not sat idle at a launch yet
            # (it spoke last): another idle session of that block already in the cache gives
            # the same opening, by the file instead of the call (six-agents' third and fourth
            # agents: routes of ~35 ms, not ~90 ms and a prompt evaluation)
            source = published_twin(info, up, key, idle_slots - {slot}) or source
        # the file only if the source is in the cache already: the call's start copies it
        failed, way = self._hand_back(url, info, ident, slot, lease, previous, live_tokens,
                                      saved, donor=source)
        if failed is not None:
            return failed
        if leaving:  # its opening differs: its entry is never the one loaded
            self.park(info, previous, live_tokens)
            metrics.eviction("session", saved)
        self.saves.mark_fresh(url, slot, session, shared, kept_on_disk=False)
        return Route(url, session, ident.rule, slot, ASSIGNED, lease=lease,
                     detail=f"slot {slot} handed back{way} to the server's RAM cache: "
                            f"~{shared:,} tokens of {prefix.session}'s prefix expected from it"
                            + (f" (from {source}'s copy)" if source != prefix.session else ""),
                     ram_tokens=shared)

    def _hand_back(self, url: str, info: UpstreamInfo, ident: Identity, slot: int,
                   lease: SlotLease, previous: SlotRecord | None, live_tokens: int,
                   saved: bool, donor: str = "") -> tuple[Route | None, str]:
        """Hand the slot back, by the file where it may, else by the call. (None, how) when
        it went through; else the request's route: what the slot holds now is not known, so
        no claim on it for anybody, and the request prefills what it must (its answer is the
        server's, right either way). `donor`: a session the request will load from the
        cache, which must be there before the request starts."""
        session = ident.session_id
        try:
            if (not donor or info.published(donor)) and self._hand_back_from_file(
                    info, slot, previous, session):
                return None, " (by the hand-back file)"
            info.client.hand_back(slot)
            self._keep_hand_back_file(info, slot)
            return None, ""
        except UpstreamError as e:
            log.warning("%s: could not hand slot %d back to %s's RAM cache (%s): the request "
                        "prefills what the slot lacks", session, slot, url, e)
            info.ram.take(session)  # whether the request loads it is not known
            if previous is not None and not previous.stale and previous.owner != session:
                if info.published(previous.owner):  # copied there while it sat idle
                    self.park(info, previous, live_tokens)
                metrics.eviction("session", saved)
            self.saves.mark_fresh(url, slot, session, 0)
            return Route(url, session, ident.rule, slot, ASSIGNED, lease=lease,
                         detail=f"hand-back to the server's RAM cache failed ({e})"), ""

    def _hand_back_from_file(self, info: UpstreamInfo, slot: int, previous: SlotRecord | None,
                             session: str) -> bool:
        """Clear the slot by restoring the hand-back file (a slot holding only the hand-back
        prompt) instead of the call: a slot action of milliseconds where the call is a prompt
        evaluation of the server's (measured: 3 ms against 27-42 ms). Only when the slot holds
        nothing the cache lacks: a restore overwrites the slot where the call parks it first.
        So its session must have been copied there while it sat idle (`published`), or the
        slot hold no session of ours (none, or stale)."""
        if self.snapshots is None or info.props is None or not (
                previous is None or previous.stale
                or (previous.owner != session and info.published(previous.owner))):
            return False
        snapshot = hand_back_id(info.props.fingerprint)
        if self.snapshots.folder.read_meta(snapshot) is None:
            return False
        notes: list[str] = []
        restored = self.snapshots.restore(info.client, info.props, slot, snapshot, 0, notes,
                                          what="hand-back file", priced=False)
        if not restored and notes:
            log.info("slot %d: %s; handed back with the call", slot, "; ".join(notes))
        return restored > 0

    def _keep_hand_back_file(self, info: UpstreamInfo, slot: int) -> None:
        """After the first hand-back call for a model, the slot holds only the hand-back
        prompt: saved once (tens of KB) as that model's hand-back file."""
        if self.snapshots is None or info.props is None:
            return
        snapshot = hand_back_id(info.props.fingerprint)
        if self.snapshots.folder.read_meta(snapshot) is None:
            self.snapshots.save(info.client, info.props, slot, snapshot, messages=0,
                                kind="hand-back")


def published_twin(info: UpstreamInfo, up: UpstreamRecord, system_key: str,
                   idle_slots: frozenset[int]) -> str | None:
    """A session of the system block `system_key` that sits idle in one of `idle_slots` and
    was copied into the server's RAM cache while it did (`published`): its copy opens as any
    conversation of that block does. None: no such session."""
    for slot in sorted(idle_slots):
        rec = up.slots.get(slot)
        if (rec is not None and not rec.stale and rec.system_key == system_key
                and info.published(rec.owner)):
            return rec.owner
    return None
