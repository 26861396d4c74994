"""Bytes written into the slot folder within the last hour, for the write budget (issue #31):
llama-server writes whole slots, never deltas, so an agent doing 500 turns a day at 32k tokens
of a 7-8B model, saved once a turn, writes ~2 TB a day, a consumer SSD's rated endurance in
under a year. Counted by this process (several proxies on one folder each keep their own
count: the budget is per proxy). Thread-safe."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

HOUR = 3600.0


class WriteWindow:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._writes: deque[tuple[float, int]] = deque()
        self._total = 0

    def wrote(self, nbytes: int) -> None:
        with self._lock:
            self._writes.append((self.clock(), nbytes))
            self._total += nbytes
            self._forget_old()

    def last_hour(self) -> int:
        with self._lock:
            self._forget_old()
            return self._total

    def _forget_old(self) -> None:
        horizon = self.clock() - HOUR
        while self._writes and self._writes[0][0] < horizon:
            self._total -= self._writes.popleft()[1]
