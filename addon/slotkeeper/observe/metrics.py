"""Prometheus metrics: counted where things happen (the rooms and the hooks call the one-line
functions below); served as `GET /metrics` by manage/scrape.py, which adds the gauges read at
scrape time.

The registry and every metric live in this module's globals. mitmproxy's script reload
re-runs only the entry script (addon/slotkeeper_addon.py); this module stays in sys.modules,
so counters survive a reload. Creating a metric is idempotent (looked up by name first), and
the globals are reused if the module itself is reloaded, so nothing is registered twice.

Every function here is safe to call from any thread and never raises into the caller for a
bad value: metrics must not break routing."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from ..wire.bodies import Timings, route_of

# Prefill speed: an exponential moving average of prompt_ms / prompt_n over responses that
# prefilled at least this many tokens (a handful of tokens is dominated by per-request
# overhead, not by the prefill itself).
EMA_ALPHA = 0.2
EMA_MIN_TOKENS = 32
# Slot operations take from a millisecond (erase, a small restore) to a minute (building the
# seed of a long system prompt: ~150 tokens/s on the 2-core test machine).
OP_BUCKETS = (.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120)
ROUTING_BUCKETS = (.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1,
                   2.5, 5, 10, 30, 60, 300, 600)
OPERATIONS = ("save", "restore", "erase", "seed_build")



def _kept(name: str, make: Any) -> Any:
    """The value `name` had before this module was re-executed (importlib.reload), else new."""
    return globals()[name] if name in globals() else make()


REGISTRY: CollectorRegistry = _kept("REGISTRY", CollectorRegistry)
_METRICS: dict[str, Any] = _kept("_METRICS", dict)
_LOCK: threading.Lock = _kept("_LOCK", threading.Lock)
# upstream -> seconds per prefilled token (EMA); upstream -> reused tokens not yet credited
_SPEED: dict[str, float] = _kept("_SPEED", dict)
_PENDING: dict[str, int] = _kept("_PENDING", dict)


def _metric(kind: type, name: str, doc: str, labels: tuple[str, ...] = (), **kwargs: Any):
    existing = _METRICS.get(name)
    if existing is None:
        existing = kind(name, doc, labels, registry=REGISTRY, **kwargs)
        _METRICS[name] = existing
    return existing


REQUESTS = _metric(Counter, "slotkeeper_requests",
                   "Completion requests by endpoint and routing outcome (kept, assigned, "
                   "restored, seeded, side, client, fallback, unpinned, passed_through, "
                   "rejected, error).", ("endpoint", "action"))
ROUTING_SECONDS = _metric(Histogram, "slotkeeper_routing_seconds",
                          "Time to decide a request's slot (including any save/restore "
                          "handover), by action.", ("action",), buckets=ROUTING_BUCKETS)
PROMPT_TOKENS = _metric(Counter, "slotkeeper_prompt_tokens",
                        "Prompt tokens of routed requests, from the responses' timings: "
                        "reused from the slot's KV (cache_n) or prefilled (prompt_n).",
                        ("kind",))
SECONDS_SAVED = _metric(Counter, "slotkeeper_prefill_seconds_saved",
                        "Estimated prefill time saved: reused tokens times the measured "
                        "prefill seconds per token (a moving average of recent responses).")
SLOT_OPS = _metric(Counter, "slotkeeper_slot_operations",
                   "Slot operations on llama-server (save, restore, erase, seed_build) by "
                   "outcome.", ("operation", "outcome"))
SLOT_OP_BYTES = _metric(Counter, "slotkeeper_slot_operation_bytes",
                        "Bytes written by saves and read by restores.", ("operation",))
SLOT_OP_TOKENS = _metric(Counter, "slotkeeper_slot_operation_tokens",
                         "Tokens saved, restored, or prefilled into seeds.", ("operation",))
SLOT_OP_SECONDS = _metric(Histogram, "slotkeeper_slot_operation_seconds",
                          "Duration of successful slot operations.", ("operation",),
                          buckets=OP_BUCKETS)
RESTORE_MISSES = _metric(Counter, "slotkeeper_restore_misses",
                         "Restored snapshots (or seeds) the server did not reuse.", ("kind",))
RESTORE_REFUSED = _metric(Counter, "slotkeeper_restore_refused",
                         "Snapshots (or seeds) found but not restored, by why: fingerprint "
                         "(another model, build, slot layout, LoRA or model file), size, "
                         "checksum, truncated, messages, ...", ("reason",))
RAM_CACHE = _metric(Counter, "slotkeeper_ram_cache",
                   "Handovers that left the incoming session to llama-server's RAM prompt "
                   "cache instead of a disk restore, by what the answer's cache_n said: hit "
                   "(reused) or miss (prefilled again; the next ones restore from disk).",
                   ("result",))
EVICTIONS = _metric(Counter, "slotkeeper_evictions",
                    "Sessions displaced from their slot, by what displaced them (another "
                    "session's handover, or a side request) and whether their KV was saved "
                    "first.", ("by", "saved"))
SLOT_MISMATCHES = _metric(Counter, "slotkeeper_slot_mismatches",
                          "Routed requests that llama-server ran on another slot than the one "
                          "slotkeeper pinned (read back from /slots after the answer).")
FALLBACKS = _metric(Counter, "slotkeeper_fallbacks",
                    "Requests hashed over the slot count (or left unpinned) because /slots "
                    "was unusable, by reason.", ("reason",))

PLACEMENTS = _metric(Counter, "slotkeeper_placements",
                    "Pool (slotkeeper_upstreams): requests placed on each server, by why "
                    "(stay, cheapest, moved, turn, least busy).", ("upstream", "reason"))
SAVES_SKIPPED = _metric(Counter, "slotkeeper_saves_skipped",
                       "Saves not run, by why: stall_budget (an idle or periodic save put off "
                       "while another slot generates), write_budget (the hour's bytes spent), "
                       "cheaper_to_prefill (its write and read cost more than re-prefilling).",
                       ("reason",))
RESTORES_SKIPPED = _metric(Counter, "slotkeeper_restores_skipped",
                           "Snapshots not restored because reading them takes longer than "
                           "prefilling their tokens at this server's measured speeds.")
SWAP_SAVES = _metric(Counter, "slotkeeper_swap_saves",
                     "Sessions saved because their model was about to be unloaded (a request "
                     "for another model behind a router or llama-swap, or an unload passing "
                     "through), by that model.", ("model",))

for _op in OPERATIONS:  # zeros from the start, so rates work before the first event
    for _outcome in ("ok", "failed"):
        SLOT_OPS.labels(_op, _outcome)
for _kind in ("reused", "prefilled"):
    PROMPT_TOKENS.labels(_kind)
RESTORE_REFUSED.labels("fingerprint")  # zero from the start: an alert can watch it


# ---- observations (one-line calls from addon.py / router.py) ------------------------------

def endpoint_of(path: str) -> str:
    return route_of(path)


@functools.cache
def _child(metric: Any, *labels: str) -> Any:
    """A labelled series of `metric`, looked up once: `labels()` validates and locks on every
    call, a cost each request paid twice on the hot path. The keys are the metric's own label
    values (few: endpoints, actions, kinds), which prometheus_client keeps for good anyway."""
    return metric.labels(*labels)


def request(path: str, action: str) -> None:
    """A completion request that was not routed (passed through, rejected, or an error)."""
    _child(REQUESTS, endpoint_of(path), action).inc()


class Routed(Protocol):
    """What `routed` reads of a request's route (routing/routes.py `Route`)."""

    upstream: str
    action: str
    placement: str
    ms: float


