"""The browser guard (issue #21, items 1 and 2): the mitmproxy side of origins.py. Listed
first among slotkeeper's addons, so it refuses a request before any other addon answers it.

The Host header a client sent is what tells a DNS-rebinding page from a real client, and
mitmproxy's reverse mode replaces it with the upstream's before any addon hook runs, unless
`keep_host_header` is on. So the guard turns that option on and puts the upstream's Host
back itself, in the first hook (`requestheaders`), keeping the client's in the flow's
metadata: llama-server sees what it saw before, the guard sees what the client sent."""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence

from mitmproxy import ctx, exceptions, http
from mitmproxy.net.http import url
from mitmproxy.utils import human

from . import origins
from .access import READ_METHODS, error, is_management_path

log = logging.getLogger("slotkeeper.api")

# flow.metadata from requestheaders to the guard's request hook: the Host the client sent
CLIENT_HOST_KEY = "slotkeeper_client_host"
# flow.metadata, set on every Ollama-route request the guard let through: the Origin that
# origins.origin_allowed let in, or "" when the request had none (no page's). Absent: not an
# Ollama route (the surface rewrites the path later, so the answer is told by this key). The
# Ollama surface's CORS answers read it in the request hook; the guard's response hook (the
# first) removes it.
OLLAMA_ORIGIN_KEY = "slotkeeper_ollama_origin"


class BrowserGuard:
    def __init__(self) -> None:
        self.names: tuple[str, ...] = ()  # host names management calls may use
        self.ollama_origins: tuple[str, ...] = ()
        self.restore_host = False  # keep_host_header was turned on by us, not the user

    def load(self, loader) -> None:
        loader.add_option("slotkeeper_api_hosts", Sequence[str], [],
                          "Host names (besides IP addresses, localhost, listen_host and this "
                          "machine's name) that management calls (/api/..., /metrics) may "
                          "name in their Host header; any other is refused (DNS rebinding).")
        loader.add_option("slotkeeper_ollama_origins", Sequence[str], [],
                          "Browser origins allowed on the Ollama routes besides loopback ones "
                          "and app schemes, like Ollama's OLLAMA_ORIGINS (`*` wildcards, e.g. "
                          "https://*.example.com; `*` alone: every origin).")

    def configure(self, updated: set[str]) -> None:
        opts = ctx.options
        for name in opts.slotkeeper_api_hosts:
            if not name or not all(c.isalnum() or c in "-._" for c in name):
                raise exceptions.OptionsError(f"slotkeeper_api_hosts: {name!r} is not a host "
                                              f"name")
        for origin in opts.slotkeeper_ollama_origins:
            if not origin or any(c.isspace() for c in origin):
                raise exceptions.OptionsError(f"slotkeeper_ollama_origins: {origin!r} is not "
                                              f"an origin")
        self.names = (opts.listen_host, socket.gethostname(), *opts.slotkeeper_api_hosts)
        self.ollama_origins = tuple(opts.slotkeeper_ollama_origins)
        if not opts.keep_host_header:
            self.restore_host = True
            opts.update(keep_host_header=True)

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        req = flow.request
        flow.metadata[CLIENT_HOST_KEY] = req.host_header or ""
        if self.restore_host and flow.client_conn.proxy_mode.type_name == "reverse":
            # What mitmproxy does without keep_host_header (proxy/layers/http): the upstream's.
            req.host_header = url.hostport(req.scheme, req.host, req.port)

    def request(self, flow: http.HTTPFlow) -> None:
        host = flow.metadata.pop(CLIENT_HOST_KEY, None)  # internal: not kept in saved flows
        if flow.response is not None:
            return
        path = flow.request.path.split("?", 1)[0]
        if is_management_path(path):
            flow.response = self._management_refusal(flow, host)
        elif self._ollama_route(flow, path):
            flow.response = self._ollama_refusal(flow)

    def _management_refusal(self, flow: http.HTTPFlow, host: str | None) -> http.Response | None:
        req = flow.request
        host = req.host_header or "" if host is None else host
        refusal: tuple[int, str] | None = None
        if not origins.host_allowed(host, self.names):
            refusal = 403, (f"Host {host[:100]!r} is not a name this proxy answers management "
                            f"calls under (DNS rebinding?); add it to slotkeeper_api_hosts")
        elif req.method.upper() not in READ_METHODS:
            refusal = origins.mutation_refusal(
                req.method.upper(), req.headers.get("origin"),
                req.headers.get("content-type", ""), bool(req.raw_content), host)
        if refusal is None:
            return None
        log.warning("management call %s %s refused (%d): %s", req.method, req.path[:100],
                    refusal[0], refusal[1])
        return error(*refusal)

    def _ollama_route(self, flow: http.HTTPFlow, path: str) -> bool:
        """The Ollama surface's routes on any port, and every route on the Ollama port."""
        if path.startswith("/api/"):
            return True
        sockname = flow.client_conn.sockname
        port = getattr(ctx.options, "slotkeeper_ollama_port", 0)
        return bool(port) and bool(sockname) and sockname[1] == port

    def _ollama_refusal(self, flow: http.HTTPFlow) -> http.Response | None:
        origin = flow.request.headers.get("origin")
        if origin is None:
            flow.metadata[OLLAMA_ORIGIN_KEY] = ""
            return None
        if origins.origin_allowed(origin, self.ollama_origins):
            flow.metadata[OLLAMA_ORIGIN_KEY] = origin
            return None
        log.info("%s %s refused (403): origin %r is not allowed (slotkeeper_ollama_origins)",
                 flow.request.method, flow.request.path[:100], origin[:100])
        return http.Response.make(403, b"", {})  # as Ollama answers a foreign origin

    def response(self, flow: http.HTTPFlow) -> None:
        """Answers made by the proxy itself (the Ollama surface's) meet no responseheaders.
        The guard's metadata ends here: saved flows keep none of it."""
        self.responseheaders(flow)
        flow.metadata.pop(OLLAMA_ORIGIN_KEY, None)

    def error(self, flow: http.HTTPFlow) -> None:
        flow.metadata.pop(CLIENT_HOST_KEY, None)
        flow.metadata.pop(OLLAMA_ORIGIN_KEY, None)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        """An Ollama route's answer names the origin it let in (never llama-server's `*`)."""
        response = flow.response
        origin = flow.metadata.get(OLLAMA_ORIGIN_KEY)
        if response is None or origin is None:
            return
        if not origin:
            response.headers.pop("access-control-allow-origin", None)
        else:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Vary"] = "Origin"


