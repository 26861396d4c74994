"""The pure part of scripts/bench-profiles and scripts/paper-profiles (issue #31): published
GPU profiles, the throttle cap that gives the test bed a profile's cost ratios, the inter-token
gaps of the streams and what overlapped them, the bytes that went through the slot folder, and
the projection of the measured counts onto each profile. No processes, no I/O.

Every rate of a profile names its source (`sources`); KV bytes a token are computed from the
model card (config.json): 2 (K and V) x layers x KV heads x head dim x 2 bytes (f16)."""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from baselinebench import fmt

MiB = 2 ** 20
GB = 1e9


@dataclass(frozen=True)
class Profile:
    name: str
    label: str
    model: str
    layers: int
    kv_heads: int
    head_dim: int
    prefill_tps: float  # llama.cpp prompt processing, tokens/s
    decode_tps: float  # llama.cpp token generation, tokens/s (one stream)
    save_bps: float  # bytes/s a slot save writes (device -> host -> disk)
    restore_bps: float  # bytes/s a slot restore reads (disk -> host -> device)
    np: int | None = None  # the deployment's -np, when it is fixed (70B on 3 GPUs: 1)
    sources: tuple[str, ...] = field(default=())
    # bytes/s llama-server's RAM prompt cache moves between the GPU and host memory (PCIe)
    host_copy_bps: float = 25.0 * GB

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"kv_bytes_per_token": self.kv_bytes_per_token}


# Compute rates: llama.cpp's own llama-bench, CUDA, all layers on the GPU(s), one source for
# all three (the same harness and llama.cpp build): XiongjieDai/GPU-Benchmarks-on-LLM-Inference,
# README, "LLaMA 3" NVIDIA table (May 2024) and "LLaMA" table (Dec 2023).
GPU_BENCH = "https://github.com/XiongjieDai/GPU-Benchmarks-on-LLM-Inference (README)"
# Save/restore rates: llama-server's own slot save/restore path (single-threaded fwrite/fread of
# each layer's K and V, through the page cache), measured uncapped on this machine by the
# calibrations (1.4-2.8 GB/s save, 2.8-3.5 GB/s restore, runs of 2026-12-06); a PCIe 4.0 NVMe
# (Samsung 990 PRO: 6.9 GB/s write, 7.45 GB/s read sequential, its data sheet) and a GPU's
# PCIe 4.0 x16 copy (~25 GB/s) are both faster, so the server's own path is the limit we take.
# The RAM prompt cache's copies: llama_state_seq_get/set_data of the slot's K and V between the
# GPU and host memory, over PCIe 4.0 x16 (all three profiles' GPUs): 31.5 GB/s a direction by
# the PCIe 4.0 specification, ~25 GB/s taken for what a copy reaches. The server copies into
# ordinary (pageable) buffers, which is slower: 25 GB/s prices the cache at its cheapest, in
# the baselines' favour.
PCIE = ("host copies 25 GB/s: PCIe 4.0 x16 (31.5 GB/s a direction by its specification, ~25 "
        "GB/s taken for a copy); the server's pageable buffers are slower")
DISK = ("save 2 GB/s, restore 3 GB/s: llama-server's own save/restore path, measured uncapped "
        "here (calibration); NVMe and PCIe 4.0 are faster")

