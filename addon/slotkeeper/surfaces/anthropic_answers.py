"""llama-server's chat completion answers -> Anthropic Messages answers, whole and streamed,
the way the server's own Anthropic writers (`to_json_anthropic`, `to_json_anthropic_stream` in
server-task.cpp) write them, plus what the Messages API documents and those writers leave out
(the stop sequence, `ping`, an early `message_start`, `input` on a `tool_use` block start).
Pure: no I/O, no mitmproxy. See docs/DESIGN.md, "Anthropic /v1/messages"."""

from __future__ import annotations

import json
from typing import Any

from ..wire.bodies import SSE_DONE, SseLines, sse_data
from .anthropic import STOP_REASONS, NotTranslatable, encode_json, error_from_chat, jany, jint, jstr

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
    reasoning = jstr(message, "reasoning_content")
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    text = _text_of(message.get("content"))
    if text:
        blocks.append({"type": "text", "text": text})
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, list) else []:
        function = jany(call, "function", {})
        blocks.append({"type": "tool_use", "id": jstr(call, "id"),
                       "name": jstr(function, "name"),
                       "input": _input_of(jstr(function, "arguments"))})
    usage = jany(chat, "usage", {})
    prompt = jint(usage, "prompt_tokens", 0)
    cached = jint(jany(usage, "prompt_tokens_details", {}), "cached_tokens", 0)
    return {
        "id": jstr(chat, "id"),
        "type": "message",
        "role": "assistant",
        "content": blocks,
        "model": jstr(chat, "model"),
        **stop_fields(choices[0].get("finish_reason"), chat.get("__verbose")),
        "usage": {"cache_read_input_tokens": cached, "input_tokens": prompt - cached,
                  "output_tokens": jint(usage, "completion_tokens", 0)},
    }


def stop_reason(finish_reason: object) -> str:
    return STOP_REASONS.get(finish_reason, "end_turn") if isinstance(finish_reason, str) \
        else "end_turn"


def stop_fields(finish_reason: object, verbose: object) -> dict[str, Any]:
    """stop_reason and stop_sequence. A stop word reads as "stop" in the chat answer, like
    the end of the turn; the server's `__verbose` copy (asked for when the request has
    stop_sequences) says `stop_type: "word"` and which word."""
    word = jstr(verbose, "stopping_word")
    if jstr(verbose, "stop_type") == "word" and word and finish_reason == "stop":
        return {"stop_reason": "stop_sequence", "stop_sequence": word}
    return {"stop_reason": stop_reason(finish_reason), "stop_sequence": None}


def _text_of(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts (the server joins them with newlines)
        return "\n".join(jstr(part, "text") for part in content if jstr(part, "type") == "text")
    return ""


def _input_of(arguments: str) -> Any:
    """Tool arguments as JSON; the server falls back to {} when they do not parse."""
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):
        return {}


# ---- answer: streamed -----------------------------------------------------------------------

def _is_role_only(event: dict[str, Any]) -> bool:
    """A chunk that carries nothing but the assistant role (no text, tool call or finish)."""
    choices = event.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else {}
    delta = jany(choice, "delta", {})
    return (isinstance(delta, dict) and not jany(choice, "finish_reason", None)
            and all(value is None or key == "role" for key, value in delta.items()))


def sse_event(name: str, data: dict[str, Any]) -> bytes:
    """format_anthropic_sse: one `event:` line, one `data:` line, a blank line."""
    return b"event: " + name.encode() + b"\ndata: " + encode_json(data) + b"\n\n"


PING = sse_event("ping", {"type": "ping"})


THINKING, TEXT = "thinking", "text"  # keys of the open block (a tool's is ("tool", n))


