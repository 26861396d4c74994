"""Ollama's API (`/api/chat`, `/api/generate`, `/api/embed`, ...) in terms of llama-server's
own routes, and llama-server's answers back in Ollama's shape. Pure: no mitmproxy, no I/O.

The mitmproxy glue is ollama_surface.py; why each route maps where it does is in
docs/DESIGN.md, "Ollama surface". In short:
- `/api/chat` and a plain `/api/generate` go to `/v1/chat/completions` (the server applies the
  model's chat template, parses tool calls and reasoning); `/api/generate` with `raw` or
  `context` goes to `/completion` (a prompt the server must not template, as tokens), with
  `suffix` to `/infill`.
- Streams: llama-server's SSE events become NDJSON lines as they arrive (`StreamTranslator`),
  nothing is held back except tool-call fragments, which Ollama sends whole.
- Errors come out as `{"error": "..."}` with the status llama-server (or we) chose.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from .bodies import SSE_DONE, sse_data

# What /api/version reports. OpenWebUI compares versions numerically (it keeps the lowest of
# its backends), so this must be plain dotted numbers; it names the Ollama API level whose
# request and response fields this surface follows, not a slotkeeper release.
OLLAMA_VERSION = "0.13.0"
RUNNING_TEXT = "Ollama is running"
NDJSON = "application/x-ndjson"

CHAT = "chat"  # /v1/chat/completions, answered as /api/chat
GENERATE_CHAT = "generate-chat"  # /v1/chat/completions, answered as /api/generate
GENERATE_RAW = "generate-raw"  # /completion (raw or context), answered as /api/generate
GENERATE_INFILL = "generate-infill"  # /infill (suffix), answered as /api/generate

# Model management has no counterpart in llama-server: one model, loaded at its start.
UNSUPPORTED_ROUTES = frozenset({"/api/pull", "/api/push", "/api/create", "/api/delete",
                                "/api/copy"})


class OllamaError(Exception):
    """A request we answer ourselves with `{"error": message}` and `status`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def error_body(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def tagged(name: str) -> str:
    """Ollama clients expect `name:tag`; llama-server's model ids have no tag."""
    return name if ":" in name else f"{name}:latest"


def untagged(name: str) -> str:
    return name[:-len(":latest")] if name.endswith(":latest") else name


# ---- options --------------------------------------------------------------------------------

# Ollama option -> llama-server field (same meaning, same units). `num_predict` is handled
# apart (its name differs between the chat and the native route).
SAMPLING_OPTIONS: dict[str, str] = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "typical_p": "typical_p",
    "seed": "seed",
    "repeat_penalty": "repeat_penalty",
    "repeat_last_n": "repeat_last_n",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "mirostat": "mirostat",
    "mirostat_tau": "mirostat_tau",
    "mirostat_eta": "mirostat_eta",
    "num_keep": "n_keep",
}
INTEGER_OPTIONS = frozenset({"top_k", "seed", "repeat_last_n", "mirostat", "num_keep",
                             "num_predict"})
# Settings llama-server takes at its start (context size, batch, GPU layers, threads, memory
# mapping) or no longer has (tfs_z, penalize_newline): ignored, and said so in the log.
LOAD_TIME_OPTIONS = frozenset({"num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram",
                               "numa", "use_mmap", "use_mlock", "num_thread", "vocab_only",
                               "f16_kv", "logits_all", "embedding_only", "tfs_z",
                               "penalize_newline", "num_gqa", "rope_frequency_base",
                               "rope_frequency_scale"})


@dataclass
class Mapped:
    """An upstream request: where it goes, its JSON body, and what was left out (for the log)."""
    path: str
    body: dict[str, Any]
    kind: str
    model: str  # as the client named it, echoed in every answer
    stream: bool
    ignored: list[str] = field(default_factory=list)
    context: list[int] | None = None  # /api/generate: the prompt tokens (context + new)


def _number(name: str, value: Any, integer: bool) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not math.isfinite(value)):
        raise OllamaError(400, f"option {name} must be a number, got {json.dumps(value)[:40]}")
    if integer:
        if isinstance(value, float) and not value.is_integer():
            raise OllamaError(400, f"option {name} must be an integer, got {value}")
        return int(value)
    return value


