"""Access: who may call slotkeeper's own endpoints (/api/..., /metrics). One check, used by
the session API and the metrics endpoint; it imports only the error builder (replies.py), so
both can use it without an import cycle."""

from __future__ import annotations

import hmac
import ipaddress
import logging

from mitmproxy import http

from ..wire.replies import error_reply

log = logging.getLogger("slotkeeper.api")


def error(status: int, message: str) -> http.Response:
    return error_reply(status, message)


READ_METHODS = frozenset({"GET", "HEAD"})
# slotkeeper's own metrics have a path of their own: `/metrics` is llama-server's (issue #32).
METRICS_PATH = "/slotkeeper/metrics"
MANAGEMENT_PREFIXES = ("/api/sessions", "/api/upstreams")


def is_management_path(path: str) -> bool:
    """slotkeeper's own endpoints (the path without its query): the session and pool APIs
    and its metrics."""
    if path.rstrip("/") == METRICS_PATH:
        return True
    return any(path == p or path.startswith(p + "/") for p in MANAGEMENT_PREFIXES)


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and IPv4-mapped loopback (::ffff:127.0.0.1); anything else, including
    a name or garbage, is not."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def management_access(flow: http.HTTPFlow, token: str) -> http.Response | None:
    """The one access check for slotkeeper's own endpoints (/api/..., its metrics): None when the
    call may go on, else the answer to give instead.

    - No token configured: loopback clients only (403 for others), every method.
    - A token configured (slotkeeper_api_token): every call needs `Authorization: Bearer
      <token>` (401 without it), loopback clients included (issue #21: any local process or
      web page could read the session list, which names every user's sessions).
    The Authorization header is redacted from the flow, so mitmweb never shows the token.
    Browsers (Host, Origin, content type) are refused before this, by guard.BrowserGuard."""
    peer = flow.client_conn.peername
    host = str(peer[0]) if peer else ""
    if not token:
        if is_loopback(host):
            return None
        log.warning("management call %s %s from %s refused: loopback only (no "
                    "slotkeeper_api_token)", flow.request.method, flow.request.path[:100], host)
        return error(403, "slotkeeper's management endpoints answer loopback clients only; "
                          "set slotkeeper_api_token to allow other clients")
    given = flow.request.headers.get("authorization", "")
    if given:
        flow.request.headers["authorization"] = "Bearer <redacted>"
    scheme, _, value = given.strip().partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(
            value.strip().encode("utf-8", "surrogatepass"), token.encode()):
        return None
    log.warning("management call %s %s from %s refused: missing or wrong API token",
                flow.request.method, flow.request.path[:100], host)
    response = error(401, "send 'Authorization: Bearer <token>' with the token set in "
                          "slotkeeper_api_token (needed for every management call)")
    response.headers["WWW-Authenticate"] = 'Bearer realm="slotkeeper"'
    return response


