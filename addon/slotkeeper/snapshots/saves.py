"""Saving a slot's KV as its owner's snapshot, and the claim marks that go with it (fresh after
a handover, stale when someone else's request ran on the slot). Every room that saves goes
through here, and here through the snapshot service's one locked pipeline per snapshot.
Blocking: worker threads; the caller holds the slot's lease."""

from __future__ import annotations

import logging

from ..decisions import policy, pricing
from ..observe import metrics
from ..store.state import SlotRecord, StateDoc, StateFile
from ..upstream.client import SlotsUnavailable
from ..upstream.registry import UpstreamInfo
from .snapshots import Snapshots

log = logging.getLogger("slotkeeper")

# What a save that can wait (idle, periodic) should do now.
NOW = "now"
LATER = "later"  # another slot generates and the save would stall it past the budget
NOT_THIS_HOUR = "not this hour"  # the write budget is spent


class Saves:
    """Owns: when a slot is worth saving (its price, the stall and write budgets), the save
    itself and the claim marks. Does not touch: leases (the caller holds one), placement,
    which slot a session gets."""

    def __init__(self, state: StateFile, snapshots: Snapshots | None, min_save_tokens: int,
                 stall_budget: float = 0.5, write_budget: float = 0.0) -> None:
        self.state = state
        self.snapshots = snapshots
        self.min_save_tokens = min_save_tokens
        self.stall_budget = stall_budget  # seconds a save that can wait may stall other slots
        self.write_budget = write_budget  # bytes an hour for saves that can wait (0: no limit)

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
        if not self.pays(info, rec.owner, tokens, rec.saved_tokens):
            return False
        return self.save_slot(url, info, slot, rec.owner,
                              info.messages_of(rec.owner, rec.messages)) > 0

    def pays(self, info: UpstreamInfo, session: str, tokens: int, saved_tokens: int) -> bool:
        """pricing.save_pays with this server's speeds and the session's last snapshot."""
        if self.snapshots is None:
            return False
        meta = self.snapshots.folder.read_meta(session) if saved_tokens > 0 else None
        rates = info.client.costs.rates()
        if pricing.save_pays(rates, tokens, saved_tokens, meta.size_bytes if meta else None):
            return True
        metrics.save_skipped("cheaper_to_prefill")
        costs = pricing.return_costs(rates, tokens, saved_tokens,
                                     meta.size_bytes if meta else None) or (0.0, 0.0)
        log.info("%s not saved: writing and later reading its %d tokens (~%.1f s) costs more "
                 "than bringing it back without this save (~%.1f s: a prefill, or its older "
                 "snapshot and a prefill of the rest)", session, tokens, costs[0], costs[1])
        return False

    def when(self, info: UpstreamInfo, slot: int, session: str, tokens: int,
             quiet: bool = True, holds_answer: bool = False) -> str:
        """For a save that can wait (idle, periodic): NOW, LATER (its predicted stall, its
        bytes at the measured save speed, exceeds the stall budget and another slot
        generates, the server is not `quiet`, or it `holds_answer`: pricing.save_now) or
        NOT_THIS_HOUR (the write budget is spent). Handover and shutdown saves never ask:
        they must happen."""
        rates = info.client.costs.rates()
        nbytes = rates.file_bytes(tokens)
        if nbytes is None and self.snapshots is not None:
            meta = self.snapshots.folder.read_meta(session)
            nbytes = float(meta.size_bytes) if meta else None
        written = self.snapshots.writes.last_hour() if self.snapshots is not None else 0
        if not pricing.within_write_budget(written, nbytes, self.write_budget):
            metrics.save_skipped("write_budget")
            log.info("save of %s skipped: %.0f MB written within the hour, the budget is "
                     "%.0f MB", session, written / 1e6, self.write_budget / 1e6)
            return NOT_THIS_HOUR
        stall = rates.save_seconds(nbytes)
        try:
            others = any(v.is_processing and v.id != slot for v in info.client.slots())
        except SlotsUnavailable:
            others = False
        if pricing.save_now(stall, others, self.stall_budget, quiet, holds_answer):
            return NOW
        metrics.save_skipped("stall_budget")
        why = ("the other slots' streams" if others else "the answer's end" if holds_answer
               else "the next request (the server is not quiet)")
        # an unmeasured save speed is not "0 s of stall": the log said ~0.0 s for those
        cost = (f"~{stall:.1f} s of stall" if stall is not None
                else "a stall of unknown length (no save measured yet)")
        log.info("save of %s deferred: %s for %s (slotkeeper_stall_budget_ms %d)",
                 session, cost, why, self.stall_budget * 1000)
        return LATER

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
                   kept_on_disk: bool = True, saved_tokens: int | None = None) -> None:
        """The slot holds `restored` tokens for `session` now, and they count as saved when a
        file gives them back to the session (its own snapshot, its seed). A parent's prefix
        does not: the parent's snapshot moves on with the parent, and `restored` is only an
        estimate of the reuse. Counted as saved, it once skipped the session's save after its
        answer (the estimate was above what the first turn came to), and the seed's cut then
        lost the session's KV. `saved_tokens`: what its snapshot holds, when the slot's tokens
        came from elsewhere (llama-server's RAM cache)."""
        def change(doc: StateDoc) -> None:
            rec = doc.upstream(url).slots.get(slot)
            if rec is not None and rec.owner == session:
                rec.stale = False
                rec.tokens = restored
                rec.saved_tokens = (saved_tokens if saved_tokens is not None
                                    else restored if kept_on_disk else 0)

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