def map_options(options: Any, predict_field: str) -> tuple[dict[str, Any], list[str]]:
    """Ollama `options` -> llama-server sampling fields, and the names ignored."""
    if options is None:
        return {}, []
    if not isinstance(options, dict):
        raise OllamaError(400, "options must be an object")
    fields: dict[str, Any] = {}
    ignored: list[str] = []
    for name, value in options.items():
        if value is None:
            continue
        if name in SAMPLING_OPTIONS:
            fields[SAMPLING_OPTIONS[name]] = _number(name, value, name in INTEGER_OPTIONS)
        elif name == "num_predict":
            n = _number(name, value, True)
            # -1: until the model stops; -2: until the context is full. llama-server's
            # default (no limit, bounded by its -n and the slot's context) covers both.
            if n >= 0:
                fields[predict_field] = n
            elif n not in (-1, -2):
                raise OllamaError(400, f"option num_predict must be -2, -1 or more, got {n}")
        elif name == "stop":
            fields["stop"] = _stop_list(value)
        else:
            ignored.append(name if name in LOAD_TIME_OPTIONS else f"{name} (unknown)")
    return fields, ignored


def _stop_list(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return list(value)
    raise OllamaError(400, "option stop must be a string or a list of strings")


# ---- requests -------------------------------------------------------------------------------

def request_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise OllamaError(400, "request body must be a JSON object")
    return body


def model_of(body: dict[str, Any], required: bool = True) -> str:
    model = body.get("model", body.get("name"))
    if model is None or model == "":
        if required:
            raise OllamaError(400, "model is required")
        return ""
    if not isinstance(model, str):
        raise OllamaError(400, "model must be a string")
    return model


def _stream(body: dict[str, Any]) -> bool:
    value = body.get("stream")
    if value is None:
        return True  # Ollama streams unless told not to
    if not isinstance(value, bool):
        raise OllamaError(400, "stream must be true or false")
    return value


def _format_fields(value: Any) -> dict[str, Any]:
    """`format`: "json" or a JSON schema -> llama-server's response_format (grammar-
    constrained output)."""
    if value is None or value == "":
        return {}
    if value == "json":
        return {"response_format": {"type": "json_object"}}
    if isinstance(value, dict):
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": "format", "schema": value}}}
    raise OllamaError(400, 'format must be "json" or a JSON schema object')


def _think_fields(value: Any) -> dict[str, Any]:
    """`think`: true/false switches the template's thinking; "low"/"medium"/"high" (gpt-oss)
    also sets the effort. Thinking text comes back in `thinking` either way."""
    if value is None:
        return {}
    if isinstance(value, bool):
        return {"chat_template_kwargs": {"enable_thinking": value}}
    if value in ("low", "medium", "high"):
        return {"chat_template_kwargs": {"enable_thinking": True, "reasoning_effort": value},
                "reasoning_effort": value}
    raise OllamaError(400, 'think must be true, false, "low", "medium" or "high"')


def _image_url(image: Any) -> dict[str, Any]:
    if not isinstance(image, str) or not image:
        raise OllamaError(400, "images must be base64-encoded strings")
    try:
        head = base64.b64decode(image[:64] + "=" * (-len(image[:64]) % 4), validate=False)
    except (binascii.Error, ValueError):
        raise OllamaError(400, "images must be base64-encoded strings") from None
    mime = ("image/jpeg" if head.startswith(b"\xff\xd8") else
            "image/gif" if head.startswith(b"GIF8") else
            "image/webp" if head[8:12] == b"WEBP" else "image/png")
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{image}"}}


def _tool_calls_out(calls: Any, turn: int) -> list[dict[str, Any]]:
    """Ollama tool calls (arguments as an object) -> OpenAI's (arguments as a JSON string)."""
    if not isinstance(calls, list):
        raise OllamaError(400, "tool_calls must be a list")
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise OllamaError(400, "each tool call needs function.name")
        arguments = function.get("arguments", {})
        out.append({"id": call.get("id") or f"call_{turn}_{i}", "type": "function",
                    "function": {"name": function["name"],
                                 "arguments": arguments if isinstance(arguments, str)
                                 else json.dumps(arguments, ensure_ascii=False)}})
    return out


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise OllamaError(400, "messages must be a list")
    out: list[dict[str, Any]] = []
    pending_calls: list[dict[str, Any]] = []  # the last assistant turn's calls, for tool replies
    for turn, message in enumerate(messages):
        if not isinstance(message, dict):
            raise OllamaError(400, "each message must be an object")
        role = message.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise OllamaError(400, f"message role must be system, user, assistant or tool, "
                                   f"got {json.dumps(role)[:40]}")
        content = message.get("content")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise OllamaError(400, "message content must be a string")
        mapped: dict[str, Any] = {"role": role, "content": content}
        images = message.get("images")
        if images:
            if not isinstance(images, list):
                raise OllamaError(400, "images must be a list")
            parts: list[dict[str, Any]] = [{"type": "text", "text": content}] if content else []
            mapped["content"] = parts + [_image_url(image) for image in images]
        if role == "assistant":
            if message.get("tool_calls"):
                pending_calls = _tool_calls_out(message["tool_calls"], turn)
                mapped["tool_calls"] = pending_calls
            thinking = message.get("thinking")
            if isinstance(thinking, str) and thinking:
                mapped["reasoning_content"] = thinking
        if role == "tool":
            name = message.get("tool_name") or message.get("name")
            call = next((c for c in pending_calls if c["function"]["name"] == name),
                        pending_calls[0] if pending_calls else None)
            if call is not None:
                mapped["tool_call_id"] = call["id"]
            if isinstance(name, str):
                mapped["name"] = name
        out.append(mapped)
    return out


# Not Ollama's, but some clients add them: passed on so that SlotKeeper's body rule can name the
# session from them (identity.py reads the rewritten request). llama-server ignores them.
SESSION_FIELDS = ("session_id", "conversation_id", "chat_id", "prompt_cache_key", "user")


def _common(body: dict[str, Any], predict_field: str) -> tuple[dict[str, Any], list[str]]:
    fields, ignored = map_options(body.get("options"), predict_field)
    fields.update({name: body[name] for name in SESSION_FIELDS
                   if isinstance(body.get(name), str) and body[name]})
    for name in ("keep_alive", "logprobs", "top_logprobs", "template", "truncate",
                 "dimensions"):
        if body.get(name) is not None:
            ignored.append(name)
    return fields, ignored


def chat_request(body: Any) -> Mapped:
    """POST /api/chat -> POST /v1/chat/completions."""
    body = request_object(body)
    model = model_of(body)
    stream = _stream(body)
    fields, ignored = _common(body, "max_tokens")
    upstream: dict[str, Any] = {"model": untagged(model), "messages": _messages(
        body.get("messages") if body.get("messages") is not None else []), "stream": stream,
        **fields, **_format_fields(body.get("format")), **_think_fields(body.get("think"))}
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise OllamaError(400, "tools must be a list")
        upstream["tools"] = tools  # Ollama's tool schema is OpenAI's
    if stream:
        upstream["stream_options"] = {"include_usage": True}
    return Mapped("/v1/chat/completions", upstream, CHAT, model, stream, ignored)


def is_load_or_unload(body: Any, path: str) -> bool:
    """An empty prompt (or no messages) only loads or unloads the model in Ollama (OpenWebUI
    unloads with `keep_alive: 0` and `prompt: ""`): nothing to run on llama-server."""
    if not isinstance(body, dict):
        return False
    if path == "/api/chat":
        return body.get("messages") in (None, [])
    return body.get("prompt") in (None, "") and not body.get("suffix") and not body.get(
        "images")


def load_answer(body: dict[str, Any], path: str) -> dict[str, Any]:
    keep_alive = body.get("keep_alive")
    unload = keep_alive in (0, "0", "0s", "0m", "0h") or keep_alive == 0.0
    answer: dict[str, Any] = {"model": body.get("model") or "", "created_at": now_iso()}
    if path == "/api/chat":
        answer["message"] = {"role": "assistant", "content": ""}
    else:
        answer["response"] = ""
    answer.update(done=True, done_reason="unload" if unload else "load")
    return answer


def generate_request(body: Any, tokens: Callable[[str, bool], list[int]] | None = None
                     ) -> Mapped:
    """POST /api/generate -> /v1/chat/completions, or /completion with `raw` or `context`
    (`tokens(text, add_special)` tokenizes on the server; needed only then), or /infill with
    `suffix`."""
    body = request_object(body)
    model = model_of(body)
    stream = _stream(body)
    prompt = body.get("prompt") or ""
    system = body.get("system")
    if not isinstance(prompt, str):
        raise OllamaError(400, "prompt must be a string")
    if system is not None and not isinstance(system, str):
        raise OllamaError(400, "system must be a string")
    raw = body.get("raw")
    if raw is not None and not isinstance(raw, bool):
        raise OllamaError(400, "raw must be true or false")
    context = body.get("context")
    if context is not None and not (isinstance(context, list) and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in context)):
        raise OllamaError(400, "context must be a list of token ids")
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise OllamaError(400, "suffix must be a string")

    if suffix:
        if raw or context:
            raise OllamaError(400, "suffix cannot be combined with raw or context")
        fields, ignored = _common(body, "n_predict")
        upstream = {"input_prefix": prompt, "input_suffix": suffix, "stream": stream, **fields}
        if system:
            ignored.append("system (infill has no system prompt)")
        return Mapped("/infill", upstream, GENERATE_INFILL, model, stream, ignored)

    if raw or context is not None:
        if tokens is None:
            raise OllamaError(500, "raw and context need the server's tokenizer")
        fields, ignored = _common(body, "n_predict")
        if body.get("format"):
            fields.update(_format_fields(body.get("format")))
        if body.get("images"):
            ignored.append("images (not with raw or context)")
        if system and raw:
            ignored.append("system (raw prompts are sent as given)")
        text = prompt if raw else _template_free_turn(system, prompt)
        prompt_tokens = list(context or []) + tokens(text, not context)
        upstream = {"prompt": prompt_tokens, "stream": stream, "return_tokens": True,
                    **fields}
        return Mapped("/completion", upstream, GENERATE_RAW, model, stream, ignored,
                      context=prompt_tokens)

    messages: list[dict[str, Any]] = []
    if system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": prompt, "images": body.get("images")})
    mapped = chat_request({**{k: v for k, v in body.items()
                              if k in ("options", "format", "think", "keep_alive", "stream",
                                       *SESSION_FIELDS)},
                           "model": model, "messages": messages})
    mapped.kind = GENERATE_CHAT
    return mapped


