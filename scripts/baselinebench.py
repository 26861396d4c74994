"""The pure part of scripts/bench-baselines: the targets (llama-server's own settings and
slotkeeper), the server flags each gets, and the sums and comparisons made of the measured
rows. No processes, no I/O: tests/unit/scripts/test_bench_baselines.py checks it."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SLOTKEEPER = "slotkeeper"


@dataclass(frozen=True)
class Target:
    name: str
    flags: tuple[str, ...] = ()  # llama-server flags beyond the test bed's own
    one_slot: bool = False  # -np 1 instead of the workload's slot count
    slotkeeper: bool = False  # slotkeeper (mitm.conf's options) in front, --slot-save-path
    # --slot-save-path on the bench's capped folder with no proxy: what the folder costs alone
    slot_folder: bool = False
    bare_proxy: bool = False  # mitmdump with no addon in front: what the proxy costs alone

    def server_np(self, slots: int) -> int:
        return 1 if self.one_slot else slots

    def server_ctx(self, slots: int, ctx_per_slot: int) -> int:
        """-c: every slot gets ctx_per_slot (with an explicit -np the cache is split)."""
        return self.server_np(slots) * ctx_per_slot

    def describe(self, slots: int, ctx_per_slot: int) -> str:
        np = self.server_np(slots)
        extra = (" --slot-save-path DIR + slotkeeper" if self.slotkeeper
                 else " --slot-save-path DIR" if self.slot_folder
                 else " + mitmdump with no addon" if self.bare_proxy else "")
        return (f"-np {np} -c {self.server_ctx(slots, ctx_per_slot)} --swa-full -t 2 "
                f"--no-repack {' '.join(self.flags)}".rstrip() + extra)


TARGETS = (
    Target("llama-default"),
    Target("llama-sps0", ("--slot-prompt-similarity", "0")),
    Target("llama-sps0-ram16", ("--slot-prompt-similarity", "0", "--cache-ram", "16")),
    Target("llama-np1-sps0", ("--slot-prompt-similarity", "0"), one_slot=True),
    Target(SLOTKEEPER, slotkeeper=True),
)


def pick_targets(names: Sequence[str] | None) -> list[Target]:
    if not names:
        return list(TARGETS)
    known = {t.name: t for t in TARGETS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown target(s) {unknown}; known: {list(known)}")
    return [known[n] for n in names]


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def later_main(row: dict[str, Any]) -> bool:
    """A conversation's turn after its first: where keeping KV pays."""
    return row["kind"] == "main" and row["turn"] >= 2