PROFILES: dict[str, Profile] = {p.name: p for p in (
    Profile(
        "rtx4090-llama8b", "Llama-3.1-8B Q4_K_M on one RTX 4090", "meta-llama/Llama-3.1-8B",
        layers=32, kv_heads=8, head_dim=128,
        prefill_tps=5265.68, decode_tps=127.74, save_bps=2.0 * GB, restore_bps=3.0 * GB,
        sources=(f"{GPU_BENCH}: 4090 24GB, 8B Q4_K_M, pp 4096 5,265.68 t/s, tg 1024 127.74 t/s",
                 "KV: Llama-3.1-8B config.json (32 layers, 8 KV heads, head dim 4096/32)",
                 DISK, PCIE)),
    Profile(
        "rtx4090-qwen32b", "Qwen2.5-32B Q4 on one RTX 4090", "Qwen/Qwen2.5-32B-Instruct",
        layers=64, kv_heads=8, head_dim=128,
        prefill_tps=1414.5, decode_tps=40.09, save_bps=2.0 * GB, restore_bps=3.0 * GB,
        sources=(f"{GPU_BENCH}: 4090 24GB, LLaMA 30B q4_0 (32.5B parameters, the source's "
                 "one-GPU ~32B model), mean PP 1,414.5 t/s, mean TG 40.09 t/s",
                 "KV: Qwen2.5-32B-Instruct config.json (64 layers, 8 KV heads, head dim 128)",
                 DISK, PCIE)),
    Profile(
        "3x3090-llama70b", "Llama-3.3-70B Q4_K_M on three RTX 3090, -np 1",
        "meta-llama/Llama-3.3-70B-Instruct", layers=80, kv_heads=8, head_dim=128,
        prefill_tps=373.6, decode_tps=15.8, save_bps=2.0 * GB, restore_bps=3.0 * GB, np=1,
        sources=(f"{GPU_BENCH}: Llama 3 70B Q4_K_M, 3090 24GB * 2: pp 4096 379.52, tg 4096 "
                 "15.36; * 4: pp 4096 367.75, tg 4096 16.24 (no * 3 row; layer split runs "
                 "the GPUs one after the other, so 3 lies between: their mean)",
                 "KV: Llama-3.3-70B-Instruct config.json (80 layers, 8 KV heads, head dim 128)",
                 DISK, PCIE)),
)}


# ---- the cap ----------------------------------------------------------------------------------

def derive_cap(profile: Profile, bed_prefill_tps: float, bed_kv_bytes_per_token: float,
               bed_decode_tps: float) -> dict[str, Any]:
    """The bytes/s of the throttled slot folder that makes restoring a token cost, relative to
    prefilling it, what it costs on `profile`:

        restore s/token / prefill s/token  =  (kv / restore_bps) / (1 / prefill_tps)

    on the profile; on the bed restore s/token = kv_bed / cap, prefill s/token = 1 / bed rate,
    so cap = kv_bed x bed_prefill_tps / ratio  =  restore_bps x (kv_bed / kv) x (bed / prefill).
    One bucket serves reads and writes, so a save costs kv_bed / cap a token too: the save
    ratio is the restore ratio (the profile's own differs by restore_bps / save_bps)."""
    kv = profile.kv_bytes_per_token
    restore_ratio = kv / profile.restore_bps * profile.prefill_tps
    save_ratio = kv / profile.save_bps * profile.prefill_tps
    cap = bed_kv_bytes_per_token * bed_prefill_tps / restore_ratio
    # The RAM prompt cache: a token's copy to or from host memory, relative to its prefill.
    host_copy_ratio = kv / profile.host_copy_bps * profile.prefill_tps
    # Stalls: a save of one token's KV, in decode steps of another stream.
    profile_save_per_decode = kv / profile.save_bps * profile.decode_tps
    bed_save_per_decode = bed_kv_bytes_per_token / cap * bed_decode_tps
    return {
        "profile": profile.name,
        "profile_kv_bytes_per_token": kv,
        "profile_restore_s_per_token": kv / profile.restore_bps,
        "profile_prefill_s_per_token": 1 / profile.prefill_tps,
        "restore_over_prefill": restore_ratio,
        "profile_save_over_prefill": save_ratio,
        "bed_prefill_tps": bed_prefill_tps,
        "bed_decode_tps": bed_decode_tps,
        "bed_kv_bytes_per_token": bed_kv_bytes_per_token,
        "cap_bytes_per_s": cap,
        "bed_restore_s_per_token": bed_kv_bytes_per_token / cap,
        # what the bed's llama-server (scripts/bed/*.patch) waits for each token it copies into
        # or out of its RAM prompt cache: the profile's PCIe copy at the bed's pace
        "host_copy_over_prefill": host_copy_ratio,
        "bed_host_copy_us_per_token": host_copy_ratio / bed_prefill_tps * 1e6,
        # how many decode steps of another stream one token's save holds up
        "profile_save_token_in_decode_steps": profile_save_per_decode,
        "bed_save_token_in_decode_steps": bed_save_per_decode,
        "decode_ratio_bed_over_profile": bed_save_per_decode / profile_save_per_decode,
        # prefill tokens/s over decode tokens/s: how much of a turn is prefill
        "profile_prefill_over_decode": profile.prefill_tps / profile.decode_tps,
        "bed_prefill_over_decode": bed_prefill_tps / bed_decode_tps,
        # how much slower the bed runs than the profile (prefill, and so restores and saves):
        # a bed second is 1/dilation of a profile second; an absolute bound (the stall budget,
        # 500 ms) is that many times tighter here than on the profile
        "time_dilation": profile.prefill_tps / bed_prefill_tps,
    }


