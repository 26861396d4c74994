"""The walk room: on the server the request was placed on, which slot it runs on and under
which lease. In order: the client's own slot, the fallback when /slots is unusable, a side
request (placed without a claim, displacing the owner), the session's own slot (kept), or a
slot claimed for it and handed over. Every lease is entered in an ExitStack the moment it is
acquired and handed to the Route only when the Route is complete, so any exception on the way
releases it (issue #11, fault 1); `keep`, on the event loop for every kept request, does the
same with a try block, which costs less. Blocking except `keep`: worker threads."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from contextlib import ExitStack

from ..decisions import choice, policy
from ..decisions.choice import SlotView
from ..identity.identity import Identity
from ..observe import metrics
from ..snapshots.saves import Saves
from ..store.locks import SlotLease, SlotLocks
from ..store.state import SlotRecord, StateDoc, StateFile
from ..upstream.client import SlotsUnavailable
from ..upstream.registry import UpstreamInfo, Upstreams
from .handover import Handover
from .routes import (
    CLIENT,
    FALLBACK,
    KEPT,
    SIDE,
    UNPINNED,
    ClaimedElsewhere,
    Route,
    RouterConfig,
    idle_in,
    resident_slot,
    tokens_in,
)
from .sessions import Sessions, conversation_fields
from .slotcosts import free_to_take, side_costs

log = logging.getLogger("slotkeeper")


class Walk:
    """Owns: the choice of slot on one server, leases, claims. Does not touch: which server
    (the pool), what a slot holds when it changes hands (the handover), the answer."""

    def __init__(self, config: RouterConfig, state: StateFile, locks: SlotLocks,
                 clock: Callable[[], float], upstreams: Upstreams, sessions: Sessions,
                 handover: Handover, saves: Saves,
                 placeable: Callable[[str], bool],
                 one_off: Callable[[str, Identity], Callable[[], None] | None] = (
                     lambda url, ident: None)) -> None:
        self.config = config
        self.state = state
        self.locks = locks
        self.clock = clock
        self.upstreams = upstreams
        self.sessions = sessions
        self.handover = handover
        self.saves = saves
        self.placeable = placeable  # the pool's verdict on another server
        # A new request that will not be continued (firstturns, #23): what removes its
        # system prompt's leftovers, or None.
        self.one_off = one_off

    def keep(self, url: str, ident: Identity, running: int) -> Route | None:
        """The fast path: a session that owns its slot keeps it. A stat of the state file and
        a non-blocking shared flock, no network. None means: take the slow path. The first
        look is at the document as last read (no stat); the read under the lease decides."""
        doc = self.state.last_read()
        slot = resident_slot(doc, url, ident.session_id)
        if slot is None:
            return None
        rec = doc.upstreams[url].slots[slot]
        if self.sessions.kind(url, ident, rec, running) != policy.MAIN:
            return None
        lease = self.locks.try_acquire(url, slot, exclusive=False)
        if lease is None:
            return None
        try:
            # Re-check under the lock: a handover elsewhere may have claimed the slot meanwhile;
            # a document changed since the first look is judged again whole.
            fresh = self.state.read()
            if fresh is doc or (
                    resident_slot(fresh, url, ident.session_id) == slot and self.sessions.kind(
                        url, ident, fresh.upstreams[url].slots[slot], running) == policy.MAIN):
                return Route(url, ident.session_id, ident.rule, slot, KEPT, lease=lease)
        except BaseException:
            lease.release()
            raise
        lease.release()
        return None

    def walk(self, url: str, ident: Identity, client_slot: int | None, path: str,
             body: dict | None, running: int) -> Route:
        """The slow path on `url`: verified first if it may have restarted."""
        info = self.upstreams.verify_if_suspect(url)
        if client_slot is not None:
            return self._client(url, info, ident, client_slot)
        try:
            slots = info.client.slots()
        except SlotsUnavailable as e:
            return self._fallback(url, info, ident, str(e), self.config.lock_timeout)
        up = self.state.read().upstreams.get(url)
        owned = up.slot_of(ident.session_id) if up else None
        kind = self.sessions.kind(url, ident, up.slots[owned] if owned is not None else None,
                                  running)
        if kind == policy.SIDE:
            return self._side(url, info, ident, slots,
                              "side task" if ident.side_task else "side request")
        drop_leftovers = self.one_off(url, ident) if owned is None else None
        if drop_leftovers is not None:
            route = self._side(url, info, ident, slots, "one-off", from_prefix=True)
            try:  # after the prefix restore; the route (and its lease) goes on regardless
                drop_leftovers()
            except Exception:
                log.exception("removing the leftovers of one-off requests failed")
            return route
        if owned is None:
            ident = self.sessions.with_parent(url, ident)
        # Remembered before the handover: a request of the session arriving meanwhile must be
        # judged against this conversation.
        self.sessions.remember(url, ident.session_id, ident)
        return self._session(url, info, ident, slots, path, body, move=kind == policy.MOVE)

    def _client(self, url: str, info: UpstreamInfo, ident: Identity, slot: int) -> Route:
        """The client chose id_slot: it runs there whatever we say, so it takes the slot's
        lease and the slot's owner is saved first and marked stale. A slot the server does
        not have is refused (SlotOutOfRange) before any lock file is made for it."""
        total = (info.props.total_slots if info.props else 0) or self.config.slot_count
        if not total:  # no slot count known: no lease (a lock file per value), server decides
            return Route(url, ident.session_id, ident.rule, slot, CLIENT,
                         detail="id_slot chosen by the client; slot count unknown")
        choice.check_client_slot(slot, total)
        return self._take_unclaimed(url, info, ident, slot, CLIENT,
                                    "id_slot chosen by the client", self.config.lock_timeout)

    def _fallback(self, url: str, info: UpstreamInfo, ident: Identity, why: str,
                  wait: float) -> Route:
        """/slots unusable (or no slot could be had): a stable hash of the session over the
        slot count, under that slot's lease like any other request on a slot."""
        count = (info.props.total_slots if info.props else 0) or self.config.slot_count
        slot = choice.fallback_slot(ident.session_id, count)
        metrics.fallback(why)
        if slot is None:
            # The server picks the slot: any claim may be overwritten, so none is trusted.
            self.saves.mark_all_stale(url)
            return Route(url, ident.session_id, ident.rule, None, UNPINNED,
                         detail=f"{why}; slot count unknown")
        return self._take_unclaimed(url, info, ident, slot, FALLBACK,
                                    f"{why}; hashed over {count} slots", wait)

    def _take_unclaimed(self, url: str, info: UpstreamInfo, ident: Identity, slot: int,
                        action: str, detail: str, wait: float) -> Route:
        """A request that runs on `slot` without claiming it (fallback, client-pinned): it
        holds the slot's lease, and the slot's owner is saved first and marked stale."""
        lease = self.locks.acquire(url, slot, exclusive=True, timeout=wait)
        with ExitStack() as stack:
            if lease is None:
                detail += "; slot stayed busy, forwarded without its lease"
                self.handover.displace(url, info, slot, ident.session_id, 0, save=False)
            else:
                stack.enter_context(lease)
                note = self.handover.displace(url, info, slot, ident.session_id, 0)
                detail += f"; {note}" if note else ""
            route = Route(url, ident.session_id, ident.rule, slot, action, detail=detail,
                          lease=lease)
            stack.pop_all()
            return route

    def _session(self, url: str, info: UpstreamInfo, ident: Identity, slots: list[SlotView],
                 path: str, body: dict | None, move: bool = False) -> Route:
        """The session's own slot if it still has one (kept, or restored into it), else the
        best slot, claimed and handed over. `move`: leave the slot running its other request."""
        live_ids = {s.id for s in slots}
        # Tried again until the lock timeout is spent, not a fixed number of times: a claim
        # is refused when the slot's owner used it while we waited (its last_used changed),
        # which with more busy sessions than slots is every other try. Five tries ran out in
        # 6.2 s in a run of the etcd test (4 sessions, 2 slots, 3 proxies) and the request went
        # out without a lease, over another session's KV (docs/DESIGN.md, "Waiting for a slot").
        deadline = time.monotonic() + self.config.lock_timeout
        for attempt in itertools.count():
            if attempt and time.monotonic() >= deadline:
                break
            up = self.state.read().upstreams.get(url)
            owned = up.slot_of(ident.session_id) if up else None
            if owned is not None and owned in live_ids and not move:
                route, again = self._own_slot(url, info, ident, owned, up.slots[owned].stale,
                                              path, body, deadline)
                if again:
                    continue
                if route is None:
                    break
                return route
            claims = up.claims() if up else {}
            ranking = self._ranking(info, slots, up, claims, avoid=owned if move else None)
            if not ranking:
                return self._fallback(url, info, ident, "server reports no slots",
                                      self.config.lock_timeout)
            lease, slot = self._lock_first_free(url, ranking, deadline)
            if lease is None:
                break
            with ExitStack() as stack:
                stack.enter_context(lease)
                claimed = claim(self.state, self.config, self.clock(), url, slot, ident,
                                expected=claims.get(slot), live_ids=live_ids, move=move,
                                live_elsewhere=self._live_elsewhere(url))
                if claimed is None:
                    continue
                route = self.handover.hand_over(url, info, ident, slot, lease,
                                                previous=claimed[0],
                                                live_tokens=tokens_in(slots, slot),
                                                path=path, body=body,
                                                idle_slots=idle_in(slots))
                if move:
                    route.detail = "; ".join(filter(None, [
                        "moved off the slot running the session's other request", route.detail]))
                stack.pop_all()
                return route
        return self._fallback(url, info, ident, "no slot could be locked in time", 0.0)

    def _own_slot(self, url: str, info: UpstreamInfo, ident: Identity, owned: int,
                  stale: bool, path: str, body: dict | None,
                  deadline: float) -> tuple[Route | None, bool]:
        """The session's claimed slot, under its lease: kept when its KV is still there,
        else restored into it. (route, False); (None, True): look again; (None, False): the
        slot stayed busy."""
        lease = self.locks.acquire(url, owned, exclusive=stale, timeout=until(deadline))
        if lease is None:
            return None, False
        with ExitStack() as stack:
            stack.enter_context(lease)
            current = self.state.read().upstreams.get(url)
            if current is None or current.slot_of(ident.session_id) != owned:
                return None, True
            if not current.slots[owned].stale:
                route = Route(url, ident.session_id, ident.rule, owned, KEPT, lease=lease)
            elif not lease.exclusive:
                return None, True
            else:
                route = self.handover.hand_over(url, info, ident, owned, lease, previous=None,
                                                live_tokens=0, path=path, body=body)
            stack.pop_all()
            return route, False

    def _side(self, url: str, info: UpstreamInfo, ident: Identity,
              slots: list[SlotView], why: str = "side request",
              from_prefix: bool = False) -> Route:
        """A side request (a small prompt, or not the session's conversation) goes to the best
        slot without claiming it, and never to its own session's slot while another is free.
        If that slot belongs to a session, its KV is saved first (when it is worth it) and the
        claim is marked stale, so the owner is restored on its next request. `from_prefix`
        (a one-off): the slot first gets its parent's snapshot when the server will reuse it,
        as a new conversation's handover does."""
        up = self.state.read().upstreams.get(url)
        claims = up.claims() if up else {}
        ranking = self._ranking(info, slots, up, claims,
                                avoid=up.slot_of(ident.session_id) if up else None)
        costs = side_costs(slots, up, info, self.handover.left_to_ram)
        tokens = {view.id: view.n_tokens for view in slots}
        ranking = policy.order_for_side(ranking, costs, tokens)
        if not ranking:
            return self._fallback(url, info, ident, "server reports no slots",
                                  self.config.lock_timeout)
        lease, slot = self._lock_first_free(url, ranking,
                                            time.monotonic() + self.config.lock_timeout)
        if lease is None:
            self.saves.mark_all_stale(url)
            return Route(url, ident.session_id, ident.rule, None, UNPINNED,
                         detail=f"{why}; every slot busy")
        with ExitStack() as stack:
            stack.enter_context(lease)
            if not from_prefix and policy.side_goes_unpinned(slot, costs, tokens):
                route = self._side_unpinned(url, ident, lease,
                                            [v.id for v in slots if v.id != slot], why)
                if route is not None:
                    stack.pop_all()
                    return route
            detail = f"{why}, slot not claimed"
            note = self.handover.displace(url, info, slot, None, tokens_in(slots, slot))
            detail += f"; {note}" if note else ""
            if from_prefix:
                note = self.handover.start_from_prefix(info, ident, slot)
                detail += f"; {note}" if note else ""
            route = Route(url, ident.session_id, ident.rule, slot, SIDE, detail=detail,
                          lease=lease)
            stack.pop_all()
            return route

    def _side_unpinned(self, url: str, ident: Identity, lease: SlotLease, slot_ids: list[int],
                       why: str) -> Route | None:
        """The side request without `id_slot` (policy.side_goes_unpinned), holding every
        slot's lock until it ends, so no request slotkeeper routes lands where the server puts
        it meanwhile. None when another request holds a slot's lock: pin it then."""
        others = []
        for slot in slot_ids:
            other = self.locks.try_acquire(url, slot, exclusive=True)
            if other is None:
                for held in others:
                    held.release()
                return None
            others.append(other)
        route = Route(url, ident.session_id, ident.rule, None, UNPINNED, lease=lease,
                      detail=f"{why}, not pinned: every slot empty and free, so llama-server "
                             "picks one and consults its RAM prompt cache")
        for held in others:
            route.on_release(held.release)
        return route

    def _ranking(self, info: UpstreamInfo, slots: list[SlotView], up, claims: dict,
                 avoid: int | None) -> list[int]:
        """The slots best first (choice.rank_slots); `avoid` last-resort only."""
        now = self.clock()
        ranking = choice.rank_slots(slots, claims, now, self.config.ttl,
                                    self.sessions.returns.expected_back(claims.values(), now),
                                    free_to_take(slots, up, info, self.handover.left_to_ram))
        if avoid is not None:
            ranking = [s for s in ranking if s != avoid] or ranking
        return ranking

    def _lock_first_free(self, url: str, ranking: list[int],
                         deadline: float) -> tuple[SlotLease | None, int]:
        for slot in ranking:
            lease = self.locks.try_acquire(url, slot, exclusive=True)
            if lease is not None:
                return lease, slot
        best = ranking[0]
        return self.locks.acquire(url, best, True, until(deadline)), best

    def _live_elsewhere(self, url: str) -> set[str]:
        return {u for u in self.config.upstreams if u != url and self.placeable(u)}


