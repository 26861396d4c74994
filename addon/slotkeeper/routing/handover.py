"""The handover room: a slot changes hands. Under the slot's lease it saves the outgoing
session (when it grew enough to be worth a file), then restores the incoming session's
snapshot, else its system prompt's seed (restored; seeds are taken after an answer, issue #23:
firstturns.py) or its parent's prefix (a young parent saved from its idle slot first), else
starts the slot clean; a
request that only passes through someone's slot displaces its owner (saved, marked stale).
Blocking: worker threads."""

from __future__ import annotations

import logging

from ..decisions import policy, pricing
from ..identity.identity import Identity
from ..observe import metrics
from ..snapshots.saves import Saves
from ..snapshots.snapshots import Snapshots, seed_id
from ..store.locks import SlotLease, SlotLocks
from ..store.state import SlotRecord, StateFile
from ..upstream.client import UpstreamError
from ..upstream.registry import UpstreamInfo
from .ramhandover import RamHandover, SharedChars
from .routes import ASSIGNED, RESTORED, SEEDED, Route

log = logging.getLogger("slotkeeper")

PREFIXED = "prefixed"  # inside the handover only: restored from the parent's snapshot


class Handover:
    """Owns: what a slot holds when it changes hands (save out, restore/seed in, erase).
    Does not touch: which slot or server (the walk and the pool decided), leases (the
    caller holds the slot's; a young parent's slot is only tried, never waited for), what
    happens after the answer."""

    def __init__(self, state: StateFile, locks: SlotLocks, saves: Saves,
                 snapshots: Snapshots | None, erase_on_handover: bool,
                 shared_chars: SharedChars = lambda ident, rec: None) -> None:
        self.state = state
        self.locks = locks
        self.saves = saves
        self.snapshots = snapshots
        self.erase_on_handover = erase_on_handover
        self.ram = RamHandover(saves, snapshots, erase_on_handover, shared_chars)

    def hand_over(self, url: str, info: UpstreamInfo, ident: Identity, slot: int,
                  lease: SlotLease, previous: SlotRecord | None, live_tokens: int,
                  path: str, body: dict | None, idle_slots: frozenset[int] = frozenset()
                  ) -> Route:
        """Under the exclusive slot lock: through the server's RAM cache when it can, else
        save the outgoing session, then restore the incoming one's snapshot if it can work,
        else its system prompt's seed, else start clean."""
        session = ident.session_id
        notes: list[str] = []
        if info.client.slot_actions_disabled:  # no --slot-save-path: pinning still works
            self.saves.mark_fresh(url, slot, session, 0)
            return Route(url, session, ident.rule, slot, ASSIGNED, lease=lease,
                         detail="server has no --slot-save-path")
        swaps = self.ram.server_swaps(info, ident, previous, live_tokens)
        entry = info.ram.predicts_hit(session) if swaps else None
        if entry is not None and previous is not None:
            return self.ram.from_ram(url, info, ident, slot, lease, previous, live_tokens, entry)
        resident = self._resident(ident, previous)
        handed_back = None if swaps else self._handed_back(url, info, ident, slot, lease,
                                                           previous, live_tokens, resident,
                                                           idle_slots)
        if handed_back is not None:
            return handed_back
        leaving = previous is not None and previous.owner != session and not previous.stale
        if leaving and self.ram.keeps(info, previous, live_tokens) and (
                (swaps and self.ram.nothing_to_restore(ident))
                or info.published(previous.owner)):
            # the request's swap parks the outgoing session in RAM (nothing will overwrite the
            # slot first), or the server copied it there while it sat idle: its save is left
            # to a priced idle save once it is back in a slot
            notes.append(f"{previous.owner} left to the server's RAM cache")
            metrics.eviction("session", False)
        elif leaving:
            saved = self.saves.save_if_worth(url, info, slot, previous, live_tokens)
            metrics.eviction("session", saved)
            if saved:
                notes.append(f"saved {previous.owner}")
        in_slot = previous if previous is not None and not previous.stale else None
        action, restored = self._restore(url, info, ident, slot, in_slot, notes, resident)
        if (previous is not None and not previous.stale and previous.owner != session
                and ((swaps and not restored and not self.erase_on_handover)
                     or info.published(previous.owner))):
            # the request's swap parks the outgoing session in RAM, or the server copied it
            # there while it sat idle
            self.ram.park(info, previous, live_tokens)
        if not restored and self.erase_on_handover:
            try:
                with metrics.timed("erase"):
                    info.client.erase(slot)
            except UpstreamError as e:
                notes.append(f"erase failed ({e})")
        if info.client.slot_actions_disabled:
            log.warning("%s: llama-server answers save/restore/erase with 501: start it with "
                        "--slot-save-path set to slotkeeper_slot_dir; sessions are pinned but "
                        "not saved", url)
        self.saves.mark_fresh(url, slot, session, restored, kept_on_disk=action != PREFIXED)
        prefix_from = ident.prefix.session if action == PREFIXED and ident.prefix else ""
        return Route(url, session, ident.rule, slot,
                     RESTORED if action == PREFIXED else action, detail="; ".join(notes),
                     lease=lease, restored_tokens=restored, prefix_from=prefix_from)

    def _handed_back(self, url: str, info: UpstreamInfo, ident: Identity, slot: int,
                     lease: SlotLease, previous: SlotRecord | None, live_tokens: int,
                     resident: int, idle_slots: frozenset[int]) -> Route | None:
        """Through the server's RAM cache: a returning session it holds, or a new one whose
        parent sits idle in another slot (`idle_slots`: live /slots). None: the disk's way."""
        return (self.ram.hand_back(url, info, ident, slot, lease, previous, live_tokens,
                                   resident)
                or self.ram.prefix_from_ram(url, info, ident, slot, lease, previous,
                                            live_tokens, self.state.read().upstreams.get(url),
                                            idle_slots))

    def _resident(self, ident: Identity, previous: SlotRecord | None) -> int:
        """Tokens the slot already holds of the request, that the server keeps without any
        restore: the system prompt, when the slot's session has the same one and its seed
        says how many tokens that is (0 when not known, or the slot is erased)."""
        if (self.erase_on_handover or previous is None or previous.stale
                or not ident.seed_key or previous.system_key != ident.seed_key
                or self.snapshots is None):
            return 0
        seed = self.snapshots.folder.read_meta(seed_id(ident.seed_key))
        return seed.n_tokens if seed is not None else 0

    def _restore(self, url: str, info: UpstreamInfo, ident: Identity, slot: int,
                 in_slot: SlotRecord | None, notes: list[str],
                 resident: int = 0) -> tuple[str, int]:
        """The session's own snapshot; else, for a content fork, its parent's snapshot (it
        shares the opening: more than a seed); else its system prompt's seed; else, for a
        header session, its parent's prefix (`_from_parent`). (action, tokens)."""
        snapshots, props = self.snapshots, info.props
        if snapshots is None or props is None:
            return ASSIGNED, 0
        restored = snapshots.restore(info.client, props, slot, ident.session_id,
                                     ident.message_count, notes, resident_tokens=resident)
        if restored:
            return RESTORED, restored
        fork = ident.rule == "content"
        restored = self._parents_prefix(url, info, ident, slot, notes, resident) if fork else 0
        if restored:
            return PREFIXED, restored
        if ident.seed_key is not None:
            restored = snapshots.restore(info.client, props, slot, seed_id(ident.seed_key),
                                         ident.message_count, notes, what="seed",
                                         resident_tokens=resident)
            if restored:
                return SEEDED, restored
        return (ASSIGNED, 0) if fork else self._from_parent(url, info, ident, slot, in_slot,
                                                            notes, resident)

    def _from_parent(self, url: str, info: UpstreamInfo, ident: Identity, slot: int,
                     in_slot: SlotRecord | None, notes: list[str],
                     resident: int = 0) -> tuple[str, int]:
        """A header session's parent shares the system block with it (the seed, tried
        first, holds just that): its KV left in place when the slot held it (`in_slot`: the
        record the slot had) or the slot's session shares all the parent would give (the
        system block), else its snapshot, else its KV saved now from its own slot."""
        prefix = ident.prefix
        if prefix is None:
            return ASSIGNED, 0
        if in_slot is not None and not self.erase_on_handover and (
                prefix.session == in_slot.owner
                or (prefix.items <= 1 and in_slot.system_key == ident.seed_key)):
            # six-agents, with no seed to say how long the system block is: a copy of the
            # parent for the block the slot holds cost 1.35 s at the bench's cap
            notes.append(f"{in_slot.owner}'s KV left in the slot as its prefix")
            return ASSIGNED, 0
        restored = self._parents_prefix(url, info, ident, slot, notes, resident)
        return (PREFIXED, restored) if restored else (ASSIGNED, 0)

    def _parents_prefix(self, url: str, info: UpstreamInfo, ident: Identity, slot: int,
                        notes: list[str], resident: int = 0) -> int:
        """The parent's snapshot restored as the session's prefix; when the parent is young
        (its slot newer than its snapshot), saved from its slot first: a copy, the parent
        keeps its slot. What llama-server alone does on a new conversation, reusing the
        prefix another slot holds (issue #32: a content fork of a young parent started cold
        where the server reused 507 tokens)."""
        restored = self._restore_prefix(info, ident, slot, notes, resident)
        if not restored and self._save_resident_parent(url, info, ident, notes, resident):
            restored = self._restore_prefix(info, ident, slot, notes, resident)
        return restored

    def _save_resident_parent(self, url: str, info: UpstreamInfo, ident: Identity,
                              notes: list[str], resident: int = 0) -> bool:
        """The parent's KV is on its own slot here and newer than its snapshot (the second
        conversation of a system prompt, while the first is young): save it now, if the
        server will reuse it after a restore and the parent's slot is idle (never waited
        for: it is the parent's). True when the parent's snapshot is current afterwards."""
        prefix = ident.prefix
        if prefix is None:
            return False
        up = self.state.read().upstreams.get(url)
        slot = up.slot_of(prefix.session) if up is not None else None
        if slot is None or up.slots[slot].stale:
            return False
        rec = up.slots[slot]
        seen = info.last_seen.get(prefix.session)
        tokens = max(rec.tokens, seen.tokens if seen is not None else 0)
        meta = self.snapshots.folder.read_meta(prefix.session) if self.snapshots else None
        on_disk = max(rec.saved_tokens, meta.n_tokens if meta is not None else 0)
        useful = 0 if on_disk >= tokens else policy.prefix_restore_tokens(
            prefix, snapshot_tokens=tokens,
            snapshot_messages=info.messages_of(prefix.session, rec.messages))
        # what the slot holds of the request already (a shared system prompt) the copy
        # would not add: six-agents once copied a parent for 2 tokens beyond it (1 s at the
        # bench's cap)
        if useful <= resident or not pricing.copy_pays(info.client.costs.rates(), tokens,
                                                       useful - resident):
            return False
        lease = self.locks.try_acquire(url, slot, exclusive=True)
        if lease is None:
            return False
        with lease:
            current = self.state.read().upstreams.get(url)
            rec = current.slots.get(slot) if current is not None else None
            if rec is None or rec.owner != prefix.session or rec.stale:
                return False
            saved = self.saves.save_if_worth(url, info, slot, rec, tokens)
        if saved:
            notes.append(f"saved {prefix.session} from slot {slot} to start from its prefix")
        return saved

    def _restore_prefix(self, info: UpstreamInfo, ident: Identity, slot: int,
                        notes: list[str], resident: int = 0) -> int:
        """A new conversation (a fork) starts from its parent's snapshot when the server will
        reuse it (policy.prefix_restore_tokens); the tokens it should reuse, 0 otherwise. The
        parent's snapshot stays the parent's: a fork's low reuse is never its miss."""
        prefix, snapshots = ident.prefix, self.snapshots
        if prefix is None or snapshots is None or info.props is None:
            return 0
        meta = snapshots.folder.read_meta(prefix.session)
        if meta is None:
            return 0
        expected = policy.prefix_restore_tokens(prefix, snapshot_tokens=meta.n_tokens,
                                                snapshot_messages=meta.n_messages)
        if not expected:
            notes.append(f"{prefix.session}'s snapshot diverges too early to reuse")
            return 0
        restored = snapshots.restore(info.client, info.props, slot, prefix.session,
                                     meta.n_messages, notes, what=f"{prefix.session}'s prefix",
                                     useful_tokens=expected, resident_tokens=resident)
        if not restored:
            return 0
        notes.append(f"started from {prefix.session}'s prefix (~{expected:,} of "
                     f"{restored:,} tokens)")
        return expected

    def start_from_prefix(self, info: UpstreamInfo, ident: Identity, slot: int) -> str:
        """A one-off on a slot it does not claim (displaced first): its parent's snapshot
        restored there when the server will reuse it, as llama-server's own cache gives a
        request the longest prefix it holds. What was done, for the route's detail."""
        if info.client.slot_actions_disabled:
            return ""
        notes: list[str] = []
        self._restore_prefix(info, ident, slot, notes)
        return "; ".join(notes)

    def left_to_ram(self, info: UpstreamInfo, rec: SlotRecord, live_tokens: int) -> bool:
        """Would the server's RAM cache keep the slot's owner if the slot were taken now, with
        no save? When the server copied it there while it sat idle and the cache has room."""
        return info.published(rec.owner) and self.ram.keeps(info, rec, live_tokens)

    def displace(self, url: str, info: UpstreamInfo, slot: int, session: str | None,
                 live_tokens: int, save: bool = True) -> str:
        """A request that is not the owner's is about to run on `slot`: save the owner's KV
        if it is worth it (we hold the slot's lease) and mark its claim stale, so nothing
        later takes the slot's new content for the owner's. "" when nobody was displaced."""
        current = self.state.read().upstreams.get(url)
        rec = current.slots.get(slot) if current else None
        if rec is None or rec.stale or rec.owner == session:
            return ""
        published = info.published(rec.owner)  # the server copied it to RAM while idle
        # left there, as a handover leaves it: a side request must not wait for a save
        left = self.left_to_ram(info, rec, live_tokens)
        saved = save and not left and self.saves.save_if_worth(url, info, slot, rec,
                                                               live_tokens)
        if published:
            self.ram.park(info, rec, live_tokens)
        metrics.eviction("side", saved)
        self.saves.mark_stale(url, slot, rec.owner)
        if saved:
            return f"{rec.owner} will be restored"
        return f"{rec.owner} left to the server's RAM cache" if left else f"displaced {rec.owner}"
