"""What this process has seen of each session's comings and goings: when its last request
ended and how long it usually waits before the next one. The walk ranks the slots with it
(decisions/returns.py says why). Bounded like every memory of sessions here; on the event
loop (the fast path counts a kept request in) as well as on workers, hence the lock."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable

from ..decisions import returns
from ..decisions.choice import Claim
from ..store.memories import MAX_REMEMBERED_SESSIONS, Recent

# The waits the usual one is the median of: enough for a steady figure, few enough to follow
# a workload that changes.
RECENT_WAITS = 64


class ReturnTimes:
    """Owns: each session's last end and usual wait here. Does not touch: slots, claims."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._ended: Recent[str, float] = Recent(MAX_REMEMBERED_SESSIONS)
        self._waits: Recent[str, float] = Recent(MAX_REMEMBERED_SESSIONS)
        self._recent: deque[float] = deque(maxlen=RECENT_WAITS)
        self._mutex = threading.Lock()

    def came_back(self, session: str) -> None:
        """A request of the session starts, none of its others running. Counted once: the
        end is taken, so a second try of the same request (the fast path's, then the slow
        path's) finds none."""
        now = self.clock()
        with self._mutex:
            ended = self._ended.pop(session, None)
            if ended is None or now < ended:
                return
            wait = now - ended
            self._waits[session] = returns.next_wait(self._waits.get(session), wait)
            self._recent.append(wait)

    def went(self, session: str) -> None:
        """The session's last running request here ended."""
        now = self.clock()
        with self._mutex:
            self._ended[session] = now

    def expected_back(self, claims: Iterable[Claim], now: float) -> Callable[[Claim], float]:
        """When each of `claims`' owners is expected back, for choice.rank_slots."""
        with self._mutex:
            usual = returns.usual_wait(self._recent)
            back = {claim.owner: returns.expected_return(
                        max(self._ended.get(claim.owner, claim.last_used), claim.last_used),
                        self._waits.get(claim.owner, usual), now)
                    for claim in claims}
        return lambda claim: back[claim.owner]
