"""Routing: which slot a request goes to, and the handover when a slot changes hands.

Ties the pure parts (identity, choice) to the I/O (state file, slot locks, upstream client,
slot files). `try_keep` is the fast path and never blocks; everything else runs in worker
threads."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from . import choice, metrics
from .bodies import Timings
from .choice import SlotView
from .identity import Identity
from .locks import SlotLease, SlotLocks
from .seeds import SeedBuilder, seed_id
from .slotfiles import SessionMeta, SlotFolder, file_name_for
from .state import SlotRecord, StateDoc, StateFile
from .upstream import ServerProps, SlotsUnavailable, Upstream, UpstreamError

log = logging.getLogger("slotkeeper")

ADMIN_LOCK_TIMEOUT = 30.0  # an API call waits this long for a slot's request to finish

# How a request was routed; also the flow marker names.
KEPT = "kept"  # the session's slot, still holding its KV
ASSIGNED = "assigned"  # a slot newly given to the session, starting cold
RESTORED = "restored"  # newly given, with the session's saved KV restored
SEEDED = "seeded"  # newly given, starting from its system prompt's saved KV (a seed)
SIDE = "side"  # a small side request, placed without claiming a slot
CLIENT = "client"  # the client chose id_slot itself
FALLBACK = "fallback"  # /slots unusable: a stable hash of the session over the slot count
UNPINNED = "unpinned"  # no slot count known: forwarded as it came


@dataclass
class RouterConfig:
    ttl: float = 120.0
    slots_timeout: float = 1.0
    small_request_chars: int = 2000
    slot_count: int = 0  # used when /props does not say
    lock_timeout: float = 600.0  # a handover waits at most this long for a busy slot
    min_save_tokens: int = 256  # smaller sessions re-prefill in about a second: not worth a file
    erase_on_handover: bool = True
    usage_write_interval: float = 2.0
    save_every_tokens: int = 2048  # a session that keeps its slot is saved after this growth
    seed_min_chars: int = 2000  # system prompts (plus tools) at least this long get a seed
    max_seeds: int = 8


@dataclass
class Route:
    upstream: str
    session: str
    rule: str
    slot: int | None
    action: str
    detail: str = ""
    lease: SlotLease | None = None
    restored_tokens: int = 0
    ms: float = 0.0
    messages: int = 0
    seed_key: str | None = None

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()


@dataclass(frozen=True)
class Seen:
    """A session's last request that ended in this process."""

    at: float
    tokens: int  # in its slot afterwards
    messages: int


@dataclass
class UpstreamInfo:
    client: Upstream
    props: ServerProps | None = None
    checked: bool = False  # props read and warnings logged since the last suspicion
    suspect: bool = True  # may have restarted: verify before trusting residency
    usage_written: dict[str, float] = field(default_factory=dict)
    # session -> (when its last request here ended, tokens in its slot then); exact where the
    # state file's copy may lag by the coalescing interval.
    last_seen: dict[str, Seen] = field(default_factory=dict)

    def messages_of(self, session: str, recorded: int) -> int:
        """Messages in the session's slot: the state file's count lags by the coalescing
        interval, this process's own last request does not."""
        seen = self.last_seen.get(session)
        return max(recorded, seen.messages) if seen else recorded


