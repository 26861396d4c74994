"""The session API, served by the proxy itself (so it answers while llama-server is down)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Awaitable
from typing import Any
from urllib.parse import unquote

from mitmproxy import http

from ..decisions import placement
from ..guard.access import management_access
from ..wire.replies import error_reply
from .admin import NoSlotDir, SessionAdmin, SlotBusy

log = logging.getLogger("slotkeeper.api")

PREFIX = "/api/sessions"
POOL_PREFIX = "/api/upstreams"  # the pool of llama-servers (issue #13)
# Session ids as identity.py normalises them: printable ASCII, at most 128 characters (plus
# "parent/child"). Anything else cannot name a session: 400, not a file lookup.
VALID_ID = re.compile(r"^[\x21-\x7e]{1,300}$")


def json_response(status: int, payload: Any) -> http.Response:
    return http.Response.make(status, json.dumps(payload, indent=1),
                              {"Content-Type": "application/json"})


def error(status: int, message: str) -> http.Response:
    return error_reply(status, message)


class SessionApi:
    def __init__(self, keeper: Any) -> None:
        # keeper: the addon.SlotKeeper (not imported: addon imports this module)
        self.keeper = keeper

    def on_request(self, flow: http.HTTPFlow) -> Awaitable[None] | None:
        """Answers the API's own paths; any other request passes on without a coroutine being
        made for it (every request comes here, from front.Front)."""
        path = flow.request.path.split("?", 1)[0]
        pool = path == POOL_PREFIX or path.startswith(POOL_PREFIX + "/")
        if flow.response is not None or not (
                pool or path == PREFIX or path.startswith(PREFIX + "/")):
            return None
        return self._answer(flow, path, pool)

    async def _answer(self, flow: http.HTTPFlow, path: str, pool: bool) -> None:
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
        call = (self._dispatch_pool(flow, path[len(POOL_PREFIX):], admin) if pool
                else self._dispatch(flow.request.method, path[len(PREFIX):], admin))
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
    def _dispatch_pool(flow: http.HTTPFlow, rest: str, admin: SessionAdmin):
        """GET /api/upstreams; POST /api/upstreams/drain and /undrain with
        {"upstream": "<base URL of a pool server>"}."""
        method = flow.request.method
        if not admin.router.pool.pooled:
            return error(404, "no pool: slotkeeper_upstreams is not set")
        if rest in ("", "/"):
            return (200, admin.pool, ()) if method == "GET" else error(
                405, f"no such endpoint: {method} {POOL_PREFIX}")
        if rest not in ("/drain", "/undrain"):
            return error(404, f"no such endpoint: {method} {POOL_PREFIX}{rest}")
        if method != "POST":
            return error(405, f"{POOL_PREFIX}{rest} takes POST")
        try:
            body = json.loads(flow.request.get_text(strict=False) or "{}")
            url = placement.parse_upstreams([body["upstream"]])[0]
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            return error(400, f'give {{"upstream": "<base URL of a pool server>"}} ({e})')
        if url not in admin.router.config.upstreams:
            return error(404, f"{url} is not in slotkeeper_upstreams")
        return 200, (admin.drain if rest == "/drain" else admin.undrain), (url,)

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
