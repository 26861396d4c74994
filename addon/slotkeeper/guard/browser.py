"""The browser guard (issue #21, items 1 and 2): the mitmproxy side of origins.py. Listed
first among slotkeeper's addons, so it refuses a request before any other addon answers it.

The Host header a client sent is what tells a DNS-rebinding page from a real client, and
mitmproxy's reverse mode replaces it with the upstream's before any addon hook runs, unless
`keep_host_header` is on. So the guard turns that option on and puts the upstream's Host
back itself, in the first hook (`requestheaders`), after reading the client's: llama-server
sees what it saw before, the guard judges what the client sent."""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence

from mitmproxy import ctx, exceptions, http
from mitmproxy.net.http import url
from mitmproxy.utils import human

from . import cors, origins
from .access import READ_METHODS, error, is_management_path

log = logging.getLogger("slotkeeper.api")

# Every path a rule may apply to starts so (management calls and the Ollama surface's routes);
# on the Ollama port, every path.
GUARDED_PREFIXES = ("/api/", "/slotkeeper/")


class BrowserGuard:
    def __init__(self) -> None:
        self.names: tuple[str, ...] = ()  # host names management calls may use
        self.ollama_origins: tuple[str, ...] = ()
        self.restore_host = False  # keep_host_header was turned on by us, not the user
        self.ollama_port = 0  # slotkeeper_ollama_port, declared by the Ollama surface

    def load(self, loader) -> None:
        loader.add_option("slotkeeper_api_hosts", Sequence[str], [],
                          "Host names (besides IP addresses, localhost, listen_host and this "
                          "machine's name) that management calls (/api/..., /slotkeeper/metrics) may "
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
        self.ollama_port = getattr(opts, "slotkeeper_ollama_port", 0)
        if not opts.keep_host_header:
            self.restore_host = True
            opts.update(keep_host_header=True)

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        """The guard's one hook on a request's path. Each rule reads only the request line and
        headers, so a refusal is decided here; mitmproxy still reads the body, and sends the
        refusal after the request hook, which the other addons skip (`flow.response` set).
        One hook, not four, and a completion only has its Host put back: every hook an addon
        has costs each request mitmproxy's dispatch (docs/BENCHMARKS.md section 3)."""
        req = flow.request
        guarded = req.path.startswith(GUARDED_PREFIXES) or self._on_ollama_port(flow)
        host = (req.host_header or "") if guarded else ""
        if self.restore_host and flow.client_conn.proxy_mode.type_name == "reverse":
            # What mitmproxy does without keep_host_header (proxy/layers/http): the upstream's.
            req.host_header = url.hostport(req.scheme, req.host, req.port)
        if not guarded:
            return
        path = req.path.split("?", 1)[0]
        if is_management_path(path):
            flow.response = self._management_refusal(req, host)
        elif path.startswith("/api/") or self._on_ollama_port(flow):
            flow.response = self._ollama_refusal(flow)
        if flow.response is not None:
            req.stream = False  # mitmproxy cannot stream a body to a request it answers

    def _management_refusal(self, req: http.Request, host: str) -> http.Response | None:
        refusal: tuple[int, str] | None = None
        if not origins.host_allowed(host, self.names):
            refusal = 403, (f"Host {host[:100]!r} is not a name this proxy answers management "
                            f"calls under (DNS rebinding?); add it to slotkeeper_api_hosts")
        elif req.method.upper() not in READ_METHODS:
            refusal = origins.mutation_refusal(
                req.method.upper(), req.headers.get("origin"),
                req.headers.get("content-type", ""), announces_body(req.headers), host)
        if refusal is None:
            return None
        log.warning("management call %s %s refused (%d): %s", req.method, req.path[:100],
                    refusal[0], refusal[1])
        return error(*refusal)

    def _on_ollama_port(self, flow: http.HTTPFlow) -> bool:
        """On the Ollama port every route is Ollama's (elsewhere only /api/...)."""
        sockname = flow.client_conn.sockname
        return bool(self.ollama_port) and bool(sockname) and sockname[1] == self.ollama_port

    def _ollama_refusal(self, flow: http.HTTPFlow) -> http.Response | None:
        """403 for a page of a foreign origin, as Ollama answers it. A request let through gets
        its answer's CORS headers decided here (cors.ANSWER_KEY, put on the answer by the
        keeper's responseheaders): the origin let in, never llama-server's `*`; none without
        an Origin."""
        origin = flow.request.headers.get("origin")
        if origin is None:
            flow.metadata[cors.ANSWER_KEY] = {"Access-Control-Allow-Origin": None}
            return None
        if origins.origin_allowed(origin, self.ollama_origins):
            flow.metadata[cors.ANSWER_KEY] = {"Access-Control-Allow-Origin": origin,
                                              "Vary": "Origin"}
            return None
        log.info("%s %s refused (403): origin %r is not allowed (slotkeeper_ollama_origins)",
                 flow.request.method, flow.request.path[:100], origin[:100])
        return http.Response.make(403, b"", {})  # as Ollama answers a foreign origin


def announces_body(headers: http.Headers) -> bool:
    """Whether a request's headers say a body follows (read before the body is)."""
    return headers.get("content-length", "0").strip() not in ("", "0") or (
        "transfer-encoding" in headers)


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
