"""Prometheus metrics: counted where things happen (router.py, addon.py call the one-line
functions below) and served as `GET /metrics` by the proxy itself.

The registry and every metric live in this module's globals. mitmproxy's script reload
re-runs only the entry script (addon/slotkeeper_addon.py); this module stays in sys.modules,
so counters survive a reload. Creating a metric is idempotent (looked up by name first), and
the globals are reused if the module itself is reloaded, so nothing is registered twice.

Every function here is safe to call from any thread and never raises into the caller for a
bad value: metrics must not break routing."""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import threading
import time
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from prometheus_client import (CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, Counter, Histogram,
                               ProcessCollector, generate_latest)
from prometheus_client.core import GaugeMetricFamily

from .models import split_key
from .bodies import route_of

if TYPE_CHECKING:
    from mitmproxy import http

    from .bodies import Timings
    from .routes import Route

log = logging.getLogger("slotkeeper.metrics")

PATH = "/metrics"
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
# The SlotKeeper whose router the scrape-time gauges read (the latest one loaded).
_BOUND: dict[str, Any] = _kept("_BOUND", dict)


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


def routed(path: str, route: Route) -> None:
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


# ---- scrape-time gauges ------------------------------------------------------------------

class _LiveCollector:
    """Gauges read when scraped: slots per upstream from the state file, files and bytes in
    the slot folder, the current prefill speed estimate."""

    def describe(self):
        return []  # no fixed description: collected fresh on each scrape

    def collect(self):
        keeper = _BOUND.get("keeper")
        router = keeper.router if keeper is not None else None
        owned = GaugeMetricFamily("slotkeeper_slots_owned",
                                  "Slots claimed by a session, per upstream.", labels=["upstream"])
        resident = GaugeMetricFamily("slotkeeper_slots_resident",
                                     "Claimed slots whose KV is the owner's (not stale), per "
                                     "upstream.", labels=["upstream"])
        total = GaugeMetricFamily("slotkeeper_slots_total",
                                  "Slots the upstream reports (/props total_slots).",
                                  labels=["upstream"])
        speed = GaugeMetricFamily("slotkeeper_prefill_seconds_per_token",
                                  "Measured prefill seconds per token (moving average), per "
                                  "upstream.", labels=["upstream"])
        files = GaugeMetricFamily("slotkeeper_disk_files",
                                  "slotkeeper's files in the slot folder (state files, "
                                  "metadata, temp files).")
        size = GaugeMetricFamily("slotkeeper_disk_bytes",
                                 "Bytes of slotkeeper's files in the slot folder.")
        member_up = GaugeMetricFamily("slotkeeper_upstream_up",
                                      "Pool: 1 while the server answers /health and takes "
                                      "requests, 0 while it is out.", labels=["upstream"])
        draining = GaugeMetricFamily("slotkeeper_upstream_draining",
                                     "Pool: 1 while the server is drained (its sessions moved "
                                     "out, no new ones).", labels=["upstream"])
        session_server = GaugeMetricFamily(
            "slotkeeper_session_upstream",
            "Pool: 1 for the server that holds each session's claim (one per slot at most, "
            "so bounded by the pool's slot count); resident says whether its KV is there.",
            labels=["session", "upstream", "resident"])
        if router is not None:
            try:
                doc = router.state.read()
            except Exception as e:  # a scrape must answer even with a broken state file
                log.warning("metrics: cannot read the state file: %s", e)
                doc = None
            urls = {url for url, _ in router.upstreams.known()}
            urls |= set(doc.upstreams) if doc is not None else set()
            for url in sorted(urls):
                up = doc.upstreams.get(url) if doc is not None else None
                recs = list(up.slots.values()) if up is not None else []
                owned.add_metric([url], len(recs))
                resident.add_metric([url], sum(1 for r in recs if not r.stale))
            for url, info in router.upstreams.known():
                if info.props is not None:
                    total.add_metric([url], info.props.total_slots)
            for url in router.config.upstreams:
                up = doc.upstreams.get(url) if doc is not None else None
                member_up.add_metric([url], 1 if router.upstreams.get(url).healthy else 0)
                draining.add_metric([url], 1 if up is not None and up.draining else 0)
                for rec in up.slots.values() if up is not None else ():
                    session_server.add_metric([rec.owner, url, str(not rec.stale).lower()], 1)
            if router.folder is not None:
                count, nbytes = router.folder.usage()
                files.add_metric([], count)
                size.add_metric([], nbytes)
        with _LOCK:
            for url, value in sorted(_SPEED.items()):
                speed.add_metric([url], value)
        return [owned, resident, total, speed, files, size, member_up, draining, session_server]