def _template_free_turn(system: str | None, prompt: str) -> str:
    # A continued context without a template: the new text follows the old tokens as is.
    return f"{system}\n\n{prompt}" if system else prompt


def embed_request(body: Any, legacy: bool) -> Mapped:
    """POST /api/embed (`input`: a string or strings) or the older /api/embeddings
    (`prompt`: one string) -> POST /v1/embeddings."""
    body = request_object(body)
    model = model_of(body)
    given = body.get("prompt" if legacy else "input")
    if given is None:
        given = "" if legacy else []
    inputs = [given] if isinstance(given, str) else given
    if not isinstance(inputs, list) or not all(isinstance(i, str) for i in inputs):
        raise OllamaError(400, ("prompt must be a string" if legacy
                                else "input must be a string or a list of strings"))
    _, ignored = _common(body, "n_predict")
    kind = "embeddings" if legacy else "embed"
    return Mapped("/v1/embeddings", {"model": untagged(model), "input": inputs}, kind, model,
                  False, ignored)


# ---- answers --------------------------------------------------------------------------------

def _ns(ms: Any) -> int:
    try:
        return max(0, int(float(ms) * 1_000_000))
    except (TypeError, ValueError):
        return 0


def final_fields(timings: Any, done_reason: str, started: float) -> dict[str, Any]:
    """The counters of Ollama's last object, from llama-server's `timings`.
    prompt_eval_count is what the server prefilled (prompt_n): as in Ollama, tokens reused
    from the cache are not evaluated again, so a kept session shows only its new tokens."""
    t = timings if isinstance(timings, dict) else {}
    return {
        "done": True,
        "done_reason": done_reason,
        "total_duration": max(0, int((time.monotonic() - started) * 1e9)),
        "load_duration": 0,  # the model is loaded when llama-server starts
        "prompt_eval_count": int(t.get("prompt_n", 0) or 0),
        "prompt_eval_duration": _ns(t.get("prompt_ms")),
        "eval_count": int(t.get("predicted_n", 0) or 0),
        "eval_duration": _ns(t.get("predicted_ms")),
    }


