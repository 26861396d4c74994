"""What a flow carries and shows about its routing: the metadata keys, markers, comment and
headers, the request's target and body as forwarded, and slotkeeper's own error answers.
mitmproxy glue without decisions; the hooks (addon.py) call these."""

from __future__ import annotations

import logging
from collections.abc import Callable

from mitmproxy import http

from .identity.identity import Identity
from .observe import metrics
from .observe.contentview import flow_comment
from .routing.routes import (
    ASSIGNED,
    CLIENT,
    FALLBACK,
    KEPT,
    RESTORED,
    SEEDED,
    SIDE,
    UNPINNED,
    Route,
)
from .wire import bodies
from .wire.bodies import BodyError, BodyRefused, SseTimingsWatcher, Timings
from .wire.replies import error_reply as error_response

log = logging.getLogger("slotkeeper")

ROUTE_KEY = "slotkeeper_route"  # flow.metadata: the Route object
SUMMARY_KEY = "slotkeeper"  # flow.metadata: a plain dict, shown by mitmweb and `~meta`
WATCH_KEY = "slotkeeper_sse"

# One marker per outcome. mitmweb shows a marker only as the character of a known emoji
# shortcode (any other string becomes a red-circle emoji), so these are shortcodes of plain
# symbols that common text fonts have (DejaVu Sans: Debian's default) and that browsers draw
# as text: coloured emoji showed as empty boxes on a machine without an emoji font.
# `~marker heavy_check_mark` finds the kept flows in mitmdump and saved flows; mitmweb filters
# on the character itself, so use `~comment "· kept"` there.
MARKERS = {
    KEPT: ":heavy_check_mark:",  # ✔
    ASSIGNED: ":arrow_forward:",  # ▶
    RESTORED: ":leftwards_arrow_with_hook:",  # ↩
    SEEDED: ":shamrock:",  # ☘
    SIDE: ":arrow_right_hook:",  # ↪
    CLIENT: ":point_up:",  # ☝
    FALLBACK: ":warning:",  # ⚠
    UNPINNED: ":black_small_square:",  # ▪
    "error": ":heavy_multiplication_x:",  # ✖
}


def upstream_of(flow: http.HTTPFlow) -> str:
    """Each upstream has its own slot space, keyed by its URL. In reverse mode the request
    already points at the target, so several `--mode reverse:URL@PORT` stay apart."""
    req = flow.request
    host = req.host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 literal needs its brackets in a URL (fault 6)
    return f"{req.scheme}://{host}:{req.port}"


def point_at(flow: http.HTTPFlow, url: str) -> None:
    """Send the flow to `url` (a pool server's base URL, placement.parse_upstreams form).
    mitmproxy opens the server connection from the request's scheme, host and port after the
    request hook, in reverse mode too; the Host header follows them (Request.host/port
    setters), so the server sees its own address, as with one reverse-mode upstream."""
    if upstream_of(flow) == url:
        return
    scheme, _, rest = url.partition("://")
    host, _, port = rest.rpartition(":")
    req = flow.request
    req.scheme = scheme
    req.host = host.strip("[]")
    req.port = int(port)


def without_empty_chunks(stream: Callable[[bytes], bytes]) -> Callable[[bytes], list[bytes]]:
    """A translation often has nothing to send for a chunk (half an event, an event the client
    API has no counterpart for). mitmproxy sends each returned bytes as one HTTP/1 chunk, and
    an empty one is the chunked terminator `0\r\n\r\n`: the client would see the body end
    there (measured: the Ollama client then read the real terminator as the next status
    line). An empty list sends nothing."""
    def send(chunk: bytes) -> list[bytes]:
        out = stream(chunk)
        return [out] if out else []
    return send


def write_body(flow: http.HTTPFlow, body: bytes) -> None:
    """Forward a plain JSON body with an exact Content-Length, whatever encoding and framing
    (gzip, chunked) it arrived with."""
    flow.request.raw_content = body  # plain: no content-encoding is left to apply
    set_headers(flow.request.headers, {"content-length": str(len(body))},
                drop=(b"content-encoding", b"transfer-encoding"))