class _SessionModels:
    """Behind a router or llama-swap (issue #22), the model each claimed session is on."""

    def describe(self):
        return []

    def collect(self):
        keeper = _BOUND.get("keeper")
        return [session_models(keeper.router if keeper is not None else None)]


def session_models(router: Any) -> GaugeMetricFamily:
    try:
        doc = router.state.read() if router is not None else None
    except Exception:  # a scrape must answer even with a broken state file (logged above)
        doc = None
    family = GaugeMetricFamily(
        "slotkeeper_session_model",
        "Router or llama-swap (issue #22): 1 for the model each session's claim is on; "
        "resident says whether its KV is loaded there.", labels=["session", "model", "resident"])
    for url, up in doc.upstreams.items() if doc is not None else ():
        model = split_key(url)[1]
        for rec in up.slots.values() if model else ():
            family.add_metric([rec.owner, model, str(not rec.stale).lower()], 1)
    return family


if "session_models" not in _METRICS:
    _METRICS["session_models"] = _SessionModels()
    REGISTRY.register(_METRICS["session_models"])
if "live" not in _METRICS:
    _METRICS["live"] = _LiveCollector()
    REGISTRY.register(_METRICS["live"])
    ProcessCollector(registry=REGISTRY)  # process_cpu_seconds_total, resident memory, fds


def bind(keeper: Any) -> None:
    _BOUND["keeper"] = keeper


def render() -> bytes:
    return generate_latest(REGISTRY)


# ---- the endpoint ----------------------------------------------------------------------------

_METRICS_PATH = re.compile(r"^/metrics/?$")


class MetricsEndpoint:
    """Answers `GET /metrics` on the proxy itself (like /api/sessions), so it works while
    llama-server is down. It shadows llama-server's own /metrics (`--metrics`): scrape the
    server directly for those."""

    def __init__(self, keeper: Any) -> None:
        self.keeper = keeper

    def load(self, loader) -> None:
        bind(self.keeper)

    def on_request(self, flow: http.HTTPFlow) -> Awaitable[None] | None:
        """Answers /metrics; any other request passes on without a coroutine being made for it
        (every request comes here, from front.Front)."""
        if flow.response is not None or not _METRICS_PATH.match(
                flow.request.path.split("?", 1)[0]):
            return None
        return self._answer(flow)

    async def _answer(self, flow: http.HTTPFlow) -> None:
        from mitmproxy import http

        from .access import management_access

        flow.marked = ":information_source:"  # ℹ: drawn by text fonts, unlike emoji
        flow.comment = "slotkeeper metrics"
        denied = management_access(flow, self.keeper.api_token)
        if denied is not None:
            flow.response = denied
            return
        if flow.request.method not in ("GET", "HEAD"):
            flow.response = http.Response.make(405, b"GET /metrics\n",
                                               {"Content-Type": "text/plain", "Allow": "GET"})
            return
        try:
            # Reading the state file and listing the slot folder is blocking I/O.
            body = await asyncio.get_running_loop().run_in_executor(None, render)
        except Exception as e:
            log.exception("rendering metrics failed")
            flow.response = http.Response.make(500, f"{type(e).__name__}: {e}\n".encode(),
                                               {"Content-Type": "text/plain"})
            return
        # Text format 0.0.4: what every Prometheus 2.x and 3.x scraper reads (our names are
        # classic ones, so the newer 1.0.0 format would add nothing).
        flow.response = http.Response.make(200, body, {"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})