def done_reason_of(finish: Any) -> str:
    """OpenAI finish_reason / llama-server stop_type -> Ollama's done_reason."""
    return "length" if finish in ("length", "limit") else "stop"


def _arguments(text: Any) -> Any:
    if isinstance(text, dict):
        return text
    if not isinstance(text, str) or not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return {"__raw": text}  # never drop what the model said
    return value if isinstance(value, dict) else {"value": value}


def tool_calls_in(calls: Any) -> list[dict[str, Any]]:
    """OpenAI tool calls -> Ollama's (arguments as an object)."""
    out = []
    for i, call in enumerate(calls if isinstance(calls, list) else []):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            continue
        entry: dict[str, Any] = {"function": {"index": i, "name": function.get("name") or "",
                                              "arguments": _arguments(function.get("arguments"))}}
        if call.get("id"):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def upstream_error(status: int, raw: bytes) -> str:
    """The message of a llama-server error body (`{"error": {"message": ...}}`), or the body."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        text = raw.decode("utf-8", "replace").strip()
        return text[:500] or f"upstream answered {status}"
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
    return json.dumps(data)[:500]


class AnswerShaper:
    """Builds Ollama objects for one request: the fields every object carries, and where the
    text goes (`message.content` for chat, `response` for generate)."""

    def __init__(self, mapped: Mapped, started: float | None = None) -> None:
        self.kind = mapped.kind
        self.model = mapped.model
        self.context = mapped.context
        self.started = time.monotonic() if started is None else started

    @property
    def is_chat(self) -> bool:
        return self.kind == CHAT

    def piece(self, content: str = "", thinking: str = "",
              tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "created_at": now_iso()}
        if self.is_chat:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if tool_calls:
                message["tool_calls"] = tool_calls
            out["message"] = message
        else:
            out["response"] = content
            if thinking:
                out["thinking"] = thinking
        out["done"] = False
        return out

    def final(self, timings: Any, done_reason: str, content: str = "", thinking: str = "",
              tool_calls: list[dict[str, Any]] | None = None,
              generated: list[int] | None = None) -> dict[str, Any]:
        out = self.piece(content, thinking, tool_calls)
        out.update(final_fields(timings, done_reason, self.started))
        if self.kind == GENERATE_RAW and self.context is not None:
            out["context"] = self.context + list(generated or [])
        return out

    # -- non-streamed ----------------------------------------------------------------------

    def whole(self, data: Any) -> dict[str, Any]:
        """A non-streamed llama-server answer -> Ollama's single object."""
        if not isinstance(data, dict):
            raise OllamaError(502, "llama-server sent an answer that is not a JSON object")
        if self.kind in (GENERATE_RAW, GENERATE_INFILL):
            return self.final(data.get("timings"), done_reason_of(data.get("stop_type")),
                              content=str(data.get("content") or ""),
                              generated=_ints(data.get("tokens")))
        choices = data.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(
            choices[0], dict) else {}
        message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
        return self.final(data.get("timings"), done_reason_of(choice.get("finish_reason")),
                          content=str(message.get("content") or ""),
                          thinking=str(message.get("reasoning_content") or ""),
                          tool_calls=tool_calls_in(message.get("tool_calls")) or None)

    def embeddings(self, data: Any, legacy: bool) -> dict[str, Any]:
        rows = data.get("data") if isinstance(data, dict) else None
        if not isinstance(rows, list):
            raise OllamaError(502, "llama-server sent no embeddings")
        vectors = [row.get("embedding") for row in sorted(
            (r for r in rows if isinstance(r, dict)), key=lambda r: r.get("index", 0))]
        if legacy:
            return {"embedding": vectors[0] if vectors else []}
        usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
        return {"model": self.model, "embeddings": vectors,
                "total_duration": max(0, int((time.monotonic() - self.started) * 1e9)),
                "load_duration": 0, "prompt_eval_count": int(usage.get("prompt_tokens", 0))}