class Router:
    def __init__(
        self,
        config: RouterConfig,
        state: StateFile,
        locks: SlotLocks,
        folder: SlotFolder | None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.state = state
        self.locks = locks
        self.folder = folder
        self.clock = clock
        self._upstreams: dict[str, UpstreamInfo] = {}
        self._mutex = threading.Lock()
        self.seeds = (SeedBuilder(self, config.seed_min_chars, config.max_seeds)
                      if folder is not None else None)

    # ---- upstream bookkeeping -------------------------------------------------------------

    def upstream(self, url: str) -> UpstreamInfo:
        with self._mutex:
            info = self._upstreams.get(url)
            if info is None:
                info = UpstreamInfo(Upstream(url, timeout=self.config.slots_timeout))
                self._upstreams[url] = info
            return info

    def known_upstreams(self) -> list[tuple[str, UpstreamInfo]]:
        with self._mutex:
            return list(self._upstreams.items())

    def mark_suspect(self, url: str) -> None:
        """The upstream may have restarted (a failed connection, a cold answer where the KV
        should have been): verify it before the next request trusts any slot's content."""
        self.upstream(url).suspect = True

    def _verify(self, url: str, info: UpstreamInfo) -> None:
        """Read /props once (and again after a suspicion); if the server is a different one or
        its slots are empty, no slot holds anyone's KV any more: mark every claim stale, so each
        session is restored on its next request instead of trusting an empty slot."""
        try:
            props = info.client.props()
        except UpstreamError as e:
            log.warning("%s: cannot read /props (%s)", url, e)
            return
        try:
            slots = info.client.slots()
        except SlotsUnavailable:
            slots = None
        if not info.checked:
            _warn_about_settings(url, props, slots, info.client.n_ctx_train())
        info.props, info.checked, info.suspect = props, True, False
        info.client.slot_actions_disabled = False  # a restarted server may have the flag now

        def reconcile(doc: StateDoc) -> bool:
            up = doc.upstream(url)
            restarted = bool(up.fingerprint) and up.fingerprint != props.fingerprint
            up.fingerprint = props.fingerprint
            live = {s.id: s for s in slots} if slots is not None else None
            dropped = False
            for slot_id, rec in list(up.slots.items()):
                if restarted or (live is not None and slot_id not in live):
                    del up.slots[slot_id]
                    dropped = True
                elif live is not None and not rec.stale and live[slot_id].n_tokens == 0:
                    rec.stale = True  # the server lost this slot's KV (restart, or cleared)
                    dropped = True
            return dropped

        if self.state.update(reconcile):
            log.info("%s: slots lost their KV (server restarted?): sessions will be restored", url)

    # ---- the fast path ---------------------------------------------------------------------

    def try_keep(self, url: str, ident: Identity) -> Route | None:
        """A session that owns its slot keeps it: a stat of the state file and a non-blocking
        shared flock, no network. None means: take the slow path."""
        started = time.monotonic()
        info = self._upstreams.get(url)
        if info is None or info.suspect or self._is_side_request(ident):
            return None
        slot = self._resident_slot(self.state.read(), url, ident.session_id)
        if slot is None:
            return None
        lease = self.locks.try_acquire(url, slot, exclusive=False)
        if lease is None:
            return None
        # Re-check under the lock: a handover elsewhere may have claimed the slot meanwhile.
        if self._resident_slot(self.state.read(), url, ident.session_id) != slot:
            lease.release()
            return None
        return Route(url, ident.session_id, ident.rule, slot, KEPT, lease=lease,
                     messages=ident.message_count, ms=(time.monotonic() - started) * 1000)

    @staticmethod
    def _resident_slot(doc: StateDoc, url: str, session: str) -> int | None:
        up = doc.upstreams.get(url)
        if up is None:
            return None
        slot = up.slot_of(session)
        if slot is None or up.slots[slot].stale:
            return None
        return slot

    def _is_side_request(self, ident: Identity) -> bool:
        return ident.prompt_chars < self.config.small_request_chars

    # ---- the slow path (worker thread) -----------------------------------------------------

    def route(self, url: str, ident: Identity, client_slot: int | None = None,
              path: str = "", body: dict | None = None) -> Route:
        started = time.monotonic()
        info = self.upstream(url)
        if info.suspect or not info.checked:
            self._verify(url, info)
        if client_slot is not None:
            route = Route(url, ident.session_id, ident.rule, client_slot, CLIENT,
                          detail="id_slot chosen by the client")
        else:
            try:
                slots = info.client.slots()
            except SlotsUnavailable as e:
                route = self._fallback(url, info, ident, str(e))
            else:
                route = (self._route_side(url, info, ident, slots) if self._is_side_request(ident)
                         else self._route_session(url, info, ident, slots, path, body))
        route.messages = ident.message_count
        route.seed_key = ident.seed_key
        route.ms = (time.monotonic() - started) * 1000
        return route

    def _fallback(self, url: str, info: UpstreamInfo, ident: Identity, why: str) -> Route:
        count = (info.props.total_slots if info.props else 0) or self.config.slot_count
        slot = choice.fallback_slot(ident.session_id, count)
        metrics.fallback(why)
        if slot is None:
            return Route(url, ident.session_id, ident.rule, None, UNPINNED,
                         detail=f"{why}; slot count unknown")
        return Route(url, ident.session_id, ident.rule, slot, FALLBACK,
                     detail=f"{why}; hashed over {count} slots")

    def _route_session(self, url: str, info: UpstreamInfo, ident: Identity,
                       slots: list[SlotView], path: str, body: dict | None) -> Route:
        session = ident.session_id
        live_ids = {s.id for s in slots}
        for _attempt in range(5):
            doc = self.state.read()
            up = doc.upstreams.get(url)
            owned = up.slot_of(session) if up else None
            if owned is not None and owned in live_ids:
                rec = up.slots[owned]
                lease = self.locks.acquire(url, owned, exclusive=rec.stale,
                                           timeout=self.config.lock_timeout)
                if lease is None:
                    break
                current = self.state.read().upstreams.get(url)
                if current is None or current.slot_of(session) != owned:
                    lease.release()
                    continue
                if not current.slots[owned].stale:
                    return Route(url, session, ident.rule, owned, KEPT, lease=lease)
                if not lease.exclusive:
                    lease.release()
                    continue
                return self._handover(url, info, ident, owned, lease, previous=None,
                                      live_tokens=0, path=path, body=body)
            claims = up.claims() if up else {}
            ranking = choice.rank_slots(slots, claims, self.clock(), self.config.ttl)
            if not ranking:
                return self._fallback(url, info, ident, "server reports no slots")
            lease, slot = self._lock_first_free(url, ranking)
            if lease is None:
                break
            claimed = self._claim(url, slot, ident, expected=claims.get(slot),
                                  live_ids=live_ids)
            if claimed is None:
                lease.release()
                continue
            return self._handover(url, info, ident, slot, lease, previous=claimed[0],
                                  live_tokens=_tokens_in(slots, slot), path=path, body=body)
        return self._fallback(url, info, ident, "no slot could be locked in time")

    def _lock_first_free(self, url: str, ranking: list[int]) -> tuple[SlotLease | None, int]:
        for slot in ranking:
            lease = self.locks.try_acquire(url, slot, exclusive=True)
            if lease is not None:
                return lease, slot
        best = ranking[0]
        return self.locks.acquire(url, best, True, self.config.lock_timeout), best

    def _claim(self, url: str, slot: int, ident: Identity, expected: choice.Claim | None,
               live_ids: set[int]) -> tuple[SlotRecord | None] | None:
        """Write the claim. Refuse (None) when the slot was claimed by a live session after we
        ranked it, or when this session got a slot elsewhere meanwhile: the caller re-ranks."""
        now = self.clock()

        def change(doc: StateDoc) -> tuple[SlotRecord | None] | None:
            up = doc.upstream(url)
            other = up.slot_of(ident.session_id)
            if other is not None and other != slot:
                if other in live_ids:
                    return None
                del up.slots[other]  # a slot the server no longer has
            previous = up.slots.get(slot)
            if previous is not None and previous.claim() != expected and not choice.is_abandoned(
                previous.claim(), now, self.config.ttl
            ) and previous.owner != ident.session_id:
                return None
            up.slots[slot] = SlotRecord(owner=ident.session_id, claimed=now, last_used=now,
                                        stale=True, messages=ident.message_count)
            return (previous,)

        return self.state.update(change)

    def _route_side(self, url: str, info: UpstreamInfo, ident: Identity,
                    slots: list[SlotView]) -> Route:
        """A small request (titles, tags, a first "hi") goes to the best slot without claiming
        it. If that slot belongs to a session, its KV is saved first (when it is worth it) and
        the claim is marked stale, so the owner is restored on its next request."""
        doc = self.state.read()
        up = doc.upstreams.get(url)
        claims = up.claims() if up else {}
        ranking = choice.rank_slots(slots, claims, self.clock(), self.config.ttl)
        if not ranking:
            return self._fallback(url, info, ident, "server reports no slots")
        lease, slot = self._lock_first_free(url, ranking)
        if lease is None:
            return Route(url, ident.session_id, ident.rule, None, UNPINNED,
                         detail="small request; every slot busy")
        current = self.state.read().upstreams.get(url)
        rec = current.slots.get(slot) if current else None
        detail = "small request, slot not claimed"
        if rec is not None and not rec.stale:
            saved = self._save_if_worth(url, info, slot, rec, _tokens_in(slots, slot))
            metrics.eviction("side", saved)
            self._mark_stale(url, slot, rec.owner)
            detail += f"; {rec.owner} will be restored" if saved else f"; displaced {rec.owner}"
        return Route(url, ident.session_id, ident.rule, slot, SIDE, detail=detail, lease=lease)

    # ---- handover --------------------------------------------------------------------------

    def _handover(self, url: str, info: UpstreamInfo, ident: Identity, slot: int,
                  lease: SlotLease, previous: SlotRecord | None, live_tokens: int,
                  path: str, body: dict | None) -> Route:
        """Under the exclusive slot lock: save the outgoing session, then restore the incoming
        one's snapshot if it can work, else its system prompt's seed, else start clean."""
        session = ident.session_id
        notes: list[str] = []
        if info.client.slot_actions_disabled:
            # No --slot-save-path: pinning still works, KV is neither saved nor restored.
            self._mark_fresh(url, slot, session, 0)
            return Route(url, session, ident.rule, slot, ASSIGNED, lease=lease,
                         detail="server has no --slot-save-path")
        if previous is not None and previous.owner != session and not previous.stale:
            saved = self._save_if_worth(url, info, slot, previous, live_tokens)
            metrics.eviction("session", saved)
            if saved:
                notes.append(f"saved {previous.owner}")
        action, restored = ASSIGNED, 0
        if self.folder is not None and info.props is not None:
            ok, reason = self._check(info, session, ident.message_count)
            if ok:
                restored = self._restore(info, slot, session, notes)
                action = RESTORED if restored else ASSIGNED
            elif reason != "no snapshot":
                notes.append(f"snapshot not used: {reason}")
            if not restored and ident.seed_key is not None:
                seed = seed_id(ident.seed_key)
                if self._check(info, seed, ident.message_count)[0]:
                    restored = self._restore(info, slot, seed, notes, what="seed")
                    action = SEEDED if restored else ASSIGNED
        if not restored and self.config.erase_on_handover:
            try:
                with metrics.timed("erase"):
                    info.client.erase(slot)
            except UpstreamError as e:
                notes.append(f"erase failed ({e})")
        if (not restored and self.seeds is not None and ident.seed_key is not None
                and body is not None):
            started = time.monotonic()
            built = self.seeds.build(url, info, slot, ident, path, body)
            if built:
                metrics.seed_built(built, time.monotonic() - started)
                action, restored = SEEDED, built
                notes.append(f"built seed of {built:,} tokens")
        if info.client.slot_actions_disabled:
            log.warning("%s: llama-server answers save/restore/erase with 501: start it with "
                        "--slot-save-path set to slotkeeper_slot_dir; sessions are pinned but "
                        "not saved", url)
        self._mark_fresh(url, slot, session, restored)
        return Route(url, session, ident.rule, slot, action, detail="; ".join(notes),
                     lease=lease, restored_tokens=restored)

    def _check(self, info: UpstreamInfo, session: str, message_count: int) -> tuple[bool, str]:
        assert self.folder is not None and info.props is not None
        return self.folder.check(session, fingerprint=info.props.fingerprint,
                                 n_ctx=info.props.n_ctx, message_count=message_count)

    def _restore(self, info: UpstreamInfo, slot: int, session: str, notes: list[str],
                 what: str = "") -> int:
        """Restore a snapshot into the slot; tokens restored, 0 on failure. A failed restore
        may leave the slot half-written, so it is erased and the request starts clean."""
        t0 = time.monotonic()
        try:
            answer = info.client.restore(slot, file_name_for(session))
        except UpstreamError as e:
            notes.append(f"{what or 'snapshot'} restore failed ({e})")
            metrics.slot_op("restore", ok=False)
            try:
                with metrics.timed("erase"):
                    info.client.erase(slot)
            except UpstreamError:
                pass
            return 0
        restored = int(answer.get("n_restored", 0))
        ms = (time.monotonic() - t0) * 1000
        metrics.slot_op("restore", seconds=ms / 1000, nbytes=answer.get("n_read"), tokens=restored)
        notes.append(f"restored {what + ' of ' if what else ''}{restored:,} tokens in {ms:.0f} ms")
        self._touch(session)
        return restored

    def _touch(self, session: str) -> None:
        """A restored snapshot was used: it is the last one the disk budget should drop."""
        assert self.folder is not None
        meta = self.folder.read_meta(session)
        if meta is not None:
            meta.last_used = self.clock()
            self.folder.write_meta(meta)

    def _save_if_worth(self, url: str, info: UpstreamInfo, slot: int, rec: SlotRecord,
                       live_tokens: int) -> bool:
        """Save a slot's KV as its owner's snapshot if it is big enough to be worth a file
        and holds more than the last snapshot. `live_tokens` is the slot's prompt size from
        /slots (exact); rec.tokens may lag by a couple of seconds (coalesced writes), so the
        larger of the two decides. True when an up-to-date snapshot exists afterwards. The
        caller holds the slot lock."""
        if self.folder is None or info.props is None:
            return False
        tokens = max(rec.tokens, live_tokens)
        if tokens < self.config.min_save_tokens:
            return False
        if rec.saved_tokens and tokens <= rec.saved_tokens:
            return True
        return self.save_slot(url, info, slot, rec.owner,
                              info.messages_of(rec.owner, rec.messages)) > 0

    def save_slot(self, url: str, info: UpstreamInfo, slot: int, owner: str,
                  messages: int, kind: str = "session") -> int:
        """Save the slot as `owner`'s snapshot and write its metadata; returns tokens saved."""
        assert self.folder is not None and info.props is not None
        if info.client.slot_actions_disabled:
            return 0
        name = file_name_for(owner)
        old = self.folder.read_meta(owner)
        # Room for the new file before writing it: its old size, or for a first save the
        # largest snapshot there is (sizes are not linear in tokens, so no per-token guess).
        expected = old.size_bytes if old else max(
            (m.size_bytes for m in self.folder.list_sessions()), default=0)
        self.folder.make_room(expected, keep={owner})
        t0 = time.monotonic()
        # The server writes in place (over whatever has the name), so it writes under a fresh
        # name and the verified file is renamed over the old snapshot: a save that fails while
        # writing (disk full, read-only folder) or a proxy killed meanwhile leaves the previous
        # snapshot whole and restorable.
        saving = self.folder.saving_name(owner)
        try:
            answer = info.client.save(slot, saving)
        except UpstreamError as e:
            log.warning("save of %s from slot %d failed: %s; the previous snapshot stays", owner,
                        slot, e)
            metrics.slot_op("save", ok=False)
            self.folder.discard_saving(saving)
            return 0
        n_saved = int(answer.get("n_saved", 0))
        ok, why = self.folder.verify_saved(owner, n_written=int(answer.get("n_written", -1)),
                                           n_saved=n_saved, name=saving)
        if not ok:
            # A full disk truncates the file while its header still claims every token.
            log.warning("save of %s from slot %d is unusable (%s): removed; the previous "
                        "snapshot stays", owner, slot, why)
            metrics.slot_op("save", ok=False)
            self.folder.discard_saving(saving)
            return 0
        crc = self.folder.crc32_of(saving)
        self.folder.commit_saved(owner, saving)
        now = self.clock()
        size = self.folder.state_path(owner).stat().st_size
        metrics.slot_op("save", seconds=time.monotonic() - t0, nbytes=size, tokens=n_saved)
        self.folder.secure(owner)
        self.folder.write_meta(SessionMeta(
            session_id=owner, kind=kind, file_name=name,
            fingerprint=info.props.fingerprint, n_ctx=info.props.n_ctx, n_tokens=n_saved,
            n_messages=messages, created=old.created if old else now, last_used=now,
            size_bytes=size, misses=0, crc32=crc,
        ))

        def note_saved(doc: StateDoc) -> None:
            rec = doc.upstream(url).slots.get(slot)
            if rec is not None and rec.owner == owner:
                rec.saved_tokens = n_saved

        self.state.update(note_saved)
        self.folder.make_room(0, keep={owner})  # the estimate may have been low
        log.info("saved %s from slot %d: %d tokens, %d bytes in %.0f ms", owner, slot, n_saved,
                 size, (time.monotonic() - t0) * 1000)
        return n_saved

    def _mark_fresh(self, url: str, slot: int, session: str, restored: int) -> None:
        def change(doc: StateDoc) -> None:
            rec = doc.upstream(url).slots.get(slot)
            if rec is not None and rec.owner == session:
                rec.stale = False
                rec.tokens = restored
                rec.saved_tokens = restored

        self.state.update(change)

    def _mark_stale(self, url: str, slot: int, owner: str) -> None:
        def change(doc: StateDoc) -> None:
            rec = doc.upstream(url).slots.get(slot)
            if rec is not None and rec.owner == owner:
                rec.stale = True

        self.state.update(change)

    # ---- after the response ----------------------------------------------------------------

    def finish(self, route: Route, timings: Timings | None) -> None:
        """Record use (coalesced to one write per session every couple of seconds), count a
        restore that was not reused, release the slot lock. Blocking: worker thread."""
        try:
            self._record(route, timings)
        finally:
            route.release()

    def _record(self, route: Route, timings: Timings | None) -> None:
        if route.slot is None or route.action in (SIDE, CLIENT, FALLBACK, UNPINNED):
            return
        if route.action in (RESTORED, SEEDED) and timings is not None:
            self._check_reuse(route, timings)
        if route.action == KEPT and timings is not None:
            self._check_still_resident(route, timings)
        info = self.upstream(route.upstream)
        now = self.clock()
        # Tokens now in the slot's KV: the last generated token was sampled, never evaluated
        # (measured: 30 prompt + 6 generated leave 35, the save's n_saved). Counting it made
        # every handover and shutdown save again a session that had not changed.
        tokens = (timings.prompt_tokens + max(timings.predicted_n - 1, 0)
                  if timings else None)
        if tokens is not None:
            info.last_seen[route.session] = Seen(now, tokens, route.messages)
        if self._grew_enough(route, tokens):
            self.save_slot(route.upstream, info, route.slot, route.session, route.messages)
        last = info.usage_written.get(route.session, 0.0)
        if route.action == KEPT and now - last < self.config.usage_write_interval:
            return  # coalesced: the handover decisions read live token counts from /slots
        info.usage_written[route.session] = now

        def change(doc: StateDoc) -> None:
            rec = doc.upstream(route.upstream).slots.get(route.slot)
            if rec is not None and rec.owner == route.session:
                rec.last_used = now
                rec.messages = route.messages
                if tokens is not None:
                    rec.tokens = tokens

        self.state.update(change)

    def _check_reuse(self, route: Route, timings: Timings) -> None:
        """A restored snapshot (or seed) the server did not reuse is a miss: its tokens were not
        a prefix of the prompt. Two misses retire it (slotfiles)."""
        if self.folder is None or timings.cache_n >= route.restored_tokens // 2:
            return
        snapshot = route.session
        if route.action == SEEDED and route.seed_key is not None:
            snapshot = seed_id(route.seed_key)
        misses = self.folder.record_miss(snapshot)
        metrics.restore_miss("seed" if snapshot != route.session else "session")
        log.warning("restore of %s was not reused (cache_n %d of %d): miss %d", snapshot,
                    timings.cache_n, route.restored_tokens, misses)

    def _check_still_resident(self, route: Route, timings: Timings) -> None:
        if timings.prompt_n == 0:
            return
        seen = self.upstream(route.upstream).last_seen.get(route.session)
        expected = seen.tokens if seen else 0
        if expected > 2 * self.config.min_save_tokens and timings.cache_n < expected // 4:
            # The slot should have held this session's KV but the server reused almost
            # nothing: it probably restarted. Verify before the next request.
            log.warning("%s on slot %s reused %d of ~%d tokens: verifying %s", route.session,
                        route.slot, timings.cache_n, expected, route.upstream)
            self.mark_suspect(route.upstream)

    def _grew_enough(self, route: Route, tokens: int | None) -> bool:
        if self.folder is None or tokens is None or tokens < self.config.min_save_tokens:
            return False
        doc = self.state.read().upstreams.get(route.upstream)
        rec = doc.slots.get(route.slot) if doc else None
        if rec is None or rec.owner != route.session or rec.stale:
            return False
        return tokens - rec.saved_tokens >= self.config.save_every_tokens

    # ---- background saves --------------------------------------------------------------------

    def save_if_idle(self, url: str, session: str, ended: float) -> bool:
        """Called a few seconds after a request ended: if the session has not been back since,
        save what it grew, so a llama-server that dies without warning loses nothing that
        finished. Skips quietly when the slot is busy or no longer the session's."""
        info = self._upstreams.get(url)
        if info is None or self.folder is None:
            return False
        seen = info.last_seen.get(session)
        if seen is None or seen.at > ended:
            return False  # it came back: its own next idle period will save it
        return self._save_resident(url, info, session, seen.tokens, lock_timeout=0)

    def save_all(self, lock_timeout: float = 30.0) -> int:
        """On shutdown: save every session resident on a known upstream that grew since its
        last save. Returns how many were saved."""
        saved = 0
        for url, info in self.known_upstreams():
            up = self.state.read().upstreams.get(url)
            for rec in list(up.slots.values()) if up else []:
                seen = info.last_seen.get(rec.owner)
                tokens = max(rec.tokens, seen.tokens if seen else 0)
                saved += self._save_resident(url, info, rec.owner, tokens, lock_timeout)
        return saved

    def _save_resident(self, url: str, info: UpstreamInfo, session: str, tokens: int,
                       lock_timeout: float) -> bool:
        if self.folder is None or info.props is None or tokens < self.config.min_save_tokens:
            return False
        slot = self._resident_slot(self.state.read(), url, session)
        if slot is None or self.state.read().upstreams[url].slots[slot].saved_tokens >= tokens:
            return False
        lease = self.locks.acquire(url, slot, exclusive=False, timeout=lock_timeout)
        if lease is None:
            return False
        try:
            if self._resident_slot(self.state.read(), url, session) != slot:
                return False
            rec = self.state.read().upstreams[url].slots[slot]
            return self.save_slot(url, info, slot, session,
                                  info.messages_of(session, rec.messages)) > 0
        finally:
            lease.release()


def _tokens_in(slots: list[SlotView], slot: int) -> int:
    return next((s.n_tokens for s in slots if s.id == slot), 0)


def _warn_about_settings(url: str, props: ServerProps, slots: list[SlotView] | None,
                         n_ctx_train: int) -> None:
    """Settings that defeat slotkeeper, said once per upstream (and after a restart)."""
    if slots is None:
        log.warning("%s: GET /slots is disabled or failing (--no-slots?): slotkeeper can only "
                    "hash sessions over the slot count", url)
    if props.total_slots <= 1:
        log.warning("%s: the server has %d slot(s): start it with -np N, N >= concurrent "
                    "sessions", url, props.total_slots)
    elif n_ctx_train and props.n_ctx >= n_ctx_train:
        # /props does not say whether the KV cache is unified. With an explicit -np the cache
        # is split and each slot gets -c / N tokens; every slot holding the model's whole
        # training context is what the automatic slot count with a unified cache looks like.
        log.warning("%s: each of the %d slots has the full context (%d tokens): this looks like "
                    "the automatic slot count with a unified KV cache, where idle slots are "
                    "cleared into a RAM cache; start llama-server with an explicit -np N",
                    url, props.total_slots, props.n_ctx)


class SessionAdmin:
    """What the /api/sessions endpoints do. Blocking: worker threads."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def current(self) -> dict:
        doc = self.router.state.read()
        folder = self.router.folder
        out: dict = {}
        for url, up in doc.upstreams.items():
            slots = {}
            for slot_id, rec in sorted(up.slots.items()):
                meta = folder.read_meta(rec.owner) if folder else None
                slots[str(slot_id)] = {
                    "session": rec.owner,
                    "resident": not rec.stale,
                    "claimed": rec.claimed,
                    "last_used": rec.last_used,
                    "tokens": rec.tokens,
                    "saved_tokens": rec.saved_tokens,
                    "file": None if meta is None else {"tokens": meta.n_tokens,
                                                       "bytes": meta.size_bytes},
                }
            out[url] = {"slots": slots}
        return {"upstreams": out, "slot_dir": str(folder.root) if folder else None}

    def saved(self) -> list[dict]:
        folder = self.router.folder
        if folder is None:
            raise NoSlotDir()
        resident = self._resident()
        return [
            {
                "id": meta.session_id,
                "kind": meta.kind,
                "bytes": meta.size_bytes,
                "tokens": meta.n_tokens,
                "messages": meta.n_messages,
                "created": meta.created,
                "last_used": meta.last_used,
                "resident": resident.get(meta.session_id),
            }
            for meta in sorted(folder.list_sessions(), key=lambda m: -m.last_used)
        ]

    def _resident(self) -> dict[str, dict]:
        return {
            rec.owner: {"upstream": url, "slot": slot_id}
            for url, up in self.router.state.read().upstreams.items()
            for slot_id, rec in up.slots.items()
            if not rec.stale
        }

    def clear(self) -> dict:
        """Erase every claimed slot and drop every claim. Saved files stay."""
        erased = []
        for url, up in self.router.state.read().upstreams.items():
            for slot_id in list(up.slots):
                self._release_slot(url, slot_id, owner=None)
                erased.append({"upstream": url, "slot": slot_id})
        return {"erased": erased}

    def forget(self, session: str) -> dict | None:
        """Erase the session's slot if it holds one and delete its files. None: unknown id."""
        found = False
        for url, up in self.router.state.read().upstreams.items():
            slot_id = up.slot_of(session)
            if slot_id is not None:
                self._release_slot(url, slot_id, owner=session)
                found = True
        folder = self.router.folder
        deleted = folder.delete(session) if folder else False
        if not (found or deleted):
            return None
        return {"id": session, "slot_erased": found, "files_deleted": deleted}

    def _release_slot(self, url: str, slot: int, owner: str | None) -> None:
        router = self.router
        lease = router.locks.acquire(url, slot, exclusive=True, timeout=ADMIN_LOCK_TIMEOUT)
        if lease is None:
            raise SlotBusy(f"slot {slot} of {url} stayed busy for {ADMIN_LOCK_TIMEOUT:.0f} s")
        try:
            try:
                with metrics.timed("erase"):
                    router.upstream(url).client.erase(slot)
            except UpstreamError as e:
                log.warning("erase of slot %d on %s failed: %s", slot, url, e)

            def drop(doc: StateDoc) -> None:
                up = doc.upstream(url)
                rec = up.slots.get(slot)
                if rec is not None and (owner is None or rec.owner == owner):
                    del up.slots[slot]

            router.state.update(drop)
        finally:
            lease.release()


class SlotBusy(Exception):
    """A slot was still serving a request when an admin call wanted it."""


class NoSlotDir(Exception):
    """The proxy was started without slotkeeper_slot_dir: there are no saved sessions."""
