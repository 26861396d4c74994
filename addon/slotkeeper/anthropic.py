"""Anthropic Messages <-> llama-server chat completions. Pure: no I/O, no mitmproxy.

llama-server b11434 answers `/v1/messages` by converting the request to its OpenAI chat form
(`server_chat_convert_anthropic_to_oai`, tools/server/server-chat.cpp) and running it exactly
like `/v1/chat/completions`, but the converter drops `id_slot` and `cache_prompt`, so a
`/v1/messages` request cannot be pinned. `to_chat_request` is a line-by-line port of that
converter (same fields, same defaults, same quirks) that keeps `id_slot` and `cache_prompt`;
since the server's own route is "convert, then the chat path", the translated request renders
the same prompt (tests/test_anthropic_real.py checks it token for token on real Claude Code
requests). The answer goes back the way the server's own Anthropic writers
(`to_json_anthropic`, `to_json_anthropic_stream` in server-task.cpp) write it, streamed event by
event: see docs/DESIGN.md, "Anthropic /v1/messages".

Everything here reads hostile input: it never raises on a bad body except `NotTranslatable`,
which means "forward the request as it came and let llama-server answer it".
"""

from __future__ import annotations

import json
from typing import Any

from .bodies import SSE_DONE, sse_data

MESSAGES_ROUTE = "/v1/messages"
CHAT_ROUTE = "/v1/chat/completions"

BILLING_PREFIX = b"x-anthropic-billing-header:"
CCH_LENGTH = 5
DEFAULT_MAX_TOKENS = 4096  # the server's default when an Anthropic request has no max_tokens
DEFAULT_THINKING_BUDGET = 10000
MAX_SSE_LINE_BYTES = 16 * 1024 * 1024  # one llama-server event is one token's worth

# finish_reason of the chat answer -> stop_reason of the Anthropic one. The server derives both
# from the same stop type: EOS or a stop word -> "stop"/"tool_calls" and "end_turn"/"tool_use",
# a token limit -> "length" and "max_tokens".
STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens"}

# llama-server's error types (format_error_response) -> Anthropic's error types.
ERROR_TYPES = {
    "invalid_request_error": "invalid_request_error",
    "exceed_context_size_error": "invalid_request_error",
    "not_supported_error": "invalid_request_error",
    "authentication_error": "authentication_error",
    "permission_error": "permission_error",
    "not_found_error": "not_found_error",
    "unavailable_error": "overloaded_error",
    "server_error": "api_error",
}
ERROR_TYPES_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error",
                         403: "permission_error", 404: "not_found_error",
                         413: "request_too_large", 429: "rate_limit_error",
                         503: "overloaded_error", 529: "overloaded_error"}


class NotTranslatable(ValueError):
    """The request is not one llama-server's converter accepts: forward it untranslated, so the
    client gets the server's own error."""


def is_messages_route(path: str) -> bool:
    """POST /v1/messages, with or without a query (Claude Code sends `?beta=true`)."""
    route = path.split("?", 1)[0]
    if len(route) > 1 and route.endswith("/"):
        route = route[:-1]
    return route == MESSAGES_ROUTE


def chat_path(path: str) -> str:
    """The chat completions path for a /v1/messages path; its query is kept (the server
    ignores it, the flow still shows it)."""
    _, mark, query = path.partition("?")
    return CHAT_ROUTE + (mark + query if mark else "")


# ---- nlohmann::json lookups, as json_value(body, key, default) does them --------------------

def _str(obj: object, key: str, default: str = "") -> str:
    """json_value<std::string>: the value when `obj` is an object holding a non-null string
    there, else the default (a wrong type is logged by the server and defaulted)."""
    value = obj.get(key) if isinstance(obj, dict) else None
    return value if isinstance(value, str) else default


def _any(obj: object, key: str, default: Any) -> Any:
    """json_value<json>: any non-null value."""
    value = obj.get(key) if isinstance(obj, dict) else None
    return default if value is None else value


def _int(obj: object, key: str, default: int) -> int:
    """json_value<int>: nlohmann converts any number (and a boolean) to int."""
    value = obj.get(key) if isinstance(obj, dict) else None
    if isinstance(value, (bool, int)):
        return int(value)
    if isinstance(value, float) and value == value and abs(value) < 2 ** 31:
        return int(value)
    return default