def line_fit(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least squares bytes = fixed + per_token x tokens; returns (fixed, per_token)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - slope * mx, slope


# ---- the server's log ------------------------------------------------------------------------

HOST_COPY = re.compile(r"slotkeeper-bed: host copy of (\d+) tokens")
PROMPT_EVAL = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
EVAL = re.compile(r"\|\s*eval time =\s*([\d.]+) ms /\s*(\d+) tokens")


def log_counts(text: str) -> dict[str, Any]:
    """Prompt tokens prefilled and tokens generated, as llama-server's log reports them (every
    request, slotkeeper's own seed builds included), with the server's own milliseconds, and
    the tokens the bed's server copied through its RAM prompt cache (counted only when it
    charges them)."""
    prompt = [(float(ms), int(n)) for ms, n in PROMPT_EVAL.findall(text)]
    decode = [(float(ms), int(n)) for ms, n in EVAL.findall(text)]
    return {"prefilled": sum(n for _, n in prompt), "prefill_ms": round(sum(m for m, _ in prompt)),
            "decoded": sum(n for _, n in decode), "decode_ms": round(sum(m for m, _ in decode)),
            "prompt_evals": len(prompt),
            # the bed's server (scripts/bed/*.patch): copies into and out of its RAM prompt cache
            "host_copies": len(copies := [int(n) for n in HOST_COPY.findall(text)]),
            "host_copy_tokens": sum(copies)}


# ---- the slot folder's traffic ----------------------------------------------------------------

KV_FILE_MIN_BYTES = 1 * MiB  # a slot file of the test model is at least its ~4.6 MiB fixed part


def io_summary(entries: Sequence[dict[str, Any]], since: float | None = None,
               until: float | None = None, server_pid: int | None = None) -> dict[str, Any]:
    """Bytes written and read in the slot folder (every file: slot files and slotkeeper's
    metadata), and the slot files' saves (written) and restores (read), from the throttled
    folder's log. `since`/`until` keep the files closed in that window."""
    keep = [e for e in entries if (since is None or e["close"] >= since)
            and (until is None or e["close"] <= until)]
    saves = [e for e in keep if e["written"] >= KV_FILE_MIN_BYTES]
    reads = [e for e in keep if e["read"] >= KV_FILE_MIN_BYTES]
    # a restore is llama-server reading a slot file; slotkeeper reads some itself (checks)
    restores = [e for e in reads if server_pid is None or e.get("pid") in (None, server_pid)]
    return {
        "proxy_reads": len(reads) - len(restores),
        "proxy_read_bytes": sum(e["read"] for e in reads if e not in restores),
        "proxy_read_charged": round(sum(e.get("charged", 0) for e in reads if e not in restores)),
        "bytes_written": sum(e["written"] for e in keep),
        "bytes_read": sum(e["read"] for e in keep),
        # bytes as KV of a model without a sliding window (scripts/throttlelog.py charged())
        "charged_written": round(sum(e.get("charged", 0) for e in saves)),
        "charged_read": round(sum(e.get("charged", 0) for e in restores)),
        "saves": len(saves), "save_bytes": [e["written"] for e in saves],
        "save_charged": [round(e.get("charged", 0)) for e in saves],
        "restore_charged": [round(e.get("charged", 0)) for e in restores],
        "save_s": [round(e["last"] - e["first"], 3) for e in saves],
        "restores": len(restores), "restore_bytes": [e["read"] for e in restores],
        "restore_s": [round(e["last"] - e["first"], 3) for e in restores],
    }




# ---- streams ---------------------------------------------------------------------------------

def io_intervals(entries: Sequence[dict[str, Any]],
                 server_pid: int | None = None) -> list[tuple[float, float, str, str]]:
    """(start, end, 'save'|'restore', path) of each slot file llama-server wrote or read."""
    out = []
    for e in entries:
        if e["first"] is None or (server_pid is not None
                                  and e.get("pid") not in (None, server_pid)):
            continue
        if e["written"] >= KV_FILE_MIN_BYTES:
            out.append((e["open"], e["close"], "save", e["path"]))
        elif e["read"] >= KV_FILE_MIN_BYTES:
            out.append((e["open"], e["close"], "restore", e["path"]))
    return out


def stream_gaps(streams: Sequence[dict[str, Any]],
                intervals: Sequence[tuple[float, float, str, str]]) -> dict[str, Any]:
    """Inter-token gaps of every stream (after its first token: before it, the stream's own
    prefill and restore), the largest, and the largest that a save or restore overlapped.
    `streams`: {"key": ..., "token_at": [perf_counter, ...]}. A gap inside a stream is time in
    which the server did something else: another slot's prefill batch, or a save/restore, which
    llama-server runs on its main loop (every slot stalls)."""
    gaps: list[float] = []
    worst: dict[str, Any] | None = None
    worst_io: dict[str, Any] | None = None
    for s in streams:
        times = s["token_at"]
        for a, b in zip(times, times[1:]):
            gap = b - a
            gaps.append(gap)
            # a save or restore that took at least 50 ms of the gap (or a tenth of it)
            overlap = [(k, p, round(min(b, e) - max(a, st), 3)) for st, e, k, p in intervals
                       if min(b, e) - max(a, st) >= min(0.05, gap / 10)]
            row = {"gap_s": round(gap, 3), "request": s["key"], "io": overlap}
            if worst is None or gap > worst["gap_s"]:
                worst = row
            if overlap and (worst_io is None or gap > worst_io["gap_s"]):
                worst_io = row
    return {
        "gaps": len(gaps),
        "median_s": round(statistics.median(gaps), 4) if gaps else None,
        "p99_s": round(percentile(gaps, 99), 4) if gaps else None,
        "max": worst,
        "max_during_io": worst_io,
        "over_0_5_s": sum(1 for g in gaps if g > 0.5),
    }


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def ttft_summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Time to first token of the conversations' turns (kind main), p50 and p95, and of the
    later turns alone (turn >= 2, where keeping KV pays)."""
    main = [r["ttft_s"] for r in rows if r["kind"] == "main" and r.get("ttft_s") is not None]
    later = [r["ttft_s"] for r in rows
             if r["kind"] == "main" and r["turn"] >= 2 and r.get("ttft_s") is not None]
    return {"turns": len(main),
            "p50_s": round(percentile(main, 50), 3) if main else None,
            "p95_s": round(percentile(main, 95), 3) if main else None,
            "max_s": round(max(main), 3) if main else None,
            "later_p50_s": round(percentile(later, 50), 3) if later else None,
            "later_p95_s": round(percentile(later, 95), 3) if later else None}


# ---- on paper ----------------------------------------------------------------------------------

def project(run: dict[str, Any], profile: Profile, per_token: float) -> dict[str, Any]:
    """A target's measured counts priced at the profile's published rates, one thing at a time
    (no overlap: llama-server runs saves and restores on its main loop, and one stream at a time
    here): prefill tokens / prefill_tps + decoded tokens / decode_tps + KV saved / save_bps +
    KV restored / restore_bps + KV copied by the RAM prompt cache / host_copy_bps (counted by
    the bed's server; 0 in results from upstream's build). The slot files' charged bytes (the test model's full-attention KV,
    scripts/throttlelog.py charged()) over its bytes a token are tokens of KV, priced at the
    profile's bytes a token."""
    counts = run["counts"]
    io = run.get("io") or {}
    kv = profile.kv_bytes_per_token
    saved = sum(io.get("save_charged", [])) / per_token * kv
    restored = sum(io.get("restore_charged", [])) / per_token * kv
    # slotkeeper reads a snapshot in full itself (its crc32) after each save and before each
    # restore: disk time too, before a restore on the request's path
    checked = io.get("proxy_read_charged", 0) / per_token * kv
    parts = {
        "prefill_s": counts["prefilled"] / profile.prefill_tps,
        "decode_s": counts["decoded"] / profile.decode_tps,
        "save_s": saved / profile.save_bps,
        "restore_s": restored / profile.restore_bps,
        "proxy_read_s": checked / profile.restore_bps,
        # the RAM prompt cache's copies, where the bed's server counted them (--host-copy)
        "host_copy_s": counts.get("host_copy_tokens", 0) * kv / profile.host_copy_bps,
    }
    return {k: round(v, 2) for k, v in parts.items()} | {
        "total_s": round(sum(parts.values()), 2),
        "saved_gib": round(saved / 2 ** 30, 2), "restored_gib": round(restored / 2 ** 30, 2)}


