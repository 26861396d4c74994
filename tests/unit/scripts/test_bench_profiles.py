"""The pure parts of scripts/bench-profiles (scripts/profilebench.py): every target's server
command line of one shape, and the table of repeated runs. No processes."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
from baselinebench import TARGETS  # noqa: E402
from profilebench import repeat_summary, repeat_table, same_shape  # noqa: E402


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
