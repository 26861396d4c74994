"""Routing: one request's walk from its identity to a slot, and the handover when a slot
changes hands. Blocking except `try_keep`: worker threads.

The walk visits each room once: policy (pure: which conversation, main or side, which slot),
access (locks: the slot's lease), the state file (the claim), the snapshot service (save the
outgoing session, restore the incoming one), and hands the lease to the Route, which holds it
until the response ends. Every lease is entered in an ExitStack the moment it is acquired and
handed over only when the Route is complete, so any exception on the way releases it (issue
#11, fault 1). Every request that runs on a slot holds that slot's lease: kept, handed over,
side, client-pinned and fallback requests alike (fault 3)."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path  # noqa: F401 (kept for callers that import it from here)
from typing import Generic, TypeVar

from . import choice, metrics, policy
from . import placement as placing
from .admin import ADMIN_LOCK_TIMEOUT, NoSlotDir, SessionAdmin, SlotBusy  # noqa: F401 (re-exported)
from .bodies import Timings
from .choice import SlotView
from .habits import Habits
from .identity import Identity
from .locks import SlotLease, SlotLocks
from .policy import Conversation
from .seeds import SeedBuilder
from .slotfiles import SlotFolder
from .snapshots import Snapshots, seed_id
from .state import SlotRecord, StateDoc, StateFile
from .upstream import ServerProps, SlotsUnavailable, Upstream, UpstreamError

log = logging.getLogger("slotkeeper")

# How a request was routed; also the flow marker names.
KEPT = "kept"  # the session's slot, still holding its KV
ASSIGNED = "assigned"  # a slot newly given to the session, starting cold
RESTORED = "restored"  # newly given, with the session's saved KV restored
SEEDED = "seeded"  # newly given, starting from its system prompt's saved KV (a seed)
SIDE = "side"  # a side request, placed without claiming a slot
CLIENT = "client"  # the client chose id_slot itself
FALLBACK = "fallback"  # /slots unusable: a stable hash of the session over the slot count
UNPINNED = "unpinned"  # no slot count known: forwarded as it came
OWNING = frozenset({KEPT, ASSIGNED, RESTORED, SEEDED})

# Per-session memories of this process are bounded: the oldest are forgotten first. A
# forgotten session loses only exactness (the state file and metas still hold what matters).
MAX_REMEMBERED_SESSIONS = 4096
MAX_FORKS_PER_OPENING = 16
# Pool: a stale claim younger than this whose slot is leased is a handover in progress (a
# restore takes milliseconds; a large model's, seconds).
HANDOVER_CLAIM_SECONDS = 120.0

K = TypeVar("K")
V = TypeVar("V")


class Recent(OrderedDict, Generic[K, V]):
    """A dict that keeps only the `limit` most recently written keys."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


@dataclass
class RouterConfig:
    ttl: float = 120.0
    slots_timeout: float = 1.0
    small_request_chars: int = 2000
    slot_count: int = 0  # used when /props does not say
    lock_timeout: float = 600.0  # a request waits at most this long for a busy slot's lease
    min_save_tokens: int = 256  # smaller sessions re-prefill in about a second: not worth a file
    erase_on_handover: bool = True
    usage_write_interval: float = 2.0
    save_every_tokens: int = 2048  # a session that keeps its slot is saved after this growth
    seed_min_chars: int = 2000  # system prompts (plus tools) at least this long get a seed
    max_seeds: int = 8
    # Several llama-servers behind one address (issue #13): their base URLs, in order. Empty:
    # each flow's own upstream, as one reverse mode gives it.
    upstreams: tuple[str, ...] = ()
    placement: str = placing.COST
    weights: placing.Weights = field(default_factory=placing.Weights)


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
    conversation: Conversation | None = None  # what the slot holds for the session afterwards
    placement: str = ""  # pool only: why this server (placing.STAY, CHEAPEST, ...)
    seed_source: tuple[str, dict] | None = None  # (path, body): a seed may be taken afterwards
    _on_release: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def release(self) -> None:
        """Idempotent, never blocks: drops the lease and this process's count of the
        session's running requests."""
        if self.lease is not None:
            self.lease.release()
        callbacks, self._on_release = self._on_release, []
        for callback in callbacks:
            callback()


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
    usage_written: Recent[str, float] = field(
        default_factory=lambda: Recent(MAX_REMEMBERED_SESSIONS))
    # session -> (when its last request here ended, tokens in its slot then); exact where the
    # state file's copy may lag by the coalescing interval.
    last_seen: Recent[str, Seen] = field(default_factory=lambda: Recent(MAX_REMEMBERED_SESSIONS))
    cleared_warned: bool = False
    healthy: bool = True  # pool member answering /health (the watcher probes it back in)
    answered_at: float = float("-inf")  # time.monotonic() of its last 200 to a routed request

    def answered_within(self, seconds: float) -> bool:
        return time.monotonic() - self.answered_at < seconds

    def messages_of(self, session: str, recorded: int) -> int:
        """Messages in the session's slot: the state file's count lags by the coalescing
        interval, this process's own last request does not."""
        seen = self.last_seen.get(session)
        return max(recorded, seen.messages) if seen else recorded


class NoUpstream(Exception):
    """Every server of the pool is down or draining."""