def summarize(rows: Sequence[dict[str, Any]], server_prefilled: int | None) -> dict[str, Any]:
    """One target's run of one workload. `prompt_n`, `cache_n` and `minimum` are per request
    (the server's timings; the minimum: tokens no earlier request started with), and
    `server_prefilled` is every prompt token the server's log says it evaluated (slotkeeper's
    seed builds and abandoned requests included)."""
    answered = [r for r in rows if r.get("prompt_n") is not None]
    later = [r for r in answered if later_main(r)]
    headers = [r["headers_s"] for r in rows if r.get("headers_s") is not None]
    ttfts = [r["ttft_s"] for r in rows if r.get("ttft_s") is not None]
    later_min = sum(r["minimum"] for r in later)
    # Answers that do not say what the server prefilled (Ollama's /api/chat: its
    # prompt_eval_count is the whole prompt) leave the later-turn sum unknown, not 0.
    unknown = any(later_main(r) and r.get("prompt_n") is None and not r.get("error")
                  for r in rows)
    later_n = None if unknown else sum(r["prompt_n"] for r in later)
    if unknown:
        later_min = sum(r["minimum"] for r in rows if later_main(r))
    return {
        "requests": len(rows),
        "errors": sum(1 for r in rows if r.get("error")),
        "retries": sum(r.get("retries", 0) for r in rows),
        "server_prefilled": server_prefilled,
        "prompt_n": sum(r["prompt_n"] for r in answered),
        "cache_n": sum(r.get("cache_n") or 0 for r in answered),
        "minimum": sum(r["minimum"] for r in rows),
        "later_prompt_n": later_n,
        "later_minimum": later_min,
        "later_over_minimum": ratio(later_n, later_min),
        "one_off_prompt_n": sum(r["prompt_n"] for r in answered if r["kind"] != "main"),
        "headers_s_max": max(headers, default=None),
        "headers_s_median": median(headers),
        "ttft_s_median": median(ttfts),
    }


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def headers_delta(mine: Sequence[dict[str, Any]],
                  theirs: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Time to response headers of the same requests (same session, turn, kind) in two runs:
    the largest of mine less theirs, and which request. An attempt that timed out counts with
    the time it waited (it is time the client spent without headers)."""
    other = {key(r): r for r in theirs}
    worst: dict[str, Any] | None = None
    for row in mine:
        there = other.get(key(row))
        if there is None or waited(row) is None or waited(there) is None:
            continue
        delta = round(waited(row) - waited(there), 4)
        if worst is None or delta > worst["delta_s"]:
            worst = {"delta_s": delta, "request": list(key(row))}
    return worst


def key(row: dict[str, Any]) -> tuple[str, int, str]:
    return (row["session"], row["turn"], row["kind"])


def waited(row: dict[str, Any]) -> float | None:
    """Seconds the client waited for headers, every attempt included."""
    if row.get("headers_s") is None and not row.get("header_waits_s"):
        return None
    return sum(row.get("header_waits_s") or []) + (row.get("headers_s") or 0.0)


def compare(workload: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """slotkeeper against each llama-server setting on one workload: `workload` maps a
    target's name to {"summary": ..., "requests": [...]}."""
    mine = workload.get(SLOTKEEPER)
    baselines = {name: run for name, run in workload.items() if name != SLOTKEEPER}
    out: dict[str, Any] = {}
    if baselines:
        best = min(baselines, key=lambda n: (baselines[n]["summary"]["later_prompt_n"], n))
        out["best_baseline_later"] = best
        out["best_baseline_later_prompt_n"] = baselines[best]["summary"]["later_prompt_n"]
    if mine is None:
        return out
    s = mine["summary"]
    for name, run in baselines.items():
        b = run["summary"]
        out[name] = {
            "later_prompt_n_ratio": ratio(s["later_prompt_n"], b["later_prompt_n"]),
            "server_prefilled_ratio": ratio(s["server_prefilled"], b["server_prefilled"]),
            "headers_max_delta": headers_delta(mine["requests"], run["requests"]),
        }
    if baselines:
        out["slotkeeper_later_at_most_best"] = (
            s["later_prompt_n"] is not None
            and s["later_prompt_n"] <= out["best_baseline_later_prompt_n"])
        # The same judged over each run's own minimum: at temperature 0 a reply can still differ
        # by a token between targets (a restored slot's numbers are not bit-identical to a
        # batch's), which changes the later prompts' sizes, and the minimum with them.
        excess = {name: later_excess(run["summary"]) for name, run in baselines.items()}
        known = [value for value in excess.values() if value is not None]
        mine_excess = later_excess(s)
        if known:
            out["best_baseline_later_excess"] = min(known)
            out["slotkeeper_later_excess"] = mine_excess
            out["slotkeeper_excess_at_most_best"] = (mine_excess is not None
                                                     and mine_excess <= min(known))
    return out


def later_excess(summary: dict[str, Any]) -> int | None:
    """Later-turn tokens prefilled beyond the minimum (None: not known)."""
    if summary.get("later_prompt_n") is None or summary.get("later_minimum") is None:
        return None
    return summary["later_prompt_n"] - summary["later_minimum"]


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def table(results: dict[str, dict[str, Any]]) -> list[list[str]]:
    """Rows for the summary table: workload, target, later-turn prefill and its minimum, the
    ratio to slotkeeper, the server's whole prefill, headers (max, and slotkeeper's largest
    delta against this target), retries, slot folder at the end."""
    rows = [["workload", "target", "later pre", "later min", "/min", "sk/this", "all pre",
             "hdr max s", "sk hdr +s", "retries", "files", "MiB"]]
    for wl, runs in results.items():
        cmp = runs.get("comparison", {})
        for name, run in runs.items():
            if name == "comparison":
                continue
            s, versus = run["summary"], cmp.get(name, {})
            delta = (versus.get("headers_max_delta") or {}).get("delta_s")
            disk = run.get("slot_dir") or {}
            rows.append([wl, name, fmt(s["later_prompt_n"]), fmt(s["later_minimum"]),
                         fmt(s["later_over_minimum"]), fmt(versus.get("later_prompt_n_ratio")),
                         fmt(s["server_prefilled"]), fmt(s["headers_s_max"]), fmt(delta),
                         fmt(s["retries"]), fmt(disk.get("files")),
                         fmt(round(disk["bytes"] / 2 ** 20, 1) if "bytes" in disk else None)])
    return rows


def markdown(rows: list[list[str]]) -> str:
    """The summary table as Markdown (the first row is the header)."""
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    return "\n".join(lines)
