"""Anthropic Messages <-> llama-server chat completions. Pure: no I/O, no mitmproxy.

llama-server b11434 answers `/v1/messages` by converting the request to its OpenAI chat form
(`server_chat_convert_anthropic_to_oai`, tools/server/server-chat.cpp) and running it exactly
like `/v1/chat/completions`, but the converter drops `id_slot` and `cache_prompt`, so a
`/v1/messages` request cannot be pinned. `to_chat_request` is a line-by-line port of that
converter (same fields, same defaults, same quirks) that keeps `id_slot` and `cache_prompt`;
since the server's own route is "convert, then the chat path", the translated request renders
the same prompt (tests/real/test_anthropic_real.py checks it token for token on real Claude Code
requests). The answer goes back the way the server's own Anthropic writers
(`to_json_anthropic`, `to_json_anthropic_stream` in server-task.cpp) write it, streamed event by
event: see docs/DESIGN.md, "Anthropic /v1/messages".

Where the Messages API says more than that converter keeps (a named `tool_choice`, `none`,
`disable_parallel_tool_use`, the stop sequence that ended the answer, `is_error`), the
translation says it too; what the server cannot take (PDF documents, Files API sources) is
refused with the API's error (`Unsupported`), never dropped. The answers are in
anthropic_answers.py.

Everything here reads hostile input: it never raises on a bad body except `NotTranslatable`
and `Unsupported`, both answered with Anthropic's error shape.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ..wire.bodies import route_of
from ..wire.replies import anthropic_error

MESSAGES_ROUTE = "/v1/messages"
CHAT_ROUTE = "/v1/chat/completions"

BILLING_PREFIX = b"x-anthropic-billing-header:"
CCH_LENGTH = 5
DEFAULT_MAX_TOKENS = 4096  # the server's default when an Anthropic request has no max_tokens
DEFAULT_THINKING_BUDGET = 10000

# finish_reason of the chat answer -> stop_reason of the Anthropic one. The server derives both
# from the same stop type: EOS or a stop word -> "stop"/"tool_calls" and "end_turn"/"tool_use",
# a token limit -> "length" and "max_tokens".
STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens"}

# llama-server's error types (format_error_response) -> Anthropic's error types.
class NotTranslatable(ValueError):
    """The request is not one llama-server's converter accepts (llama-server would answer it
    400 in its own shape): answered 400 invalid_request_error."""


class Unsupported(NotTranslatable):
    """A part of the request the server cannot take (a PDF document, a Files API source):
    answered 400 invalid_request_error saying what, rather than dropped in silence."""


def is_messages_route(path: str) -> bool:
    """POST /v1/messages, with or without a query (Claude Code sends `?beta=true`)."""
    return route_of(path) == MESSAGES_ROUTE


def chat_path(path: str) -> str:
    """The chat completions path for a /v1/messages path; its query is kept (the server
    ignores it, the flow still shows it)."""
    _, mark, query = path.partition("?")
    return CHAT_ROUTE + (mark + query if mark else "")


# ---- nlohmann::json lookups, as json_value(body, key, default) does them --------------------

def jstr(obj: object, key: str, default: str = "") -> str:
    """json_value<std::string>: the value when `obj` is an object holding a non-null string
    there, else the default (a wrong type is logged by the server and defaulted)."""
    value = obj.get(key) if isinstance(obj, dict) else None
    return value if isinstance(value, str) else default


def jany(obj: object, key: str, default: Any) -> Any:
    """json_value<json>: any non-null value."""
    value = obj.get(key) if isinstance(obj, dict) else None
    return default if value is None else value


def jint(obj: object, key: str, default: int) -> int:
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
            "name": jstr(tool, "name"),
            "description": jstr(tool, "description"),
            "parameters": (tool["input_schema"] if isinstance(tool, dict) and "input_schema" in tool
                           else {}),
        }} for tool in tools]
    out.update(_tool_choice(body.get("tool_choice"), out.get("tools")))
    if "stop_sequences" in body:
        out["stop"] = body["stop_sequences"]
        # The chat answer does not say which stop word ended it; the server's debug copy of
        # its native answer (`__verbose`: stop_type, stopping_word) does.
        out["verbose"] = True
    out["max_tokens"] = body["max_tokens"] if "max_tokens" in body else DEFAULT_MAX_TOKENS
    for key in ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs"):
        if key in body:
            out[key] = body[key]
    if "thinking" in body:
        thinking = jany(body, "thinking", {})
        if jstr(thinking, "type") == "enabled":
            out["thinking_budget_tokens"] = jint(thinking, "budget_tokens",
                                                 DEFAULT_THINKING_BUDGET)
    if "metadata" in body:
        user_id = jstr(jany(body, "metadata", {}), "user_id")
        if user_id:
            out["__metadata_user_id"] = user_id
        out["metadata"] = body["metadata"]  # not read by the server; identity reads it
    for key in ("id_slot", "cache_prompt"):  # the two fields the server's converter drops
        if key in body:
            out[key] = body[key]
    if body.get("stream") is True:
        out["timings_per_token"] = True
        # A progress event as soon as the slot takes the prompt (then one per batch): so
        # message_start goes out before the prefill, and the rest become `ping`s.
        out["return_progress"] = True
    return out


def _tool_choice(choice: object, tools: object) -> dict[str, Any]:
    """Anthropic's tool_choice -> the chat fields. llama-server takes only "auto", "none" and
    "required": a named tool is "required" with the tools narrowed to that one (the grammar
    then allows no other); `disable_parallel_tool_use` is `parallel_tool_calls: false`."""
    if not isinstance(choice, dict):
        return {}
    kind = jstr(choice, "type")
    out: dict[str, Any] = {}
    if kind in ("auto", "none"):
        out["tool_choice"] = kind
    elif kind in ("any", "tool"):
        out["tool_choice"] = "required"
    if kind == "tool" and isinstance(tools, list):
        name = jstr(choice, "name")
        named = [t for t in tools if t["function"]["name"] == name]
        if not named:
            raise NotTranslatable(f"tool_choice names the tool {name!r}, which is not in tools")
        out["tools"] = named
    if choice.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False
    return out


def _system_text(system: object) -> str:
    if isinstance(system, str):
        return normalize_billing_header(system)
    if isinstance(system, list):
        return "".join(normalize_billing_header(jstr(block, "text")) for block in system
                       if jstr(block, "type") == "text")
    return ""


def _convert_message(message: object) -> list[Any]:
    """One Anthropic message -> the chat messages the server makes of it (none, one, or one
    plus a `tool` message per tool_result block)."""
    role = jstr(message, "role")
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
        kind = jstr(block, "type")
        if kind == "text":
            parts.append(block)  # as is: the chat parser reads its text
        elif kind == "thinking":
            reasoning += jstr(block, "thinking")
        elif kind == "redacted_thinking":
            pass  # encrypted by Anthropic for its own models: nothing a local model can read
        elif kind == "image":
            parts.append({"type": "image_url",
                          "image_url": {"url": _image_url(jany(block, "source", {}))}})
        elif kind in READ_AS_TEXT:
            parts.append({"type": "text", "text": READ_AS_TEXT[kind](block)})
        elif kind == "tool_use":
            tool_calls.append({"id": jstr(block, "id"), "type": "function", "function": {
                "name": jstr(block, "name"), "arguments": _dump(jany(block, "input", {}))}})
        elif kind == "tool_result":
            result = _tool_result_content(jany(block, "content", None))
            if block.get("is_error") is True:
                result = _marked_error(result)
            tool_results.append({"role": "tool", "tool_call_id": jstr(block, "tool_use_id"),
                                 "content": result})
        else:
            raise _unknown_block(kind)
    out: list[Any] = []
    if parts or tool_calls or reasoning:
        converted: dict[str, Any] = {"role": role, "content": parts if parts else ""}
        if tool_calls:
            converted["tool_calls"] = tool_calls
        if reasoning:
            converted["reasoning_content"] = reasoning
        out.append(converted)
    return out + tool_results


def _unknown_block(kind: str) -> Unsupported:
    """A block this translation cannot pass on (a server tool's, or one newer than it): the
    request is refused naming it, never sent with the block left out."""
    return Unsupported(f"content block type {kind!r} is not supported by this server (it "
                       f"takes text, image, document, search_result, thinking, tool_use and "
                       f"tool_result blocks)")


def _image_url(source: object) -> str:
    kind = jstr(source, "type")
    if kind == "base64":
        media_type = jstr(source, "media_type", "image/jpeg")
        return f"data:{media_type};base64,{jstr(source, 'data')}"
    if kind == "url":
        return jstr(source, "url")
    if kind == "file":
        raise Unsupported("image source type 'file' (the Files API) is not supported by this "
                          "server: send the image as base64 or a URL")
    raise Unsupported(f"image source type {kind!r} is not supported by this server: send the "
                      f"image as base64 or a URL")


ERROR_MARK = "Error: "  # a tool_result with is_error: the chat form has no field for it


def _marked_error(result: Any) -> Any:
    if isinstance(result, list):
        return [{"type": "text", "text": ERROR_MARK.strip()}] + result
    return ERROR_MARK + result


def _document_text(block: dict[str, Any]) -> str:
    """A `document` block the server can read, as text: plain text (`text` source) or text
    blocks (`content` source), after its title and context. A PDF, a URL or a Files API
    source cannot be read here: Unsupported."""
    source = jany(block, "source", {})
    kind = jstr(source, "type")
    if kind == "text":
        body = jstr(source, "data")
    elif kind == "content":
        content = jany(source, "content", [])
        body = content if isinstance(content, str) else "\n".join(
            jstr(item, "text") for item in (content if isinstance(content, list) else [])
            if jstr(item, "type") == "text")
    else:
        what = jstr(source, "media_type") or kind or "unknown"
        raise Unsupported(f"document source {what!r} is not supported by this server (it "
                          f"reads text documents only): send the document's text instead")
    head = [jstr(block, "title"), jstr(block, "context")]
    return "\n\n".join([part for part in head if part] + [body])


def _search_result_text(block: dict[str, Any]) -> str:
    """A `search_result` block (a RAG tool's hit) as text: its title and source, then its
    text blocks. Citations have no counterpart here; the text itself reaches the model."""
    content = jany(block, "content", [])
    body = "\n".join(jstr(item, "text") for item in (content if isinstance(content, list) else [])
                     if jstr(item, "type") == "text")
    head = [jstr(block, "title"), jstr(block, "source")]
    return "\n\n".join([part for part in head if part] + [body])


# Blocks the server cannot take as they are but whose text it can read.
READ_AS_TEXT: dict[str, Callable[[dict[str, Any]], str]] = {
    "document": _document_text, "search_result": _search_result_text}


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
        kind = jstr(item, "type")
        if kind == "text":
            piece = jstr(item, "text")
            text += piece
            parts.append({"type": "text", "text": piece})
        elif kind == "image":
            has_images = True
            parts.append({"type": "image_url",
                          "image_url": {"url": _image_url(jany(item, "source", {}))}})
        elif kind in READ_AS_TEXT:
            piece = READ_AS_TEXT[kind](item)
            text += piece
            parts.append({"type": "text", "text": piece})
        else:
            raise _unknown_block(kind)
    return parts if has_images else text


def encode_json(value: object) -> bytes:
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:  # a lone surrogate: keep it escaped
        return json.dumps(value, separators=(",", ":")).encode()


# ---- errors ---------------------------------------------------------------------------------

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
        return {"type": "error", "error": anthropic_error(status, inner)}
    if isinstance(inner, str):
        return {"type": "error", "error": anthropic_error(status, {"message": inner})}
    text = raw.decode("utf-8", "replace").strip() or f"HTTP {status}"
    return {"type": "error", "error": anthropic_error(status, {"message": text[:2000]})}