class StreamTranslator:
    """llama-server's chat completion SSE stream -> the Messages API's event stream (the events
    llama-server's own `/v1/messages` writer sends, in the API's order), one chunk at a time
    (nothing is held back beyond a partial line). Call it with each chunk as it arrives and
    with b"" once at the end.

    One content block is open at a time, as the Messages API streams them: a block starts when
    its first delta arrives and stops when another starts or the answer ends (a thinking block
    gets its empty signature_delta just before it stops). Indices count up in that order:
    thinking, text, then each tool_use, the order the server's parser produces. llama-server's
    own /v1/messages writer instead keeps every block open until its final event; clients that
    follow the API's documented order see no difference here."""

    def __init__(self) -> None:
        self._lines = SseLines()
        self._verbose: Any = None  # the final event's __verbose: which stop word ended it
        self._started = False
        self._finished = False
        self._next_index = 0
        self._open: tuple[object, int] | None = None  # the open block: its key and index

    @property
    def finished(self) -> bool:
        return self._finished

    def __call__(self, chunk: bytes) -> bytes:
        if not chunk:
            return self._end()
        if self._finished:
            return b""
        out = [self._line(line) for line in self._lines.feed(chunk)]
        if self._lines.overflowed:
            out.append(self._fail("api_error", "an event from llama-server was too large"))
        return b"".join(out)

    def _line(self, line: bytes) -> bytes:
        if self._finished or not line:
            return b""
        if line.startswith(b":"):
            # llama-server's keep-alive comment: the API's keep-alive is a `ping` event.
            return PING if self._started else b""
        event = sse_data(line)  # `event:`/`id:` lines: llama-server's chat stream sends none
        if event == SSE_DONE:
            return self._end()
        if not isinstance(event, dict):
            return b""
        if "error" in event:  # the server failed mid-stream: it ends the stream after this
            self._finished = True
            return sse_event("error", error_from_chat(500, encode_json({"error": event["error"]})))
        if "prompt_progress" in event and _is_role_only(event):
            # return_progress: the slot took the prompt (first), then one per batch.
            return self._start(event) or PING
        if "__verbose" in event:
            self._verbose = event["__verbose"]
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
        timings = jany(event, "timings", {})
        progress = jany(event, "prompt_progress", None)
        if isinstance(progress, dict):  # before the prefill: what it will reuse and process
            total, cached = jint(progress, "total", 0), jint(progress, "cache", 0)
            timings = {"cache_n": cached, "prompt_n": max(0, total - cached)}
        return sse_event("message_start", {"type": "message_start", "message": {
            "id": jstr(event, "id"),
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": jstr(event, "model"),
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"cache_read_input_tokens": jint(timings, "cache_n", 0),
                      "input_tokens": jint(timings, "prompt_n", 0),
                      "output_tokens": 0},
        }})

    def _chunk(self, event: dict[str, Any]) -> bytes:
        choices = event.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices else {}
        delta = jany(choice, "delta", {})
        out: list[bytes] = []
        reasoning = jstr(delta, "reasoning_content")
        if reasoning:
            index = self._block(THINKING, {"type": "thinking", "thinking": ""}, out)
            out.append(self._delta(index, {"type": "thinking_delta", "thinking": reasoning}))
        text = jstr(delta, "content")
        if text:
            index = self._block(TEXT, {"type": "text", "text": ""}, out)
            out.append(self._delta(index, {"type": "text_delta", "text": text}))
        calls = delta.get("tool_calls") if isinstance(delta, dict) else None
        for call in calls if isinstance(calls, list) else []:
            out.append(self._tool_call(call))
        finish = choice.get("finish_reason") if isinstance(choice, dict) else None
        if finish is not None:
            out.append(self._finish(finish, event))
        return b"".join(out)

    def _block(self, key: object, block: dict[str, Any], out: list[bytes]) -> int:
        """The index of the open block for `key`; if another is open, it stops first and
        this one starts."""
        if self._open is not None and self._open[0] == key:
            return self._open[1]
        self._stop_open(out)
        index = self._next_index
        self._next_index += 1
        out.append(sse_event("content_block_start", {"type": "content_block_start",
                                                     "index": index, "content_block": block}))
        self._open = (key, index)
        return index

    def _stop_open(self, out: list[bytes]) -> None:
        if self._open is None:
            return
        key, index = self._open
        if key == THINKING:
            # Anthropic clients expect a signature before a thinking block stops; a local model
            # has none (the server sends an empty one too).
            out.append(self._delta(index, {"type": "signature_delta", "signature": ""}))
        out.append(sse_event("content_block_stop", {"type": "content_block_stop",
                                                    "index": index}))
        self._open = None

    @staticmethod
    def _delta(index: int, delta: dict[str, Any]) -> bytes:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                 "delta": delta})

    def _tool_call(self, call: object) -> bytes:
        number = jint(call, "index", 0)
        function = jany(call, "function", {})
        out: list[bytes] = []
        index = self._block(("tool", number), {
            "type": "tool_use", "id": jstr(call, "id"), "name": jstr(function, "name"),
            "input": {}}, out)
        arguments = jstr(function, "arguments")
        if arguments:
            out.append(self._delta(index, {"type": "input_json_delta",
                                           "partial_json": arguments}))
        return b"".join(out)

    def _finish(self, finish_reason: object, event: dict[str, Any]) -> bytes:
        self._finished = True
        out: list[bytes] = []
        self._stop_open(out)
        timings = jany(event, "timings", {})
        usage = jany(event, "usage", {})
        output_tokens = jint(timings, "predicted_n", jint(usage, "completion_tokens", 0))
        out.append(sse_event("message_delta", {
            "type": "message_delta",
            "delta": stop_fields(finish_reason, self._verbose),
            "usage": {"output_tokens": output_tokens},
        }))
        out.append(sse_event("message_stop", {"type": "message_stop"}))
        return b"".join(out)

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
