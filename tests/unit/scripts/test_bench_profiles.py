"""The pure parts of scripts/bench-profiles (scripts/profilebench.py): every target's server
command line of one shape, and the table of repeated runs. No processes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
from baselinebench import TARGETS  # noqa: E402
from profilebench import (PROFILES, derive_cap, log_counts, project,  # noqa: E402
                          repeat_summary, repeat_table, same_shape)


def shape(flags: tuple[str, ...]) -> list[object]:
    """What the layout of the server's memory can follow: each argument's length, in order."""
    return [len(flag) if flag.startswith("-") else ("value", len(flag)) for flag in flags]


def test_every_target_gets_one_command_line_shape() -> None:
    shapes = {target.name: shape(same_shape(target.flags)) for target in TARGETS
              if "--cache-ram" not in target.flags}
    assert len({repr(s) for s in shapes.values()}) == 1, shapes


def test_the_similarity_each_target_asked_for_is_kept() -> None:
    assert same_shape(()) == ("--slot-prompt-similarity", "0.10")  # llama-server's default
    assert same_shape(("--slot-prompt-similarity", "0")) == ("--slot-prompt-similarity", "0.00")
    assert same_shape(("-sps", "0.5", "--cache-ram", "16")) == (
        "--slot-prompt-similarity", "0.50", "--cache-ram", "16")


def run(wall: float, p95: float | None, prefill_ms: float) -> dict[str, object]:
    return {"wall_s": wall, "ttft": {"p95_s": p95}, "counts": {"prefill_ms": prefill_ms},
            "gaps": {"max": {"gap_s": 0.02}}, "io": None}


def test_repeat_table_gives_every_run_and_the_mean() -> None:
    first = run(60.0, 21.0, 50_000) | {"repeats": [repeat_summary(run(60.0, 21.0, 50_000)),
                                                   repeat_summary(run(56.0, 19.0, 46_000))]}
    rows = repeat_table({"mixed-agents": {"slotkeeper": first}})
    assert rows[1] == ["mixed-agents", "slotkeeper", "60.0 / 56.0", "58.0", "21.00 / 19.00",
                       "20.00", "48.0"]


def test_repeat_table_says_when_no_turn_had_a_first_token() -> None:
    lone = run(5.0, None, 1_000) | {"repeats": [repeat_summary(run(5.0, None, 1_000))]}
    assert repeat_table({"w": {"t": lone}})[1][5] == "-"


def test_the_bed_waits_for_a_ram_cache_copy_as_long_as_the_profile_takes_at_the_beds_pace() -> None:
    profile = PROFILES["rtx4090-llama8b"]
    derived = derive_cap(profile, bed_prefill_tps=135.0, bed_kv_bytes_per_token=3088.0,
                         bed_decode_tps=22.6)
    # 128 KiB over 25 GB/s is 5.24 us on the 4090, 2.76% of its 190 us prefill of a token
    assert derived["host_copy_over_prefill"] == pytest.approx(131072 / 25e9 * 5265.68)
    # the same share of the bed's 7.4 ms prefill of a token
    assert derived["bed_host_copy_us_per_token"] == pytest.approx(
        derived["host_copy_over_prefill"] / 135.0 * 1e6)
    assert 200 < derived["bed_host_copy_us_per_token"] < 210


def test_the_bed_servers_ram_cache_copies_are_counted_and_priced() -> None:
    log = ("slot launch_slot_: id  0 | task 5 | processing task\n"
           "slotkeeper-bed: host copy of 512 tokens\n"
           "prompt eval time =     100.00 ms /    10 tokens\n"
           "slotkeeper-bed: host copy of 88 tokens\n")
    counts = log_counts(log)
    assert (counts["host_copies"], counts["host_copy_tokens"]) == (2, 600)
    run = {"counts": counts | {"decoded": 0}, "io": {}}
    profile = PROFILES["3x3090-llama70b"]
    assert project(run, profile, per_token=3088.0)["host_copy_s"] == pytest.approx(
        600 * profile.kv_bytes_per_token / profile.host_copy_bps, abs=0.01)


def test_upstreams_server_counts_no_ram_cache_copies() -> None:
    counts = log_counts("prompt eval time =     100.00 ms /    10 tokens\n")
    assert (counts["host_copies"], counts["host_copy_tokens"]) == (0, 0)
