"""What identify reads from a request body, whatever its API (chat completions, Anthropic
messages, responses, raw completion and infill): model, system prompt, first user message,
tools, the messages' texts. Pure, and like identity.py it reads hostile input: every function
accepts any value and never raises."""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..wire.bodies import route_of
from .memo import Memo

SYSTEM_ROLES = frozenset({"system", "developer"})

# Keys whose values are not prompt text (or change between turns, like cache_control).
NOT_PROMPT_TEXT = frozenset({
    "role", "type", "id", "call_id", "tool_call_id", "tool_use_id", "cache_control", "status",
    "signature", "encrypted_content", "index",
})
MAX_DEPTH = 32  # deeper structures are ignored: real payloads nest < 10 levels
REPLY_ROLES = frozenset({"assistant", "model"})


def id_text(value: object) -> str | None:
    """A usable id value: a non-blank string, or an int (chat ids are sometimes numbers).
    Booleans, floats, dicts and lists never name a session."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return int_text(value)
    if isinstance(value, str) and value.strip():
        return value
    return None


def int_text(value: int) -> str:
    # str() refuses ints over 4300 digits (CPython's conversion limit); hex has no limit.
    return str(value) if value.bit_length() <= 10_000 else hex(value)


@dataclass(frozen=True)
class Prompt:
    """What identify needs from a request body, whatever its API."""

    model: str = ""
    system_parts: tuple[str, ...] = ()  # system text as sent (billing block included)
    first_user_parts: tuple[str, ...] = ()
    raw_prompt: str | None = None  # /completion, /infill: the prompt text in server order
    tools_json: str | None = None  # the canonical tools as sorted ASCII JSON, or None
    tools_chars: int = 0
    message_chars: int = 0
    message_count: int = 0
    messages: tuple[tuple[str | None, tuple[str, ...]], ...] = ()  # (role, texts) after the system
    message_sizes: tuple[int, ...] = ()  # characters of each message's texts (replies too)


ANTHROPIC_ROUTES = frozenset({"/v1/messages", "/messages"})
CHAT_ROUTES = frozenset({"/v1/chat/completions", "/chat/completions"})
RESPONSES_ROUTES = frozenset({"/v1/responses", "/responses"})
COMPLETION_ROUTES = frozenset({"/completion", "/completions", "/v1/completions"})
INFILL_ROUTES = frozenset({"/infill"})
INFILL_FIELDS = ("input_extra", "input_prefix", "input_suffix")


def read_prompt(path: object, body: object) -> Prompt:
    """The route decides which fields the server prefills (a stray "prompt" on a chat
    request is ignored by the server, so here too); an unknown route goes by the body."""
    if not isinstance(body, dict):
        return Prompt()
    kind = _api_kind(path, body)
    if kind == "anthropic":
        return _read_conversation(body, _system_field(body.get("system")), body.get("messages"))
    if kind == "chat":
        return _read_conversation(body, (), body.get("messages"))
    if kind == "responses":
        return _read_responses(body)
    if kind == "completion":
        return _read_raw(body, _prompt_text(body.get("prompt")))
    if kind == "infill":
        return _read_raw(body, _infill_text(body))
    return Prompt(model=_model(body))


def _api_kind(path: object, body: dict) -> str:
    route = route_of(path) if isinstance(path, str) else ""
    for routes, kind in ((ANTHROPIC_ROUTES, "anthropic"), (CHAT_ROUTES, "chat"),
                         (RESPONSES_ROUTES, "responses"), (COMPLETION_ROUTES, "completion"),
                         (INFILL_ROUTES, "infill")):
        if route in routes:
            return kind
    if "messages" in body:
        return "anthropic" if "system" in body else "chat"
    if "input" in body or "instructions" in body:
        return "responses"
    if any(field in body for field in INFILL_FIELDS):
        return "infill"
    if "prompt" in body:
        return "completion"
    return "none"


def _model(body: dict) -> str:
    return id_text(body.get("model")) or ""


def _read_conversation(body: dict, top_system: tuple[str, ...], messages: object,
                       leading: tuple[str, ...] = ()) -> Prompt:
    """Anthropic and chat: system text = top-level `system` + the leading run of
    system/developer messages (a later one is not part of a stable prefix)."""
    items = messages if isinstance(messages, list) else []
    system_parts = list(top_system) + list(leading)
    start = 0
    while start < len(items) and _role(items[start]) in SYSTEM_ROLES:
        system_parts.extend(_texts(items[start].get("content")))
        start += 1
    rest = items[start:]
    tools_json, tools_chars = tools_of(body.get("tools"))
    # One walk over the messages' texts serves both the size and the chain.
    messages = []
    sizes = []
    for message in rest:
        role = _role(message)
        texts = tuple(_texts(message))
        sizes.append(sum(len(text) for text in texts))
        messages.append((role, () if role in REPLY_ROLES else texts))
    return Prompt(
        model=_model(body),
        system_parts=tuple(system_parts),
        first_user_parts=_first_user_parts(rest),
        tools_json=tools_json,
        tools_chars=tools_chars,
        message_chars=sum(sizes),
        message_count=len(items),
        messages=tuple(messages),
        message_sizes=tuple(sizes),
    )


def _read_responses(body: dict) -> Prompt:
    instructions = body.get("instructions")
    leading = (instructions,) if isinstance(instructions, str) and instructions else ()
    given = body.get("input")
    if isinstance(given, str):
        tools_json, tools_chars = tools_of(body.get("tools"))
        return Prompt(model=_model(body), system_parts=leading,
                       first_user_parts=(given,) if given else (), tools_json=tools_json,
                       tools_chars=tools_chars, message_chars=len(given),
                       message_count=1 if given else 0,
                       messages=(("user", (given,)),) if given else (),
                       message_sizes=(len(given),) if given else ())
    return _read_conversation(body, (), given, leading)


def _read_raw(body: dict, text: str) -> Prompt:
    return Prompt(model=_model(body), raw_prompt=text, message_chars=len(text),
                   message_count=1 if text else 0)


def _role(message: object) -> str | None:
    role = message.get("role") if isinstance(message, dict) else None
    return role if isinstance(role, str) else None  # a list or dict role is not hashable


def _first_user_parts(messages: list) -> tuple[str, ...]:
    """The first user message's text; with no user message, the first message of any role."""
    dicts = [m for m in messages if isinstance(m, dict)]
    first = next((m for m in dicts if m.get("role") == "user"), dicts[0] if dicts else None)
    return tuple(_texts(first.get("content"))) if first is not None else ()


