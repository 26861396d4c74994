"""Conversations driven against a real server, through slotkeeper or directly."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import requests

TIMEOUT_S = 600


@dataclass
class Turn:
    session: str
    turn: int
    cache_n: int
    prompt_n: int
    slot: str | None
    action: str | None
    headers: dict[str, str]
    prompt_ms: float = 0.0  # the server's time prefilling prompt_n

    @property
    def prompt_tokens(self) -> int:
        return self.cache_n + self.prompt_n


@dataclass
class Conversation:
    """One session: a system prompt and a growing list of messages; each turn sends the whole
    conversation, as coding agents do."""

    session: str
    system: str
    messages: list[dict[str, str]] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    header: str = "X-Session-Id"

    def ask(self, url: str, question: str, n_predict: int = 8, **extra: Any) -> Turn:
        self.messages.append({"role": "user", "content": question})
        body = {
            "messages": [{"role": "system", "content": self.system}, *self.messages],
            "temperature": 0,
            "max_tokens": n_predict,
            **extra,
        }
        r = requests.post(url + "/v1/chat/completions", json=body,
                          headers={self.header: self.session}, timeout=TIMEOUT_S)
        assert r.status_code == 200, f"{r.status_code}: {r.text[:500]}"
        data = r.json()
        self.messages.append(data["choices"][0]["message"] | {"role": "assistant"})
        timings = data["timings"]
        turn = Turn(self.session, len(self.turns) + 1, timings["cache_n"], timings["prompt_n"],
                    r.headers.get("X-Slotkeeper-Slot"), r.headers.get("X-Slotkeeper-Action"),
                    dict(r.headers), timings.get("prompt_ms", 0.0))
        self.turns.append(turn)
        return turn

    def new_tokens(self, turn: Turn) -> int:
        """Tokens of this turn's prompt that the session's previous prompt did not start with
        (its previous prompt plus reply is a prefix of this one)."""
        index = self.turns.index(turn)
        if index == 0:
            return turn.prompt_tokens
        return turn.prompt_tokens - self.turns[index - 1].prompt_tokens


QUESTIONS = [
    "Please list three ways to make a slow unit test suite faster, briefly, with one reason "
    "for each and an example from a Python project that uses pytest and fixtures.",
    "Now explain how to find which single test is the slowest one in a large suite, and what "
    "command line flag of pytest shows the durations of the slowest tests after a run.",
    "Finally, suggest how to keep the suite fast over time in a team of ten engineers, with a "
    "check in continuous integration that fails when the suite becomes slower than before.",
    "Summarise everything above in two sentences for a colleague who missed the discussion "
    "and wants to know what to do first on Monday morning when they start work again.",
]


def interleave(conversations: list[Conversation], url: str, turns: int) -> None:
    for k in range(turns):
        for conversation in conversations:
            conversation.ask(url, f"(session {conversation.session}) {QUESTIONS[k]}")


def started_from_ram(log: str, session: str) -> bool:
    """Does the proxy's log show the session's request handed its slot back to the server's
    RAM cache to start from its idle parent's prefix there (routing/ramhandover.py)?"""
    return any(session in line and "prefix expected from it" in line
               for line in log.splitlines())


def eventually(predicate: Callable[[], bool], timeout: float) -> bool:
    """Whether `predicate` came true within `timeout` seconds (polled every 0.2 s)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True
