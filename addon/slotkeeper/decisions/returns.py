"""When a session is expected back, from the waits between its own requests. Pure: no I/O,
no clock (the caller passes `now`).

Why (docs/DESIGN.md, "Which slot"): the slot to take from its owner is the one whose owner
returns last. Taking the least recently used one is that guess when nothing else is known,
and the worst one for agents that take turns: six sessions on four slots in turn, the least
recently used is always the next to come back, and every turn changed hands (six-agents:
18 of 18 turns assigned, none kept)."""

from __future__ import annotations

import math
from collections.abc import Sequence

# A new wait counts as much as all the earlier ones together: an agent's waits change with its
# work (a tool that runs long), and two turns are enough to follow the change.
WEIGHT_OF_THE_LAST_WAIT = 0.5


def expected_return(last_end: float, wait: float, now: float) -> float:
    """When a session whose last request ended at `last_end` is expected back: `wait` later.
    Once that time has passed it broke its rhythm, and it is expected as late again as it is
    overdue (a session idle twice as long as usual is no sooner back than one that never came:
    with `wait` 0 this is least recently used first, the order of old)."""
    due = last_end + wait
    if not math.isfinite(due) or due >= now:
        return due
    return now + (now - due)


def next_wait(previous: float | None, observed: float) -> float:
    """A session's typical wait, after one more observed wait between its requests."""
    if previous is None:
        return observed
    return previous + WEIGHT_OF_THE_LAST_WAIT * (observed - previous)


def usual_wait(recent: Sequence[float]) -> float:
    """The wait assumed for a session not seen twice: the median of the latest waits of all
    sessions (a median, so one user away for an hour does not move it), 0 if none."""
    if not recent:
        return 0.0
    ordered = sorted(recent)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
