"""The session API, served by the proxy itself (so it answers while llama-server is down)."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import re
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from mitmproxy import http

from .router import NoSlotDir, SessionAdmin, SlotBusy

if TYPE_CHECKING:
    from .addon import SlotKeeper

log = logging.getLogger("slotkeeper.api")

PREFIX = "/api/sessions"
# Session ids as identity.py normalises them: printable ASCII, at most 128 characters (plus
# "parent/child"). Anything else cannot name a session: 400, not a file lookup.
VALID_ID = re.compile(r"^[\x21-\x7e]{1,300}$")


def json_response(status: int, payload: Any) -> http.Response:
    return http.Response.make(status, json.dumps(payload, indent=1),
                              {"Content-Type": "application/json"})


def error(status: int, message: str) -> http.Response:
    return json_response(status, {"error": {"code": status, "message": message}})


# ---- who may call the management endpoints ---------------------------------------------------

READ_METHODS = frozenset({"GET", "HEAD"})


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
    """The one access check for slotkeeper's own endpoints (/api/..., /metrics): None when the
    call may go on, else the answer to give instead.

    - No token configured: loopback clients only (403 for others), every method.
    - A token configured (slotkeeper_api_token): loopback clients may read (GET, HEAD)
      without it; every other call needs `Authorization: Bearer <token>` (401 without it):
      changes from any client, and reads from other machines, since the session list names
      every user's sessions.
    The Authorization header is redacted from the flow, so mitmweb never shows the token."""
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
    if flow.request.method.upper() in READ_METHODS and is_loopback(host):
        return None
    scheme, _, value = given.strip().partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(
            value.strip().encode("utf-8", "surrogatepass"), token.encode()):
        return None
    log.warning("management call %s %s from %s refused: missing or wrong API token",
                flow.request.method, flow.request.path[:100], host)
    response = error(401, "send 'Authorization: Bearer <token>' with the token set in "
                          "slotkeeper_api_token (needed for changes, and for reads from "
                          "other machines)")
    response.headers["WWW-Authenticate"] = 'Bearer realm="slotkeeper"'
    return response


class SessionApi:
    def __init__(self, keeper: SlotKeeper) -> None:
        self.keeper = keeper

    async def request(self, flow: http.HTTPFlow) -> None:
        path = flow.request.path.split("?", 1)[0]
        if flow.response is not None or not (path == PREFIX or path.startswith(PREFIX + "/")):
            return
        flow.marked = ":gear:"
        flow.comment = "slotkeeper API"
        denied = management_access(flow, self.keeper.api_token)
        if denied is not None:
            flow.response = denied
            return
        router = self.keeper.router
        if router is None:
            flow.response = error(503, "slotkeeper is not configured")
            return
        admin = SessionAdmin(router)
        call = self._dispatch(flow.request.method, path[len(PREFIX):], admin)
        if isinstance(call, http.Response):
            flow.response = call
            return
        status, func, args = call
        try:
            result = await asyncio.get_running_loop().run_in_executor(
                self.keeper.pool, func, *args)
        except NoSlotDir:
            flow.response = error(409, self.keeper.slot_dir_problem)
            return
        except SlotBusy as e:
            flow.response = error(409, str(e))
            return
        except Exception as e:
            log.exception("session API call failed")
            flow.response = error(500, f"{type(e).__name__}: {e}")
            return
        if result is None:
            flow.response = error(404, "unknown session id")
        else:
            flow.response = json_response(status, result)

    @staticmethod
    def _dispatch(method: str, rest: str, admin: SessionAdmin):
        if rest in ("", "/") and method == "GET":
            return 200, lambda: {"sessions": admin.saved()}, ()
        if rest == "/current" and method == "GET":
            return 200, admin.current, ()
        if rest == "/clear" and method == "POST":
            return 200, admin.clear, ()
        if rest.startswith("/") and method == "DELETE" and rest not in ("/current", "/clear"):
            session = unquote(rest[1:])
            if not VALID_ID.match(session):
                return error(400, "malformed session id: printable ASCII, 1-300 characters")
            return 200, admin.forget, (session,)
        return error(405 if rest in ("", "/", "/current", "/clear") else 404,
                     f"no such endpoint: {method} {PREFIX}{rest}")
