"""The pool room (issue #13): which llama-server of several a request goes to, each server's
view for that choice, the load this process puts on each, and moving sessions out of a server
(drain, evacuation). One upstream (no pool): only the load count is used. Blocking except
`sticky_upstream`, `any_upstream` and the counts: worker threads."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..decisions import choice, fingerprints, placement
from ..identity.identity import Identity
from ..snapshots.saves import Saves
from ..snapshots.slotfiles import SlotFolder
from ..snapshots.snapshots import seed_id
from ..store.locks import SlotLocks
from ..store.state import SlotRecord, StateDoc, StateFile
from ..upstream.client import SlotsUnavailable
from ..upstream.registry import Upstreams
from .routes import NoUpstream, RouterConfig, count_down, tokens_in
from .sessions import Sessions

log = logging.getLogger("slotkeeper")

# A stale claim younger than this whose slot is leased is a handover in progress (a restore
# takes milliseconds; building a seed of a long system prompt up to a minute here).
HANDOVER_CLAIM_SECONDS = 120.0


class Pool:
    """Owns: placement (views, the per-session placement lock), draining, evacuation, the
    in-flight counts. Does not touch: which slot a request gets on its server (the walk),
    restores (the handover), what happens after the answer (accounting)."""

    def __init__(self, config: RouterConfig, state: StateFile, locks: SlotLocks,
                 folder: SlotFolder | None, clock: Callable[[], float], upstreams: Upstreams,
                 sessions: Sessions, saves: Saves) -> None:
        self.config = config
        self.state = state
        self.locks = locks
        self.folder = folder
        self.clock = clock
        self.upstreams = upstreams
        self.sessions = sessions
        self.saves = saves
        # upstream -> routed requests of this process not yet ended (the pool's load)
        self._in_flight: dict[str, int] = {}
        self._mutex = threading.Lock()
        self._turn = 0  # round-robin placement

    @property
    def pooled(self) -> bool:
        return bool(self.config.upstreams)

    # ---- load ------------------------------------------------------------------------------

    def in_flight(self, url: str) -> int:
        return self._in_flight.get(url, 0)

    def count(self, url: str, delta: int) -> None:
        """A request placed on `url` starts (+1) or ends (-1) counting as its load."""
        with self._mutex:
            if delta > 0:
                self._in_flight[url] = self._in_flight.get(url, 0) + delta
            else:
                count_down(self._in_flight, url)

    # ---- views -----------------------------------------------------------------------------

    def home_of(self, session: str, doc: StateDoc | None = None) -> str | None:
        """The pool server holding the session's claim (fresh or stale), if any. Claims are
        in the state file every proxy process shares, so every process sees one home."""
        doc = doc or self.state.read()
        for url in self.config.upstreams:
            up = doc.upstreams.get(url)
            if up is not None and up.slot_of(session) is not None:
                return url
        return None

    def placeable(self, url: str, doc: StateDoc | None = None) -> bool:
        """Up (as this process's health checks see it) and not draining (as the state file
        says, for every process)."""
        doc = doc or self.state.read()
        up = doc.upstreams.get(url)
        return self.upstreams.get(url).healthy and not (up is not None and up.draining)

    def sticky_upstream(self, session: str) -> str | None:
        """For the fast path: the session's server when a kept request may go there without
        asking any server (resident there, placeable, not saturated by this process's own
        requests); None: take the slow path, which places it."""
        doc = self.state.read()
        url = self.home_of(session, doc)
        if url is None or not self.placeable(url, doc):
            return None
        info = self.upstreams.peek(url)
        slots = info.props.total_slots if info is not None and info.props else 0
        if (self.config.placement != placement.COST
                or self.in_flight(url) >= max(slots, 1)):
            return None
        return url

    def any_upstream(self) -> str | None:
        """A server for a request that is not placed (listings, /props, /tokenize): the
        first placeable one."""
        doc = self.state.read()
        return next((url for url in self.config.upstreams if self.placeable(url, doc)), None)

    # ---- placement -------------------------------------------------------------------------

    @contextmanager
    def placement_lock(self, session: str) -> Iterator[None]:
        """One placement of a session at a time, in every process: from reading the pool's
        views until its claim is written, so a second request of a new session sees where
        the first one went (pending or resident there) and follows it. A lock that stays
        taken past lock_timeout is passed by (logged): the claim checks of the walk still
        refuse a second server while the first is live. No pool: no lock."""
        lease = self.locks.placement(session, self.config.lock_timeout) if self.pooled else None
        if self.pooled and lease is None:
            log.warning("%s: placement lock still held after %.0f s; placing without it",
                        session, self.config.lock_timeout)
        try:
            yield
        finally:
            if lease is not None:
                lease.release()

    def place_and_reserve(self, ident: Identity) -> placement.Placement:
        """Choose the server, count the request on it at once (so requests placed at the
        same moment see it; the caller ends the reservation), and evacuate the session's
        old home if it leaves one."""
        chosen = self.place(ident)
        url = chosen.url
        self.count(url, +1)
        home = self.home_of(ident.session_id)
        leaving = chosen.leaving or (home if home not in (None, url) else None)
        if leaving is not None:
            # The cost policy carries the session's KV along (saved there, restored here); the
            # baselines place as a KV-blind balancer would, so only what an idle save wrote
            # before is there to restore.
            self.evacuate(leaving, ident.session_id, self.config.lock_timeout,
                          save=self.config.placement == placement.COST)
        return chosen

    def place(self, ident: Identity) -> placement.Placement:
        """Gather each pool server's view and let placement.place decide. Blocking."""
        session = ident.session_id
        # A request of the session still running in this process: the others go where it is,
        # so the side-request rules of one server apply (never two servers for one session).
        for url in self.sessions.running_on(session):
            if url in self.config.upstreams and self.placeable(url):
                return placement.Placement(url, placement.STAY)
        views = self._views(ident)
        prompt = max([placement.estimate_tokens(ident.prompt_chars)] + [v.reuse for v in views])
        with self._mutex:
            turn = self._turn
            self._turn += 1
        chosen = placement.place(views, prompt, self.config.placement, self.config.weights, turn)
        if chosen is None:
            raise NoUpstream("every server of the pool is down or draining")
        return chosen

    def _views(self, ident: Identity) -> list[placement.ServerView]:
        folder = self.folder
        snapshot = folder.read_meta(ident.session_id) if folder is not None else None
        seed = (folder.read_meta(seed_id(ident.seed_key))
                if folder is not None and ident.seed_key else None)
        doc = self.state.read()
        now = self.clock()
        return [self._view(url, ident.session_id, doc, now, (snapshot, seed))
                for url in self.config.upstreams]

    def _view(self, url: str, session: str, doc: StateDoc, now: float,
              metas: tuple) -> placement.ServerView:
        info = self.upstreams.get(url)
        up_rec = doc.upstreams.get(url)
        healthy = info.healthy
        if healthy:
            self.upstreams.verify_if_suspect(url)
        props = info.props
        total = props.total_slots if props is not None else 1
        busy = free = live_tokens = 0
        slot = up_rec.slot_of(session) if up_rec is not None else None
        if healthy:
            try:
                slots = info.client.slots()
            except SlotsUnavailable:
                if not info.client.healthy():
                    healthy = False
                    self.upstreams.set_health(url, False)
                    log.info("%s: not answering: taken out of the pool", url)
            else:
                claims = up_rec.claims() if up_rec is not None else {}
                total = len(slots) or total
                busy = sum(1 for s in slots if s.is_processing)
                free = sum(1 for s in slots if not s.is_processing
                           and choice.is_abandoned(claims.get(s.id), now, self.config.ttl))
                live_tokens = tokens_in(slots, slot) if slot is not None else 0
        rec = up_rec.slots[slot] if healthy and slot is not None else None
        resident = rec is not None and not rec.stale
        pending = (rec is not None and not resident
                   and self._handover_in_progress(url, slot, rec, now))
        reuse = 0
        if resident:
            reuse = max(rec.tokens, live_tokens)
        elif props is not None:
            for meta in metas:
                if (meta is not None
                        and fingerprints.same_model(meta.fingerprint, props.fingerprint)
                        and meta.n_tokens <= props.n_ctx):
                    reuse = max(reuse, meta.n_tokens)
        return placement.ServerView(
            url=url, up=healthy, draining=up_rec is not None and up_rec.draining,
            slots=max(total, 1), busy=busy, in_flight=self.in_flight(url), free=free,
            reuse=reuse, resident=resident, pending=pending)

    def _handover_in_progress(self, url: str, slot: int, rec: SlotRecord, now: float) -> bool:
        """A stale claim is either a session displaced from its slot (free to go where it
        is cheapest) or one being handed over right now, in this or another process (claims
        are written stale before the restore): then its slot's lease is held and the claim
        is recent. Placing it elsewhere then would run it on two servers at once."""
        if now - rec.claimed > HANDOVER_CLAIM_SECONDS:
            return False
        lease = self.locks.try_acquire(url, slot, exclusive=False)
        if lease is None:
            return True
        lease.release()
        return False

    # ---- moving sessions out ---------------------------------------------------------------

    def set_draining(self, url: str, draining: bool) -> None:
        def change(doc: StateDoc) -> None:
            doc.upstream(url).draining = draining

        self.state.update(change)

    def evacuate(self, url: str, session: str, timeout: float, save: bool = True) -> int:
        """The session leaves `url` (draining, saturated, or a baseline placement moved it):
        save its KV there if the server is up and it grew (under the slot's exclusive lease,
        so no request of it runs meanwhile), then drop its claim, so its next request is
        restored wherever it is placed. Returns the tokens saved (0: nothing new saved; -1:
        its slot stayed busy past `timeout`, nothing changed)."""
        up = self.state.read().upstreams.get(url)
        slot = up.slot_of(session) if up is not None else None
        if slot is None:
            return 0
        info = self.upstreams.get(url)
        lease = None
        if save and info.healthy and not up.slots[slot].stale:
            lease = self.locks.acquire(url, slot, exclusive=True, timeout=timeout)
            if lease is None:
                return -1  # its slot stayed busy: the claim stays, it moves on a later request
        try:
            current = self.state.read().upstreams.get(url)
            rec = current.slots.get(slot) if current is not None else None
            if rec is None or rec.owner != session:
                return 0
            saved = self._save_leaving(url, slot, rec) if lease is not None else 0

            def drop(doc: StateDoc) -> None:
                cur = doc.upstream(url).slots.get(slot)
                if cur is not None and cur.owner == session:
                    del doc.upstream(url).slots[slot]

            self.state.update(drop)
            self.sessions.forget(url, session)
            return saved
        finally:
            if lease is not None:
                lease.release()

    def _save_leaving(self, url: str, slot: int, rec: SlotRecord) -> int:
        """Under the slot's exclusive lease: save what the leaving session grew."""
        if rec.stale:
            return 0
        info = self.upstreams.get(url)
        if info.props is None:
            self.upstreams.verify(url, info)
        try:
            live = tokens_in(info.client.slots(), slot)
        except SlotsUnavailable:
            live = 0
        seen = info.last_seen.get(rec.owner)
        tokens = max(rec.tokens, live, seen.tokens if seen else 0)
        if self.saves.save_if_worth(url, info, slot, rec, tokens):
            return max(tokens, rec.saved_tokens)
        return 0
