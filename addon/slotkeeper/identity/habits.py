"""What earlier requests like this one did (issue #23). Pure: no I/O, no clock; bounded.

The router tells it about each conversation request it routes (`saw`) and when that request
ended (`ended`); it answers two questions about a new request:

- `is_one_off`: will this request not be continued (a title, tag, summary or memory request:
  its own system prompt, one turn, often abandoned)? Then it is never made a session.
- `seed_wanted`: does a second conversation use this system prompt (so its seed will be
  restored by someone)? Only then is a seed taken.

A conversation is counted by its *opening* (a content id's forks are one conversation: an
agent that rebuilds its prompt each turn forks on every turn, yet it comes back) and it is
*continued* once a second request of it arrives. docs/DESIGN.md, "First turns and one-off
requests", gives the traffic behind each rule."""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

# A system prompt is taken as one-off when this many earlier conversations with it ended
# without a second request (and none ever had one). One is not enough: two agents started
# with the same system prompt look exactly like that until the first one's next turn.
ONE_OFF_AFTER = 2
MAX_KEYS = 1024  # system prompts remembered (the oldest are forgotten)
MAX_OPENINGS_PER_KEY = 16

# Session ids that name a task rather than a conversation: `title-<session>` (seen: an agent's
# title request), `summary_...`, `<session>:tags`. A word of its own, at the start or end.
_TASK_WORDS = ("title", "titles", "tag", "tags", "summary", "summarize", "memory", "memories")
_TASK_ID = re.compile(r"^(?:%s)(?:[-_:.]|$)|[-_:.](?:%s)$" % (("|".join(_TASK_WORDS),) * 2),
                      re.IGNORECASE)


def names_a_task(session_id: str) -> bool:
    """Does the session id say it is a side task of a conversation, not one (`title-<id>`)?"""
    return bool(_TASK_ID.search(session_id))


@dataclass
class _Opening:
    requests: int = 0  # with different prompts: a retry of the same prompt does not count
    last_prompt: str = ""
    running: int = 0
    ended_at: int = -1  # Habits.turns when a request of it last ended (-1: none yet)
    sessions: set[str] = field(default_factory=set)  # its forks (bounded)
    cleaned: bool = False  # its leftovers were handed out once (leftovers)

    @property
    def continued(self) -> bool:
        return self.requests > 1


@dataclass
class _Key:
    openings: OrderedDict[str, _Opening] = field(default_factory=OrderedDict)

    def ended_once(self, turns: int) -> int:
        """Conversations that ended after one request and did not come back although the
        client had the time: another conversation (any system prompt) had a next turn since
        (`turns` counts those). Sessions started one after another, each waiting for its
        next turn, are no evidence until something comes back."""
        return sum(1 for o in self.openings.values()
                   if 0 <= o.ended_at < turns and not o.continued and not o.running)

    def any_continued(self) -> bool:
        return any(o.continued for o in self.openings.values())


class Habits:
    """Per system key (identity's seed_key): the conversations seen with it. Thread-safe."""

    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self.max_keys = max_keys
        self._keys: OrderedDict[str, _Key] = OrderedDict()
        self._lock = threading.Lock()
        self.turns = 0  # next turns seen, any system prompt: the clock of ended_once

    def saw(self, system_key: str | None, opening: str, session_id: str,
            prompt: str = "") -> None:
        """A request of this conversation is routed as a conversation (it may own a slot).
        `prompt` names its content (identity's chain head): the same prompt again is a retry,
        not a second turn."""
        if not system_key:
            return
        with self._lock:
            key = self._keys.get(system_key)
            if key is None:
                key = self._keys[system_key] = _Key()
                while len(self._keys) > self.max_keys:
                    self._keys.popitem(last=False)
            self._keys.move_to_end(system_key)
            seen = key.openings.get(opening)
            if seen is None:
                seen = key.openings[opening] = _Opening()
                while len(key.openings) > MAX_OPENINGS_PER_KEY:
                    key.openings.popitem(last=False)
            if not prompt or prompt != seen.last_prompt:
                seen.requests += 1
                self.turns += seen.requests > 1
            seen.last_prompt = prompt
            seen.running += 1
            if len(seen.sessions) < MAX_OPENINGS_PER_KEY:
                seen.sessions.add(session_id)

    def ended(self, system_key: str | None, opening: str) -> None:
        if not system_key:
            return
        with self._lock:
            key = self._keys.get(system_key)
            seen = key.openings.get(opening) if key else None
            if seen is not None:
                seen.running = max(seen.running - 1, 0)
                seen.ended_at = self.turns

    def is_one_off(self, *, system_key: str | None, opening: str, session_id: str) -> bool:
        """A new conversation's request that will not be continued: its session id names a
        task, or its system prompt's earlier conversations (at least ONE_OFF_AFTER) all ended
        after one request. A conversation already seen is never one-off: it came back. The
        size of the request does not enter (a memory request carries a whole transcript)."""
        if names_a_task(session_id):
            return True
        if not system_key:
            return False
        with self._lock:
            key = self._keys.get(system_key)
            if key is None or opening in key.openings or key.any_continued():
                return False
            return key.ended_once(self.turns) >= ONE_OFF_AFTER

    def seed_wanted(self, system_key: str | None, ending: str = "") -> bool:
        """A seed is worth taking once a second conversation (or a fork) uses the system
        prompt, unless the prompt's conversations so far look like one-offs (at least
        ONE_OFF_AFTER ended after one request, none continued). `ending`: a conversation
        whose request is ending now (counted as ended)."""
        if not system_key:
            return False
        with self._lock:
            key = self._keys.get(system_key)
            if key is None or sum(len(o.sessions) for o in key.openings.values()) < 2:
                return False
            now_ended = key.openings.get(ending)
            extra = int(now_ended is not None and not now_ended.continued
                        and now_ended.running <= 1)
            return key.any_continued() or key.ended_once(self.turns) + extra < ONE_OFF_AFTER

    def leftovers(self, system_key: str | None) -> list[str]:
        """Sessions of a system prompt now known as one-off (their conversations ended after
        one request): their snapshots, written before that was known, will not be restored.
        Each session is handed out once."""
        if not system_key:
            return []
        with self._lock:
            key = self._keys.get(system_key)
            if key is None or key.any_continued() or key.ended_once(self.turns) < ONE_OFF_AFTER:
                return []
            done = [o for o in key.openings.values()
                    if o.ended_at >= 0 and not o.continued and not o.running and not o.cleaned]
            for o in done:
                o.cleaned = True
            return sorted(session for o in done for session in o.sessions)