def until(deadline: float) -> float:
    """The seconds left before `deadline` (time.monotonic), never negative."""
    return max(0.0, deadline - time.monotonic())


def claim(state: StateFile, config: RouterConfig, now: float, url: str, slot: int,
          ident: Identity, expected: choice.Claim | None, live_ids: set[int],
          move: bool = False, live_elsewhere: frozenset[str] | set[str] = frozenset()
          ) -> tuple[SlotRecord | None] | None:
    """Write the claim. Refuse (None) when the slot was claimed by a live session after we
    ranked it, or when this session got a slot elsewhere meanwhile: the caller re-ranks.
    `move`: the session leaves its other slot (running its other request) for this one.
    Raises ClaimedElsewhere when the session holds a claim on another live server of the
    pool (`live_elsewhere`)."""
    session = ident.session_id

    def change(doc: StateDoc) -> tuple[SlotRecord | None] | str | None:
        if config.upstreams:
            # Never one session on two servers: a claim on another live server of the pool
            # means another process placed it there meanwhile (place again: it stays there);
            # one on a server that is down, draining or gone is dropped (its snapshot is
            # restored here).
            for other_url, other_up in doc.upstreams.items():
                held = other_up.slot_of(session) if other_url != url else None
                if held is None:
                    continue
                if other_url in live_elsewhere:
                    return "elsewhere"
                del other_up.slots[held]
        up = doc.upstream(url)
        other = up.slot_of(session)
        if other is not None and other != slot:
            if other in live_ids and not move:
                return None
            del up.slots[other]  # a slot the server no longer has, or the one we leave
        previous = up.slots.get(slot)
        if previous is not None and previous.claim() != expected and not choice.is_abandoned(
            previous.claim(), now, config.ttl
        ) and previous.owner != session:
            return None
        up.slots[slot] = SlotRecord(owner=session, claimed=now, last_used=now, stale=True,
                                    messages=ident.message_count, **conversation_fields(ident))
        return (previous,)

    claimed = state.update(change)
    if claimed == "elsewhere":
        raise ClaimedElsewhere(session)
    return claimed
