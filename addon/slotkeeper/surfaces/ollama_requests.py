"""Ollama requests -> llama-server requests. Pure: no mitmproxy; the server's tokenizer and
chat template are reached only through the callables the surface passes in.

- `/api/chat` goes to `/v1/chat/completions` (the server applies the model's chat template,
  parses tool calls and reasoning).
- `/api/generate` goes to `/completion` as tokens: the chat template rendered by the server
  (`render`), or the prompt as given with `raw`, after any `context` sent back; so the answer
  can return the `context` that continues it. With images or `think` it goes to
  `/v1/chat/completions` (the server parses images and reasoning only there), and with
  `suffix` to `/infill`.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Callable
from typing import Any

from .ollama import (
    CHAT,
    GENERATE_CHAT,
    GENERATE_INFILL,
    GENERATE_RAW,
    Mapped,
    OllamaError,
    now_iso,
    untagged,
)

# tokens(text, add_special) -> token ids; render(messages, fields) -> the templated prompt text
Tokens = Callable[[str, bool], list[int]]
Render = Callable[[list[dict[str, Any]], dict[str, Any]], str]


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


def _format_fields(value: Any, think: Any) -> dict[str, Any]:
    """`format`: "json" or a JSON schema -> llama-server's response_format (grammar-
    constrained output). Unless the client asked to think, the reasoning parser is off for
    this request (`reasoning_format: "none"`): with a template that can think, the server
    would otherwise take the constrained JSON for reasoning and leave `content` empty."""
    if value is None or value == "":
        return {}
    if value == "json":
        fields: dict[str, Any] = {"response_format": {"type": "json_object"}}
    elif isinstance(value, dict):
        fields = {"response_format": {"type": "json_schema",
                                      "json_schema": {"name": "format", "schema": value}}}
    else:
        raise OllamaError(400, 'format must be "json" or a JSON schema object')
    if think in (None, False):
        fields["reasoning_format"] = "none"
    return fields


def _native_format(value: Any) -> dict[str, Any]:
    """`format` on /completion, which reads `json_schema` (not response_format)."""
    if value is None or value == "":
        return {}
    if value == "json":
        return {"json_schema": {"type": "object"}}
    if isinstance(value, dict):
        return {"json_schema": value}
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


def _answered_call(pending: list[dict[str, Any]], name: Any,
                   call_id: Any = None) -> dict[str, Any] | None:
    """The call a tool result answers: the one whose id it names, when a client sends one
    (LangChain's ChatOllama sends `tool_call_id`, not Ollama's); else, as Ollama's results
    carry only the tool's name in the order of the calls, the first call of that name not yet
    answered (any unanswered call when the name matches none). Answered calls are taken out
    of `pending`."""
    call = next((c for c in pending if call_id and c["id"] == call_id), None) or next(
        (c for c in pending if c["function"]["name"] == name), pending[0] if pending else None)
    if call is not None:
        pending.remove(call)
    return call


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
                calls = _tool_calls_out(message["tool_calls"], turn)
                mapped["tool_calls"] = calls
                pending_calls = list(calls)
            thinking = message.get("thinking")
            if isinstance(thinking, str) and thinking:
                mapped["reasoning_content"] = thinking
        if role == "tool":
            name = message.get("tool_name") or message.get("name")
            call = _answered_call(pending_calls, name, message.get("tool_call_id"))
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
        **fields, **_format_fields(body.get("format"), body.get("think")),
        **_think_fields(body.get("think"))}
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


def _generate_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The /api/generate fields, type-checked: prompt, system, raw, context, suffix."""
    prompt = body.get("prompt") or ""
    if not isinstance(prompt, str):
        raise OllamaError(400, "prompt must be a string")
    system = body.get("system")
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
    if suffix and (raw or context):
        raise OllamaError(400, "suffix cannot be combined with raw or context")
    return {"prompt": prompt, "system": system, "raw": bool(raw), "context": context,
            "suffix": suffix}


def generate_request(body: Any, tokens: Tokens | None = None, render: Render | None = None
                     ) -> Mapped:
    """POST /api/generate -> /completion as tokens (the chat template applied by `render`
    unless `raw`, after any `context`), /v1/chat/completions with images or `think` (or when
    no `render` is given and neither raw nor context asks for tokens), /infill with `suffix`.
    `tokens(text, add_special)` and `render(messages, fields)` run on the server."""
    body = request_object(body)
    model = model_of(body)
    stream = _stream(body)
    g = _generate_fields(body)
    if g["suffix"]:
        fields, ignored = _common(body, "n_predict")
        upstream = {"input_prefix": g["prompt"], "input_suffix": g["suffix"], "stream": stream,
                    **fields}
        if g["system"]:
            ignored.append("system (infill has no system prompt)")
        return Mapped("/infill", upstream, GENERATE_INFILL, model, stream, ignored)
    as_chat = body.get("images") or body.get("think") is not None
    if g["raw"] or (not as_chat and (g["context"] is not None or render is not None)):
        return _native(body, model, stream, g, tokens, render)
    messages: list[dict[str, Any]] = []
    if g["system"]:
        messages.append({"role": "system", "content": g["system"]})
    messages.append({"role": "user", "content": g["prompt"], "images": body.get("images")})
    mapped = chat_request({**{k: v for k, v in body.items()
                              if k in ("options", "format", "think", "keep_alive", "stream",
                                       *SESSION_FIELDS)},
                           "model": model, "messages": messages})
    mapped.kind = GENERATE_CHAT
    if g["context"] is not None:
        mapped.ignored.append("context (not with images or think)")
    return mapped


def _native(body: dict[str, Any], model: str, stream: bool, g: dict[str, Any],
            tokens: Tokens | None, render: Render | None) -> Mapped:
    """/completion with the prompt as tokens: what the client's `context` and its new turn
    make, so the answer's `context` (these tokens and the generated ones) continues it."""
    if tokens is None:
        raise OllamaError(500, "raw and context need the server's tokenizer")
    fields, ignored = _common(body, "n_predict")
    fields.update(_native_format(body.get("format")))
    if body.get("images"):
        ignored.append("images (not with raw)")
    if g["system"] and g["raw"]:
        ignored.append("system (raw prompts are sent as given)")
    context = list(g["context"] or [])
    if g["raw"]:
        new = tokens(g["prompt"], not context)
    elif render is None:
        new = tokens(_template_free_turn(g["system"], g["prompt"]), not context)
    else:
        messages = ([{"role": "system", "content": g["system"]}] if g["system"] else []) + [
            {"role": "user", "content": g["prompt"]}]
        new = tokens(render(messages, {}), True)
        if context:
            # The turn continues the context: no second BOS in the middle of the prompt.
            bos = tokens("", True)
            while bos and new[:len(bos)] == bos:
                new = new[len(bos):]
    prompt_tokens = context + new
    upstream = {"prompt": prompt_tokens, "stream": stream, "return_tokens": True, **fields}
    return Mapped("/completion", upstream, GENERATE_RAW, model, stream, ignored,
                  context=prompt_tokens)


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