class BodyLimit:
    """mitmproxy's own `body_size_limit`, derived from slotkeeper_max_body_mb (issue #21,
    item 6). Without it mitmproxy buffers a request body whole, whatever its size, before
    any addon sees it: a 200 MB body cost 200 MB of the proxy's memory just to be refused.
    The limit is 1 MiB above slotkeeper's: a body just over slotkeeper's limit still gets its
    JSON 413 naming the option; anything larger is refused by mitmproxy (413) as it arrives.
    A body_size_limit the user set is left alone; the shipped mitm.conf's (the default
    slotkeeper_max_body_mb's limit) is not the user's, so `--set slotkeeper_max_body_mb=N`
    with that file still moves it. Listed after SlotKeeper, which declares and checks
    slotkeeper_max_body_mb."""

    def __init__(self) -> None:
        self.ours: str | None = None  # the value this addon set, so it may change it again

    def configure(self, updated: set[str]) -> None:
        opts = ctx.options
        if opts.slotkeeper_max_body_mb < 1:
            return  # refused by SlotKeeper.configure
        current = opts.body_size_limit
        want = limit_for(opts.slotkeeper_max_body_mb)
        shipped = limit_for(opts.default("slotkeeper_max_body_mb"))
        if current is not None and current not in (self.ours, shipped):
            if human.parse_size(current) < human.parse_size(want):
                log.warning("body_size_limit %s is below slotkeeper_max_body_mb (%d MiB): "
                            "mitmproxy refuses bodies slotkeeper would take; set it to %s",
                            current, opts.slotkeeper_max_body_mb, want)
            return
        if current != want:
            self.ours = want
            opts.update(body_size_limit=want)


def limit_for(max_body_mb: int) -> str:
    """mitmproxy's body_size_limit for slotkeeper_max_body_mb: 1 MiB above it."""
    return f"{max_body_mb + 1}m"
