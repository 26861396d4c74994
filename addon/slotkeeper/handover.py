"""The handover room: a slot changes hands. Under the slot's lease it saves the outgoing
session (when it grew enough to be worth a file), then restores the incoming session's
snapshot, else its system prompt's seed (restored; seeds are taken after an answer, issue #23:
firstturns.py), else starts the slot clean; a
request that only passes through someone's slot displaces its owner (saved, marked stale).
Blocking: worker threads."""

from __future__ import annotations

import logging

from . import metrics
from .identity import Identity
from .locks import SlotLease
from .routes import ASSIGNED, RESTORED, SEEDED, Route
from .saves import Saves
from .snapshots import Snapshots, seed_id
from .state import SlotRecord, StateFile
from .upstream import UpstreamError
from .upstreams import UpstreamInfo

log = logging.getLogger("slotkeeper")


class Handover:
    """Owns: what a slot holds when it changes hands (save out, restore/seed in, erase).
    Does not touch: which slot or server (the walk and the pool decided), leases (the
    caller holds the slot's), what happens after the answer."""

    def __init__(self, state: StateFile, saves: Saves, snapshots: Snapshots | None,
                 erase_on_handover: bool) -> None:
        self.state = state
        self.saves = saves
        self.snapshots = snapshots
        self.erase_on_handover = erase_on_handover

    def hand_over(self, url: str, info: UpstreamInfo, ident: Identity, slot: int,
                  lease: SlotLease, previous: SlotRecord | None, live_tokens: int,
                  path: str, body: dict | None) -> Route:
        """Under the exclusive slot lock: save the outgoing session, then restore the incoming
        one's snapshot if it can work, else its system prompt's seed, else start clean."""
        session = ident.session_id
        notes: list[str] = []
        if info.client.slot_actions_disabled:
            # No --slot-save-path: pinning still works, KV is neither saved nor restored.
            self.saves.mark_fresh(url, slot, session, 0)
            return Route(url, session, ident.rule, slot, ASSIGNED, lease=lease,
                         detail="server has no --slot-save-path")
        if previous is not None and previous.owner != session and not previous.stale:
            saved = self.saves.save_if_worth(url, info, slot, previous, live_tokens)
            metrics.eviction("session", saved)
            if saved:
                notes.append(f"saved {previous.owner}")
        action, restored = self._restore(info, ident, slot, notes)
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
        self.saves.mark_fresh(url, slot, session, restored)
        return Route(url, session, ident.rule, slot, action, detail="; ".join(notes),
                     lease=lease, restored_tokens=restored)

    def _restore(self, info: UpstreamInfo, ident: Identity, slot: int,
                 notes: list[str]) -> tuple[str, int]:
        """The session's own snapshot, else its system prompt's seed: (action, tokens)."""
        snapshots, props = self.snapshots, info.props
        if snapshots is None or props is None:
            return ASSIGNED, 0
        restored = snapshots.restore(info.client, props, slot, ident.session_id,
                                     ident.message_count, notes)
        if restored:
            return RESTORED, restored
        if ident.seed_key is not None:
            restored = snapshots.restore(info.client, props, slot, seed_id(ident.seed_key),
                                         ident.message_count, notes, what="seed")
            if restored:
                return SEEDED, restored
        return ASSIGNED, 0

    def displace(self, url: str, info: UpstreamInfo, slot: int, session: str | None,
                 live_tokens: int, save: bool = True) -> str:
        """A request that is not the owner's is about to run on `slot`: save the owner's KV
        if it is worth it (we hold the slot's lease) and mark its claim stale, so nothing
        later takes the slot's new content for the owner's. "" when nobody was displaced."""
        current = self.state.read().upstreams.get(url)
        rec = current.slots.get(slot) if current else None
        if rec is None or rec.stale or rec.owner == session:
            return ""
        saved = save and self.saves.save_if_worth(url, info, slot, rec, live_tokens)
        metrics.eviction("side", saved)
        self.saves.mark_stale(url, slot, rec.owner)
        return f"{rec.owner} will be restored" if saved else f"displaced {rec.owner}"
