"""The write budget's count: bytes saved within the last hour (issue #31)."""

from __future__ import annotations

from slotkeeper.store.budgets import HOUR, WriteWindow


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_writes_count_for_an_hour_then_age_out():
    clock = Clock()
    window = WriteWindow(clock)
    window.wrote(100)
    clock.now += HOUR / 2
    window.wrote(50)
    assert window.last_hour() == 150
    clock.now += HOUR / 2 + 1  # the first write is over an hour old
    assert window.last_hour() == 50
    clock.now += HOUR
    assert window.last_hour() == 0


def test_an_empty_window_counts_nothing():
    assert WriteWindow(Clock()).last_hour() == 0
