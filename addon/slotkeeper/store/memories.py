"""This process's bounded memories of sessions: the oldest are forgotten first, so memory
stays bounded however many sessions pass. A forgotten session loses only exactness (the state
file and the snapshots' metas still hold what matters)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

MAX_REMEMBERED_SESSIONS = 4096

K = TypeVar("K")
V = TypeVar("V")


class Recent(OrderedDict, Generic[K, V]):
    """A dict that keeps only the `limit` most recently written keys."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


@dataclass(frozen=True)
class Seen:
    """A session's last request that ended in this process."""

    at: float
    tokens: int  # in its slot afterwards
    messages: int
