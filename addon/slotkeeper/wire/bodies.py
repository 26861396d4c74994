"""Request and response bodies: decode, parse, pin to a slot, read timings. Pure functions."""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# POST paths whose requests run a prompt in a slot (llama-server's own and its OpenAI/Anthropic
# compatible routes). Everything else passes through untouched.
COMPLETION_PATHS = frozenset(
    {
        "/completion",
        "/completions",
        "/v1/completions",
        "/chat/completions",
        "/v1/chat/completions",
        "/v1/messages",
        "/v1/responses",
        "/responses",
        "/infill",
    }
)


def route_of(path: str) -> str:
    """A request path as a route: without its query string and without trailing slashes
    (`/v1/messages/?beta=true` -> `/v1/messages`; `/` stays `/`). The one way every room
    compares a path with a route."""
    route = path.split("?", 1)[0]
    return (route.rstrip("/") or "/") if route.endswith("/") else route


def is_completion_path(path: str) -> bool:
    """True for a completion route, ignoring the query string and trailing slashes."""
    return route_of(path) in COMPLETION_PATHS


class BodyError(ValueError):
    """The body cannot be pinned; the message says why (shown in the flow and the log)."""


class BodyRefused(BodyError):
    """The body must not be forwarded at all: answered with `status` and the message."""

    status = 400


class BodyTooLarge(BodyRefused):
    """Over slotkeeper_max_body_mb, before or after decoding: 413."""

    status = 413


class BodyTooDeep(BodyRefused):
    """JSON nested deeper than Python's parser goes (about 1000 levels). No client nests that
    deep; llama-server b11434 segfaults on bodies nested about 110,000 deep (any endpoint), so
    such a body is answered 400 instead of being passed through."""


# Bodies shorter than this cannot nest deep enough to crash llama-server (measured: 100,000
# levels are survived, 120,000 are not; each level takes at least one byte), so only longer
# ones are checked on routes slotkeeper does not otherwise read.
DEEP_CHECK_MIN_BYTES = 32 * 1024


def nested_too_deep(raw: bytes) -> bool:
    """True when `raw` is JSON-looking and nested deeper than Python's parser accepts. Only
    bodies of at least DEEP_CHECK_MIN_BYTES are parsed (the rest cannot hurt the server)."""
    if len(raw) < DEEP_CHECK_MIN_BYTES or raw.lstrip()[:1] not in (b"{", b"["):
        return False
    try:
        json.loads(raw)
    except RecursionError:
        return True
    except ValueError:  # not JSON (or not UTF-8): the server gives its own error
        return False
    return False


def read_body(raw: bytes | None, content_encoding: str, max_bytes: int) -> bytes:
    """The one body read of every room: the request's bytes (None: mitmproxy streamed them,
    so there is nothing to read), size-checked against slotkeeper_max_body_mb before and after
    Content-Encoding is undone. BodyTooLarge (413) over the limit; BodyError otherwise."""
    if raw is None:
        raise BodyError("body was streamed, not read")
    if len(raw) > max_bytes:
        raise BodyTooLarge(f"request body of {len(raw)} bytes exceeds {max_bytes} bytes "
                           f"(slotkeeper_max_body_mb)")
    return decode_body(raw, content_encoding, max_bytes)


# flow.metadata: (text, data) of a body a surface rewrote, so SlotKeeper reads it without
# decoding and parsing it again; valid only while the request's content is still `text`.
PARSED_KEY = "slotkeeper_parsed_body"


# zlib window bits per Content-Encoding: 31 reads a gzip header, 15 a zlib stream.
_WBITS = {"gzip": 31, "x-gzip": 31, "deflate": 15}


def decode_body(raw: bytes, content_encoding: str, max_bytes: int) -> bytes:
    """Undo Content-Encoding, refusing to inflate past max_bytes (a gzip bomb stops there)."""
    encoding = content_encoding.strip().lower()
    if encoding in ("", "identity"):
        return raw
    if encoding not in _WBITS:
        raise BodyError(f"unsupported Content-Encoding {encoding!r}")
    inflater = zlib.decompressobj(_WBITS[encoding])
    try:
        out = inflater.decompress(raw, max_bytes + 1)
    except zlib.error as e:
        raise BodyError(f"body is not valid {encoding}: {e}") from None
    if len(out) > max_bytes or inflater.unconsumed_tail:
        raise BodyTooLarge(f"request body exceeds {max_bytes} bytes once decoded "
                           f"(slotkeeper_max_body_mb)")
    return out