class ClaimedElsewhere(Exception):
    """Another process placed the session on another live server meanwhile: place again."""


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
        self.snapshots = Snapshots(folder, locks, clock) if folder is not None else None
        self.seeds = (SeedBuilder(self.snapshots, config.seed_min_chars, config.max_seeds)
                      if self.snapshots is not None else None)
        # (upstream, session) -> the session's main conversation as last routed here.
        self._conversations: Recent[tuple[str, str], Conversation] = Recent(
            MAX_REMEMBERED_SESSIONS)
        # content id of an opening -> {session: conversation} of the conversations that opened so
        self._openings: Recent[str, dict[str, Conversation]] = Recent(MAX_REMEMBERED_SESSIONS)
        # (upstream, session) -> requests of the session running in this process
        self._running: dict[tuple[str, str], int] = {}
        # upstream -> routed requests of this process not yet ended (the pool's load)
        self._in_flight: dict[str, int] = {}
        self._turn = 0  # round-robin placement
        self.habits = Habits()  # what earlier conversations of each system prompt did (#23)
        for url in config.upstreams:
            self.upstream(url)

    def adopt(self, old: Router) -> None:
        """An option changed and a new router replaces `old`: keep what it knew (upstream
        props and the sessions it saw), not only what the state file says (fault 6)."""
        with old._mutex:
            upstreams = dict(old._upstreams)
        for url, info in upstreams.items():
            mine = self.upstream(url)
            mine.props, mine.checked, mine.suspect = info.props, info.checked, True
            mine.healthy = info.healthy
            mine.last_seen.update(info.last_seen)
            mine.usage_written.update(info.usage_written)
        self._conversations.update(old._conversations)
        self._openings.update(old._openings)

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

    def note_answer(self, url: str, status: int) -> None:
        """A routed request got its answer. A 200 shows the server up (the health watcher
        need not ask it this round); a 503 is what llama-server answers while it loads a
        model, after a restart: verify its slots before trusting them."""
        info = self._upstreams.get(url)
        if info is None:
            return
        if status == 200:
            info.answered_at = time.monotonic()
        elif status == 503:
            info.suspect = True

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
            for line in policy.advice(url=url, total_slots=props.total_slots,
                                      slots_readable=slots is not None):
                log.warning(line)
        info.props, info.checked, info.suspect = props, True, False
        info.client.slot_actions_disabled = False  # a restarted server may have the flag now
        cleared: list[int] = []

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
                    if not restarted:
                        cleared.append(slot_id)
            return dropped

        if self.state.update(reconcile):
            log.info("%s: slots lost their KV (server restarted?): sessions will be restored", url)
        if cleared and not info.cleared_warned:
            info.cleared_warned = True
            log.warning("%s: slot(s) %s lost their session's KV while the same server kept "
                        "running: idle slots are being cleared (--cache-idle-slots with the "
                        "automatic slot count?); start llama-server with an explicit -np N",
                        url, cleared)

    # ---- conversations (policy decides, the router remembers) -------------------------------

    def _resolve(self, url: str, ident: Identity) -> Identity:
        """A content-identified request continues the conversation it extends, or forks a
        session of its own (fault 5). Known conversations: this process's memory, and the
        claims in the state file (other processes, or before a restart)."""
        if ident.rule != "content" or not ident.chain:
            return ident
        known: dict[str, Conversation] = {}
        doc = self.state.read()
        for up_url in self.config.upstreams or (url,):
            up = doc.upstreams.get(up_url)
            for rec in up.slots.values() if up else ():
                if rec.chain_head and _opening_of(rec.owner) == ident.session_id:
                    known[rec.owner] = Conversation(rec.system_key or None, rec.chain_length,
                                                    rec.chain_head, rec.chars)
        known.update(self._openings.get(ident.session_id, {}))
        session = policy.resolve_content(ident.session_id, ident.chain, known)
        if session == ident.session_id:
            return ident
        return _with_session(ident, session)

    def _conversation_of(self, url: str, session: str,
                         rec: SlotRecord | None) -> Conversation | None:
        remembered = self._conversations.get((url, session))
        if remembered is not None:
            return remembered
        if rec is not None and rec.owner == session and rec.chain_head:
            return Conversation(rec.system_key or None, rec.chain_length, rec.chain_head,
                                rec.chars)
        return None

    def _kind(self, url: str, ident: Identity, rec: SlotRecord | None, running: int) -> str:
        return policy.classify(
            chain=ident.chain, system_key=ident.seed_key, prompt_chars=ident.prompt_chars,
            small_request_chars=self.config.small_request_chars,
            resident=self._conversation_of(url, ident.session_id, rec),
            own_request_running=running > 0)

    def _enter(self, url: str, session: str) -> int:
        """Count a request of the session as running from the moment its routing starts (so
        a second request that arrives during the first one's handover sees it); returns how
        many were running before."""
        key = (url, session)
        with self._mutex:
            before = self._running.get(key, 0)
            self._running[key] = before + 1
        return before

    def _leave(self, url: str, session: str) -> None:
        with self._mutex:
            _count_down(self._running, (url, session))

    def _remember(self, url: str, session: str, ident: Identity) -> Conversation:
        """The session's main conversation is now this request's."""
        conversation = Conversation.of(ident.chain, ident.seed_key, ident.prompt_chars)
        self._conversations[(url, session)] = conversation
        if ident.rule == "content" and ident.chain:
            opening = _opening_of(session)
            forks = self._openings.get(opening) or {}
            forks[session] = conversation
            while len(forks) > MAX_FORKS_PER_OPENING:
                forks.pop(next(iter(forks)))
            self._openings[opening] = forks
        return conversation

    def _begin(self, route: Route, ident: Identity) -> Route:
        """Called with the request already counted as running (_enter): a route that runs on
        the session's own slot stays counted until its lease is released; any other stops
        counting now."""
        url = route.upstream
        with self._mutex:
            self._in_flight[url] = self._in_flight.get(url, 0) + 1
        route._on_release.append(lambda: self._request_ended(url))
        if route.action not in OWNING:
            self._leave(route.upstream, route.session)
            return route
        route.conversation = self._remember(route.upstream, route.session, ident)
        route._on_release.append(lambda: self._leave(route.upstream, route.session))
        talk = _talk_of(route.rule, route.session)
        self.habits.saw(ident.seed_key, talk, route.session,
                        ident.chain[-1] if ident.chain else "")
        route._on_release.append(lambda: self.habits.ended(ident.seed_key, talk))
        return route

    def _request_ended(self, url: str) -> None:
        with self._mutex:
            _count_down(self._in_flight, url)

    def in_flight(self, url: str) -> int:
        return self._in_flight.get(url, 0)

    # ---- the pool (issue #13): which server a request goes to -------------------------------

    @property
    def pooled(self) -> bool:
        return bool(self.config.upstreams)

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
        return self.upstream(url).healthy and not (up is not None and up.draining)

    def sticky_upstream(self, session: str) -> str | None:
        """For the fast path: the session's server when a kept request may go there without
        asking any server (resident there, placeable, not saturated by this process's own
        requests); None: take the slow path, which places it."""
        doc = self.state.read()
        url = self.home_of(session, doc)
        if url is None or not self.placeable(url, doc):
            return None
        info = self._upstreams.get(url)
        slots = info.props.total_slots if info is not None and info.props else 0
        if (self.config.placement != placing.COST
                or self.in_flight(url) >= max(slots, 1)):
            return None
        return url

    def any_upstream(self) -> str | None:
        """A server for a request that is not placed (listings, /props, /tokenize): the
        first placeable one."""
        doc = self.state.read()
        return next((url for url in self.config.upstreams if self.placeable(url, doc)), None)

    def set_health(self, url: str, healthy: bool) -> bool:
        """The health watcher's verdict; True when it changed. A server that comes back may
        have restarted: its slots are verified before the next request trusts them."""
        info = self.upstream(url)
        changed = info.healthy != healthy
        info.healthy = healthy
        if not healthy or changed:
            info.suspect = True
        return changed

    def place(self, ident: Identity) -> placing.Placement:
        """Gather each pool server's view and let placing.place decide. Blocking."""
        session = ident.session_id
        # A request of the session still running in this process: the others go where it is,
        # so the side-request rules of one server apply (never two servers for one session).
        for (url, running_session), count in list(self._running.items()):
            if running_session == session and count > 0 and url in self.config.upstreams \
                    and self.placeable(url):
                return placing.Placement(url, placing.STAY)
        views = self._pool_views(ident)
        prompt = max([placing.estimate_tokens(ident.prompt_chars)]
                     + [v.reuse for v in views])
        with self._mutex:
            turn = self._turn
            self._turn += 1
        chosen = placing.place(views, prompt, self.config.placement, self.config.weights,
                                 turn)
        if chosen is None:
            raise NoUpstream("every server of the pool is down or draining")
        return chosen

    def _pool_views(self, ident: Identity) -> list[placing.ServerView]:
        session = ident.session_id
        doc = self.state.read()
        folder = self.folder
        snapshot = folder.read_meta(session) if folder is not None else None
        seed = (folder.read_meta(seed_id(ident.seed_key))
                if folder is not None and ident.seed_key else None)
        now = self.clock()
        views = []
        for url in self.config.upstreams:
            info = self.upstream(url)
            up_rec = doc.upstreams.get(url)
            draining = up_rec is not None and up_rec.draining
            healthy = info.healthy
            if healthy and (info.suspect or not info.checked):
                self._verify(url, info)
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
                        self.set_health(url, False)
                        log.info("%s: not answering: taken out of the pool", url)
                else:
                    claims = up_rec.claims() if up_rec is not None else {}
                    total = len(slots) or total
                    busy = sum(1 for s in slots if s.is_processing)
                    free = sum(1 for s in slots if not s.is_processing
                               and choice.is_abandoned(claims.get(s.id), now, self.config.ttl))
                    live_tokens = _tokens_in(slots, slot) if slot is not None else 0
            resident = (healthy and slot is not None and up_rec is not None
                        and not up_rec.slots[slot].stale)
            pending = (healthy and not resident and slot is not None and up_rec is not None
                       and self._handover_in_progress(url, slot, up_rec.slots[slot], now))
            reuse = 0
            if resident:
                reuse = max(up_rec.slots[slot].tokens, live_tokens)
            elif props is not None:
                for meta in (snapshot, seed):
                    if (meta is not None and meta.fingerprint == props.fingerprint
                            and meta.n_tokens <= props.n_ctx):
                        reuse = max(reuse, meta.n_tokens)
            views.append(placing.ServerView(
                url=url, up=healthy, draining=draining, slots=max(total, 1), busy=busy,
                in_flight=self.in_flight(url), free=free, reuse=reuse, resident=resident,
                pending=pending))
        return views

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
        info = self.upstream(url)
        saved = 0
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
            if lease is not None and not rec.stale:
                if info.props is None:
                    self._verify(url, info)
                try:
                    live = _tokens_in(info.client.slots(), slot)
                except SlotsUnavailable:
                    live = 0
                seen = info.last_seen.get(session)
                tokens = max(rec.tokens, live, seen.tokens if seen else 0)
                if self._save_if_worth(url, info, slot, rec, tokens):
                    saved = max(tokens, rec.saved_tokens)

            def drop(doc: StateDoc) -> None:
                cur = doc.upstream(url).slots.get(slot)
                if cur is not None and cur.owner == session:
                    del doc.upstream(url).slots[slot]

            self.state.update(drop)
            self._conversations.pop((url, session), None)
            return saved
        finally:
            if lease is not None:
                lease.release()

    def set_draining(self, url: str, draining: bool) -> None:
        def change(doc: StateDoc) -> None:
            doc.upstream(url).draining = draining

        self.state.update(change)

    # ---- the fast path ---------------------------------------------------------------------

    def try_keep(self, url: str, ident: Identity) -> Route | None:
        """A session that owns its slot keeps it: a stat of the state file and a non-blocking
        shared flock, no network. None means: take the slow path."""
        started = time.monotonic()
        info = self._upstreams.get(url)
        if info is None or info.suspect:
            return None
        ident = self._resolve(url, ident)
        doc = self.state.read()
        slot = _resident_slot(doc, url, ident.session_id)
        if slot is None:
            return None
        with ExitStack() as stack:
            running = self._enter(url, ident.session_id)
            stack.callback(self._leave, url, ident.session_id)
            if self._kind(url, ident, doc.upstreams[url].slots[slot], running) != policy.MAIN:
                return None
            lease = self.locks.try_acquire(url, slot, exclusive=False)
            if lease is None:
                return None
            stack.enter_context(lease)
            # Re-check under the lock: a handover elsewhere may have claimed the slot meanwhile.
            if _resident_slot(self.state.read(), url, ident.session_id) != slot:
                return None
            route = Route(url, ident.session_id, ident.rule, slot, KEPT, lease=lease,
                          messages=ident.message_count, seed_key=ident.seed_key,
                          ms=(time.monotonic() - started) * 1000)
            stack.pop_all()
            return self._begin(route, ident)

    # ---- the slow path (worker thread) -----------------------------------------------------

    def route(self, url: str, ident: Identity, client_slot: int | None = None,
              path: str = "", body: dict | None = None) -> Route:
        started = time.monotonic()
        ident = self._resolve(url, ident)
        reserved: list[str] = []
        try:
            return self._placed_route(url, ident, client_slot, path, body, started, reserved)
        finally:
            for held in reserved:
                self._reserve(held, -1)

    def _reserve(self, url: str, delta: int) -> None:
        with self._mutex:
            self._in_flight[url] = self._in_flight.get(url, 0) + delta
            if self._in_flight[url] <= 0:
                self._in_flight.pop(url, None)

    def _placed_route(self, url: str, ident: Identity, client_slot: int | None, path: str,
                      body: dict | None, started: float, reserved: list[str]) -> Route:
        if not self.pooled:
            return self._place_and_walk(url, ident, client_slot, path, body, started, reserved)
        with self.placing(ident.session_id):
            return self._place_and_walk(url, ident, client_slot, path, body, started, reserved)

    @contextmanager
    def placing(self, session: str) -> Iterator[None]:
        """One placement of a session at a time, in every process: from reading the pool's
        views until its claim is written, so a second request of a new session sees where
        the first one went (pending or resident there) and follows it. A lock that stays
        taken past lock_timeout is passed by (logged): the claim checks in `_claim` still
        refuse a second server while the first is live."""
        lease = self.locks.placement(session, self.config.lock_timeout)
        if lease is None:
            log.warning("%s: placement lock still held after %.0f s; placing without it",
                        session, self.config.lock_timeout)
        try:
            yield
        finally:
            if lease is not None:
                lease.release()

    def _place_and_walk(self, url: str, ident: Identity, client_slot: int | None, path: str,
                        body: dict | None, started: float, reserved: list[str]) -> Route:
        chosen = None
        for _attempt in range(3):
            if self.pooled:
                chosen = self.place(ident)
                url = chosen.url
                # Counted as in flight from now on, so requests placed at the same moment see
                # it (the route, once made, counts itself; this reservation then ends).
                self._reserve(url, +1)
                reserved.append(url)
                home = self.home_of(ident.session_id)
                leaving = chosen.leaving or (home if home not in (None, url) else None)
                if leaving is not None:
                    # The cost policy carries the session's KV along (saved there, restored
                    # here); the baselines place as a KV-blind balancer would, so only what an
                    # idle save wrote before is there to restore.
                    self.evacuate(leaving, ident.session_id, self.config.lock_timeout,
                                  save=self.config.placement == placing.COST)
            running = self._enter(url, ident.session_id)
            try:
                route = self._walk(url, ident, client_slot, path, body, running)
            except ClaimedElsewhere:
                self._leave(url, ident.session_id)
                continue
            except BaseException:
                self._leave(url, ident.session_id)
                raise
            break
        else:
            raise NoUpstream("the session's placement kept changing under other processes")
        if chosen is not None:
            route.placement = chosen.reason
            log.info("%s placed on %s (%s)", ident.session_id, url, chosen.reason)
        route.messages = ident.message_count
        route.seed_key = ident.seed_key
        if (route.action in (ASSIGNED, RESTORED) and body is not None and self.seeds is not None
                and ident.system_chars >= self.config.seed_min_chars):
            route.seed_source = (path, body)
        route.ms = (time.monotonic() - started) * 1000
        return self._begin(route, ident)

    def _walk(self, url: str, ident: Identity, client_slot: int | None, path: str,
              body: dict | None, running: int) -> Route:
        info = self.upstream(url)
        if info.suspect or not info.checked:
            self._verify(url, info)
        if client_slot is not None:
            route = self._route_client(url, info, ident, client_slot)
        else:
            try:
                slots = info.client.slots()
            except SlotsUnavailable as e:
                route = self._fallback(url, info, ident, str(e), self.config.lock_timeout)
            else:
                up = self.state.read().upstreams.get(url)
                owned = up.slot_of(ident.session_id) if up else None
                kind = self._kind(url, ident, up.slots[owned] if owned is not None else None,
                                  running)
                if kind == policy.SIDE:
                    return self._route_side(url, info, ident, slots)
                if owned is None and self.habits.is_one_off(
                        system_key=ident.seed_key, opening=_talk_of(ident.rule, ident.session_id),
                        session_id=ident.session_id):
                    self._drop_leftovers(url, ident.seed_key)
                    return self._route_side(url, info, ident, slots, "one-off")
                # Remembered before the handover: a request of the session arriving meanwhile
                # must be judged against this conversation.
                self._remember(url, ident.session_id, ident)
                route = self._route_session(url, info, ident, slots, path, body,
                                            move=kind == policy.MOVE)
        return route

    def _fallback(self, url: str, info: UpstreamInfo, ident: Identity, why: str,
                  wait: float) -> Route:
        """/slots unusable (or no slot could be had): a stable hash of the session over the
        slot count, under that slot's lease like any other request on a slot."""
        count = (info.props.total_slots if info.props else 0) or self.config.slot_count
        slot = choice.fallback_slot(ident.session_id, count)
        metrics.fallback(why)
        if slot is None:
            # The server picks the slot: any claim may be overwritten, so none is trusted.
            self._mark_all_stale(url)
            return Route(url, ident.session_id, ident.rule, None, UNPINNED,
                         detail=f"{why}; slot count unknown")
        return self._take_unclaimed(url, info, ident, slot, FALLBACK,
                                    f"{why}; hashed over {count} slots", wait)

    def _route_client(self, url: str, info: UpstreamInfo, ident: Identity,
                      slot: int) -> Route:
        """The client chose id_slot: it runs there whatever we say, so it takes the slot's
        lease (waiting for the request on it) and the slot's owner is saved first and marked
        stale, so a later handover never saves the client's KV as the owner's snapshot."""
        return self._take_unclaimed(url, info, ident, slot, CLIENT,
                                    "id_slot chosen by the client", self.config.lock_timeout)

    def _take_unclaimed(self, url: str, info: UpstreamInfo, ident: Identity, slot: int,
                        action: str, detail: str, wait: float) -> Route:
        """A request that runs on `slot` without claiming it (fallback, client-pinned): it
        holds the slot's lease, and the slot's owner is saved first and marked stale."""
        lease = self.locks.acquire(url, slot, exclusive=True, timeout=wait)
        with ExitStack() as stack:
            if lease is None:
                detail += "; slot stayed busy, forwarded without its lease"
                self._displace(url, info, slot, ident.session_id, 0, save=False)
            else:
                stack.enter_context(lease)
                note = self._displace(url, info, slot, ident.session_id, 0)
                detail += f"; {note}" if note else ""
            route = Route(url, ident.session_id, ident.rule, slot, action, detail=detail,
                          lease=lease)
            stack.pop_all()
            return route

    def _route_session(self, url: str, info: UpstreamInfo, ident: Identity,
                       slots: list[SlotView], path: str, body: dict | None,
                       move: bool = False) -> Route:
        session = ident.session_id
        live_ids = {s.id for s in slots}
        for _attempt in range(5):
            doc = self.state.read()
            up = doc.upstreams.get(url)
            owned = up.slot_of(session) if up else None
            if owned is not None and owned in live_ids and not move:
                rec = up.slots[owned]
                lease = self.locks.acquire(url, owned, exclusive=rec.stale,
                                           timeout=self.config.lock_timeout)
                if lease is None:
                    break
                with ExitStack() as stack:
                    stack.enter_context(lease)
                    current = self.state.read().upstreams.get(url)
                    if current is None or current.slot_of(session) != owned:
                        continue
                    if not current.slots[owned].stale:
                        route = Route(url, session, ident.rule, owned, KEPT, lease=lease)
                    elif not lease.exclusive:
                        continue
                    else:
                        route = self._handover(url, info, ident, owned, lease, previous=None,
                                               live_tokens=0, path=path, body=body)
                    stack.pop_all()
                    return route
            claims = up.claims() if up else {}
            ranking = choice.rank_slots(slots, claims, self.clock(), self.config.ttl)
            if move and owned is not None:
                ranking = [s for s in ranking if s != owned] or ranking
            if not ranking:
                return self._fallback(url, info, ident, "server reports no slots",
                                      self.config.lock_timeout)
            lease, slot = self._lock_first_free(url, ranking)
            if lease is None:
                break
            with ExitStack() as stack:
                stack.enter_context(lease)
                claimed = self._claim(url, slot, ident, expected=claims.get(slot),
                                      live_ids=live_ids, move=move)
                if claimed is None:
                    continue
                route = self._handover(url, info, ident, slot, lease, previous=claimed[0],
                                       live_tokens=_tokens_in(slots, slot), path=path, body=body)
                if move:
                    route.detail = "; ".join(filter(None, [
                        "moved off the slot running the session's other request", route.detail]))
                stack.pop_all()
                return route
        return self._fallback(url, info, ident, "no slot could be locked in time", 0.0)

    def _lock_first_free(self, url: str, ranking: list[int]) -> tuple[SlotLease | None, int]:
        for slot in ranking:
            lease = self.locks.try_acquire(url, slot, exclusive=True)
            if lease is not None:
                return lease, slot
        best = ranking[0]
        return self.locks.acquire(url, best, True, self.config.lock_timeout), best

    def _claim(self, url: str, slot: int, ident: Identity, expected: choice.Claim | None,
               live_ids: set[int], move: bool = False) -> tuple[SlotRecord | None] | None:
        """Write the claim. Refuse (None) when the slot was claimed by a live session after we
        ranked it, or when this session got a slot elsewhere meanwhile: the caller re-ranks.
        `move`: the session leaves its other slot (running its other request) for this one."""
        now = self.clock()
        live_elsewhere = {u for u in self.config.upstreams if u != url and self.placeable(u)}

        def change(doc: StateDoc) -> tuple[SlotRecord | None] | None:
            if self.pooled:
                # Never one session on two servers: a claim on another live server of the pool
                # means another process placed it there meanwhile (place again: it stays
                # there); one on a server that is down, draining or gone is dropped (its
                # snapshot is restored here).
                for other_url, other_up in doc.upstreams.items():
                    held = other_up.slot_of(ident.session_id) if other_url != url else None
                    if held is None:
                        continue
                    if other_url in live_elsewhere:
                        return "elsewhere"
                    del other_up.slots[held]
            up = doc.upstream(url)
            other = up.slot_of(ident.session_id)
            if other is not None and other != slot:
                if other in live_ids and not move:
                    return None
                del up.slots[other]  # a slot the server no longer has, or the one we leave
            previous = up.slots.get(slot)
            if previous is not None and previous.claim() != expected and not choice.is_abandoned(
                previous.claim(), now, self.config.ttl
            ) and previous.owner != ident.session_id:
                return None
            up.slots[slot] = SlotRecord(owner=ident.session_id, claimed=now, last_used=now,
                                        stale=True, messages=ident.message_count,
                                        **_conversation_fields(ident))
            return (previous,)

        claimed = self.state.update(change)
        if claimed == "elsewhere":
            raise ClaimedElsewhere(ident.session_id)
        return claimed

    def _route_side(self, url: str, info: UpstreamInfo, ident: Identity,
                    slots: list[SlotView], why: str = "side request") -> Route:
        """A side request (a small prompt, or not the session's conversation) goes to the best
        slot without claiming it, and never to its own session's slot while another is free.
        If that slot belongs to a session, its KV is saved first (when it is worth it) and the
        claim is marked stale, so the owner is restored on its next request."""
        doc = self.state.read()
        up = doc.upstreams.get(url)
        claims = up.claims() if up else {}
        ranking = choice.rank_slots(slots, claims, self.clock(), self.config.ttl)
        own = up.slot_of(ident.session_id) if up else None
        ranking = [s for s in ranking if s != own] or ranking
        ranking = policy.order_for_side(ranking, _side_costs(slots, up))
        if not ranking:
            return self._fallback(url, info, ident, "server reports no slots",
                                  self.config.lock_timeout)
        lease, slot = self._lock_first_free(url, ranking)
        if lease is None:
            self._mark_all_stale(url)
            return Route(url, ident.session_id, ident.rule, None, UNPINNED,
                         detail=f"{why}; every slot busy")
        with ExitStack() as stack:
            stack.enter_context(lease)
            detail = f"{why}, slot not claimed"
            note = self._displace(url, info, slot, None, _tokens_in(slots, slot))
            detail += f"; {note}" if note else ""
            route = Route(url, ident.session_id, ident.rule, slot, SIDE, detail=detail,
                          lease=lease)
            stack.pop_all()
            return route

    def _drop_leftovers(self, url: str, seed_key: str | None) -> None:
        """Issue #23: the system prompt turned out to be one of one-offs. What its earlier
        requests left before that was known (their snapshots, their seed, their claims) will
        never be restored: removed now, not when the disk budget is full."""
        sessions = self.habits.leftovers(seed_key)
        if not sessions:
            return
        if self.snapshots is not None:
            for snapshot in [*sessions, seed_id(seed_key)]:
                meta = self.snapshots.folder.read_meta(snapshot)
                if meta is not None and self.snapshots.delete(snapshot):
                    log.info("removed %s: its system prompt's requests are one-offs", snapshot)
        gone = set(sessions)

        def drop(doc: StateDoc) -> bool:
            up = doc.upstream(url)
            mine = [slot for slot, rec in up.slots.items() if rec.owner in gone]
            for slot in mine:
                del up.slots[slot]
            return bool(mine)

        if self.state.update(drop):
            log.info("released the slots of one-offs %s", ", ".join(sorted(gone)))

    def _displace(self, url: str, info: UpstreamInfo, slot: int, session: str | None,
                  live_tokens: int, save: bool = True) -> str:
        """A request that is not the owner's is about to run on `slot`: save the owner's KV
        if it is worth it (we hold the slot's lease) and mark its claim stale, so nothing
        later takes the slot's new content for the owner's. "" when nobody was displaced."""
        current = self.state.read().upstreams.get(url)
        rec = current.slots.get(slot) if current else None
        if rec is None or rec.stale or rec.owner == session:
            return ""
        saved = save and self._save_if_worth(url, info, slot, rec, live_tokens)
        metrics.eviction("side", saved)
        self._mark_stale(url, slot, rec.owner)
        return f"{rec.owner} will be restored" if saved else f"displaced {rec.owner}"

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
        snapshots, props = self.snapshots, info.props
        if snapshots is not None and props is not None:
            restored = snapshots.restore(info.client, props, slot, session, ident.message_count,
                                         notes)
            action = RESTORED if restored else ASSIGNED
            if not restored and ident.seed_key is not None:
                restored = snapshots.restore(info.client, props, slot, seed_id(ident.seed_key),
                                             ident.message_count, notes, what="seed")
                action = SEEDED if restored else ASSIGNED
        if not restored and self.config.erase_on_handover:
            try:
                with metrics.timed("erase"):
                    info.client.erase(slot)
            except UpstreamError as e:
                notes.append(f"erase failed ({e})")
        if info.client.slot_actions_disabled:
            log.warning("%s: llama-server answers save/restore/erase with 501: start it with "
                        "--slot-save-path set to slotkeeper_slot_dir; sessions are pinned but "
                        "not saved", url)
        self._mark_fresh(url, slot, session, restored)
        return Route(url, session, ident.rule, slot, action, detail="; ".join(notes),
                     lease=lease, restored_tokens=restored)

    def _save_if_worth(self, url: str, info: UpstreamInfo, slot: int, rec: SlotRecord,
                       live_tokens: int) -> bool:
        """Save a slot's KV as its owner's snapshot if it is big enough to be worth a file
        and holds more than the last snapshot. `live_tokens` is the slot's prompt size from
        /slots (exact); rec.tokens may lag by a couple of seconds (coalesced writes), so the
        larger of the two decides. True when an up-to-date snapshot exists afterwards. The
        caller holds the slot lock."""
        if self.snapshots is None or info.props is None:
            return False
        tokens = max(rec.tokens, live_tokens)
        if tokens < self.config.min_save_tokens:
            return False
        if not policy.worth_saving(tokens, rec.saved_tokens, self.config.min_save_tokens):
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

    def _mark_all_stale(self, url: str) -> None:
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

    # ---- after the response ----------------------------------------------------------------

    def finish(self, route: Route, timings: Timings | None) -> str:
        """Verify which slot ran the request, record use (coalesced to one write per session
        every couple of seconds), count a restore that was not reused, release the slot
        lock. Returns the verification ("" when there was nothing to verify). Blocking:
        worker thread."""
        try:
            verdict = self._verify_route(route, timings)
            if not verdict.startswith(policy.MISMATCH):
                self._record(route, timings)
                self._seed_afterwards(route, timings)
            return verdict
        finally:
            route.release()

    def finish_quick(self, route: Route, timings: Timings | None) -> str | None:
        """`finish` on the event loop for the common case, without a thread hop: a kept
        request that reused its slot's prefix (verified by reuse), with no state write due and
        no save due. Only memory, a stat of the state file and the lease's release, none of
        which blocks. None: the rest needs the worker (`finish`)."""
        if route.action != KEPT or route.slot is None or timings is None:
            return None
        info = self._upstreams.get(route.upstream)
        if info is None:
            return None
        seen = info.last_seen.get(route.session)
        if policy.needs_slot_check(expected_prefix=seen.tokens if seen else 0,
                                   cache_n=timings.cache_n):
            return None
        now = self.clock()
        if now - info.usage_written.get(route.session, 0.0) >= self.config.usage_write_interval:
            return None
        tokens = timings.prompt_tokens + max(timings.predicted_n - 1, 0)
        if self._grew_enough(route, tokens):
            return None
        info.last_seen[route.session] = Seen(now, tokens, route.messages)
        route.release()
        return policy.BY_REUSE

    def _verify_route(self, route: Route, timings: Timings | None) -> str:
        """Did llama-server run the request on the pinned slot? Checked while the route still
        holds the slot's lease (no other routed request ran there since). On a mismatch the
        state is corrected: neither the pinned slot nor the one that ran the request holds
        what the state said, so both claims go stale and nothing is saved from them."""
        if (route.slot is None or timings is None
                or route.action in (CLIENT, FALLBACK, UNPINNED)):
            return ""
        info = self.upstream(route.upstream)
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
        tokens_after = timings.prompt_tokens + max(timings.predicted_n - 1, 0)
        verdict, ran_on = policy.verify_slot(
            route.slot, tokens_after, [(s.id, s.n_tokens, s.is_processing) for s in slots])
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
                self._mark_stale(route.upstream, slot, rec.owner)
        return f"{policy.MISMATCH}: ran on slot {ran_on}"

    def _record(self, route: Route, timings: Timings | None) -> None:
        if route.slot is None or route.action not in OWNING:
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

    def _seed_afterwards(self, route: Route, timings: Timings | None) -> None:
        """Issue #23: a seed is never built on a request's path. After the answer of a
        conversation that holds its slot exclusively (a handover), if a second conversation
        uses its system prompt and no seed exists: save the session (if it grew), cut the
        slot to the system prefix (the server reuses it: one token evaluated), save that as
        the seed, restore the session. Measured in DESIGN ("Seeds, taken afterwards")."""
        source, lease = route.seed_source, route.lease
        if (source is None or timings is None or lease is None or not lease.exclusive
                or self.seeds is None or route.slot is None or route.action not in OWNING):
            return
        info = self.upstream(route.upstream)
        props, key = info.props, route.seed_key
        if props is None or info.client.slot_actions_disabled or not self.habits.seed_wanted(
                key, ending=_talk_of(route.rule, route.session)):
            return
        if not self.seeds.wants(props, key):
            return
        up = self.state.read().upstreams.get(route.upstream)
        rec = up.slots.get(route.slot) if up is not None else None
        tokens = timings.prompt_tokens + max(timings.predicted_n - 1, 0)
        if (rec is None or rec.owner != route.session or rec.stale
                or not self._save_if_worth(route.upstream, info, route.slot, rec, tokens)):
            return  # the session's KV could not be kept: never cut it
        started = time.monotonic()
        taken = self.seeds.take_afterwards(info.client, props, route.slot, key, *source,
                                           route.session, route.messages)
        if taken.seed_tokens:  # tokens the server prefilled for it: 1 when it cut the slot
            metrics.seed_built(taken.evaluated, time.monotonic() - started)
        if taken.restored == 0:
            self._mark_stale(route.upstream, route.slot, route.session)

    def _check_reuse(self, route: Route, timings: Timings) -> None:
        """A restored snapshot (or seed) the server did not reuse is a miss: its tokens were not
        a prefix of the prompt. Two misses retire it (slotfiles)."""
        if self.snapshots is None or timings.cache_n >= route.restored_tokens // 2:
            return
        snapshot = route.session
        if route.action == SEEDED and route.seed_key is not None:
            snapshot = seed_id(route.seed_key)
        misses = self.snapshots.record_miss(snapshot)
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
        if self.snapshots is None or tokens is None:
            return False
        doc = self.state.read().upstreams.get(route.upstream)
        rec = doc.slots.get(route.slot) if doc else None
        if rec is None or rec.owner != route.session or rec.stale:
            return False
        return policy.grew_enough(tokens, rec.saved_tokens, self.config.min_save_tokens,
                                  self.config.save_every_tokens)

    # ---- background saves --------------------------------------------------------------------

    def save_if_idle(self, url: str, session: str, ended: float) -> bool:
        """Called a few seconds after a request ended: if the session has not been back since,
        save what it grew, so a llama-server that dies without warning loses nothing that
        finished. Skips quietly when the slot is busy or no longer the session's."""
        info = self._upstreams.get(url)
        if info is None or self.snapshots is None:
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
        if self.snapshots is None or info.props is None or tokens < self.config.min_save_tokens:
            return False
        slot = _resident_slot(self.state.read(), url, session)
        if slot is None or self.state.read().upstreams[url].slots[slot].saved_tokens >= tokens:
            return False
        lease = self.locks.acquire(url, slot, exclusive=False, timeout=lock_timeout)
        if lease is None:
            return False
        with lease:
            if _resident_slot(self.state.read(), url, session) != slot:
                return False
            rec = self.state.read().upstreams[url].slots[slot]
            return self.save_slot(url, info, slot, session,
                                  info.messages_of(session, rec.messages)) > 0


