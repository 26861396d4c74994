"""The plain load balancers that scripts/bench-pool measures slotkeeper's pool against: a
mitmproxy addon that spreads requests over several llama-servers and does nothing else (no
session pinning, no slot choice, no KV saving; each llama-server picks its own slot, by prompt
similarity, as it does without slotkeeper).

    mitmdump --mode reverse:URL1@PORT -s scripts/pool_baselines.py \\
        --set pool_upstreams=URL1 --set pool_upstreams=URL2 --set pool_placement=least-busy

Placements (`pool_placement`):
- `round-robin`: the next live server in turn.
- `least-busy`: the live server with the fewest busy slots, where busy is the larger of
  `/slots` entries with `is_processing` and the requests this balancer has sent there that
  have not finished (a request just forwarded may not show in `/slots` yet); ties go round
  robin. This is "least connections" (nginx `least_conn`, HAProxy `leastconn`) with the
  server's own view of its load added.

Both skip a server that does not answer (`/health` for round-robin, `/slots` for least-busy,
1 s timeout, asked before every request), as a balancer with health checks does: after a
server dies its requests go to the others instead of failing. Each answer carries
`X-Pool-Upstream: URL` so the bench can see where a request went."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import urllib.request
from collections.abc import Sequence
from urllib.parse import urlsplit

from mitmproxy import ctx, http

PLACEMENTS = ("round-robin", "least-busy")
PROBE_TIMEOUT_S = 1.0


def choose_upstream(placement: str, loads: Sequence[int | None], turn: int) -> int | None:
    """The index of the server to send a request to, or None if every server is down.
    `loads[i]` is server i's busy count, None when it did not answer. `turn` is a counter
    that grows by one per request: round-robin starts its search there, least-busy breaks
    ties with it, so equal servers take turns."""
    n = len(loads)
    order = [(turn + k) % n for k in range(n)]
    live = [i for i in order if loads[i] is not None]
    if not live:
        return None
    if placement == "round-robin":
        return live[0]
    if placement == "least-busy":
        return min(live, key=lambda i: loads[i])  # min keeps the first of equals: turn order
    raise ValueError(f"unknown placement {placement!r}: one of {', '.join(PLACEMENTS)}")


def busy_slots(slots: object) -> int:
    """How many slots of a `/slots` answer are processing."""
    if not isinstance(slots, list):
        raise ValueError("/slots did not answer a list")
    return sum(1 for slot in slots if isinstance(slot, dict) and slot.get("is_processing"))


def _get(url: str) -> object:
    with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S) as response:
        return json.loads(response.read() or b"null")


class PoolBalancer:
    """Chooses each request's server; counts the requests in flight per server."""

    def __init__(self) -> None:
        self.turns = itertools.count()
        self.in_flight: dict[str, int] = {}
        self.lock = threading.Lock()

    def load(self, loader) -> None:
        loader.add_option("pool_upstreams", Sequence[str], [],
                          "llama-server URLs to balance over (repeat the option).")
        loader.add_option("pool_placement", str, "round-robin",
                          f"How to choose a server: {' | '.join(PLACEMENTS)}.")

    def configure(self, updated: set[str]) -> None:
        if "pool_placement" in updated and ctx.options.pool_placement not in PLACEMENTS:
            raise ValueError(f"pool_placement must be one of {', '.join(PLACEMENTS)}")
        if "pool_upstreams" in updated:
            for url in ctx.options.pool_upstreams:
                parts = urlsplit(url)
                if parts.scheme not in ("http", "https") or not parts.hostname:
                    raise ValueError(f"pool_upstreams: not an http(s) URL: {url!r}")

    def _probe(self, url: str, placement: str) -> int | None:
        try:
            if placement == "round-robin":
                _get(url + "/health")
                return 0
            slots = busy_slots(_get(url + "/slots"))
        except (OSError, ValueError):
            return None  # down, or not a llama-server: skipped this time
        with self.lock:
            return max(slots, self.in_flight.get(url, 0))

    async def request(self, flow: http.HTTPFlow) -> None:
        upstreams = [u.rstrip("/") for u in ctx.options.pool_upstreams]
        if not upstreams:
            return  # plain reverse proxy to the --mode upstream
        placement = ctx.options.pool_placement
        loads = await asyncio.gather(*(asyncio.to_thread(self._probe, url, placement)
                                       for url in upstreams))
        index = choose_upstream(placement, loads, next(self.turns))
        if index is None:
            flow.response = http.Response.make(503, b"no upstream answers\n",
                                               {"Content-Type": "text/plain"})
            return
        url = upstreams[index]
        parts = urlsplit(url)
        flow.request.scheme = parts.scheme
        flow.request.host = parts.hostname
        flow.request.port = parts.port or (443 if parts.scheme == "https" else 80)
        flow.metadata["pool_upstream"] = url
        with self.lock:
            self.in_flight[url] = self.in_flight.get(url, 0) + 1

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        url = flow.metadata.get("pool_upstream")
        if url and flow.response is not None:
            flow.response.headers["X-Pool-Upstream"] = url
            if flow.response.headers.get("content-type", "").startswith("text/event-stream"):
                flow.response.stream = True  # pass SSE on as it comes, as slotkeeper does

    def _finished(self, flow: http.HTTPFlow) -> None:
        url = flow.metadata.pop("pool_upstream", None)
        if url:
            with self.lock:
                self.in_flight[url] = max(0, self.in_flight.get(url, 0) - 1)

    def response(self, flow: http.HTTPFlow) -> None:
        self._finished(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._finished(flow)


addons = [PoolBalancer()]