def parse_json(raw: bytes) -> Any:
    """Any JSON value; BodyTooDeep past Python's nesting limit, BodyError when not JSON."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise BodyTooDeep("request body is JSON nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an int over 4300 digits
        raise BodyError(f"body is not JSON: {str(e)[:200]}") from None


def parse_json_object(raw: bytes) -> dict[str, Any]:
    data = parse_json(raw)
    if not isinstance(data, dict):
        raise BodyError(f"body is JSON {type(data).__name__}, not an object")
    return data


def client_slot(data: dict[str, Any]) -> int | None:
    """The id_slot the client chose itself, or None. -1 means "any" to llama-server."""
    value = data.get("id_slot")
    if value is None or value == -1:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BodyError(f"id_slot must be an integer, got {json.dumps(value)[:40]}")
    return value


def check_cache_prompt(data: dict[str, Any]) -> None:
    value = data.get("cache_prompt")
    # null is "not set" (clients that serialise every field send it; llama-server accepts it).
    if value is not None and not isinstance(value, bool):
        raise BodyError(f"cache_prompt must be true or false, got {json.dumps(value)[:40]}")


JSON_WHITESPACE = b" \t\r\n"


def pin(data: dict[str, Any], slot: int | None, raw: bytes | None = None) -> bytes:
    """The body to forward: id_slot set (when slot is not None) and cache_prompt defaulted to
    true. An explicit cache_prompt: false from the client stays: it asked not to cache.

    `raw` is the JSON text `data` was parsed from. When neither field is at its top level (every
    client seen), the fields are appended to the client's own bytes instead of serializing the
    whole body again: a conversation of 100 KB or more costs a millisecond or more to dump on
    every request, the append costs nothing, and the server gets the client's JSON as sent."""
    if raw is not None and "id_slot" not in data and "cache_prompt" not in data:
        text = raw.strip(JSON_WHITESPACE)
        # An object in an ASCII-compatible encoding: json.loads also reads UTF-16 and UTF-32,
        # whose bytes neither start with "{" nor end with "}".
        if text[:1] == b"{" and text[-1:] == b"}":
            fields = b'"cache_prompt":true' if slot is None else (
                b'"id_slot":%d,"cache_prompt":true' % slot)
            return text[:-1] + (b"," if data else b"") + fields + b"}"
    out = dict(data)
    if slot is not None:
        out["id_slot"] = slot
    if out.get("cache_prompt") is None:
        out["cache_prompt"] = True
    try:
        return json.dumps(out, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:  # a lone surrogate ("\ud800" in the JSON): keep it escaped
        return json.dumps(out, separators=(",", ":")).encode()


SSE_DONE = "[DONE]"
# The longest SSE line kept while waiting for its end. One llama-server event is one token's
# worth; the largest is the final one (its timings, or a `__verbose` copy of the answer).
MAX_SSE_LINE_BYTES = 16 * 1024 * 1024


class SseLines:
    """The one line buffer for llama-server's event streams: chunks in, whole lines out (without
    their line end), only the unfinished last line kept between chunks. A line longer than
    MAX_SSE_LINE_BYTES is dropped and `overflowed` says so once."""

    def __init__(self) -> None:
        self._partial = b""
        self.overflowed = False

    def feed(self, chunk: bytes) -> list[bytes]:
        lines = (self._partial + chunk).split(b"\n") if self._partial else chunk.split(b"\n")
        self._partial = lines.pop()
        self.overflowed = len(self._partial) > MAX_SSE_LINE_BYTES
        if self.overflowed:
            self._partial = b""
        return [line[:-1] if line.endswith(b"\r") else line for line in lines]


def sse_data(line: bytes) -> dict[str, Any] | str | None:
    """One line of llama-server's OpenAI-style event stream, for the translations that rewrite
    it: the JSON object of a `data:` line, SSE_DONE for `data: [DONE]`, None for anything else
    (blank separators, other fields, a payload that is not a JSON object)."""
    if not line.startswith(b"data:"):
        return None
    payload = line[5:].strip()
    if payload == b"[DONE]":
        return SSE_DONE
    try:
        event = json.loads(payload)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    return event if isinstance(event, dict) else None


@dataclass(frozen=True)
class Timings:
    cache_n: int  # prompt tokens reused from the slot
    prompt_n: int  # prompt tokens prefilled
    predicted_n: int
    prompt_ms: float
    predicted_ms: float = 0.0

    @property
    def prompt_tokens(self) -> int:
        return self.cache_n + self.prompt_n


def timings_from(obj: object, earlier: Timings | None = None) -> Timings | None:
    """Token counts of a parsed response (or SSE event). llama-server's own `timings` where it
    sends them (/completion, chat completions); otherwise the API's `usage`, which is all that
    /v1/messages and /v1/responses carry in b11434 (measured). `earlier` fills what an event
    leaves out: an Anthropic stream gives the prompt counts in `message_start` and only
    `output_tokens` at the end."""
    if not isinstance(obj, dict):
        return None
    t = obj.get("timings")
    try:
        if isinstance(t, dict):
            return Timings(
                cache_n=int(t.get("cache_n", 0)),
                prompt_n=int(t.get("prompt_n", 0)),
                predicted_n=int(t.get("predicted_n", 0)),
                prompt_ms=float(t.get("prompt_ms", 0.0)),
                predicted_ms=float(t.get("predicted_ms", 0.0)),
            )
        usage = _usage_in(obj)
        return None if usage is None else _timings_from_usage(usage, earlier)
    except (TypeError, ValueError):
        return None


def _usage_in(obj: dict) -> dict | None:
    # Top level (non-streamed), or inside an Anthropic `message_start` / a Responses
    # `response.completed` event.
    for holder in (obj, obj.get("message"), obj.get("response")):
        if isinstance(holder, dict) and isinstance(holder.get("usage"), dict):
            return holder["usage"]
    return None


def _timings_from_usage(usage: dict, earlier: Timings | None) -> Timings | None:
    base = earlier or Timings(cache_n=0, prompt_n=0, predicted_n=0, prompt_ms=0.0)
    predicted = int(usage.get("output_tokens", base.predicted_n))
    details = usage.get("input_tokens_details")
    if isinstance(details, dict):
        # OpenAI Responses: input_tokens counts the cached ones too.
        cached = int(details.get("cached_tokens", 0))
        return Timings(cache_n=cached, prompt_n=int(usage.get("input_tokens", 0)) - cached,
                       predicted_n=predicted, prompt_ms=0.0)
    if "input_tokens" in usage or "cache_read_input_tokens" in usage or "output_tokens" in usage:
        # Anthropic: input_tokens are the ones not read from the cache.
        return Timings(cache_n=int(usage.get("cache_read_input_tokens", base.cache_n)),
                       prompt_n=int(usage.get("input_tokens", base.prompt_n)),
                       predicted_n=predicted, prompt_ms=0.0)
    return None  # chat completions' usage: their `timings` are read instead


_TIMINGS_KEY = b'"timings":'
_DECODER = json.JSONDecoder()


def timings_in_json(raw: bytes) -> Timings | None:
    """The token counts of a non-streamed answer. llama-server writes `timings` as the last
    key of its answer, so only that object is parsed (the answer before it can be long: the
    whole parse was the response hook's largest cost on a kept turn, docs/BENCHMARKS.md); an
    answer without it (`usage` only, or an escaped `\"timings\":` inside a text) is parsed
    whole."""
    at = raw.rfind(_TIMINGS_KEY)
    if at > 0 and raw[at - 1:at] != b"\\":
        try:
            found, _end = _DECODER.raw_decode(raw[at + len(_TIMINGS_KEY):].decode().lstrip())
        except (UnicodeDecodeError, json.JSONDecodeError):
            found = None
        if isinstance(found, dict):
            return timings_from({"timings": found})
    try:
        return timings_from(json.loads(raw))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None


# What marks llama-server's final event of a stream, read on the raw line (no parse): a chat
# or completions choice with a finish reason (`null` until then), /completion's `stop`, the
# Responses API's completion, the end marker.
_FINAL_MARKS = (b'"finish_reason":"', b'"stop":true', b'"response.completed"', b"[DONE]")


class SseTimingsWatcher:
    """Passes a server-sent-event stream through unchanged, chunk by chunk, and remembers the
    last `timings` it saw (llama-server puts them in the final event). Used as
    `flow.response.stream`, so nothing is buffered beyond one partial line. `on_final` is
    called once, when the final event passes (before the client has it)."""

    def __init__(self, on_final: Callable[[], None] | None = None) -> None:
        self._lines = SseLines()  # a runaway line is dropped: stop looking, keep streaming
        self.timings: Timings | None = None
        self.final = False
        self._on_final = on_final

    def __call__(self, chunk: bytes) -> bytes:
        for line in self._lines.feed(chunk):
            if line.startswith(b"data:") and (b'"timings"' in line or b'"usage"' in line):
                try:
                    event = json.loads(line[5:].strip())
                except (UnicodeDecodeError, json.JSONDecodeError):
                    continue
                found = timings_from(event, self.timings)
                if found is not None:
                    self.timings = found
            if not self.final and line.startswith(b"data:") and any(
                    mark in line for mark in _FINAL_MARKS):
                self.final = True
                if self._on_final is not None:
                    self._on_final()
        return chunk
