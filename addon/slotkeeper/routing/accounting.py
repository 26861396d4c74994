"""The accounting room: what happens after the answer. Which slot really ran the request
(verification), what the slot holds now (records, coalesced to one state write per session
every couple of seconds), restores that were not reused, and the saves that do not belong to
a request: idle saves a few seconds after a session's last request, and the shutdown save.
Blocking except `finish_quick`: worker threads."""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..decisions import policy
from ..observe import metrics
from ..snapshots.saves import LATER, NOT_THIS_HOUR, NOW, Saves
from ..snapshots.snapshots import Snapshots, seed_id
from ..store.locks import SlotLocks
from ..store.memories import Seen
from ..store.state import StateDoc, StateFile
from ..upstream.client import SlotsUnavailable
from ..upstream.registry import UpstreamInfo, Upstreams
from ..wire.bodies import Timings
from .routes import (
    CLIENT,
    FALLBACK,
    KEPT,
    OWNING,
    RESTORED,
    SEEDED,
    UNPINNED,
    Route,
    RouterConfig,
    resident_slot,
)

# A save longer than the stall budget that can wait (the idle save) runs only once the server
# has had nothing of ours sent to it or ended on it for this long: a client's next turn comes
# within ~50 ms of its answer (the benches' clients) or after a tool call of a second or so,
# and a save the server runs meanwhile holds that turn for its whole length.
QUIET_SECONDS = 2.0

log = logging.getLogger("slotkeeper")


def tokens_after(timings: Timings) -> int:
    """Tokens in the slot's KV after the request: the last generated token was sampled, never
    evaluated (measured: 30 prompt + 6 generated leave 35, the save's n_saved). Counting it
    made every handover and shutdown save again a session that had not changed."""
    return timings.prompt_tokens + max(timings.predicted_n - 1, 0)