def _ints(value: Any) -> list[int]:
    return [t for t in value if isinstance(t, int)] if isinstance(value, list) else []


class StreamTranslator:
    """llama-server's SSE stream -> Ollama's NDJSON, one line per event as it arrives. Only a
    partial SSE line is kept between chunks; tool-call fragments (OpenAI streams arguments in
    pieces) are joined and sent whole, as Ollama does, when the model stops."""

    MAX_PARTIAL = 4 * 1024 * 1024

    def __init__(self, shaper: AnswerShaper) -> None:
        self.shaper = shaper
        self._partial = b""
        self._calls: dict[int, dict[str, Any]] = {}
        self._finish: Any = None
        self._timings: Any = None
        self._generated: list[int] = []
        self._done = False

    def feed(self, chunk: bytes) -> bytes:
        if self._done:
            return b""
        if chunk == b"":
            return self._end()
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > self.MAX_PARTIAL:
            self._partial = b""
            return self._error_line("llama-server sent an SSE line over 4 MiB")
        out = [self._line(line.strip()) for line in lines]
        return b"".join(out)

    def _line(self, line: bytes) -> bytes:
        if line.startswith(b"error:"):
            return self._error_line(upstream_error(500, line[6:].strip()))
        event = sse_data(line)  # None: blank separators, comments, event names
        if event == SSE_DONE:
            return self._end()
        if not isinstance(event, dict):
            return b""
        if "error" in event:
            return self._error_line(upstream_error(500, line[5:].strip()))
        if isinstance(event.get("timings"), dict):
            self._timings = event["timings"]
        if self.shaper.kind in (GENERATE_RAW, GENERATE_INFILL):
            return self._native(event)
        return self._chat(event)

    def _native(self, event: dict[str, Any]) -> bytes:
        self._generated += _ints(event.get("tokens"))
        content = str(event.get("content") or "")
        if event.get("stop"):
            self._finish = event.get("stop_type")
            return self._emit_final(content)
        return _ndjson(self.shaper.piece(content)) if content else b""

    def _chat(self, event: dict[str, Any]) -> bytes:
        out = b""
        for choice in event.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
            for call in delta.get("tool_calls") or []:
                self._add_call(call)
            content = str(delta.get("content") or "")
            thinking = str(delta.get("reasoning_content") or "")
            if content or thinking:
                out += _ndjson(self.shaper.piece(content, thinking))
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        if self._finish is not None and self._timings is not None:
            out += self._emit_final()
        return out

    def _add_call(self, call: Any) -> None:
        if not isinstance(call, dict):
            return
        index = call.get("index", 0) if isinstance(call.get("index"), int) else 0
        entry = self._calls.setdefault(index, {"id": None, "name": "", "arguments": ""})
        if call.get("id"):
            entry["id"] = call["id"]
        function = call.get("function") if isinstance(call.get("function"), dict) else {}
        entry["name"] += function.get("name") or ""
        entry["arguments"] += function.get("arguments") or ""

    def _collected_calls(self) -> list[dict[str, Any]]:
        return tool_calls_in([{"id": c["id"], "function": {"name": c["name"],
                                                           "arguments": c["arguments"]}}
                              for _, c in sorted(self._calls.items())])

    def _emit_final(self, content: str = "") -> bytes:
        self._done = True
        out = b""
        calls = self._collected_calls()
        if calls:
            out += _ndjson(self.shaper.piece(tool_calls=calls))
        return out + _ndjson(self.shaper.final(self._timings, done_reason_of(self._finish),
                                               content=content, generated=self._generated))

    def _end(self) -> bytes:
        if self._done:
            return b""
        if self._finish is None and self._timings is None:
            self._done = True
            return self._error_line("llama-server's stream ended before the answer was done")
        return self._emit_final()

    def _error_line(self, message: str) -> bytes:
        self._done = True
        return _ndjson({"error": message})


