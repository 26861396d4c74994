"""Is this request a client's side task (a title, tags, follow-up suggestions) by what it asks,
whatever order it arrives in (issue #19: "side requests are told by what they are, not by
which arrives first")? Pure: no I/O.

Seen in real clients' requests (tests/bed/corpus, docs/DESIGN.md "Side tasks by what they ask"):
OpenCode's title request, sent at the same moment as its conversation's first turn under the
same `x-session-id`, opens its system prompt with "You are a title generator. You output ONLY
a thread title."; OpenWebUI's task requests are one user message opening with "### Task:
Generate a concise, 3-5 word title ..." (or "... 1-3 broad tags ...", "Suggest 3-5 relevant
follow-up questions ..."). What they share, and what a conversation's turn does not:

- no tools (an agent's own turns always carry its tools);
- one turn: no reply in the messages yet (a conversation's later turns carry replies);
- the instruction, at the head of the system prompt or of the first user message, asks for
  a title, tags or follow-up questions.

A chat whose first message happens to ask for a title is taken as a side task for that one
turn (it claims no slot); its next turn carries a reply, so it is a conversation from then
on, and finds its first turn's KV by prefix like any new conversation."""

from __future__ import annotations

import re
from collections.abc import Sequence

from .prompts import REPLY_ROLES

# Only the head of a text is read: task prompts open with their instruction, and a
# conversation's long system prompt is not scanned on every request.
HEAD_CHARS = 400

_WORDS = ("title", "tags", "follow-up questions")
_ASK = re.compile(
    r"\btitle generator\b"
    r"|\b(?:generate|create|write|suggest|provide|produce|output|give)\b[^\n.]{0,60}?"
    r"\b(?:title|tags|follow-up questions)\b",
    re.IGNORECASE)


def asks_for_side_task(*, has_tools: bool, roles: Sequence[str | None],
                       system_parts: Sequence[str], first_user_parts: Sequence[str]) -> bool:
    """A title/tags/follow-ups request: no tools, no reply yet, and the instruction at the
    head of the system prompt or of the first user message asks for one."""
    if has_tools or any(role in REPLY_ROLES for role in roles):
        return False
    return _asks(_head(system_parts)) or _asks(_head(first_user_parts))


def _asks(head: str) -> bool:
    # The words first: a substring test is ~20x cheaper than the pattern, which runs on the
    # hot path's every request otherwise (measured with py-spy on bench-overhead).
    lowered = head.lower()
    return any(word in lowered for word in _WORDS) and bool(_ASK.search(head))


def _head(parts: Sequence[str]) -> str:
    """The first HEAD_CHARS characters of the joined parts, without joining them all."""
    head = ""
    for part in parts:
        head += part[:HEAD_CHARS - len(head)]
        if len(head) >= HEAD_CHARS:
            break
    return head