class Accounting:
    """Owns: verification after the answer, usage records, miss counts, idle and shutdown
    saves. Does not touch: routing decisions, placement, a Route's lease (the router's
    lifecycle releases it)."""

    def __init__(self, config: RouterConfig, state: StateFile, locks: SlotLocks,
                 clock: Callable[[], float], upstreams: Upstreams, saves: Saves,
                 snapshots: Snapshots | None) -> None:
        self.config = config
        self.state = state
        self.locks = locks
        self.clock = clock
        self.upstreams = upstreams
        self.saves = saves
        self.snapshots = snapshots
        # Where a kept request's usage record is written without the answer waiting for it
        # (the addon's release pool); None: written by `settle`, on the request's worker.
        self.background: Callable[[Callable[[], None]], None] | None = None

    def settle(self, route: Route, timings: Timings | None) -> str:
        """Verify which slot ran the request and record its use. Returns the verification
        ("" when there was nothing to verify). Called while the route still holds its lease."""
        verdict = self._verify(route, timings)
        if not verdict.startswith(policy.MISMATCH):
            self._record(route, timings)
        return verdict

    def settle_quick(self, route: Route, timings: Timings | None) -> str | None:
        """`settle` for the common case, without a thread hop: a kept request that reused its
        slot's prefix (verified by reuse), with no save due. Only memory and a stat of the
        state file; a usage record due is written in the background (nothing decides on it
        before it lands: the claim's owner and slot do not change, and the handover reads
        live token counts from /slots). None: the rest needs the worker (`settle`)."""
        if route.action != KEPT or route.slot is None or timings is None:
            return None
        info = self.upstreams.peek(route.upstream)
        if info is None:
            return None
        seen = info.last_seen.get(route.session)
        if policy.needs_slot_check(expected_prefix=seen.tokens if seen else 0,
                                   cache_n=timings.cache_n):
            return None
        now = self.clock()
        due = now - info.usage_written.get(route.session, 0.0) >= self.config.usage_write_interval
        if due and self.background is None:
            return None
        tokens = tokens_after(timings)
        if self._grew_enough(route, tokens):
            return None
        info.last_seen[route.session] = Seen(now, tokens, route.messages)
        if due and self.background is not None:
            info.usage_written[route.session] = now
            self.background(lambda: self._write_usage(route, tokens, now))
        return policy.BY_REUSE

    def _verify(self, route: Route, timings: Timings | None) -> str:
        """Did llama-server run the request on the pinned slot? Checked while the route still
        holds the slot's lease (no other routed request ran there since). On a mismatch the
        state is corrected: neither the pinned slot nor the one that ran the request holds
        what the state said, so both claims go stale and nothing is saved from them."""
        if (route.slot is None or timings is None
                or route.action in (CLIENT, FALLBACK, UNPINNED)):
            return ""
        info = self.upstreams.get(route.upstream)
        if route.action in (RESTORED, SEEDED):
            expected = route.restored_tokens
        elif route.action == KEPT:
            seen = info.last_seen.get(route.session)
            expected = seen.tokens if seen else 0
        else:
            expected = 0
        if not policy.needs_slot_check(expected_prefix=expected, cache_n=timings.cache_n):
            return policy.BY_REUSE
        try:
            slots = info.client.slots()
        except SlotsUnavailable:
            return policy.UNKNOWN
        verdict, ran_on = policy.verify_slot(
            route.slot, tokens_after(timings),
            [(s.id, s.n_tokens, s.is_processing) for s in slots])
        if verdict != policy.MISMATCH or ran_on is None:
            return verdict
        metrics.slot_mismatch()
        log.warning("%s: pinned to slot %d, llama-server ran it on slot %d (%s %s): state "
                    "corrected, nothing saved from either slot", route.session, route.slot,
                    ran_on, route.upstream, route.action)
        up = self.state.read().upstreams.get(route.upstream)
        for slot in (route.slot, ran_on):
            rec = up.slots.get(slot) if up else None
            if rec is not None and not rec.stale:
                self.saves.mark_stale(route.upstream, slot, rec.owner)
        return f"{policy.MISMATCH}: ran on slot {ran_on}"

    def _record(self, route: Route, timings: Timings | None) -> None:
        if route.slot is None or route.action not in OWNING:
            return
        if route.action in (RESTORED, SEEDED) and timings is not None:
            self._check_reuse(route, timings)
        if route.ram_tokens and timings is not None:
            self._check_ram(route, timings)
        if route.action == KEPT and timings is not None:
            self._check_still_resident(route, timings)
        info = self.upstreams.get(route.upstream)
        now = self.clock()
        tokens = tokens_after(timings) if timings else None
        if tokens is not None:
            info.last_seen[route.session] = Seen(now, tokens, route.messages)
        if (self._grew_enough(route, tokens) and tokens is not None
                and self.saves.pays(info, route.session, tokens, self._saved_tokens(route))
                and self.saves.when(info, route.slot, route.session, tokens,
                                    holds_answer=True) == NOW):
            self.saves.save_slot(route.upstream, info, route.slot, route.session, route.messages)
        last = info.usage_written.get(route.session, 0.0)
        if route.action == KEPT and now - last < self.config.usage_write_interval:
            return  # coalesced: the handover decisions read live token counts from /slots
        info.usage_written[route.session] = now
        self._write_usage(route, tokens, now)

    def _write_usage(self, route: Route, tokens: int | None, now: float) -> None:
        """The slot's record as the request left it, if the session still owns the slot."""
        conversation = route.conversation

        def change(doc: StateDoc) -> None:
            rec = doc.upstream(route.upstream).slots.get(route.slot)
            if rec is not None and rec.owner == route.session:
                rec.last_used = now
                rec.messages = route.messages
                if tokens is not None:
                    rec.tokens = tokens
                if conversation is not None:
                    rec.system_key = conversation.system_key or ""
                    rec.chain_length = conversation.length
                    rec.chain_head = conversation.head
                    rec.chars = conversation.chars

        self.state.update(change)

    def _check_reuse(self, route: Route, timings: Timings) -> None:
        """A restored snapshot (or seed) the server did not reuse is a miss: its tokens were not
        a prefix of the prompt. Two misses retire it (slotfiles)."""
        if self.snapshots is None or timings.cache_n >= route.restored_tokens // 2:
            return
        if route.prefix_from:
            # Another session's snapshot, restored as a fork's prefix: it was a guess, and a
            # miss must not retire the parent's own snapshot.
            log.info("%s reused %d of ~%d tokens of %s's prefix", route.session,
                     timings.cache_n, route.restored_tokens, route.prefix_from)
            return
        snapshot = route.session
        if route.action == SEEDED and route.seed_key is not None:
            snapshot = seed_id(route.seed_key)
        misses = self.snapshots.record_miss(snapshot)
        metrics.restore_miss("seed" if snapshot != route.session else "session")
        log.warning("restore of %s was not reused (cache_n %d of %d): miss %d", snapshot,
                    timings.cache_n, route.restored_tokens, misses)

    def _check_ram(self, route: Route, timings: Timings) -> None:
        """The handover left the session to llama-server's RAM cache: trust the server. A miss
        (it prefilled what the model said it held) sends the next predicted hits to the disk
        (ramcache.RamModel.confirm)."""
        ram = self.upstreams.get(route.upstream).ram
        hit = ram.confirm(route.ram_tokens, timings.cache_n)
        metrics.ram_cache(hit)
        if not hit:
            log.warning("%s: expected ~%d tokens back from %s's RAM cache, it reused %d: the "
                        "next %d handovers it predicts restore from disk", route.session,
                        route.ram_tokens, route.upstream, timings.cache_n, ram.distrust)

    def _check_still_resident(self, route: Route, timings: Timings) -> None:
        if timings.prompt_n == 0:
            return
        seen = self.upstreams.get(route.upstream).last_seen.get(route.session)
        expected = seen.tokens if seen else 0
        if expected > 2 * self.config.min_save_tokens and timings.cache_n < expected // 4:
            # The slot should have held this session's KV but the server reused almost
            # nothing: it probably restarted. Verify before the next request.
            log.warning("%s on slot %s reused %d of ~%d tokens: verifying %s", route.session,
                        route.slot, timings.cache_n, expected, route.upstream)
            self.upstreams.mark_suspect(route.upstream)

    def _saved_tokens(self, route: Route) -> int:
        up = self.state.read().upstreams.get(route.upstream)
        rec = up.slots.get(route.slot) if up is not None and route.slot is not None else None
        return rec.saved_tokens if rec is not None else 0

    def _grew_enough(self, route: Route, tokens: int | None) -> bool:
        if self.snapshots is None or tokens is None:
            return False
        doc = self.state.read().upstreams.get(route.upstream)
        rec = doc.slots.get(route.slot) if doc else None
        if rec is None or rec.owner != route.session or rec.stale:
            return False
        return policy.grew_enough(tokens, rec.saved_tokens, self.config.min_save_tokens,
                                  self.config.save_every_tokens)

    # ---- saves outside a request -------------------------------------------------------------

    def save_if_idle(self, url: str, session: str, ended: float) -> bool | None:
        """Called a few seconds after a request ended: if the session has not been back since,
        save what it grew, so a llama-server that dies without warning loses nothing that
        finished. Skips quietly when the slot is busy or no longer the session's. None: not
        now, another slot is generating and the save would stall it past the budget (the
        caller tries again later)."""
        info = self.upstreams.peek(url)
        if info is None or self.snapshots is None:
            return False
        seen = info.last_seen.get(session)
        if seen is None or seen.at > ended:
            return False  # it came back: its own next idle period will save it
        slot = resident_slot(self.state.read(), url, session)
        if slot is not None and self._grown(url, slot, seen.tokens):
            when = self.saves.when(info, slot, session, seen.tokens,
                                   quiet=self.quiet(url))
            if when == LATER:
                return None
            if when == NOT_THIS_HOUR:
                return False
        return self._save_resident(url, info, session, seen.tokens, lock_timeout=0)

    def quiet(self, url: str) -> bool:
        """Nothing sent to the server or answered by it for QUIET_SECONDS."""
        info = self.upstreams.peek(url)
        return info is not None and info.quiet_for(QUIET_SECONDS, self.clock())

    def _grown(self, url: str, slot: int, tokens: int) -> bool:
        """The slot holds more than its snapshot (else there is nothing to save, or wait for)."""
        up = self.state.read().upstreams.get(url)
        rec = up.slots.get(slot) if up is not None else None
        return rec is not None and tokens > rec.saved_tokens

    def save_all(self, lock_timeout: float = 30.0) -> int:
        """On shutdown: save every session resident on a known upstream that grew since its
        last save. Returns how many were saved."""
        saved = 0
        for url, info in self.upstreams.known():
            up = self.state.read().upstreams.get(url)
            for rec in list(up.slots.values()) if up else []:
                seen = info.last_seen.get(rec.owner)
                tokens = max(rec.tokens, seen.tokens if seen else 0)
                saved += self._save_resident(url, info, rec.owner, tokens, lock_timeout)
        return saved

    def _save_resident(self, url: str, info: UpstreamInfo, session: str, tokens: int,
                       lock_timeout: float) -> bool:
        if self.snapshots is None or info.props is None or tokens < self.config.min_save_tokens:
            return False
        slot = resident_slot(self.state.read(), url, session)
        if slot is None or self.state.read().upstreams[url].slots[slot].saved_tokens >= tokens:
            return False
        lease = self.locks.acquire(url, slot, exclusive=False, timeout=lock_timeout)
        if lease is None:
            return False
        with lease:
            if resident_slot(self.state.read(), url, session) != slot:
                return False
            rec = self.state.read().upstreams[url].slots[slot]
            if not self.saves.pays(info, session, tokens, rec.saved_tokens):
                return False
            return self.saves.save_slot(url, info, slot, session,
                                        info.messages_of(session, rec.messages)) > 0
