"""The answers slotkeeper writes itself, in the error shape of the API the client speaks: one
builder for every JSON answer and one for every error (the session API, the access check,
SlotKeeper's refusals, the Ollama and Anthropic surfaces)."""

from __future__ import annotations

import json
from typing import Any

from mitmproxy import http

OPENAI = "openai"  # llama-server's own routes and slotkeeper's: {"error": {code, message, type}}
OLLAMA = "ollama"  # {"error": "message"}
ANTHROPIC = "anthropic"  # {"type": "error", "error": {"type", "message"}}


def error_payload(status: int, message: str, api: str = OPENAI) -> dict[str, Any]:
    if api == OLLAMA:
        return {"error": message}
    if api == ANTHROPIC:
        return {"type": "error", "error": anthropic_error(status, {"message": message})}
    return {"error": {"code": status, "message": message, "type": "slotkeeper"}}


def json_reply(status: int, payload: Any, headers: dict[str, str] | None = None
               ) -> http.Response:
    return http.Response.make(status, json.dumps(payload, ensure_ascii=False).encode(),
                              {"Content-Type": "application/json", **(headers or {})})


def error_reply(status: int, message: str, api: str = OPENAI) -> http.Response:
    return json_reply(status, error_payload(status, message, api))


# Anthropic's error types: llama-server's error type -> Anthropic's, and by HTTP status when
# the server named none (the Messages API's documented errors).
ANTHROPIC_ERROR_TYPES = {
    "invalid_request_error": "invalid_request_error",
    "exceed_context_size_error": "invalid_request_error",
    "not_supported_error": "invalid_request_error",
    "authentication_error": "authentication_error",
    "permission_error": "permission_error",
    "not_found_error": "not_found_error",
    "unavailable_error": "overloaded_error",
    "server_error": "api_error",
}
ANTHROPIC_ERROR_TYPES_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error",
                                   403: "permission_error", 404: "not_found_error",
                                   413: "request_too_large", 429: "rate_limit_error",
                                   503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error(status: int, inner: dict[str, Any]) -> dict[str, Any]:
    """The inner object of Anthropic's error body, from an error's fields (`type`, `message`
    and any extra ones, which are kept)."""
    given = inner.get("type")
    kind = (ANTHROPIC_ERROR_TYPES.get(given if isinstance(given, str) else "")
            or ANTHROPIC_ERROR_TYPES_BY_STATUS.get(status)
            or ("invalid_request_error" if 400 <= status < 500 else "api_error"))
    message = inner.get("message")
    out: dict[str, Any] = {"type": kind,
                           "message": message if isinstance(message, str) and message
                           else f"HTTP {status}"}
    for key, value in inner.items():
        if key not in ("type", "message", "code") and isinstance(key, str):
            out[key] = value
    return out
