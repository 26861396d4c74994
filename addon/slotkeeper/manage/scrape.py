"""slotkeeper's metrics endpoint, `/slotkeeper/metrics`: its counters (observe/metrics.py) plus the gauges read
when scraped (slots per upstream from the state file, the slot folder's files and bytes, the
prefill speed estimate, the pool's members, the session each model holds), served by the
proxy itself so that it answers while llama-server is down."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable
from typing import Any

from mitmproxy import http
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..guard.access import METRICS_PATH, management_access
from ..observe import metrics
from ..upstream.models import split_key

log = logging.getLogger("slotkeeper.metrics")

# Its own path: `/metrics` is llama-server's (`--metrics`) and passes through unchanged, so a
# client or scraper that reads the server's metrics through the proxy still gets them (#32).
PATH = METRICS_PATH


# What each server costs, measured from its answers and slot calls (upstream/costs.py, #31).
MEASURED_RATES = (
    ("prefill_tokens_per_s", "Measured prefill speed (tokens/s, moving average), per upstream."),
    ("decode_tokens_per_s", "Measured generation speed (tokens/s, moving average), per "
                            "upstream."),
    ("save_bytes_per_s", "Measured slot save speed (bytes/s of n_written over save_ms), per "
                         "upstream."),
    ("restore_bytes_per_s", "Measured slot restore speed (bytes/s of n_read over "
                            "restore_ms), per upstream."),
    ("kv_bytes_per_token", "Measured bytes a token adds to a saved slot (the slope of the "
                           "sizes of the latest saves and restores), per upstream."),
    ("slot_fixed_bytes", "Measured bytes of a saved slot that do not grow with its tokens "
                         "(that line at 0 tokens), per upstream."),
)



def _metric_name(rate: str) -> str:
    return "slotkeeper_" + rate.replace("_per_s", "_per_second")


class LiveGauges:
    """Gauges read when scraped: slots per upstream from the state file, files and bytes in
    the slot folder, the current prefill speed estimate. `keeper`: the SlotKeeper whose router
    they read (the latest one loaded)."""

    keeper: Any = None

    def describe(self):
        return []  # no fixed description: collected fresh on each scrape

    def collect(self):
        router = self.keeper.router if self.keeper is not None else None
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
        for url, value in sorted(metrics.prefill_speeds().items()):
            speed.add_metric([url], value)
        return [owned, resident, total, speed, files, size, member_up, draining, session_server]


class MeasuredCosts:
    """What each server costs, as its answers and slot calls measured it (issue #31)."""

    keeper: Any = None

    def describe(self):
        return []

    def collect(self):
        router = self.keeper.router if self.keeper is not None else None
        families = {name: GaugeMetricFamily(_metric_name(name), doc, labels=["upstream"])
                    for name, doc in MEASURED_RATES}
        for url, info in router.upstreams.known() if router is not None else ():
            rates = info.client.costs.rates().as_dict()
            for name, family in families.items():
                if rates[name] is not None:
                    family.add_metric([url], rates[name])
        return list(families.values())


class SessionModels:
    """Behind a router or llama-swap (issue #22), the model each claimed session is on."""

    keeper: Any = None

    def describe(self):
        return []

    def collect(self):
        return [session_models(self.keeper.router if self.keeper is not None else None)]


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


class StoreHealth:
    """Whether the shared store answers (issue #33): 0 while etcd is unreachable and requests
    pass through unpinned; the state file is always 1 (a broken file is rebuilt)."""

    keeper: Any = None

    def describe(self):
        return []

    def collect(self):
        router = self.keeper.router if self.keeper is not None else None
        conn = getattr(getattr(router, "state", None), "conn", None)  # etcd's EtcdState only
        up = GaugeMetricFamily("slotkeeper_store_reachable",
                               "1 while the shared store answers; 0 while etcd is unreachable "
                               "(requests pass through unpinned).")
        failures = CounterMetricFamily("slotkeeper_store_unreachable",
                                       "Store calls that found every etcd endpoint down.")
        if router is not None:
            up.add_metric([], 0 if conn is not None and not conn.reachable else 1)
            failures.add_metric([], conn.failures if conn is not None else 0)
        return [up, failures]


GAUGES = (("live", LiveGauges), ("session_models", SessionModels),
          ("measured_costs", MeasuredCosts), ("store", StoreHealth))
for _name, _make in GAUGES:  # registered from the start: empty until a keeper is bound
    metrics.collector(_name, _make)


def bind(keeper: Any) -> None:
    """The scrape-time gauges read this SlotKeeper's router from now on."""
    for name, make in GAUGES:
        metrics.collector(name, make).keeper = keeper


# ---- the endpoint ----------------------------------------------------------------------------

_METRICS_PATH = re.compile("^" + re.escape(PATH) + "/?$")


class MetricsEndpoint:
    """Answers `GET /slotkeeper/metrics` on the proxy itself (like /api/sessions), so it
    works while llama-server is down. llama-server's own `/metrics` is not shadowed: it passes
    through like any of the server's routes."""

    def __init__(self, keeper: Any) -> None:
        self.keeper = keeper

    def load(self, loader) -> None:
        bind(self.keeper)

    def on_request(self, flow: http.HTTPFlow) -> Awaitable[None] | None:
        """Answers its path; any other request passes on without a coroutine being made for it
        (every request comes here, from front.Front)."""
        if flow.response is not None or not _METRICS_PATH.match(
                flow.request.path.split("?", 1)[0]):
            return None
        return self._answer(flow)

    async def _answer(self, flow: http.HTTPFlow) -> None:
        flow.marked = ":information_source:"  # ℹ: drawn by text fonts, unlike emoji
        flow.comment = "slotkeeper metrics"
        denied = management_access(flow, self.keeper.api_token)
        if denied is not None:
            flow.response = denied
            return
        if flow.request.method not in ("GET", "HEAD"):
            flow.response = http.Response.make(405, f"GET {PATH}\n".encode(),
                                               {"Content-Type": "text/plain", "Allow": "GET"})
            return
        try:
            # Reading the state file and listing the slot folder is blocking I/O.
            body = await asyncio.get_running_loop().run_in_executor(None, metrics.render)
        except Exception as e:
            log.exception("rendering metrics failed")
            flow.response = http.Response.make(500, f"{type(e).__name__}: {e}\n".encode(),
                                               {"Content-Type": "text/plain"})
            return
        # Text format 0.0.4: what every Prometheus 2.x and 3.x scraper reads (our names are
        # classic ones, so the newer 1.0.0 format would add nothing).
        flow.response = http.Response.make(200, body, {"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})
