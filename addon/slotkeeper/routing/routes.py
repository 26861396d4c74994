"""What every room of the router shares: how a request was routed (the outcome names), the
Route it gets (with the one release that ends its lifecycle), the router's configuration, and
the running counts. No I/O and no decisions here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from ..decisions.placement import COST, Weights
from ..decisions.policy import Conversation
from ..store.locks import SlotLease
from ..store.state import StateDoc

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

K = TypeVar("K")

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
    stall_budget: float = 0.5  # seconds a save that can wait may stall other slots' streams
    # the servers' --cache-ram as slotkeeper counts on it (0: not at all; -1: no limit)
    ram_cache_bytes: float = 8192 * 2**20
    slot_similarity: float = 0.1  # the servers' --slot-prompt-similarity as counted on
    write_budget: float = 8192 * 2**20  # bytes an hour saves that can wait may write (0: any)
    seed_min_chars: int = 2000  # system prompts (plus tools) at least this long get a seed
    max_seeds: int = 8
    # idle timers run (idle saves on): a seed can wait for a quiet server (firstturns)
    idle_work: bool = True
    # Several llama-servers behind one address (issue #13): their base URLs, in order. Empty:
    # each flow's own upstream, as one reverse mode gives it.
    upstreams: tuple[str, ...] = ()
    placement: str = COST
    weights: Weights = field(default_factory=Weights)
    api_key: str = ""  # llama-server's --api-key, sent on slotkeeper's own calls (issue #21)


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
    sent_at: float = float("-inf")  # the router's clock when it was sent on
    messages: int = 0
    seed_key: str | None = None
    seed_source: tuple[str, dict] | None = None  # (path, body): a seed may be taken afterwards
    conversation: Conversation | None = None  # what the slot holds for the session afterwards
    placement: str = ""  # pool only: why this server (placement.STAY, CHEAPEST, ...)
    final_seen: bool = False  # the answer's final event went to the client
    prefix_from: str = ""  # restored from this session's snapshot, as its prefix (a fork)
    ram_tokens: int = 0  # left to llama-server's RAM cache: the tokens expected back from it
    model: str = ""  # behind a router or llama-swap (issue #22): the model it runs on
    swap_saved: str = ""  # the sessions saved before loading that model unloaded another
    _on_release: list[Callable[[], None]] = field(default_factory=list, repr=False)
    _on_final: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def final_event(self) -> None:
        """The answer's final event is on its way to the client (`done: true`, the event with
        llama-server's timings, `[DONE]`): only bookkeeping is left. Idempotent."""
        if self.final_seen:
            return
        self.final_seen = True
        callbacks, self._on_final = self._on_final, []
        for callback in callbacks:
            callback()

    def on_final(self, callback: Callable[[], None]) -> None:
        """Run `callback` once, when the answer's final event passes (`final_event`)."""
        self._on_final.append(callback)

    def on_release(self, callback: Callable[[], None]) -> None:
        """Run `callback` once, when the route is released."""
        self._on_release.append(callback)

    def release(self) -> None:
        """Idempotent, never blocks: drops the lease and this process's count of the
        session's running requests. The one place a request's hold on its slot ends."""
        if self.lease is not None:
            self.lease.release()
        self._on_final = []  # a final event after the end changes nothing
        callbacks, self._on_release = self._on_release, []
        for callback in callbacks:
            callback()


class NoUpstream(Exception):
    """Every server of the pool is down or draining."""


class ClaimedElsewhere(Exception):
    """Another process placed the session on another live server meanwhile: place again."""


def count_down(counts: dict[K, int], key: K) -> None:
    """One less of `key` running; a count that reaches 0 leaves the dict (it stays bounded)."""
    left = counts.get(key, 1) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


def resident_slot(doc: StateDoc, url: str, session: str) -> int | None:
    """The slot whose KV is still the session's on `url`, if any."""
    up = doc.upstreams.get(url)
    if up is None:
        return None
    slot = up.slot_of(session)
    if slot is None or up.slots[slot].stale:
        return None
    return slot


def tokens_in(slots, slot: int) -> int:
    """A slot's cached tokens in a /slots answer (0 when it is not listed)."""
    return next((s.n_tokens for s in slots if s.id == slot), 0)


def idle_in(slots) -> frozenset[int]:
    """The slots a /slots answer shows idle and holding something."""
    return frozenset(s.id for s in slots if not s.is_processing and s.n_tokens > 0)
