"""When a save that can wait runs (issue #31): the stall and write budgets, with a FAKE server
client (its measured rates and its /slots) and a FAKE snapshot service (its folder and writes)."""

from __future__ import annotations

from types import SimpleNamespace

from slotkeeper.decisions.choice import SlotView
from slotkeeper.decisions.pricing import Rates
from slotkeeper.snapshots.saves import LATER, NOT_THIS_HOUR, NOW, Saves
from slotkeeper.store.budgets import WriteWindow

MB = 1_000_000
# 10 MB a save at 5 MB/s: 2 s of stall for the other slots.
SLOW = Rates(prefill_tokens_per_s=600, save_bytes_per_s=5 * MB, restore_bytes_per_s=5 * MB,
             kv_bytes_per_token=5_000, slot_fixed_bytes=0)


def info(rates: Rates, other_slot_busy: bool):
    client = SimpleNamespace(
        costs=SimpleNamespace(rates=lambda: rates),
        slots=lambda: [SlotView(id=0, is_processing=False, n_tokens=2_000, n_ctx=4096),
                       SlotView(id=1, is_processing=other_slot_busy, n_tokens=100, n_ctx=4096)])
    return SimpleNamespace(client=client)


def saves(written: int = 0, write_budget: float = 0.0) -> Saves:
    writes = WriteWindow()
    writes.wrote(written)
    snapshots = SimpleNamespace(writes=writes,
                                folder=SimpleNamespace(read_meta=lambda session: None))
    return Saves(state=None, snapshots=snapshots, min_save_tokens=0, stall_budget=0.5,
                 write_budget=write_budget)


def test_a_two_second_save_waits_while_another_slot_streams():
    assert saves().when(info(SLOW, other_slot_busy=True), 0, "s", 2_000) == LATER


def test_it_runs_once_the_other_slot_is_idle():
    assert saves().when(info(SLOW, other_slot_busy=False), 0, "s", 2_000) == NOW


def test_a_save_past_the_hours_write_budget_is_skipped():
    spent = saves(written=95 * MB, write_budget=100 * MB)
    assert spent.when(info(SLOW, other_slot_busy=False), 0, "s", 2_000) == NOT_THIS_HOUR
    assert saves(written=85 * MB, write_budget=100 * MB).when(
        info(SLOW, other_slot_busy=False), 0, "s", 2_000) == NOW


def test_unknown_speeds_run_it_now_to_measure_them():
    assert saves().when(info(Rates(), other_slot_busy=False), 0, "s", 2_000) == NOW
    # but not while another slot streams: it may take seconds (a first save of 5,880 tokens
    # stopped a stream 3.8 s at the GPU bench's cap)
    assert saves().when(info(Rates(), other_slot_busy=True), 0, "s", 2_000) == LATER


def test_a_deferral_says_how_long_the_stall_would_be_or_that_it_is_not_known(caplog):
    with caplog.at_level("INFO", logger="slotkeeper"):
        saves().when(info(SLOW, other_slot_busy=True), 0, "measured", 2_000)
        saves().when(info(Rates(), other_slot_busy=True), 0, "unmeasured", 2_000)
    lines = [r.getMessage() for r in caplog.records if "deferred" in r.getMessage()]
    assert "measured deferred: ~2.0 s of stall for the other slots' streams" in lines[0], lines
    # not "~0.0 s": nothing says the save would be quick
    assert "unmeasured deferred: a stall of unknown length (no save measured yet)" in lines[1]