def set_headers(headers: http.Headers, values: dict[str, str],
                drop: tuple[bytes, ...] = ()) -> None:
    """Set several headers (replacing any of the same names) and remove the `drop` ones in one
    pass over the raw fields: each `headers[name] = value` scans them all again, which showed
    on the hot path."""
    new = tuple((name.encode(), value.encode("utf-8", "surrogateescape"))
                for name, value in values.items())
    gone = {name.lower() for name, _ in new}.union(drop)
    headers.fields = tuple(f for f in headers.fields if f[0].lower() not in gone) + new


def describe(flow: http.HTTPFlow, ident: Identity, route: Route) -> None:
    """The flow comment (a column in mitmweb), its marker and metadata."""
    flow.marked = MARKERS.get(route.action, "")
    flow.metadata[SUMMARY_KEY] = {
        "session": route.session,
        "rule": route.rule,
        "parent": ident.parent_id,
        "slot": route.slot,
        "action": route.action,
        "detail": route.detail,
        "routing_ms": round(route.ms, 2),
        **({"server": route.upstream, "placement": route.placement} if route.placement else {}),
        **({"model": route.model} if route.model else {}),
        **({"swap_saved": route.swap_saved} if route.swap_saved else {}),
        "prompt_chars": ident.prompt_chars,
        "messages": ident.message_count,
    }
    flow.comment = flow_comment(flow.metadata[SUMMARY_KEY])


def note_pass_through(flow: http.HTTPFlow, why: str, marker: str = UNPINNED) -> None:
    flow.comment = f"passed through unchanged: {why}"
    flow.marked = MARKERS[marker]
    flow.metadata[SUMMARY_KEY] = {"action": "passed through", "why": why}
    metrics.request(flow.request.path, "error" if marker == "error" else "passed_through")
    log.info("%s %s passed through unchanged: %s", flow.request.method, flow.request.path, why)


def read_body(flow: http.HTTPFlow, max_bytes: int) -> tuple[bytes, dict]:
    """The decoded body's JSON text, and the object parsed from it: a surface that rewrote
    the body left both (bodies.PARSED_KEY), else the one body read (bodies.read_body)."""
    raw = flow.request.raw_content
    parsed = flow.metadata.pop(bodies.PARSED_KEY, None)
    if parsed is not None and raw is not None and parsed[0] == raw:
        return parsed
    text = bodies.read_body(raw, flow.request.headers.get("content-encoding", ""), max_bytes)
    return text, bodies.parse_json_object(text)


def checked_body(flow: http.HTTPFlow, max_bytes: int) -> tuple[bytes, dict, int | None] | None:
    """A completion's body: its JSON text, its object and the client's own id_slot; None when
    the flow was answered here (refused) or is passed through unchanged."""
    try:
        body_text, data = read_body(flow, max_bytes)
    except BodyRefused as e:
        # Too large, or nested deeper than anything we (or llama-server) should parse:
        # answered here, never forwarded.
        flow.response = error_response(e.status, str(e))
        metrics.request(flow.request.path, "rejected")
        log.info("%s %s refused (%d): %s", flow.request.method, flow.request.path, e.status, e)
        return None
    except BodyError as e:
        note_pass_through(flow, str(e))
        return None
    try:
        client_slot = bodies.client_slot(data)
        bodies.check_cache_prompt(data)
    except BodyError as e:
        flow.response = error_response(400, str(e))
        metrics.request(flow.request.path, "rejected")
        return None
    return body_text, data, client_slot


def refuse_if_too_deep(flow: http.HTTPFlow, max_bytes: int) -> None:
    """Any other POST is forwarded as it came, except JSON nested deep enough to crash
    llama-server (a segfault at ~110,000 levels on every endpoint, b11434): 400."""
    raw = flow.request.raw_content
    if not raw or len(raw) > max_bytes:
        return
    try:
        body = bodies.decode_body(raw, flow.request.headers.get("content-encoding", ""),
                                  max_bytes)
    except BodyError:
        return
    if bodies.nested_too_deep(body):
        flow.response = error_response(400, "request body is JSON nested too deeply")
        log.info("%s %s refused (400): JSON nested too deeply", flow.request.method,
                 flow.request.path)


def timings_of(flow: http.HTTPFlow) -> Timings | None:
    """The answer's timings: from the SSE watcher of a streamed answer, else the JSON body."""
    watcher: SseTimingsWatcher | None = flow.metadata.pop(WATCH_KEY, None)
    if watcher is not None:
        return watcher.timings
    if flow.response is None or flow.response.status_code != 200:
        return None
    return bodies.timings_in_json(flow.response.content or b"")
