"""What this process remembers about sessions: which conversation each one's slot holds (and
the forks of a content-identified opening, and the chains of the most recent ones), and how
many of its requests are running, and how many of those already sent their answer's final
event (finishing). Policy decides with it; nothing here does I/O except reading the state
file's claims."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import replace

from ..decisions import policy
from ..decisions.policy import Conversation
from ..identity.identity import Identity
from ..store.memories import MAX_REMEMBERED_SESSIONS, Recent
from ..store.state import SlotRecord, StateFile
from .returns import ReturnTimes
from .routes import count_down

MAX_FORKS_PER_OPENING = 16
# Full chains (one hash per message) are kept for the most recent sessions only: they give the
# longest common prefix (a rebuilt prompt, a title request carrying a chat's transcript). A
# session whose chain was forgotten is judged by its last hash, as before (issue #19).
MAX_CHAINS = 512


class Sessions:
    """Owns: the remembered conversations and the running counts. Does not touch: slots,
    leases, servers (it only reads claims from the state file)."""

    def __init__(self, state: StateFile, small_request_chars: int,
                 upstreams: tuple[str, ...], returns: ReturnTimes) -> None:
        self.state = state
        self.returns = returns  # told when a session comes and goes
        self.small_request_chars = small_request_chars
        self.pool_urls = upstreams
        # (upstream, session) -> the session's main conversation as last routed here.
        self.conversations: Recent[tuple[str, str], Conversation] = Recent(
            MAX_REMEMBERED_SESSIONS)
        # content id of an opening -> {session: conversation} of the conversations that opened so
        self.openings: Recent[str, dict[str, Conversation]] = Recent(MAX_REMEMBERED_SESSIONS)
        # session -> the chain of its main conversation (bounded: MAX_CHAINS)
        self.chains: Recent[str, tuple[str, ...]] = Recent(MAX_CHAINS)
        # (upstream, session) -> the last request of the session placed as a side request by
        # divergence (not by size): its next turn makes it the main conversation
        self.sides: Recent[tuple[str, str], Conversation] = Recent(MAX_CHAINS)
        # (upstream, session) -> requests of the session running in this process, and how many
        # of them already sent their answer's final event (only bookkeeping left)
        self._running: dict[tuple[str, str], int] = {}
        self._finishing: dict[tuple[str, str], int] = {}
        self._changed = threading.Condition()

    def adopt(self, old: Sessions) -> None:
        self.conversations.update(old.conversations)
        self.openings.update(old.openings)
        self.chains.update(old.chains)
        self.returns = old.returns

    def resolve(self, url: str, ident: Identity) -> Identity:
        """A content-identified request continues the conversation it extends, or forks a
        session of its own (fault 5). Known conversations: this process's memory, and the
        claims in the state file (other processes, or before a restart)."""
        if ident.rule != "content" or not ident.chain:
            return ident
        known: dict[str, Conversation] = {}
        doc = self.state.read()
        for up_url in self.pool_urls or (url,):
            up = doc.upstreams.get(up_url)
            for rec in up.slots.values() if up else ():
                if rec.chain_head and opening_of(rec.owner) == ident.session_id:
                    known[rec.owner] = Conversation(rec.system_key or None, rec.chain_length,
                                                    rec.chain_head, rec.chars)
        known.update(self.openings.get(ident.session_id, {}))
        chains = {s: self.chains[s] for s in known if s in self.chains}
        session = policy.resolve_content(ident.session_id, ident.chain, known, chains)
        if session not in known:
            return self._fork(url, ident, session, chains, known)
        if policy.extends(ident.chain, known[session]):
            return ident if session == ident.session_id else replace(ident, session_id=session)
        return replace(ident, session_id=session, rewrites=True)

    def _fork(self, url: str, ident: Identity, session: str,
              chains: dict[str, tuple[str, ...]], known: dict[str, Conversation]) -> Identity:
        """A new conversation: it may start from the longest prefix another session holds
        (its parent: the handover restores the parent's snapshot when that pays). First the
        conversations of its own opening; failing those, any recent conversation with the same
        system block when that block is long (an agent's memory request: its 24k-character
        system prompt and tools, then a transcript that grows each time, so no two share an
        opening; llama-server's own cache reuses the block, issue #23)."""
        parent, shared = _longest(ident.chain, chains, policy.MIN_CONTINUED_PREFIX)
        if not parent and ident.chain_chars:
            parent, shared = _longest(ident.chain, self.chains, 1)
        if not parent or parent == session:
            return ident if session == ident.session_id else replace(ident, session_id=session)
        return self._with_prefix(url, replace(ident, session_id=session), parent, shared,
                                 known.get(parent))

    def with_parent(self, url: str, ident: Identity) -> Identity:
        """A header-identified session with no slot here: its parent is the latest
        conversation with its system block, as for a content request that opens
        something new (`_fork`). Its handover starts it from the parent's prefix when that
        pays and no snapshot of its own exists: the second conversation of a system prompt,
        which llama-server alone on one slot starts from the first's (DESIGN, "The second
        conversation")."""
        if ident.prefix is not None or ident.rule == "content" or not ident.chain_chars:
            return ident
        parent, shared = _longest(ident.chain, self.chains, 1, exclude=ident.session_id)
        return self._with_prefix(url, ident, parent, shared, None) if parent else ident

    def _with_prefix(self, url: str, ident: Identity, parent: str, shared: int,
                     known: Conversation | None) -> Identity:
        if not ident.chain_chars:
            return ident
        conversation = known or self.conversations.get((url, parent))
        parent_chars = conversation.chars if conversation is not None else 0
        return replace(ident, prefix=policy.Prefix(
            parent, shared, ident.chain_chars[shared - 1], parent_chars))

    def conversation_of(self, url: str, session: str,
                        rec: SlotRecord | None) -> Conversation | None:
        remembered = self.conversations.get((url, session))
        if remembered is not None:
            return remembered
        if rec is not None and rec.owner == session and rec.chain_head:
            return Conversation(rec.system_key or None, rec.chain_length, rec.chain_head,
                                rec.chars)
        return None

    def kind(self, url: str, ident: Identity, rec: SlotRecord | None, running: int) -> str:
        """policy.MAIN, SIDE or MOVE for this request of the session. A side request that is
        one by divergence (not by size) is remembered: its next turn makes it the main one."""
        resident = self.conversation_of(url, ident.session_id, rec)
        key = (url, ident.session_id)
        # The common prefix is only looked for when the request does not extend the slot's
        # conversation: a kept turn pays one hash comparison, as before.
        diverges = resident is not None and not policy.extends(ident.chain, resident)
        kind = policy.classify(
            chain=ident.chain, system_key=ident.seed_key, prompt_chars=ident.prompt_chars,
            small_request_chars=self.small_request_chars, resident=resident,
            own_request_running=running > 0, rewrites=ident.rewrites,
            common_chars=self._common_chars(ident, resident) if diverges else None,
            last_side=self.sides.get(key) if diverges else None, side_task=ident.side_task)
        if kind == policy.SIDE and diverges and ident.prompt_chars >= self.small_request_chars:
            self.sides[key] = Conversation.of(ident.chain, ident.seed_key, ident.prompt_chars)
        return kind

    def _common_chars(self, ident: Identity, resident: Conversation | None) -> int | None:
        """Characters of the chain prefix the request shares with the session's resident
        conversation, when its chain is remembered (None: unknown)."""
        chain = self.chains.get(ident.session_id)
        if resident is None or chain is None or not ident.chain_chars or not chain \
                or chain[-1] != resident.head:
            return None
        n = policy.common_prefix(ident.chain, chain)
        return ident.chain_chars[n - 1] if n else 0

    def shared_chars(self, ident: Identity, rec: SlotRecord) -> int | None:
        """Characters of the leading items (system block, messages) the request shares with
        the conversation `rec`'s slot holds for another session, when this process remembers
        that conversation's chain (None: unknown, e.g. claimed by another proxy)."""
        chain = self.chains.get(rec.owner)
        if (not chain or not ident.chain_chars or not rec.chain_head
                or chain[-1] != rec.chain_head):
            return None
        n = policy.common_prefix(ident.chain, chain)
        return ident.chain_chars[n - 1] if n else 0

    def remember(self, url: str, session: str, ident: Identity) -> Conversation:
        """The session's main conversation is now this request's."""
        conversation = Conversation.of(ident.chain, ident.seed_key, ident.prompt_chars)
        self.conversations[(url, session)] = conversation
        self.sides.pop((url, session), None)
        if ident.chain:
            self.chains[session] = ident.chain
        if ident.rule == "content" and ident.chain:
            opening = opening_of(session)
            forks = self.openings.get(opening) or {}
            forks[session] = conversation
            while len(forks) > MAX_FORKS_PER_OPENING:
                forks.pop(next(iter(forks)))
            self.openings[opening] = forks
        return conversation

    def forget(self, url: str, session: str) -> None:
        self.conversations.pop((url, session), None)

    def enter(self, url: str, session: str) -> int:
        """Count a request of the session as running from the moment its routing starts (so
        a second request that arrives during the first one's handover sees it); returns how
        many were running before."""
        key = (url, session)
        with self._changed:
            before = self._running.get(key, 0)
            self._running[key] = before + 1
        if before == 0:
            self.returns.came_back(session)
        return before

    def leave(self, url: str, session: str, finishing: bool = False,
              tried: bool = False) -> None:
        """The request ended (`finishing`: it had been counted as finishing; `tried`: it was
        only a try that another try of the same request follows, not an end)."""
        key = (url, session)
        with self._changed:
            count_down(self._running, key)
            if finishing:
                count_down(self._finishing, key)
            self._changed.notify_all()
            gone = key not in self._running
        if gone and not tried:
            self.returns.went(session)

    def finishing(self, url: str, session: str) -> None:
        """A running request of the session sent its answer's final event: only its
        bookkeeping is left (verification, records, the lease's release)."""
        with self._changed:
            self._finishing[(url, session)] = self._finishing.get((url, session), 0) + 1
            self._changed.notify_all()

    def should_wait(self, url: str, ident: Identity) -> bool:
        """Is a running request of this session only a turn the client already has? Every one
        of them sent its final event, or this request holds the running conversation and more
        (its reply is in it). Then this is the session continuing, not a second request at
        once: it waits for that request's end instead of going elsewhere (issue #19)."""
        key = (url, ident.session_id)
        with self._changed:
            running = self._running.get(key, 0)
            finishing = self._finishing.get(key, 0)
        if running == 0:
            return False
        return finishing >= running or policy.strictly_extends(
            ident.chain, self.conversations.get(key))

    def wait_until_ended(self, url: str, session: str, timeout: float) -> float:
        """Wait (bounded) until no request of the session runs here; the seconds waited."""
        key = (url, session)
        started = time.monotonic()
        deadline = started + timeout
        with self._changed:
            while self._running.get(key, 0) > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
        return time.monotonic() - started

    def running_on(self, session: str) -> list[str]:
        """The servers where a request of the session is running in this process."""
        with self._changed:
            return [url for (url, running), count in self._running.items()
                    if running == session and count > 0]


def opening_of(session: str) -> str:
    """The content id a (possibly forked) content session opened under."""
    return session.split(".", 1)[0]


def conversation_fields(ident: Identity) -> dict:
    """The claim's fields that describe the conversation the slot will hold."""
    conversation = Conversation.of(ident.chain, ident.seed_key, ident.prompt_chars)
    return {"system_key": conversation.system_key or "", "chain_length": conversation.length,
            "chain_head": conversation.head, "chars": conversation.chars}


def _longest(chain: tuple[str, ...], chains: Mapping[str, tuple[str, ...]],
             at_least: int, exclude: str = "") -> tuple[str, int]:
    """The session whose chain shares the most leading items with `chain`, and how many
    (0 and "" when none shares `at_least`), `exclude` aside. Among equals the one written
    last (`chains` is oldest first): an agent's memory requests all share only their system
    block with the next, and the latest holds the most of the next one's transcript."""
    parent, shared = "", at_least - 1
    for other, theirs in chains.items():
        if other == exclude:
            continue
        n = policy.common_prefix(chain, theirs)
        if n >= shared and n >= at_least:
            parent, shared = other, n
    return (parent, shared) if parent else ("", 0)
