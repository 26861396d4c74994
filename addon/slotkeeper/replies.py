"""The answers slotkeeper writes itself, in the error shape of the API the client speaks: one
builder for every JSON answer and one for every error (the session API, the access check,
SlotKeeper's refusals, the Ollama and Anthropic surfaces)."""

from __future__ import annotations

import json
from typing import Any

from mitmproxy import http

from . import anthropic

OPENAI = "openai"  # llama-server's own routes and slotkeeper's: {"error": {code, message, type}}
OLLAMA = "ollama"  # {"error": "message"}
ANTHROPIC = "anthropic"  # {"type": "error", "error": {"type", "message"}}


def error_payload(status: int, message: str, api: str = OPENAI) -> dict[str, Any]:
    if api == OLLAMA:
        return {"error": message}
    if api == ANTHROPIC:
        return anthropic.error_object(status, message)
    return {"error": {"code": status, "message": message, "type": "slotkeeper"}}


def json_reply(status: int, payload: Any, headers: dict[str, str] | None = None
               ) -> http.Response:
    return http.Response.make(status, json.dumps(payload, ensure_ascii=False).encode(),
                              {"Content-Type": "application/json", **(headers or {})})


def error_reply(status: int, message: str, api: str = OPENAI) -> http.Response:
    return json_reply(status, error_payload(status, message, api))
