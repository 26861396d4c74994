"""The budgets' accounting (issues #31, #33): bytes written into the slot folder within the
last hour (the write budget) and the saves in flight (the disk budget's room for them). This
process's own count (`LocalLedger`, the default beside the state file), or the cluster's in
etcd (`etcd_budgets.EtcdLedger`) so that proxies on several hosts charge one budget.

Why a write budget: llama-server writes whole slots, never deltas, so an agent doing 500
turns a day at 32k tokens of a 7-8B model, saved once a turn, writes ~2 TB a day, a consumer
SSD's rated endurance in under a year. Why reservations: the disk budget frees room before a
save for its expected size, reading the folder; two saves that start at once each see the
folder without the other's file, and both fit only if each also makes room for the other's
bytes not written yet. Every save reserves before it reads the others' reservations, so of
two saves at least one sees the other. Thread-safe."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

HOUR = 3600.0


class Ledger(Protocol):
    def wrote(self, nbytes: int) -> None: ...
    def last_hour(self) -> int: ...
    def reserve(self, name: str, nbytes: int): ...  # a context manager
    def pending(self, size_of: Callable[[str], int], exclude: str) -> int: ...


class WriteWindow:
    """Bytes written within the last hour, by this process."""

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


class LocalLedger(WriteWindow):
    """This process's count: several proxies on one folder each keep their own (the budget is
    per proxy), and the reservations are those of this process's threads."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(clock)
        self._reserved: dict[str, int] = {}

    @contextmanager
    def reserve(self, name: str, nbytes: int) -> Iterator[None]:
        """`nbytes` are about to be written into the folder as `name` (a save's temp file)."""
        with self._lock:
            self._reserved[name] = max(int(nbytes), 0)
        try:
            yield
        finally:
            with self._lock:
                self._reserved.pop(name, None)

    def reservations(self) -> dict[str, int]:
        with self._lock:
            return dict(self._reserved)

    def pending(self, size_of: Callable[[str], int], exclude: str) -> int:
        """Bytes the other saves in flight will still add: each reservation less what its file
        already holds (the folder's usage counts that part)."""
        return unwritten(self.reservations(), size_of, exclude)


def unwritten(reserved: dict[str, int], size_of: Callable[[str], int], exclude: str) -> int:
    return sum(max(nbytes - size_of(name), 0) for name, nbytes in reserved.items()
               if name != exclude)
