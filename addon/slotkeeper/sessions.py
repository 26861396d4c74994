"""What this process remembers about sessions: which conversation each one's slot holds (and
the forks of a content-identified opening), and how many of its requests are running. Policy
decides with it; nothing here does I/O except reading the state file's claims."""

from __future__ import annotations

import threading
from dataclasses import replace

from . import policy
from .identity import Identity
from .policy import Conversation
from .routes import MAX_REMEMBERED_SESSIONS, Recent, count_down
from .state import SlotRecord, StateFile

MAX_FORKS_PER_OPENING = 16


class Sessions:
    """Owns: the remembered conversations and the running counts. Does not touch: slots,
    leases, servers (it only reads claims from the state file)."""

    def __init__(self, state: StateFile, small_request_chars: int,
                 upstreams: tuple[str, ...]) -> None:
        self.state = state
        self.small_request_chars = small_request_chars
        self.pool_urls = upstreams
        # (upstream, session) -> the session's main conversation as last routed here.
        self.conversations: Recent[tuple[str, str], Conversation] = Recent(
            MAX_REMEMBERED_SESSIONS)
        # content id of an opening -> {session: conversation} of the conversations that opened so
        self.openings: Recent[str, dict[str, Conversation]] = Recent(MAX_REMEMBERED_SESSIONS)
        # (upstream, session) -> requests of the session running in this process
        self._running: dict[tuple[str, str], int] = {}
        self._mutex = threading.Lock()

    def adopt(self, old: Sessions) -> None:
        self.conversations.update(old.conversations)
        self.openings.update(old.openings)

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
        session = policy.resolve_content(ident.session_id, ident.chain, known)
        if session == ident.session_id:
            return ident
        return replace(ident, session_id=session)

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
        """policy.MAIN, SIDE or MOVE for this request of the session."""
        return policy.classify(
            chain=ident.chain, system_key=ident.seed_key, prompt_chars=ident.prompt_chars,
            small_request_chars=self.small_request_chars,
            resident=self.conversation_of(url, ident.session_id, rec),
            own_request_running=running > 0)

    def remember(self, url: str, session: str, ident: Identity) -> Conversation:
        """The session's main conversation is now this request's."""
        conversation = Conversation.of(ident.chain, ident.seed_key, ident.prompt_chars)
        self.conversations[(url, session)] = conversation
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
        with self._mutex:
            before = self._running.get(key, 0)
            self._running[key] = before + 1
        return before

    def leave(self, url: str, session: str) -> None:
        with self._mutex:
            count_down(self._running, (url, session))

    def running_on(self, session: str) -> list[str]:
        """The servers where a request of the session is running in this process."""
        with self._mutex:
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