def _count_down(counts: dict[K, int], key: K) -> None:
    """One less of `key` running; a count that reaches 0 leaves the dict (it stays bounded)."""
    left = counts.get(key, 1) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


def _resident_slot(doc: StateDoc, url: str, session: str) -> int | None:
    up = doc.upstreams.get(url)
    if up is None:
        return None
    slot = up.slot_of(session)
    if slot is None or up.slots[slot].stale:
        return None
    return slot


def _side_costs(slots: list[SlotView], up) -> dict[int, tuple[bool, int]]:
    """What running a request that claims nothing on each slot costs (policy.order_for_side):
    busy or not, and FREE (nobody's KV), CURRENT (its owner's snapshot holds what the slot
    holds: the owner pays one restore) or SAVE (its owner must be saved first)."""
    costs = {}
    for view in slots:
        rec = up.slots.get(view.id) if up is not None else None
        if rec is None or rec.stale:
            cost = policy.FREE
        elif rec.saved_tokens >= max(rec.tokens, view.n_tokens):
            cost = policy.CURRENT
        else:
            cost = policy.SAVE
        costs[view.id] = (view.is_processing, cost)
    return costs


def _tokens_in(slots: list[SlotView], slot: int) -> int:
    return next((s.n_tokens for s in slots if s.id == slot), 0)


def _talk_of(rule: str, session: str) -> str:
    """The conversation a session belongs to for habits: a content id's forks are one."""
    return _opening_of(session) if rule == "content" else session


def _opening_of(session: str) -> str:
    """The content id a (possibly forked) content session opened under."""
    return session.split(".", 1)[0]


def _with_session(ident: Identity, session: str) -> Identity:
    from dataclasses import replace
    return replace(ident, session_id=session)


def _conversation_fields(ident: Identity) -> dict:
    conversation = Conversation.of(ident.chain, ident.seed_key, ident.prompt_chars)
    return {"system_key": conversation.system_key or "", "chain_length": conversation.length,
            "chain_head": conversation.head, "chars": conversation.chars}