def routed(path: str, route: Routed) -> None:
    _child(REQUESTS, endpoint_of(path), route.action).inc()
    if route.placement:
        placed(route.upstream, route.placement)
    _child(ROUTING_SECONDS, route.action).observe(max(route.ms, 0.0) / 1000)


def placed(upstream: str, reason: str) -> None:
    PLACEMENTS.labels(upstream, reason).inc()


def timings(upstream: str, t: Timings | None) -> None:
    """A routed response's timings: count its tokens, update the prefill speed estimate and
    credit the reused tokens with the time they would have taken to prefill."""
    if t is None:
        return
    cache_n, prompt_n = max(t.cache_n, 0), max(t.prompt_n, 0)
    _child(PROMPT_TOKENS, "reused").inc(cache_n)
    _child(PROMPT_TOKENS, "prefilled").inc(prompt_n)
    with _LOCK:
        speed = _SPEED.get(upstream)
        if prompt_n >= EMA_MIN_TOKENS and t.prompt_ms > 0:
            sample = t.prompt_ms / 1000 / prompt_n
            speed = sample if speed is None else speed + EMA_ALPHA * (sample - speed)
            _SPEED[upstream] = speed
        if speed is None:  # no measurement yet: credit these at the first measured speed
            _PENDING[upstream] = _PENDING.get(upstream, 0) + cache_n
            return
        credit = cache_n + _PENDING.pop(upstream, 0)
    SECONDS_SAVED.inc(credit * speed)


