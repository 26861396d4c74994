"""The choice rule of the plain load balancers bench-pool compares slotkeeper's pool against
(scripts/pool_baselines.py): pure functions, no processes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from pool_baselines import busy_slots, choose_upstream  # noqa: E402


def test_round_robin_takes_turns() -> None:
    picks = [choose_upstream("round-robin", [0, 0, 0], turn) for turn in range(6)]
    assert picks == [0, 1, 2, 0, 1, 2]


def test_round_robin_skips_a_dead_server() -> None:
    picks = [choose_upstream("round-robin", [0, None, 0], turn) for turn in range(4)]
    assert picks == [0, 2, 2, 0]


def test_least_busy_takes_the_idlest() -> None:
    assert choose_upstream("least-busy", [2, 1, 3], 0) == 1
    assert choose_upstream("least-busy", [2, 1, 3], 5) == 1


def test_least_busy_ties_take_turns() -> None:
    picks = [choose_upstream("least-busy", [1, 0, 0], turn) for turn in range(4)]
    assert picks == [1, 1, 2, 1]


def test_least_busy_skips_a_dead_server_even_if_it_looks_idle() -> None:
    assert choose_upstream("least-busy", [None, 2], 0) == 1


def test_every_server_down_gives_none() -> None:
    assert choose_upstream("round-robin", [None, None], 3) is None
    assert choose_upstream("least-busy", [None, None], 3) is None


def test_unknown_placement_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown placement"):
        choose_upstream("random", [0, 0], 0)


def test_busy_slots_counts_processing_slots() -> None:
    slots = [{"id": 0, "is_processing": True}, {"id": 1, "is_processing": False},
             {"id": 2}, {"id": 3, "is_processing": True}]
    assert busy_slots(slots) == 2


def test_busy_slots_refuses_what_is_not_a_slot_list() -> None:
    with pytest.raises(ValueError):
        busy_slots({"error": "slots disabled"})
