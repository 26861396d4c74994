"""The slot calls (save, restore, erase) this process has in flight on one server, and the last
/slots view it read (issue #31). llama-server runs a slot call on its main loop and answers
/slots from that loop too: while a multi-second save runs, a /slots read times out. That is
not a dead server, and sending the request to the hash fallback (another slot than its
session's) would cost a prefill: the last view read is used instead."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ..decisions.choice import SlotView


class SlotCalls:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self.last: list[SlotView] | None = None  # the last /slots answer (SlotView list)

    @contextmanager
    def running(self, slot_call: bool = True) -> Iterator[None]:
        """Around a POST; counted when it is a slot call (`slot_call`)."""
        step = 1 if slot_call else 0
        with self._lock:
            self._running += step
        try:
            yield
        finally:
            with self._lock:
                self._running -= step

    def stand_in(self) -> list[SlotView] | None:
        """The view to use for a /slots read that failed: the last one while a slot call of
        ours runs (the server is busy with it), else None (the failure stands)."""
        with self._lock:
            return self.last if self._running > 0 else None