def slot_op(operation: str, ok: bool = True, seconds: float | None = None,
            nbytes: int | None = None, tokens: int | None = None) -> None:
    SLOT_OPS.labels(operation, "ok" if ok else "failed").inc()
    if not ok:
        return
    if seconds is not None:
        SLOT_OP_SECONDS.labels(operation).observe(max(seconds, 0.0))
    if nbytes:
        SLOT_OP_BYTES.labels(operation).inc(max(int(nbytes), 0))
    if tokens:
        SLOT_OP_TOKENS.labels(operation).inc(max(int(tokens), 0))


@contextmanager
def timed(operation: str) -> Iterator[None]:
    """Count the block as one `operation`: ok with its duration, or failed if it raises."""
    started = time.monotonic()
    try:
        yield
    except BaseException:
        slot_op(operation, ok=False)
        raise
    slot_op(operation, seconds=time.monotonic() - started)


def seed_built(tokens: int, seconds: float) -> None:
    slot_op("seed_build", seconds=seconds, tokens=tokens)


def slot_mismatch() -> None:
    SLOT_MISMATCHES.inc()


def restore_miss(kind: str) -> None:
    RESTORE_MISSES.labels(kind).inc()


def ram_cache(hit: bool) -> None:
    RAM_CACHE.labels("hit" if hit else "miss").inc()


def save_skipped(reason: str) -> None:
    SAVES_SKIPPED.labels(reason).inc()


def restore_skipped() -> None:
    RESTORES_SKIPPED.inc()


def swap_saved(model: str) -> None:
    SWAP_SAVES.labels(model).inc()


# A snapshot check's reason (slotfiles.restorable, SlotFolder.check) -> a label.
_REFUSALS = (("model changed", "fingerprint"), ("retired", "retired"),
             ("not a llama state file", "not_a_state_file"), ("version", "version"),
             ("exceeds slot n_ctx", "too_long"), ("truncated", "truncated"),
             ("bytes, the save wrote", "size"), ("tokens, the save recorded", "tokens"),
             ("messages, request has", "messages"), ("missing", "missing"),
             ("changed since its save", "checksum"))


def restore_refused(why: str) -> None:
    """A snapshot that exists was not restored; `why` is the check's reason text."""
    reason = next((r for text, r in _REFUSALS if text in why), "other")
    RESTORE_REFUSED.labels(reason).inc()


def eviction(by: str, saved: bool) -> None:
    EVICTIONS.labels(by, "true" if saved else "false").inc()


_REASONS = (("no slot could be locked", "lock_timeout"), ("reports no slots", "no_slots"))


def fallback(why: str) -> None:
    """`why` is free text (it may carry an exception message): mapped to a few reasons."""
    reason = next((r for text, r in _REASONS if text in why), "slots_unavailable")
    FALLBACKS.labels(reason).inc()


def prefill_seconds_per_token(upstream: str) -> float | None:
    with _LOCK:
        return _SPEED.get(upstream)


def prefill_speeds() -> dict[str, float]:
    """Every upstream's measured prefill seconds per token."""
    with _LOCK:
        return dict(_SPEED)


C = TypeVar("C")


def collector(name: str, make: Callable[[], C]) -> C:
    """The scrape-time collector registered as `name`, made and registered on first use: kept
    across reloads like every metric here, so it is never registered twice."""
    with _LOCK:
        existing = _METRICS.get(name)
        if existing is None:
            existing = _METRICS[name] = make()
            REGISTRY.register(existing)
        return existing


def render() -> bytes:
    return generate_latest(REGISTRY)


if "process" not in _METRICS:
    _METRICS["process"] = ProcessCollector(registry=REGISTRY)  # CPU seconds, memory, fds
