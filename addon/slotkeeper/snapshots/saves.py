"""Saving a slot's KV as its owner's snapshot, and the claim marks that go with it (fresh after
a handover, stale when someone else's request ran on the slot). Every room that saves goes
through here, and here through the snapshot service's one locked pipeline per snapshot.
Blocking: worker threads; the caller holds the slot's lease."""

from __future__ import annotations

from ..decisions import policy
from ..store.state import SlotRecord, StateDoc, StateFile
from ..upstream.registry import UpstreamInfo
from .snapshots import Snapshots


class Saves:
    """Owns: when a slot is worth saving, the save itself and the claim marks. Does not
    touch: leases (the caller holds one), placement, which slot a session gets."""

    def __init__(self, state: StateFile, snapshots: Snapshots | None,
                 min_save_tokens: int) -> None:
        self.state = state
        self.snapshots = snapshots
        self.min_save_tokens = min_save_tokens

    def save_if_worth(self, url: str, info: UpstreamInfo, slot: int, rec: SlotRecord,
                      live_tokens: int) -> bool:
        """Save a slot's KV as its owner's snapshot if it is big enough to be worth a file
        and holds more than the last snapshot. `live_tokens` is the slot's prompt size from
        /slots (exact); rec.tokens may lag by a couple of seconds (coalesced writes), so the
        larger of the two decides. True when an up-to-date snapshot exists afterwards."""
        if self.snapshots is None or info.props is None:
            return False
        tokens = max(rec.tokens, live_tokens)
        if tokens < self.min_save_tokens:
            return False
        if not policy.worth_saving(tokens, rec.saved_tokens, self.min_save_tokens):
            return True
        return self.save_slot(url, info, slot, rec.owner,
                              info.messages_of(rec.owner, rec.messages)) > 0

    def save_slot(self, url: str, info: UpstreamInfo, slot: int, owner: str,
                  messages: int, kind: str = "session") -> int:
        """Save the slot as `owner`'s snapshot (snapshot service) and note it in the state."""
        if self.snapshots is None or info.props is None:
            return 0
        n_saved = self.snapshots.save(info.client, info.props, slot, owner, messages, kind)
        if n_saved:
            def note_saved(doc: StateDoc) -> None:
                rec = doc.upstream(url).slots.get(slot)
                if rec is not None and rec.owner == owner:
                    rec.saved_tokens = n_saved

            self.state.update(note_saved)
        return n_saved

    def mark_fresh(self, url: str, slot: int, session: str, restored: int,
                   kept_on_disk: bool = True) -> None:
        """The slot holds `restored` tokens for `session` now, and they count as saved when a
        file gives them back to the session (its own snapshot, its seed). A parent's prefix
        does not: the parent's snapshot moves on with the parent, and `restored` is only an
        estimate of the reuse. Counted as saved, it once skipped the session's save after its
        answer (the estimate was above what the first turn came to), and the seed's cut then
        lost the session's KV."""
        def change(doc: StateDoc) -> None:
            rec = doc.upstream(url).slots.get(slot)
            if rec is not None and rec.owner == session:
                rec.stale = False
                rec.tokens = restored
                rec.saved_tokens = restored if kept_on_disk else 0

        self.state.update(change)

    def mark_stale(self, url: str, slot: int, owner: str) -> None:
        def change(doc: StateDoc) -> None:
            rec = doc.upstream(url).slots.get(slot)
            if rec is not None and rec.owner == owner:
                rec.stale = True

        self.state.update(change)

    def mark_all_stale(self, url: str) -> None:
        """A request runs on a slot we cannot name: no claim of this upstream is trusted."""
        def change(doc: StateDoc) -> bool:
            up = doc.upstream(url)
            changed = False
            for rec in up.slots.values():
                changed |= not rec.stale
                rec.stale = True
            return changed

        if self.state.read().upstreams.get(url) is not None:
            self.state.update(change)
