"""The upstream registry: one llama-server client per base URL, what this process knows about
each (props, health, whether it may have restarted), and the check that reconciles the state
file's claims with a server that restarted or lost its slots. Blocking: worker threads."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..decisions import fingerprints, policy
from ..decisions.ramcache import DEFAULT_LIMIT_BYTES, DEFAULT_SPS, RamModel
from ..store.memories import MAX_REMEMBERED_SESSIONS, Recent, Seen
from ..store.state import StateDoc, StateFile
from .client import ServerProps, SlotsUnavailable, Upstream, UpstreamError

log = logging.getLogger("slotkeeper")


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
    # what its RAM prompt cache holds of our sessions (issue #31: ramcache.py)
    ram: RamModel = field(default_factory=RamModel)
    sent_at: float = float("-inf")  # clock time our last request to it was sent
    # clock time of sending the last request of ours it is known to have launched (its answer
    # began): llama-server copies its idle slots into its RAM cache as it launches one
    launched_at: float = float("-inf")
    # one verification at a time: a request arriving while the start-up one runs waits for it
    # rather than reading /props, /slots and the model file a second time
    verifying: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def published(self, session: str) -> bool:
        """Was the session's slot idle when a request of ours that the server has launched
        was sent? llama-server then copied it into its RAM cache (--cache-idle-slots, on by
        default with -np N): ramcache.py. Launched is known once its answer began: a request
        the server deferred launches later than it was sent."""
        seen = self.last_seen.get(session)
        return seen is not None and seen.at < self.launched_at

    def quiet_for(self, seconds: float, now: float) -> bool:
        """Nothing of ours sent to this server, and no answer of it ended, within the last
        `seconds` (`now` and both marks on the router's clock)."""
        ends = [seen.at for seen in self.last_seen.values()]
        return now - max([self.sent_at, *ends]) >= seconds

    def launched(self, sent_at: float) -> None:
        """A request of ours sent at `sent_at` is running there: its answer began."""
        self.launched_at = max(self.launched_at, sent_at)

    def answered_within(self, seconds: float) -> bool:
        return time.monotonic() - self.answered_at < seconds

    def messages_of(self, session: str, recorded: int) -> int:
        """Messages in the session's slot: the state file's count lags by the coalescing
        interval, this process's own last request does not."""
        seen = self.last_seen.get(session)
        return max(recorded, seen.messages) if seen else recorded


class Upstreams:
    """Owns: the UpstreamInfo of every server seen, health verdicts, suspicion and the
    verification of a suspect server. Does not touch: slot leases, snapshots, placement."""

    def __init__(self, state: StateFile, slots_timeout: float, api_key: str = "",
                 make_client: Callable[..., Upstream] = Upstream,
                 ram_limit: float = DEFAULT_LIMIT_BYTES, sps: float = DEFAULT_SPS) -> None:
        self.state = state
        self.ram_limit = ram_limit  # the servers' --cache-ram as slotkeeper counts on it
        self.sps = sps  # and their --slot-prompt-similarity
        self.slots_timeout = slots_timeout
        self.api_key = api_key  # llama-server's --api-key, on our own calls (issue #21)
        self.make_client = make_client  # a model's key gets a client bound to it (models.py)
        self._infos: dict[str, UpstreamInfo] = {}
        self._mutex = threading.Lock()

    def adopt(self, old: Upstreams) -> None:
        """Keep what a replaced router's registry knew (props, sessions seen), suspect."""
        for url, info in old.known():
            mine = self.get(url)
            mine.props, mine.checked, mine.suspect = info.props, info.checked, True
            mine.healthy = info.healthy
            mine.last_seen.update(info.last_seen)
            mine.usage_written.update(info.usage_written)

    def get(self, url: str) -> UpstreamInfo:
        with self._mutex:
            info = self._infos.get(url)
            if info is None:
                # A slot call that hangs marks the server suspect (issue #21, item 7).
                info = UpstreamInfo(self.make_client(url, timeout=self.slots_timeout,
                                                     api_key=self.api_key,
                                                     on_hang=lambda: self.mark_suspect(url)),
                                    ram=RamModel(self.ram_limit, self.sps))
                self._infos[url] = info
            return info

    def peek(self, url: str) -> UpstreamInfo | None:
        """The server's info if it was seen; never creates one (the hot path)."""
        return self._infos.get(url)

    def put(self, url: str, info: UpstreamInfo) -> None:
        with self._mutex:
            self._infos[url] = info

    def known(self) -> list[tuple[str, UpstreamInfo]]:
        with self._mutex:
            return list(self._infos.items())

    def note_answer(self, url: str, status: int) -> None:
        """A routed request got its answer. A 200 shows the server up (the health watcher
        need not ask it this round); a 503 is what llama-server answers while it loads a
        model, after a restart: verify its slots before trusting them."""
        info = self._infos.get(url)
        if info is None:
            return
        if status == 200:
            info.answered_at = time.monotonic()
        elif status == 503:
            info.suspect = True

    def mark_suspect(self, url: str) -> None:
        """The upstream may have restarted (a failed connection, a cold answer where the KV
        should have been): verify it before the next request trusts any slot's content."""
        self.get(url).suspect = True

    def set_health(self, url: str, healthy: bool) -> bool:
        """The health watcher's verdict; True when it changed. A server that comes back may
        have restarted: its slots are verified before the next request trusts them."""
        info = self.get(url)
        changed = info.healthy != healthy
        info.healthy = healthy
        if not healthy or changed:
            info.suspect = True
        return changed

    def verify_if_suspect(self, url: str) -> UpstreamInfo:
        info = self.get(url)
        if info.suspect or not info.checked:
            with info.verifying:
                if info.suspect or not info.checked:  # not done while this one waited
                    self.verify(url, info)
        return info

    def verify(self, url: str, info: UpstreamInfo) -> None:
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
        info.props = props
        info.client.slot_actions_disabled = False  # a restarted server may have the flag now
        live = {s.id: s for s in slots} if slots is not None else None
        cleared: list[int] = []
        if self.state.update(lambda doc: _reconcile(doc, url, props.fingerprint, live, cleared)):
            log.info("%s: slots lost their KV (server restarted?): sessions will be restored", url)
            info.ram.forget()  # a restarted server's RAM cache is empty too
        # Trusted only now that the lost claims are marked: a request's fast path reads
        # `suspect` with no lock, and one let in before the write above was "kept" on an
        # empty slot (seen in CI after a restart, during the start-up verification).
        info.checked, info.suspect = True, False
        if cleared and not info.cleared_warned:
            info.cleared_warned = True
            log.warning("%s: slot(s) %s lost their session's KV while the same server kept "
                        "running: idle slots are being cleared (--cache-idle-slots with the "
                        "automatic slot count?); start llama-server with an explicit -np N",
                        url, cleared)


def _reconcile(doc: StateDoc, url: str, fingerprint: str, live: dict | None,
               cleared: list[int]) -> bool:
    """Drop the claims of a restarted server (another fingerprint) or of slots it no longer
    has; mark stale the claims of slots that now hold no tokens (noted in `cleared`). Only a
    claim that held tokens and whose slot is idle: a claim whose first request is still in
    flight (queued, or the slot processing its prompt) shows 0 tokens too, and marking it
    stale lost that session's first turn for good (seen when several first requests reached a
    fresh proxy at once: the second one's verification read the first one's slot mid-prompt,
    so it was never saved)."""
    up = doc.upstream(url)
    restarted = bool(up.fingerprint) and not fingerprints.same_model(up.fingerprint,
                                                                    fingerprint)
    up.fingerprint = fingerprint
    dropped = False
    for slot_id, rec in list(up.slots.items()):
        if restarted or (live is not None and slot_id not in live):
            del up.slots[slot_id]
            dropped = True
        elif (live is not None and not rec.stale and rec.tokens > 0
              and not live[slot_id].is_processing and live[slot_id].n_tokens == 0):
            rec.stale = True  # the server lost this slot's KV (restart, or cleared)
            dropped = True
            if not restarted:
                cleared.append(slot_id)
    return dropped
