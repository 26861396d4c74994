"""The pure part of scripts/bench-pool: the order of requests, and the sums and ratios made of
the measured rows. No processes, no I/O: tests/unit/scripts/test_bench_pool.py checks it."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Step:
    session: int  # index of the session, from 0
    turn: int  # from 1

    @property
    def name(self) -> str:
        return f"agent{self.session}"


def plan(sessions: int, turns: int, concurrency: int) -> list[list[Step]]:
    """Batches of requests sent at once: turn by turn, every session asks once, `concurrency`
    sessions at a time. A batch never spans two turns, so a session's turns stay in order and
    the servers' logs can be read turn by turn."""
    if sessions < 1 or turns < 1 or concurrency < 1:
        raise ValueError("sessions, turns and concurrency must be at least 1")
    batches = []
    for turn in range(1, turns + 1):
        steps = [Step(s, turn) for s in range(sessions)]
        batches += [steps[i:i + concurrency] for i in range(0, sessions, concurrency)]
    return batches


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def totals(rows: Sequence[dict[str, Any]], server_prefilled: int | None = None) -> dict[str, Any]:
    """Sums over some requests of one target. Failed requests count as errors and add no
    tokens; `server_prefilled` is what the servers' logs say they evaluated over the same
    requests (slotkeeper's own seed builds included), when known."""
    answered = [r for r in rows if not r.get("error")]
    prefilled = sum(r["prefilled"] for r in answered)
    minimum = sum(r["minimum"] for r in answered)
    evaluated = prefilled if server_prefilled is None else server_prefilled
    ttfts = [r["ttft_ms"] for r in answered if r.get("ttft_ms") is not None]
    return {
        "requests": len(rows),
        "errors": len(rows) - len(answered),
        "retries": sum(r.get("retries", 0) for r in rows),
        "prompt_n": prefilled,
        "prefilled": evaluated,
        "reused": sum(r["reused"] for r in answered),
        "minimum": minimum,
        "over_minimum": ratio(evaluated, minimum),
        "ttft_ms_median": median(ttfts),
        "ttft_ms_sum": round(sum(ttfts), 1),
        "prompt_ms_median": median([r["prompt_ms"] for r in answered
                                    if r.get("prompt_ms") is not None]),
    }


def per_turn(rows: Sequence[dict[str, Any]],
             server_prefilled: dict[int, int]) -> list[dict[str, Any]]:
    turns = sorted({r["turn"] for r in rows})
    return [{"turn": t, **totals([r for r in rows if r["turn"] == t], server_prefilled.get(t))}
            for t in turns]


def phase(rows: Sequence[dict[str, Any]], server_prefilled: dict[int, int],
          turns: Iterable[int]) -> dict[str, Any]:
    """Totals over the given turns; the server-log count is the sum of those turns'."""
    wanted = set(turns)
    chosen = [r for r in rows if r["turn"] in wanted]
    logged = [server_prefilled[t] for t in wanted if t in server_prefilled]
    known = len(logged) == len(wanted)
    return {"turns": sorted(wanted), **totals(chosen, sum(logged) if known else None)}


def phases(rows: Sequence[dict[str, Any]], server_prefilled: dict[int, int], turns: int,
           kill_after: int) -> dict[str, dict[str, Any]]:
    """The parts of a run the write-up compares: all turns; the turns before the kill; the
    later turns before it (2..kill_after: the first turn is the same cold prefill for every
    placement); the turns after the kill."""
    last_before = kill_after if kill_after else turns
    out = {"all": phase(rows, server_prefilled, range(1, turns + 1)),
           "before_kill": phase(rows, server_prefilled, range(1, last_before + 1)),
           "later_before_kill": phase(rows, server_prefilled, range(2, last_before + 1))}
    if kill_after:
        out["after_kill"] = phase(rows, server_prefilled, range(kill_after + 1, turns + 1))
    return out


def compare(results: dict[str, dict[str, Any]], keeper: str) -> dict[str, Any]:
    """slotkeeper's target against every other, part by part: prefilled / minimum and the
    median time to first token, and whether slotkeeper's is lower."""
    if keeper not in results:
        return {}
    mine = results[keeper]["phases"]
    out: dict[str, Any] = {}
    for label, result in results.items():
        if label == keeper:
            continue
        theirs = result["phases"]
        parts = {}
        for part in mine:
            if part not in theirs:
                continue
            a, b = mine[part], theirs[part]
            parts[part] = {
                "over_minimum": {keeper: a["over_minimum"], label: b["over_minimum"]},
                "prefilled": {keeper: a["prefilled"], label: b["prefilled"]},
                "prefilled_ratio": ratio(a["prefilled"], b["prefilled"]),
                "ttft_ms_median": {keeper: a["ttft_ms_median"], label: b["ttft_ms_median"]},
                "ttft_ratio": ratio(a["ttft_ms_median"] or 0, b["ttft_ms_median"] or 0),
                "errors": {keeper: a["errors"], label: b["errors"]},
                "slotkeeper_prefills_less": (a["over_minimum"] or 0) < (b["over_minimum"] or 0),
                "slotkeeper_faster": (a["ttft_ms_median"] or 0) < (b["ttft_ms_median"] or 0),
            }
        out[label] = parts
    return out
