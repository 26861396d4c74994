"""llama-server's answers -> Ollama's objects: the whole answer, the NDJSON stream, and the
counters of the final object. Pure: no mitmproxy, no I/O.

Streams: llama-server's SSE events become NDJSON lines as they arrive (`StreamTranslator`),
nothing is held back except tool-call fragments, which Ollama sends whole.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from ..wire.bodies import SSE_DONE, SseLines, sse_data
from .ollama import (
    CHAT,
    GENERATE_INFILL,
    GENERATE_RAW,
    Mapped,
    OllamaError,
    now_iso,
    upstream_error,
)


def _ns(ms: Any) -> int:
    try:
        return max(0, int(float(ms) * 1_000_000))
    except (TypeError, ValueError):
        return 0


def final_fields(timings: Any, done_reason: str, started: float) -> dict[str, Any]:
    """The counters of Ollama's last object, from llama-server's `timings`.
    prompt_eval_count is the whole prompt (reused + prefilled, cache_n + prompt_n), as Ollama
    reports it: its runner counts the prompt's inputs before the cache is consulted
    (docs/DESIGN.md); prompt_eval_duration is the prefill's time only."""
    t = timings if isinstance(timings, dict) else {}
    return {
        "done": True,
        "done_reason": done_reason,
        "total_duration": max(0, int((time.monotonic() - started) * 1e9)),
        "load_duration": 0,  # the model is loaded when llama-server starts
        "prompt_eval_count": _count(t.get("cache_n")) + _count(t.get("prompt_n")),
        "prompt_eval_duration": _ns(t.get("prompt_ms")),
        "eval_count": int(t.get("predicted_n", 0) or 0),
        "eval_duration": _ns(t.get("predicted_ms")),
    }


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


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
    except (ValueError, RecursionError):
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

    def __init__(self, shaper: AnswerShaper) -> None:
        self.shaper = shaper
        self._lines = SseLines()
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
        out = [self._line(line.strip()) for line in self._lines.feed(chunk)]
        if self._lines.overflowed:
            out.append(self._error_line("llama-server sent an SSE line over 16 MiB"))
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