def _ndjson(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode() + b"\n"


# ---- model listings -------------------------------------------------------------------------

def _quantization(name: str) -> str:
    upper = name.upper()
    for marker in ("Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_0", "Q4_1", "Q4_K_S", "Q4_K_M",
                   "Q5_0", "Q5_1", "Q5_K_S", "Q5_K_M", "Q6_K", "Q8_0", "F16", "BF16", "F32",
                   "IQ4_XS", "IQ4_NL", "MXFP4"):
        if marker in upper:
            return marker
    return ""


def _parameter_size(n_params: Any) -> str:
    if not isinstance(n_params, (int, float)) or n_params <= 0:
        return ""
    if n_params >= 1e9:
        return f"{n_params / 1e9:.1f}B"
    return f"{n_params / 1e6:.0f}M"


def _details(model_id: str, meta: dict[str, Any], family: str = "") -> dict[str, Any]:
    ftype = meta.get("ftype") if isinstance(meta.get("ftype"), str) else ""
    return {"parent_model": "", "format": "gguf", "family": family,
            "families": [family] if family else None,
            "parameter_size": _parameter_size(meta.get("n_params")),
            # "Q4_K - Medium" (llama-server's ftype) -> "Q4_K_M" (Ollama's spelling)
            "quantization_level": _quantization(model_id) or _quantization(
                ftype.replace(" - Small", "_S").replace(" - Medium", "_M")
                .replace(" - Large", "_L"))}


def display_name(model_id: str) -> str:
    """llama-server names a model by its file path unless started with --alias: Ollama
    clients get the file name without `.gguf`, tagged (`gemma-3-270m-q4_k_m:latest`).
    llama-server serves its one model whatever name a request gives."""
    base = model_id.replace("\\", "/").rsplit("/", 1)[-1]
    return tagged(base[:-len(".gguf")] if base.lower().endswith(".gguf") else base)


def _digest(model_id: str) -> str:
    # Stable per model id (Ollama's is the manifest's sha256; there is no manifest here).
    return hashlib.sha256(model_id.encode()).hexdigest()


def _models(data: Any) -> list[tuple[str, dict[str, Any], int]]:
    """(id, meta, created) of each model in llama-server's /v1/models answer."""
    rows = data.get("data") if isinstance(data, dict) else None
    out = []
    for row in rows if isinstance(rows, list) else []:
        if isinstance(row, dict) and isinstance(row.get("id"), str):
            meta = row.get("meta") if isinstance(row.get("meta"), dict) else {}
            created = row.get("created") if isinstance(row.get("created"), int) else 0
            out.append((row["id"], meta, created))
    return out


def _iso(timestamp: int) -> str:
    return datetime.fromtimestamp(timestamp or time.time(), UTC).isoformat().replace(
        "+00:00", "Z")


def tags_answer(models: Any) -> dict[str, Any]:
    """GET /api/tags from GET /v1/models."""
    return {"models": [{"name": display_name(model_id), "model": display_name(model_id),
                        "modified_at": _iso(created), "size": int(meta.get("size", 0) or 0),
                        "digest": _digest(model_id), "details": _details(model_id, meta)}
                       for model_id, meta, created in _models(models)]}


def ps_answer(models: Any) -> dict[str, Any]:
    """GET /api/ps from GET /v1/models: the model is always loaded while llama-server runs."""
    never = "2318-01-01T00:00:00Z"  # Ollama's "kept loaded for ever" (keep_alive < 0)
    return {"models": [{"name": display_name(model_id), "model": display_name(model_id),
                        "size": int(meta.get("size", 0) or 0), "digest": _digest(model_id),
                        "details": _details(model_id, meta), "expires_at": never,
                        "size_vram": 0,
                        # the context each slot has (n_ctx), else what the model was trained on
                        "context_length": int(meta.get("n_ctx") or meta.get("n_ctx_train")
                                              or 0)}
                       for model_id, meta, _ in _models(models)]}


def show_answer(props: Any, requested: str) -> dict[str, Any]:
    """POST /api/show from GET /props: the template, the context size, what it can do."""
    if not isinstance(props, dict):
        raise OllamaError(502, "llama-server's /props is not a JSON object")
    template = props.get("chat_template") if isinstance(props.get("chat_template"), str) else ""
    settings = props.get("default_generation_settings")
    settings = settings if isinstance(settings, dict) else {}
    n_ctx = int(settings.get("n_ctx", 0) or 0)
    path = props.get("model_path") if isinstance(props.get("model_path"), str) else ""
    modalities = props.get("modalities") if isinstance(props.get("modalities"), dict) else {}
    caps = props.get("chat_template_caps") if isinstance(props.get("chat_template_caps"),
                                                         dict) else {}
    capabilities = ["completion"]
    if caps.get("supports_tools") or caps.get("supports_tool_calls"):
        capabilities.append("tools")
    if modalities.get("vision"):
        capabilities.append("vision")
    if "enable_thinking" in template or caps.get("supports_reasoning_effort"):
        capabilities.append("thinking")
    return {
        "license": "",
        "modelfile": f"# served by llama-server through slotkeeper\nFROM {path}\n",
        "parameters": f"num_ctx {n_ctx}" if n_ctx else "",
        "template": template,
        "details": _details(path or requested, {"ftype": props.get("model_ftype")}),
        # Clients read "<general.architecture>.context_length"; the real architecture is not in
        # /props, so the key names this surface and still leads to the served context size.
        "model_info": {"general.architecture": "slotkeeper",
                       "general.basename": untagged(requested),
                       "slotkeeper.context_length": n_ctx, "general.file": path},
        "capabilities": capabilities,
        "modified_at": now_iso(),
    }
