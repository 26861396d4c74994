"""The router: builds the rooms and walks one request through them, top to bottom, each room
entered once (`route`), and ends it in one place (`finish`, `finish_quick`: the Route's
release). Blocking except `try_keep` and `finish_quick`: worker threads.

The rooms (docs/DESIGN.md, "Module map"):
- sessions (sessions.py): which conversation the request continues; running counts.
- pool (pool.py): which server, the placement lock, evacuating the old home.
- walk (walk.py): which slot on that server, under which lease; claims; side requests.
- handover (handover.py): save the outgoing session, restore or seed the incoming one.
- accounting (accounting.py): after the answer: verification, records, idle/shutdown saves.
- upstreams (upstreams.py) and saves (saves.py) are the shared services they are given.

Every request that runs on a slot holds that slot's lease: kept, handed over, side,
client-pinned and fallback requests alike (issue #11, fault 3). Its lease, its running count
and its load count end in Route.release, which `finish` always calls."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack

from ..decisions import policy
from ..identity.identity import Identity
from ..snapshots.saves import Saves
from ..snapshots.seeds import SeedBuilder
from ..snapshots.slotfiles import SlotFolder
from ..snapshots.snapshots import Snapshots
from ..store.budgets import Ledger
from ..store.locks import SlotLocks
from ..store.state import StateFile
from ..upstream.client import Upstream
from ..upstream.models import Kinds, model_of_body, split_key
from ..upstream.registry import Upstreams
from ..wire.bodies import Timings
from .accounting import Accounting
from .firstturns import FirstTurns
from .handover import Handover
from .model_swaps import ModelSwaps, Prepared
from .pool import Pool
from .returns import ReturnTimes
from .routes import OWNING, UNPINNED, ClaimedElsewhere, NoUpstream, Route, RouterConfig
from .sessions import Sessions
from .walk import Walk

log = logging.getLogger("slotkeeper")

PLACEMENT_ATTEMPTS = 3  # another process moving the session meanwhile: place again
# A session's next turn that arrives while its previous request is only finishing (its final
# event sent, bookkeeping left) waits this long at most for it, then runs on its own slot
# (issue #19). Measured bookkeeping: docs/DESIGN.md, "Ordering races".
FINISH_WAIT_SECONDS = 5.0


class Router:
    def __init__(self, config: RouterConfig, state: StateFile, locks: SlotLocks,
                 folder: SlotFolder | None, clock: Callable[[], float] = time.time,
                 ledger: Ledger | None = None) -> None:
        self.config = config
        self.state = state
        self.locks = locks
        self.folder = folder
        self.clock = clock
        # ledger: the budgets' accounting, the store's (None: this process's own)
        self.snapshots = (Snapshots(folder, locks, clock, ledger=ledger)
                          if folder is not None else None)
        seeds = (SeedBuilder(self.snapshots, config.seed_min_chars, config.max_seeds)
                 if self.snapshots is not None else None)
        kinds = Kinds(config.slots_timeout, config.api_key)
        self.upstreams = Upstreams(state, config.slots_timeout, config.api_key,
                                   make_client=kinds.client, ram_limit=config.ram_cache_bytes,
                                   sps=config.slot_similarity)
        self.sessions = Sessions(state, config.small_request_chars, config.upstreams,
                                 ReturnTimes(clock))
        self.saves = Saves(state, self.snapshots, config.min_save_tokens, config.stall_budget,
                           config.write_budget)
        self.pool = Pool(config, state, locks, folder, clock, self.upstreams, self.sessions,
                         self.saves)
        self.handover = Handover(state, locks, self.saves, self.snapshots,
                                config.erase_on_handover, self.sessions.shared_chars)
        self.first_turns = FirstTurns(state, locks, self.upstreams, self.saves, self.snapshots,
                                      seeds, config.seed_min_chars, config.idle_work)
        self.walk = Walk(config, state, locks, clock, self.upstreams, self.sessions,
                         self.handover, self.saves, self.pool.placeable,
                         self.first_turns.one_off)
        self.accounting = Accounting(config, state, locks, clock, self.upstreams, self.saves,
                                     self.snapshots)
        self.models = ModelSwaps(kinds, state, locks, self.saves, self.upstreams,
                                 self.pool.in_flight, config.lock_timeout)
        for url in config.upstreams:
            self.upstreams.get(url)

    def adopt(self, old: Router) -> None:
        """An option changed and a new router replaces `old`: keep what it knew (upstream
        props and the sessions it saw), not only what the state file says (fault 6)."""
        self.upstreams.adopt(old.upstreams)
        self.sessions.adopt(old.sessions)

    def warm_up(self, bases: Sequence[str]) -> list[str]:
        """At start, off every request's path: learn what each server is and verify a single
        server (its /props, the model file's digest, its /slots), so that the first request
        does not wait for them (measured: 0.2-0.3 s of a fresh proxy's first request, most of
        it the digest; docs/DESIGN.md, "Verified at start"). A server that is not up is left
        to the first request and the health watcher, as before. Returns the servers checked."""
        checked = []
        for base in dict.fromkeys(bases):
            probe = Upstream(base, timeout=self.config.slots_timeout, api_key=self.config.api_key)
            if not probe.healthy():
                continue
            key = base if self.pool.pooled else self.models.prepare(base, "").key
            if key:
                self.upstreams.verify_if_suspect(key)
                checked.append(base)
        return checked

    # ---- a request's walk --------------------------------------------------------------------

    def try_keep(self, url: str, ident: Identity, model: str = "") -> Route | None:
        """The fast path, on the event loop: a session that owns its slot keeps it (no
        network). None means: take the slow path (`route`). `model`: the one the request
        names (a router's or llama-swap's model is its own upstream key, models.py)."""
        started = time.monotonic()
        key = url if self.pool.pooled else self.models.key_now(url, model)
        if key is None:
            return None
        return self._keep(key, self.sessions.resolve(key, ident), started)

    def _keep(self, url: str, ident: Identity, started: float) -> Route | None:
        """`try_keep` for a resolved request on its upstream key; also the slow path's first
        try after waiting for the session's previous request (no /slots read, which a busy
        server answers only between two steps of its batch: seconds while it prefills)."""
        info = self.upstreams.peek(url)
        if info is None or info.suspect:
            return None
        running = self.sessions.enter(url, ident.session_id)
        try:
            route = self.walk.keep(url, ident, running)
        except BaseException:
            self.sessions.leave(url, ident.session_id)
            raise
        if route is None:
            self.sessions.leave(url, ident.session_id, tried=True)  # the slow path follows
            return None
        return self._begin(route, ident, started)

    def route(self, url: str, ident: Identity, client_slot: int | None = None,
              path: str = "", body: dict | None = None) -> Route:
        """The slow path: which conversation (sessions), which server (pool), which slot and
        what it holds (walk, which hands the slot over when it changes hands)."""
        started = time.monotonic()
        prepared = Prepared(url) if self.pool.pooled else self.models.prepare(
            url, model_of_body(body))
        if not prepared.key:
            return unlisted_model(url, ident, prepared)
        url = prepared.key
        ident = self.sessions.resolve(url, ident)
        session = ident.session_id
        waited = self._wait_for_previous(url, ident)
        if client_slot is None and not self.pool.pooled:
            # Kept here too: after the wait, and where the event loop's try could not take
            # the slot's lease from memory (etcd: this process had no key on the slot yet).
            kept = self._keep(url, ident, started)
            if kept is not None:
                if waited is not None:
                    kept.detail = f"waited {waited * 1000:.1f} ms for its previous request to end"
                return kept
        with ExitStack() as reservations, self.pool.placement_lock(session):
            for _attempt in range(PLACEMENT_ATTEMPTS):
                placed = None
                if self.pool.pooled:
                    placed = self.pool.place_and_reserve(ident)
                    url = placed.url
                    reservations.callback(self.pool.count, url, -1)
                running = self.sessions.enter(url, session)
                try:
                    route = self.walk.walk(url, ident, client_slot, path, body, running)
                except ClaimedElsewhere:
                    self.sessions.leave(url, session, tried=True)
                    continue
                except BaseException:
                    self.sessions.leave(url, session)
                    raise
                break
            else:
                raise NoUpstream("the session's placement kept changing under other processes")
            if placed is not None:
                route.placement = placed.reason
                log.info("%s placed on %s (%s)", session, url, placed.reason)
            if waited is not None:
                route.detail = "; ".join(filter(None, [
                    f"waited {waited * 1000:.1f} ms for its previous request to end",
                    route.detail]))
            route.swap_saved = prepared.swap_saved
            return self._begin(route, ident, started, path, body)

    def _wait_for_previous(self, url: str, ident: Identity) -> float | None:
        """The session's next turn, sent while its previous request is only finishing: wait
        (bounded) for that request's end, so this one is judged with nothing running and
        keeps the session's slot. None: there was nothing to wait for."""
        waited = None
        for where in {url, *self.sessions.running_on(ident.session_id)}:
            if self.sessions.should_wait(where, ident):
                waited = (waited or 0.0) + self.sessions.wait_until_ended(
                    where, ident.session_id, FINISH_WAIT_SECONDS)
        return waited

    def _begin(self, route: Route, ident: Identity, started: float, path: str = "",
               body: dict | None = None) -> Route:
        """The request runs from here until `finish`: counted as load on its server, and a
        route on the session's own slot stays counted as the session's running request (the
        count `enter` began); any other stops counting now."""
        url, session = route.upstream, route.session
        route.messages = ident.message_count
        route.seed_key = ident.seed_key
        route.ms = (time.monotonic() - started) * 1000
        route.model = route.model or split_key(url)[1]
        self.models.touch(url)
        info = self.upstreams.peek(url)
        route.sent_at = self.clock()
        if info is not None:
            info.sent_at = route.sent_at
        self.pool.count(url, +1)
        route.on_release(lambda: self.pool.count(url, -1))
        if route.action not in OWNING:
            self.sessions.leave(url, session)
            return route
        route.conversation = self.sessions.remember(url, session, ident)
        route.on_final(lambda: self.sessions.finishing(url, session))
        route.on_release(lambda: self.sessions.leave(url, session, finishing=route.final_seen))
        self.first_turns.began(route, ident, path, body)
        return route

    # ---- its end -------------------------------------------------------------------------------

    def answer_began(self, route: Route) -> None:
        """The server launched the route's request (its answer began), and copied its idle
        slots into its RAM cache as it did (`UpstreamInfo.published`)."""
        info = self.upstreams.peek(route.upstream)
        if info is not None:
            info.launched(route.sent_at)

    def finish(self, route: Route, timings: Timings | None) -> str:
        """Verify which slot ran the request and record its use, then release the route,
        whatever raised. Returns the verification. Blocking: worker thread."""
        try:
            verdict = self.accounting.settle(route, timings)
            if not verdict.startswith(policy.MISMATCH):
                self.first_turns.after(route, timings)  # a seed, taken off the request's path
            return verdict
        finally:
            route.release()

    def when_idle(self, url: str, session: str, ended: float) -> bool | None:
        """A few seconds after the session's request ended (watch.IdleSaves): save what it
        grew, then take the seed its answer left waiting (firstturns), each only when it may
        run now. None: not now, again an idle period later. Nothing while the session has a
        request running here: it came back (its end schedules the next idle save), and a save
        decided then ran right after that request, holding up the next session's turn for the
        save's whole length (six-agents: two kept turns 1.9-2.1 s to their first token, 0.6 s
        without)."""
        if url in self.sessions.running_on(session):
            return False
        saved = self.accounting.save_if_idle(url, session, ended)
        if saved is None:
            return None
        seeded = self.first_turns.seed_if_idle(url, session, self.accounting.quiet(url))
        return None if seeded is None else saved

    def finish_quick(self, route: Route, timings: Timings | None) -> str | None:
        """`finish` on the event loop when nothing is due (accounting.settle_quick); None:
        the route is not released, call `finish` on a worker."""
        verdict = self.accounting.settle_quick(route, timings)
        if verdict is not None:
            route.release()
        return verdict


def unlisted_model(url: str, ident: Identity, prepared: Prepared) -> Route:
    """A router or llama-swap that does not list the model the request names (or none is
    named): forwarded as it came, for the server to answer."""
    why = f"model {prepared.model!r} not listed by the server" if prepared.model else (
        "no model named")
    return Route(url, ident.session_id, ident.rule, None, UNPINNED, detail=why)