def result_table(workloads: dict[str, dict[str, Any]]) -> list[list[str]]:
    """Per workload and target: wall, TTFT p50/p95 of the turns, the largest inter-token gap
    (and the largest a save/restore overlapped), bytes written to the slot folder (in all and per
    turn), prefilled tokens."""
    rows = [["workload", "target", "wall s", "TTFT p50 s", "TTFT p95 s", "max gap s",
             "max gap in save/restore s", "MiB written", "MiB / turn", "saves", "restores",
             "prefilled"]]
    for wl, runs in workloads.items():
        for name, run in runs.items():
            if name.startswith("_"):
                continue
            t, g, io = run["ttft"], run["gaps"], run.get("io") or {}
            turns = t["turns"] or 1
            written = io.get("bytes_written", 0)
            rows.append([wl, name, fmt(run["wall_s"], 1), fmt(t["p50_s"]), fmt(t["p95_s"]),
                         fmt((g["max"] or {}).get("gap_s")),
                         fmt((g["max_during_io"] or {}).get("gap_s")),
                         fmt(written / MiB, 1), fmt(written / MiB / turns, 1),
                         fmt(io.get("saves", 0)), fmt(io.get("restores", 0)),
                         fmt(run["counts"]["prefilled"])])
    return rows


def same_shape(flags: tuple[str, ...]) -> tuple[str, ...]:
    """The target's flags with `--slot-prompt-similarity` always given, in one width (its
    default, 0.10, where the target leaves it). Every target's llama-server then has a command
    line of one shape: the same arguments, each of the same length, `--slot-save-path` on a
    folder whose path has one length (only slotkeeper's server uses it). Measured here
    (BENCHMARKS 7, "The bed's own spread"): the first 5,849-token prompt on fresh servers
    prefilled at 280-291 tokens/s with the test bed's flags alone, and at 252-262 tokens/s with
    `-sps 0`, `-sps 0.1` (the default's own value) or `--slot-save-path DIR` added, run after
    run, with server logs alike line for line: the arguments change where the server's memory
    lies (our reading), not its work. Compared with different shapes, the targets measured
    that, not the policy."""
    similarity, rest = "0.10", []
    given = iter(flags)
    for flag in given:
        if flag in ("--slot-prompt-similarity", "-sps"):
            similarity = f"{float(next(given)):.2f}"
        else:
            rest.append(flag)
    return ("--slot-prompt-similarity", similarity, *rest)


