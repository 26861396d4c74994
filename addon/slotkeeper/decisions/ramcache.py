"""llama-server's own RAM prompt cache, as slotkeeper predicts it (issue #31). Pure.

llama-server (b11434, server-context.cpp get_available_slot) keeps a host-memory cache of
prompts (`--cache-ram`, 8192 MiB by default). A request pinned with `id_slot` to an idle slot
that holds something else goes through it when the server's `--slot-prompt-similarity` (sps,
0.1 by default) is not 0 and the request would keep less than half of the slot's tokens
(`f_keep < 0.5`): the slot's prompt is parked in the cache (skipped if the cache already holds
it whole), the cache's best entry for the new prompt is loaded into the slot and leaves the
cache. An empty slot (f_keep = 0/0) and sps 0 never consult it. Entries leave oldest-inserted
first when the size limit is passed.

So behind slotkeeper, handing a slot from session A to a dissimilar session B parks A in RAM
and brings B back from RAM if B was parked before: no file read or written, where a disk
restore of B (which slotkeeper did before this module) overwrites the slot first, so the server
sees a similar prompt and never looks in its cache. This module models what the cache holds
(what slotkeeper's handovers parked, in order, with bytes from the measured bytes a token), says
when a handover will swap, and keeps a trust that answers' `cache_n` confirm or withdraw."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_SPS = 0.1  # llama-server's --slot-prompt-similarity default (common.h)
DEFAULT_LIMIT_BYTES = 8192 * 2**20  # its --cache-ram default, 8192 MiB
KEEP_THRESHOLD = 0.5  # f_keep below this: the server swaps through its cache
LOAD_MIN_KEEP = 0.25  # an entry must keep this share of itself to be loaded ("don't trash")
# A predicted hit counts as one when the answer reused at least this share of the tokens we
# expected back (a few tokens at the end may be re-evaluated, as after a disk restore).
HIT_SHARE = 0.5
# After a miss, this many predicted hits in a row go to the disk instead (each further miss
# doubles it, up to MAX_DISTRUST): the server may run with --cache-ram 0 or -sps 0, restarted,
# or evicted the entry for a reason the model does not see. One later hit restores trust.
FIRST_DISTRUST = 2
MAX_DISTRUST = 64
# A hand-back (routing/ramhandover.py) costs one small completion: 31-59 ms on the test bed,
# the prefill of ~16 of its tokens. It is sent only when it gives back at least that much.
HAND_BACK_MIN_GAIN = 16
# Predicting a swap from characters (`swap_predicted`): each ratio must clear its threshold by
# this much, and the shared part counts this many characters more than its items (the chat
# template's tokens between them, and the start two next messages may have in common).
SWAP_MARGIN = 0.05
SHARED_SLACK_CHARS = 64
# A new conversation loads its parent's entry only if the parent keeps at least this share of
# itself in the load (the server's LOAD_MIN_KEEP, plus a margin for the parent's reply, which
# the estimate from characters does not see).
PREFIX_MIN_KEEP = LOAD_MIN_KEEP + 0.1


def server_swaps(slot_tokens: int, shared_tokens: int, new_tokens: int,
                 sps: float = DEFAULT_SPS) -> bool:
    """Will a request of `new_tokens`, pinned to an idle slot holding `slot_tokens` of which it
    shares the first `shared_tokens`, go through the server's RAM cache? As
    get_available_slot: with sps 0 never; an empty slot never (0/0); the slot's similarity
    lcp/len(new) counts only above sps, and then f_keep = lcp/len(slot) must be below 0.5."""
    if sps <= 0 or slot_tokens <= 0 or new_tokens <= 0:
        return False
    f_sim = shared_tokens / new_tokens
    kept = shared_tokens if f_sim > sps else 0
    return kept / slot_tokens < KEEP_THRESHOLD


def hand_back_pays(entry_tokens: int, kept_tokens: int, snapshot_tokens: int,
                   restore_as_tokens: float = 0.0) -> bool:
    """Hand a slot back to the server's RAM cache before a request whose session the cache
    holds (`entry_tokens`), rather than restore the session's snapshot (`snapshot_tokens`;
    0 when there is none or its restore does not pay) over a slot that holds `kept_tokens` of
    the request already (the system prompt both share)? Yes when what the cache gives back
    beyond the better of the two, plus the restore it spares (`restore_as_tokens`: its
    seconds as tokens of prefill), reaches HAND_BACK_MIN_GAIN."""
    base = max(kept_tokens, snapshot_tokens)
    if entry_tokens < snapshot_tokens:
        return False
    spared = restore_as_tokens if snapshot_tokens > kept_tokens else 0.0
    return entry_tokens - base + spared >= HAND_BACK_MIN_GAIN


def prefix_load_pays(shared_tokens: int, donor_tokens: int, seed_tokens: int) -> bool:
    """Start a new conversation from its idle parent's entry in the server's RAM cache
    (routing/ramhandover.py, `prefix_from_ram`) rather than from the disk: the parent's copy
    there shares `shared_tokens` of the `donor_tokens` it holds, a seed of the system prompt
    `seed_tokens` (0: none). Yes when the server will load it (the parent keeps a large enough
    share of itself: load's "don't trash" rule), it gives back at least HAND_BACK_MIN_GAIN
    tokens and no fewer than the seed's restore would, less that margin: a load in host memory
    beats a read from the disk of the same tokens on every profile."""
    if donor_tokens <= 0 or shared_tokens < HAND_BACK_MIN_GAIN:
        return False
    if shared_tokens / donor_tokens < PREFIX_MIN_KEEP:
        return False
    return shared_tokens + HAND_BACK_MIN_GAIN >= seed_tokens


def swap_predicted(shared_chars: int | None, slot_chars: int, slot_tokens: int,
                   request_chars: int, sps: float = DEFAULT_SPS) -> bool:
    """`server_swaps` as far as slotkeeper can tell without tokenizing, leaning to "no": a
    wrong yes leaves the slot's unsaved tail to a cache the server never gave it, a wrong no
    costs a hand-back call or a restore. `shared_chars`: the leading items (system block,
    messages) the request and the slot's conversation have in common; 0 is next to nothing
    (the chat template's first tokens: under any sps), None unknown (never a swap).
    `slot_chars`: the slot's last prompt without its reply, so f_keep looks larger than it
    is, which leans to "no" too."""
    if shared_chars is None or sps <= 0 or slot_tokens <= 0 or request_chars <= 0:
        return False
    if shared_chars == 0:
        return True
    if slot_chars <= 0:
        return False
    shared = shared_chars + SHARED_SLACK_CHARS
    return (shared / request_chars < sps - SWAP_MARGIN
            or shared / slot_chars < KEEP_THRESHOLD - SWAP_MARGIN)


@dataclass(frozen=True)
class Entry:
    session: str
    tokens: int
    nbytes: float
    system_key: str = ""  # its system prompt's key ("" unknown)


class RamModel:
    """What one server's RAM prompt cache holds of slotkeeper's sessions, oldest first, and
    how far its predictions are trusted. One per server, shared by the handovers and answer
    checks of all its slots, which run in worker threads at once: every method that reads or
    changes the entries or the trust takes the model's lock (a sum over the entries while
    another thread parks one would raise)."""

    def __init__(self, limit_bytes: float = DEFAULT_LIMIT_BYTES, sps: float = DEFAULT_SPS) -> None:
        self.limit_bytes = limit_bytes
        self.sps = sps
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self.distrust = 0  # predicted hits still to send to the disk
        self._next_distrust = FIRST_DISTRUST
        self.hits = 0
        self.misses = 0
        self._lock = threading.RLock()

    @property
    def enabled(self) -> bool:
        return self.limit_bytes != 0 and self.sps > 0

    @property
    def confirmed(self) -> bool:
        """Is a handover save left to the cache? From the start, as the option says the
        server keeps one (on a GPU host each such save writes GiBs while every other slot
        waits); after a miss only once a later answer showed the cache at work again. A server
        run with --cache-ram 0 behind the default option costs each of the first handed-over
        sessions what it grew since its last snapshot: a prefill, never a wrong answer."""
        return self.enabled and self.distrust == 0 and (self.hits > 0 or self.misses == 0)

    def holds(self, session: str, tokens: int = 0) -> Entry | None:
        """The session's entry if the model says the cache holds at least `tokens` of it."""
        with self._lock:
            entry = self._entries.get(session)
            return entry if entry is not None and entry.tokens >= tokens else None

    def fits(self, nbytes: float | None) -> bool:
        """Would the server park an entry of `nbytes` at all (alloc skips over-limit ones)?
        An unknown size (no slot file measured yet on this server) counts as fitting: the
        answer's cache_n tells, and 8 GiB holds 64k tokens of an 8B model's KV."""
        return self.limit_bytes < 0 or nbytes is None or nbytes <= self.limit_bytes

    def has_room(self, session: str, nbytes: float | None) -> bool:
        """Would the session's entry of `nbytes` stay in the cache without pushing out any
        other entry? Only then is it left there with no disk save: an entry the cache drops
        before the session returns costs its whole prefill."""
        with self._lock:
            if self.limit_bytes < 0 or nbytes is None:
                return self.fits(nbytes)
            others = sum(e.nbytes for e in self._entries.values() if e.session != session)
            return others + nbytes <= self.limit_bytes

    def park(self, session: str, tokens: int, nbytes: float | None,
             system_key: str = "") -> None:
        """The server parked the slot's prompt (a swap): newest entry; the oldest leave while
        the total passes the limit. An entry of unknown or over-limit size is not parked."""
        with self._lock:
            self._entries.pop(session, None)
            if tokens <= 0 or not self.fits(nbytes):
                return
            self._entries[session] = Entry(session, tokens, float(nbytes or 0.0), system_key)
            if self.limit_bytes > 0:
                while sum(e.nbytes for e in self._entries.values()) > self.limit_bytes:
                    self._entries.popitem(last=False)

    def only_copy_of(self, system_key: str, resident: set[str]) -> str | None:
        """A session parked here with this system prompt (or an unknown one) that no slot
        holds: the cache may be its only copy. A new conversation's load takes the oldest
        entry sharing its opening out of the cache, so with such an entry there it could take
        that one instead of its idle parent's. None when there is none."""
        with self._lock:
            return next((e.session for e in self._entries.values()
                         if e.session not in resident
                         and (not e.system_key or e.system_key == system_key)), None)

    def take(self, session: str) -> Entry | None:
        """The server loaded the session's entry into a slot: it leaves the cache."""
        with self._lock:
            return self._entries.pop(session, None)

    def forget(self) -> None:
        """The server may have restarted: its cache is empty."""
        with self._lock:
            self._entries.clear()

    def predicts_hit(self, session: str) -> Entry | None:
        """The entry a swap would load for `session`, unless the model is off or distrusted.
        Each distrusted call uses up one of the disk fallbacks."""
        with self._lock:
            entry = self.holds(session) if self.enabled else None
            if entry is None:
                return None
            if self.distrust > 0:
                self.distrust -= 1
                return None
            return entry

    def confirm(self, expected_tokens: int, cache_n: int) -> bool:
        """An answer after a predicted RAM hit: True (a hit) when the server reused at least
        HIT_SHARE of what the entry held. A miss distrusts the next predictions (doubling)."""
        with self._lock:
            if cache_n >= expected_tokens * HIT_SHARE:
                self.hits += 1
                self.distrust, self._next_distrust = 0, FIRST_DISTRUST
                return True
            self.misses += 1
            self.distrust = self._next_distrust
            self._next_distrust = min(self._next_distrust * 2, MAX_DISTRUST)
            return False

    def as_dict(self) -> dict[str, float | int]:
        with self._lock:
            return {"entries": len(self._entries),
                    "bytes": round(sum(e.nbytes for e in self._entries.values())),
                    "hits": self.hits, "misses": self.misses, "distrust": self.distrust}
