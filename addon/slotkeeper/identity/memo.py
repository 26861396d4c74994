"""A bounded memory of values computed from a request, for what every turn of a conversation
sends again unchanged (a coding agent's tools and system prompt: tens of KB, made canonical
and hashed on each request otherwise, docs/BENCHMARKS.md). Pure: no I/O."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

_MISSING = object()


class Memo(Generic[K, V]):
    """The `limit` most recently used values by key. Thread-safe: identify runs on the event
    loop and on routing workers alike. A value is made outside the lock (two threads may make
    the same one; both get an equal value)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._values: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K, make: Callable[[], V]) -> V:
        with self._lock:
            found = self._values.get(key, _MISSING)
            if found is not _MISSING:
                self._values.move_to_end(key)
                return found  # type: ignore[return-value]
        value = make()
        with self._lock:
            self._values[key] = value
            while len(self._values) > self.limit:
                self._values.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._values)