def repeat_summary(run: dict[str, Any]) -> dict[str, Any]:
    return {"wall_s": run["wall_s"], "ttft_p95_s": run["ttft"]["p95_s"],
            "prefill_ms": run["counts"].get("prefill_ms"),
            "max_gap_s": (run["gaps"]["max"] or {}).get("gap_s"),
            "bytes_written": (run.get("io") or {}).get("bytes_written", 0)}


def repeat_table(workloads: dict[str, dict[str, Any]]) -> list[list[str]]:
    """With --repeat: every run's wall time, TTFT p95 and server prefill time, and their
    means. Fresh llama-server processes on this bed differ by up to ~10% in prefill speed run
    to run (BENCHMARKS 7, "The bed's own spread"); the repeats run in reverse order every other
    time, so a drift of the machine falls on every target alike."""
    rows = [["workload", "target", "wall s (runs)", "wall s (mean)", "TTFT p95 s (runs)",
             "TTFT p95 s (mean)", "server prefill s (mean)"]]
    for wl, runs in workloads.items():
        for name, run in runs.items():
            reps = run.get("repeats") or []
            walls = [r["wall_s"] for r in reps]
            p95s = [r["ttft_p95_s"] for r in reps if r["ttft_p95_s"] is not None]
            prefill = [r["prefill_ms"] / 1000 for r in reps if r["prefill_ms"] is not None]
            rows.append([wl, name, " / ".join(f"{w:.1f}" for w in walls),
                         f"{statistics.mean(walls):.1f}",
                         " / ".join(f"{p:.2f}" for p in p95s),
                         f"{statistics.mean(p95s):.2f}" if p95s else "-",
                         f"{statistics.mean(prefill):.1f}" if prefill else "-"])
    return rows