def _system_field(system: object) -> tuple[str, ...]:
    """Anthropic's top-level `system`: a string or a list of text blocks."""
    return tuple(_texts(system))


def _texts(value: object, depth: int = 0) -> Iterator[str]:
    """Every piece of prompt text in a message or content value, in a canonical order (dict
    keys sorted, so a client that rebuilds its objects in another key order hashes the
    same), skipping metadata such as roles, ids and cache_control markers."""
    if isinstance(value, str):
        yield value
    elif depth >= MAX_DEPTH:
        return
    elif isinstance(value, dict):
        for key in sorted(k for k in value if isinstance(k, str)):
            if key not in NOT_PROMPT_TEXT:
                yield from _texts(value[key], depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _texts(item, depth + 1)


def tools_of(tools: object) -> tuple[str | None, int]:
    """(the canonical tools as sorted ASCII JSON, about as many characters as their JSON has);
    (None, 0) when there are none. The count takes each \\u escape as the one character it
    stands for (a literal backslash-u in a description is counted 5 short): dumping 48 KB of
    Claude Code's tools a second time unescaped, to count them exactly, cost ~0.25 ms a
    request for a size that is only ever an estimate (the prompt's size, in characters).

    An agent sends the same tools on every turn, so they are made canonical once (0.25 ms for
    Claude Code's) and looked up after that by their pickle (0.02 ms): a pickle, not the list
    itself, because Python's equality takes `true`, `1` and `1.0` for one value, which the
    canonical JSON does not."""
    if not isinstance(tools, list) or not tools:
        return None, 0
    try:
        key = pickle.dumps(tools, protocol=5)
    except (RecursionError, pickle.PicklingError, TypeError, ValueError):
        return _canonical_tools(tools)  # nothing a parsed body holds; made afresh anyway
    return _TOOLS.get(key, lambda: _canonical_tools(tools))


# Tool lists in use at once: one per agent and subagent kind, ~100 KB each with its key.
_TOOLS: Memo[bytes, tuple[str, int]] = Memo(32)


def _canonical_tools(tools: list) -> tuple[str, int]:
    text = _CANONICAL_JSON.encode(canonical(tools))
    return text, len(text) - 5 * text.count("\\u")


# One encoder made once: json.dumps builds a new one for every call with options.
_CANONICAL_JSON = json.JSONEncoder(ensure_ascii=True, sort_keys=True, separators=(",", ":"))


def canonical(value: object, depth: int = 0) -> Any:
    """A JSON-safe copy for hashing: string keys only, no cache_control (its placement moves
    between requests), bounded depth, ints json can always print."""
    if isinstance(value, (str, bool, float)) or value is None:
        return value
    if isinstance(value, int):
        return value if value.bit_length() <= 10_000 else hex(value)
    if depth >= MAX_DEPTH:
        return "<deep>"
    if isinstance(value, dict):
        return {k: canonical(v, depth + 1) for k, v in value.items()
                if isinstance(k, str) and k != "cache_control"}
    if isinstance(value, (list, tuple)):
        return [canonical(item, depth + 1) for item in value]
    return f"<{type(value).__name__}>"


def _prompt_text(prompt: object, depth: int = 0) -> str:
    """A raw prompt as text: a string, token ids (each as its decimal text and a space, about
    as many characters as the text it encodes), a list of those, or llama-server's
    {"prompt_string": ...} object."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, bool):
        return ""
    if isinstance(prompt, int):
        return int_text(prompt) + " "
    if depth >= MAX_DEPTH:
        return ""
    if isinstance(prompt, list):
        return "".join(_prompt_text(item, depth + 1) for item in prompt)
    if isinstance(prompt, dict):
        return _prompt_text(prompt.get("prompt_string"), depth + 1)
    return ""


def _infill_text(body: dict) -> str:
    """/infill text in the order the server lays it out: extra context chunks, prefix,
    suffix, then the middle (`prompt`)."""
    extra = "".join(_texts(body.get("input_extra")))
    pieces = [body.get("input_prefix"), body.get("input_suffix")]
    return extra + "".join(p for p in pieces if isinstance(p, str)) + _prompt_text(
        body.get("prompt"))