def _dump(value: object) -> str:
    """json::dump(): nlohmann keeps object keys sorted (std::map), writes compact JSON and
    raw UTF-8."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def normalize_billing_header(text: str) -> str:
    """The server's normalize_anthropic_billing_header: Claude Code's first system block,
    "x-anthropic-billing-header: ...; cch=ab12c;...", changes its 5-character cch stamp on every
    request; the server overwrites it with "fffff" so the prefix cache gets past it. Done on the
    UTF-8 bytes, as the server does."""
    raw = text.encode("utf-8", "surrogatepass")
    if not raw.startswith(BILLING_PREFIX):
        return text
    index_cch = raw.find(b"cch=", len(BILLING_PREFIX))
    if index_cch < 0:
        return text
    start = index_cch + 4
    if start + CCH_LENGTH < len(raw) and raw[start + CCH_LENGTH:start + CCH_LENGTH + 1] == b";":
        raw = raw[:start] + b"f" * CCH_LENGTH + raw[start + CCH_LENGTH:]
        return raw.decode("utf-8", "replace")
    return text


# ---- request --------------------------------------------------------------------------------

def to_chat_request(body: object) -> dict[str, Any]:
    """The `/v1/chat/completions` body llama-server itself builds from an Anthropic request,
    plus what its converter drops and slotkeeper needs: `id_slot`, `cache_prompt` (when the
    client sent them), `metadata` (so the session is identified from `metadata.user_id` as
    before), and `timings_per_token` on a stream (so `message_start` can carry the prompt's
    usage, as the server's own first event does)."""
    if not isinstance(body, dict):
        raise NotTranslatable("body is not a JSON object")
    if "messages" not in body:
        raise NotTranslatable("'messages' is required")
    messages: list[Any] = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": _system_text(body["system"])})
    if isinstance(body["messages"], list):
        for message in body["messages"]:
            messages.extend(_convert_message(message))
    out: dict[str, Any] = {"messages": messages}

    tools = body.get("tools")
    if "tools" in body and isinstance(tools, list):
        out["tools"] = [{"type": "function", "function": {
            "name": _str(tool, "name"),
            "description": _str(tool, "description"),
            "parameters": (tool["input_schema"] if isinstance(tool, dict) and "input_schema" in tool
                           else {}),
        }} for tool in tools]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        kind = _str(choice, "type")
        if kind == "auto":
            out["tool_choice"] = "auto"
        elif kind in ("any", "tool"):
            out["tool_choice"] = "required"
    if "stop_sequences" in body:
        out["stop"] = body["stop_sequences"]
    out["max_tokens"] = body["max_tokens"] if "max_tokens" in body else DEFAULT_MAX_TOKENS
    for key in ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs"):
        if key in body:
            out[key] = body[key]
    if "thinking" in body:
        thinking = _any(body, "thinking", {})
        if _str(thinking, "type") == "enabled":
            out["thinking_budget_tokens"] = _int(thinking, "budget_tokens",
                                                 DEFAULT_THINKING_BUDGET)
    if "metadata" in body:
        user_id = _str(_any(body, "metadata", {}), "user_id")
        if user_id:
            out["__metadata_user_id"] = user_id
        out["metadata"] = body["metadata"]  # not read by the server; identity reads it
    for key in ("id_slot", "cache_prompt"):  # the two fields the server's converter drops
        if key in body:
            out[key] = body[key]
    if body.get("stream") is True:
        out["timings_per_token"] = True
    return out


def _system_text(system: object) -> str:
    if isinstance(system, str):
        return normalize_billing_header(system)
    if isinstance(system, list):
        return "".join(normalize_billing_header(_str(block, "text")) for block in system
                       if _str(block, "type") == "text")
    return ""


def _convert_message(message: object) -> list[Any]:
    """One Anthropic message -> the chat messages the server makes of it (none, one, or one
    plus a `tool` message per tool_result block)."""
    role = _str(message, "role")
    if not isinstance(message, dict) or "content" not in message:
        return [] if role == "assistant" else [message]
    content = message["content"]
    if not isinstance(content, list):
        return [message]  # a string, or anything the chat parser will judge
    parts: list[Any] = []
    tool_calls: list[dict[str, Any]] = []
    tool_results: list[dict[str, Any]] = []
    reasoning = ""
    for block in content:
        kind = _str(block, "type")
        if kind == "text":
            parts.append(block)  # as is: the chat parser reads its text
        elif kind == "thinking":
            reasoning += _str(block, "thinking")
        elif kind == "image":
            url = _image_url(_any(block, "source", {}))
            if url is not None:
                parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "tool_use":
            tool_calls.append({"id": _str(block, "id"), "type": "function", "function": {
                "name": _str(block, "name"), "arguments": _dump(_any(block, "input", {}))}})
        elif kind == "tool_result":
            tool_results.append({"role": "tool", "tool_call_id": _str(block, "tool_use_id"),
                                 "content": _tool_result_content(_any(block, "content", None))})
    out: list[Any] = []
    if parts or tool_calls or reasoning:
        converted: dict[str, Any] = {"role": role, "content": parts if parts else ""}
        if tool_calls:
            converted["tool_calls"] = tool_calls
        if reasoning:
            converted["reasoning_content"] = reasoning
        out.append(converted)
    return out + tool_results


def _image_url(source: object) -> str | None:
    kind = _str(source, "type")
    if kind == "base64":
        media_type = _str(source, "media_type", "image/jpeg")
        return f"data:{media_type};base64,{_str(source, 'data')}"
    if kind == "url":
        return _str(source, "url")
    return None


def _tool_result_content(content: object) -> Any:
    """A string stays; text blocks are joined into one string; with any image the blocks stay
    a list of chat content parts; anything else is ""."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    text = ""
    parts: list[dict[str, Any]] = []
    has_images = False
    for item in content:
        kind = _str(item, "type")
        if kind == "text":
            piece = _str(item, "text")
            text += piece
            parts.append({"type": "text", "text": piece})
        elif kind == "image":
            has_images = True
            url = _image_url(_any(item, "source", {}))
            if url is not None:
                parts.append({"type": "image_url", "image_url": {"url": url}})
    return parts if has_images else text


def encode_json(value: object) -> bytes:
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:  # a lone surrogate: keep it escaped
        return json.dumps(value, separators=(",", ":")).encode()


# ---- answer: whole --------------------------------------------------------------------------

def message_from_chat(chat: object) -> dict[str, Any]:
    """A non-streamed chat completion -> the Anthropic message the server would have written
    (to_json_anthropic). Raises NotTranslatable when it is not a chat completion."""
    choices = chat.get("choices") if isinstance(chat, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise NotTranslatable("answer has no choices")
    message = choices[0].get("message")
    if not isinstance(message, dict):
        raise NotTranslatable("answer has no message")
    blocks: list[dict[str, Any]] = []
    reasoning = _str(message, "reasoning_content")
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    text = _text_of(message.get("content"))
    if text:
        blocks.append({"type": "text", "text": text})
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, list) else []:
        function = _any(call, "function", {})
        blocks.append({"type": "tool_use", "id": _str(call, "id"),
                       "name": _str(function, "name"),
                       "input": _input_of(_str(function, "arguments"))})
    usage = _any(chat, "usage", {})
    prompt = _int(usage, "prompt_tokens", 0)
    cached = _int(_any(usage, "prompt_tokens_details", {}), "cached_tokens", 0)
    return {
        "id": _str(chat, "id"),
        "type": "message",
        "role": "assistant",
        "content": blocks,
        "model": _str(chat, "model"),
        "stop_reason": stop_reason(choices[0].get("finish_reason")),
        # The chat answer does not say which stop word ended it (the server's own writer does).
        "stop_sequence": None,
        "usage": {"cache_read_input_tokens": cached, "input_tokens": prompt - cached,
                  "output_tokens": _int(usage, "completion_tokens", 0)},
    }


def stop_reason(finish_reason: object) -> str:
    return STOP_REASONS.get(finish_reason, "end_turn") if isinstance(finish_reason, str) \
        else "end_turn"


def _text_of(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts (the server joins them with newlines)
        return "\n".join(_str(part, "text") for part in content if _str(part, "type") == "text")
    return ""


def _input_of(arguments: str) -> Any:
    """Tool arguments as JSON; the server falls back to {} when they do not parse."""
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):
        return {}


def error_from_chat(status: int, raw: bytes) -> dict[str, Any]:
    """An error answer (llama-server's {"error": {code, message, type}}, slotkeeper's own, or
    any text) -> Anthropic's {"type": "error", "error": {"type", "message"}}. The server's extra
    fields (n_prompt_tokens, n_ctx on a context overflow) are kept."""
    try:
        parsed = json.loads(raw)
    except (ValueError, RecursionError):
        parsed = None
    inner = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(inner, dict):
        return {"type": "error", "error": _anthropic_error(status, inner)}
    if isinstance(inner, str):
        return {"type": "error", "error": _anthropic_error(status, {"message": inner})}
    text = raw.decode("utf-8", "replace").strip() or f"HTTP {status}"
    return {"type": "error", "error": _anthropic_error(status, {"message": text[:2000]})}


def _anthropic_error(status: int, inner: dict[str, Any]) -> dict[str, Any]:
    kind = ERROR_TYPES.get(_str(inner, "type")) or ERROR_TYPES_BY_STATUS.get(status) or (
        "invalid_request_error" if 400 <= status < 500 else "api_error")
    out: dict[str, Any] = {"type": kind, "message": _str(inner, "message") or f"HTTP {status}"}
    for key, value in inner.items():
        if key not in ("type", "message", "code") and isinstance(key, str):
            out[key] = value
    return out


# ---- answer: streamed -----------------------------------------------------------------------

def _is_role_only(event: dict[str, Any]) -> bool:
    """A chunk that carries nothing but the assistant role (no text, tool call or finish)."""
    choices = event.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else {}
    delta = _any(choice, "delta", {})
    return (isinstance(delta, dict) and not _any(choice, "finish_reason", None)
            and all(value is None or key == "role" for key, value in delta.items()))


def sse_event(name: str, data: dict[str, Any]) -> bytes:
    """format_anthropic_sse: one `event:` line, one `data:` line, a blank line."""
    return b"event: " + name.encode() + b"\ndata: " + encode_json(data) + b"\n\n"


class StreamTranslator:
    """llama-server's chat completion SSE stream -> the Anthropic event stream its own
    `/v1/messages` writer produces, one chunk at a time (nothing is held back beyond a partial
    line). Call it with each chunk as it arrives and with b"" once at the end.

    Block indices are given in order of first appearance (thinking, text, tool_use: the order
    the server's parser produces, where this equals the server's fixed scheme), and every block
    is closed at the end, in that order, as the server's final event does."""

    def __init__(self) -> None:
        self._partial = b""
        self._started = False
        self._finished = False
        self._next_index = 0
        self._thinking_index: int | None = None
        self._text_index: int | None = None
        self._tool_indices: dict[int, int] = {}  # tool call index -> content block index

    @property
    def finished(self) -> bool:
        return self._finished

    def __call__(self, chunk: bytes) -> bytes:
        if not chunk:
            return self._end()
        if self._finished:
            return b""
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()
        out = [self._line(line.rstrip(b"\r")) for line in lines]
        if len(self._partial) > MAX_SSE_LINE_BYTES:
            self._partial = b""
            out.append(self._fail("api_error", "an event from llama-server was too large"))
        return b"".join(out)

    def _line(self, line: bytes) -> bytes:
        if self._finished or not line:
            return b""
        if line.startswith(b":"):
            return line + b"\n\n"  # a keep-alive comment: pass it on, clients ignore it
        event = sse_data(line)  # `event:`/`id:` lines: llama-server's chat stream sends none
        if event == SSE_DONE:
            return self._end()
        if not isinstance(event, dict):
            return b""
        if "error" in event:  # the server failed mid-stream: it ends the stream after this
            self._finished = True
            return sse_event("error", error_from_chat(500, encode_json({"error": event["error"]})))
        if not self._started and "timings" not in event and _is_role_only(event):
            # The server's first token comes as two events: {"role": "assistant"} alone, then
            # the token with the timings (timings_per_token). message_start waits for the
            # timings, so it can carry the prompt's usage as the server's own does.
            return b""
        return self._start(event) + self._chunk(event)

    def _start(self, event: dict[str, Any]) -> bytes:
        if self._started:
            return b""
        self._started = True
        timings = _any(event, "timings", {})
        return sse_event("message_start", {"type": "message_start", "message": {
            "id": _str(event, "id"),
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": _str(event, "model"),
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"cache_read_input_tokens": _int(timings, "cache_n", 0),
                      "input_tokens": _int(timings, "prompt_n", 0),
                      "output_tokens": 0},
        }})

    def _chunk(self, event: dict[str, Any]) -> bytes:
        choices = event.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices else {}
        delta = _any(choice, "delta", {})
        out = []
        reasoning = _str(delta, "reasoning_content")
        if reasoning:
            if self._thinking_index is None:
                self._thinking_index = self._open({"type": "thinking", "thinking": ""}, out)
            out.append(self._delta(self._thinking_index,
                                   {"type": "thinking_delta", "thinking": reasoning}))
        text = _str(delta, "content")
        if text:
            if self._text_index is None:
                self._text_index = self._open({"type": "text", "text": ""}, out)
            out.append(self._delta(self._text_index, {"type": "text_delta", "text": text}))
        calls = delta.get("tool_calls") if isinstance(delta, dict) else None
        for call in calls if isinstance(calls, list) else []:
            out.append(self._tool_call(call))
        finish = choice.get("finish_reason") if isinstance(choice, dict) else None
        if finish is not None:
            out.append(self._finish(finish, event))
        return b"".join(out)

    def _open(self, block: dict[str, Any], out: list[bytes]) -> int:
        index = self._next_index
        self._next_index += 1
        out.append(sse_event("content_block_start", {"type": "content_block_start",
                                                     "index": index, "content_block": block}))
        return index

    @staticmethod
    def _delta(index: int, delta: dict[str, Any]) -> bytes:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                 "delta": delta})

    def _tool_call(self, call: object) -> bytes:
        number = _int(call, "index", 0)
        function = _any(call, "function", {})
        out: list[bytes] = []
        if number not in self._tool_indices:
            self._tool_indices[number] = self._open(
                {"type": "tool_use", "id": _str(call, "id"), "name": _str(function, "name")}, out)
        arguments = _str(function, "arguments")
        if arguments:
            out.append(self._delta(self._tool_indices[number],
                                   {"type": "input_json_delta", "partial_json": arguments}))
        return b"".join(out)

    def _finish(self, finish_reason: object, event: dict[str, Any]) -> bytes:
        self._finished = True
        out = []
        if self._thinking_index is not None:
            # Anthropic clients expect a signature before a thinking block closes; a local model
            # has none (the server sends an empty one too).
            out.append(self._delta(self._thinking_index,
                                   {"type": "signature_delta", "signature": ""}))
        for index in self._open_blocks():
            out.append(sse_event("content_block_stop",
                                 {"type": "content_block_stop", "index": index}))
        timings = _any(event, "timings", {})
        usage = _any(event, "usage", {})
        output_tokens = _int(timings, "predicted_n", _int(usage, "completion_tokens", 0))
        out.append(sse_event("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason(finish_reason), "stop_sequence": None},
            "usage": {"output_tokens": output_tokens},
        }))
        out.append(sse_event("message_stop", {"type": "message_stop"}))
        return b"".join(out)

    def _open_blocks(self) -> list[int]:
        thinking = [] if self._thinking_index is None else [self._thinking_index]
        text = [] if self._text_index is None else [self._text_index]
        tools = [self._tool_indices[n] for n in sorted(self._tool_indices)]
        return thinking + text + tools

    def _end(self) -> bytes:
        if self._finished:
            return b""
        self._finished = True
        if not self._started:
            return self._fail("api_error", "llama-server ended the stream without an answer")
        return sse_event("error", {"type": "error", "error": {
            "type": "api_error", "message": "llama-server ended the stream before the answer "
                                            "was complete"}})

    def _fail(self, kind: str, message: str) -> bytes:
        self._finished = True
        return sse_event("error", {"type": "error", "error": {"type": kind, "message": message}})
