"""Which session a request belongs to, and by which rule. Pure: no I/O, no logging.

The rules, their order and every decision behind them are in docs/DESIGN.md, "Session
identity". In short: a client-sent header, else a body field, else a hash of the conversation
start (model + system prompt + first user message); a subagent request becomes
"<parent>/<child>" (or its parent's session, when configured so).

Everything here reads hostile input (headers and a JSON body from any client), so every
function accepts any value and never raises; session ids come out normalised (see
`_normalise_id`): printable ASCII without spaces, "/" only as the parent/child separator.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

from ..decisions.policy import Prefix
from .memo import Memo
from .prompts import Prompt, id_text, read_prompt
from .tasks import asks_for_side_task


@dataclass(frozen=True)
class IdentityConfig:
    # configured extra session header names, checked after the built-in headers
    extra_headers: tuple[str, ...] = ()
    # a subagent/child request uses its parent's session instead of "parent/child"
    children_share_parent: bool = False


@dataclass(frozen=True)
class Identity:
    session_id: str  # normalised (see _normalise_id)
    rule: str  # which rule matched, human readable ("header x-session-id", "content", ...)
    parent_id: str | None  # the parent session when this request is a child (subagent) session
    prompt_chars: int  # characters the server will prefill (system + tools JSON + all messages)
    message_count: int  # conversation messages / input items (a bare prompt counts 1)
    seed_key: str | None  # sha256 hex of (system prompt, tools): the shared seed snapshot
    system_chars: int  # characters of system prompt + tools JSON
    # Cumulative hashes of the conversation: item 0 is the system block (system prompt +
    # tools), then one per message; chain[k] names the first k+1 items. A request continues
    # a conversation when its chain holds that conversation's last hash at the same place.
    chain: tuple[str, ...] = ()
    # chain_chars[k]: characters of the first k+1 items (system block + tools, then each
    # message's texts, replies included): how much of the prompt a common chain prefix is.
    chain_chars: tuple[int, ...] = ()
    # Set by the router's sessions room, not by identify: a content request that continues a
    # conversation whose prompt it rebuilt (shares its longest prefix) instead of extending it.
    rewrites: bool = False
    # Also set by sessions: a new conversation (a fork) whose opening another session holds,
    # and how much of it they share.
    prefix: Prefix | None = None
    # A title, tags or follow-ups request by what it asks (tasks.py): never the session's
    # conversation, whichever of the two arrives first.
    side_task: bool = False


# ---- rule 1: headers ------------------------------------------------------------------------

# Checked in this order; the first non-blank value wins. Generic names first, then the ones
# particular clients send (see /work/shared/llama-server-facts.md, "What clients send").
SESSION_HEADERS: tuple[str, ...] = (
    "x-session-id",  # generic; OpenCode sends it too
    "x-conversation-id",
    "session-id",  # generic; Codex >= thread/session split sends it
    "conversation-id",
    "x-claude-code-session-id",  # Claude Code
    "session_id",  # Codex (older releases), pi with sendSessionAffinityHeaders
    "thread-id",  # Codex
    "x-session-affinity",  # OpenCode, pi
    "x-opencode-session",  # OpenCode
    "x-openwebui-chat-id",  # OpenWebUI (with forwarded user info headers)
    "x-litellm-session-id",  # LiteLLM / OpenHands
)
# Deliberately absent: x-client-request-id. pi sets it to the session id, but only next to
# session_id / x-session-affinity, and Codex to the thread id, next to thread-id (both above),
# while OpenAI SDKs send a fresh one per request: it adds nothing, and as a key it could
# split one conversation into one session per request.

# ---- rule 3: children -----------------------------------------------------------------------

CLAUDE_AGENT = "x-claude-code-agent-id"  # set on subagent requests only; the main agent has none
CLAUDE_PARENT_AGENT = "x-claude-code-parent-agent-id"
CODEX_THREAD = "thread-id"
CODEX_PARENT_THREAD = "x-codex-parent-thread-id"
OPENCODE_PARENT = "x-parent-session-id"

# ---- rule 2: body fields --------------------------------------------------------------------

# API object ids: a response, message or completion id names one request or one reply, never
# a conversation. A top-level "id" with one of these prefixes is not a chat id.
OBJECT_ID_PREFIXES: tuple[str, ...] = (
    "resp_", "msg_", "chatcmpl-", "cmpl-", "rs_", "fc_", "call_", "toolu_", "req_", "run_",
    "asst_", "file_", "batch_",
)

# Claude Code's metadata.user_id: "user_<hash>_account_<uuid>_session_<uuid>".
CLAUDE_SESSION_MARK = "_session_"
BILLING_MARK = "x-anthropic-billing-header"  # rotates per request: kept out of every hash

# ---- rule 4: content ------------------------------------------------------------------------

# A raw prompt (/completion) has no first user message; its stable part is a prefix. The
# prefix length equals the default small-request threshold (slotkeeper_small_request_chars):
# every prompt that claims a slot is at least this long, so its key never changes as the
# conversation grows. Shorter prompts are side requests and claim no slot.
PROMPT_KEY_CHARS = 2000

# ---- normalisation --------------------------------------------------------------------------

MAX_ID_CHARS = 128
READABLE_CHARS = 48
ID_HASH_HEX = 16
# Printable ASCII without space (ids go into headers and log lines), "/" (the parent/child
# separator) and "~" (marks a hashed id, so a verbatim id can never look like one).
SAFE_ID_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F)) - {"/", "~"}

DEFAULT_SESSION = "default"


@dataclass(frozen=True)
class _Found:
    session_id: str  # normalised
    rule: str


def identify(path: str, headers: Mapping[str, str], body: object,
             config: IdentityConfig = IdentityConfig()) -> Identity:
    """The session of one completion request. Never raises, whatever the input."""
    header_values = _lowercase_headers(headers)
    prompt = read_prompt(path, body)
    own = _from_headers(header_values, config) or _from_body(body)
    session, rule, parent = _resolve_children(own, header_values, prompt, config)
    system_chars = sum(len(part) for part in prompt.system_parts) + prompt.tools_chars
    # The seed key and the chain's first link hash the same material: hashed once (a coding
    # agent's tools alone are tens of KB of JSON).
    system = _hashable_system(prompt.system_parts)
    system_digest, chain_head = _system_digest(prompt, system)
    return Identity(
        session_id=session,
        rule=rule,
        parent_id=parent,
        prompt_chars=system_chars + prompt.message_chars,
        message_count=prompt.message_count,
        seed_key=system_digest if prompt.tools_json or system else None,
        system_chars=system_chars,
        chain=_chain(prompt, chain_head),
        chain_chars=_chain_chars(prompt, system_chars),
        side_task=asks_for_side_task(
            has_tools=prompt.tools_json is not None,
            roles=[role for role, _texts in prompt.messages],
            system_parts=prompt.system_parts, first_user_parts=prompt.first_user_parts),
    )


# ---- normalisation --------------------------------------------------------------------------

def _normalise_id(raw: str) -> str:
    """A client id as it may appear in headers, logs and the API: verbatim when it is 1-128
    safe characters (and not just dots, which name directories); otherwise
    "<readable prefix>~<sha256[:16]>", unique and deterministic. Never empty."""
    text = raw.strip()
    if 0 < len(text) <= MAX_ID_CHARS and all(c in SAFE_ID_CHARS for c in text) \
            and text.strip(".") != "":
        return text
    readable = "".join(c if c in SAFE_ID_CHARS else "_" for c in text[:READABLE_CHARS])
    return f"{readable}~{_sha256(text)[:ID_HASH_HEX]}"


def _sha256(text: str) -> str:
    # surrogatepass: header values decoded with surrogateescape (mitmproxy) and JSON "\ud800"
    # escapes hold lone surrogates, which plain utf-8 refuses to encode.
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


# ---- rule 1: headers ------------------------------------------------------------------------

def _lowercase_headers(headers: object) -> dict[str, str]:
    """Header values by lower-case name. Repeated names are joined with ", " as mitmproxy's
    Headers does, so a plain dict and a Headers object give the same answer."""
    values: dict[str, str] = {}
    fields = getattr(headers, "fields", None)
    if isinstance(fields, tuple):
        # mitmproxy's Headers: its raw (name, value) byte pairs, decoded as Headers decodes
        # them, read once; its items() looks every name up again to join repeats.
        items = fields
    else:
        items = headers.items() if isinstance(headers, Mapping) else ()
    for name, value in items:
        if isinstance(name, bytes):
            name = name.decode("utf-8", "surrogateescape")
        if isinstance(value, bytes):
            value = value.decode("utf-8", "surrogateescape")
        if not isinstance(name, str) or not isinstance(value, str):
            continue
        key = name.strip().lower()
        values[key] = f"{values[key]}, {value}" if key in values else value
    return values


def _header_id(header_values: Mapping[str, str], name: str) -> str | None:
    return id_text(header_values.get(name))


def _from_headers(header_values: Mapping[str, str], config: IdentityConfig) -> _Found | None:
    extra = config.extra_headers
    extra = tuple(extra) if isinstance(extra, (tuple, list)) else ()
    try:
        names = _header_names(extra)
    except TypeError:  # an unhashable item: not a header name, and not worth a cache
        names = _header_names.__wrapped__(extra)
    for name in names:
        value = _header_id(header_values, name)
        if value is not None:
            return _Found(_normalise_id(value), f"header {name}")
    return None


@functools.lru_cache(maxsize=16)
def _header_names(extra: tuple) -> tuple[str, ...]:
    """The built-in session headers, then the configured ones (made once per option value)."""
    return SESSION_HEADERS + tuple(n.strip().lower() for n in extra if isinstance(n, str))


# ---- rule 2: body ---------------------------------------------------------------------------

def _from_body(body: object) -> _Found | None:
    if not isinstance(body, dict):
        return None
    for field in ("session_id", "conversation_id", "chat_id"):
        value = id_text(body.get(field))
        if value is not None:
            return _Found(_normalise_id(value), f"body {field}")
    chat_id = _chat_id(body.get("id"))
    if chat_id is not None:
        return _Found(_normalise_id(chat_id), "body id")
    value = id_text(body.get("prompt_cache_key"))
    if value is not None:
        return _Found(_normalise_id(value), "body prompt_cache_key")
    metadata = body.get("metadata")
    user_id = id_text(metadata.get("user_id")) if isinstance(metadata, dict) else None
    if user_id is not None:
        return _Found(_normalise_id(_claude_session(user_id)), "body metadata.user_id")
    value = id_text(body.get("user"))
    if value is not None:
        return _Found(_normalise_id(value), "body user")
    return None


def _chat_id(value: object) -> str | None:
    """A top-level "id" names a chat (the Vercel AI SDK's useChat posts {id: chatId, ...})
    unless it is an API object id, which names a single request or reply."""
    text = id_text(value)
    if text is None or text.strip().startswith(OBJECT_ID_PREFIXES):
        return None
    return text


def _claude_session(user_id: str) -> str:
    """The session inside Claude Code's metadata.user_id: "..._session_<uuid>", or a JSON
    object with "session_id" (newer releases). Anything else is used whole."""
    text = user_id.strip()
    if text.startswith("{"):
        try:
            decoded = json.loads(text)
        except (ValueError, RecursionError):
            decoded = None
        if isinstance(decoded, dict):
            session = id_text(decoded.get("session_id"))
            if session is not None:
                return session
        return user_id
    _, mark, tail = text.rpartition(CLAUDE_SESSION_MARK)
    if mark and tail and all(c.isascii() and (c.isalnum() or c == "-") for c in tail):
        return tail
    return user_id


# ---- rule 3: children -----------------------------------------------------------------------

def _resolve_children(own: _Found | None, header_values: Mapping[str, str], prompt: Prompt,
                      config: IdentityConfig) -> tuple[str, str, str | None]:
    """(session, rule, parent) once subagent headers are applied to the client's own id."""
    relation = (_claude_child(own, header_values, prompt)
                or _codex_child(own, header_values, prompt)
                or _opencode_child(own, header_values, prompt))
    if relation is None:
        found = own or _from_content(prompt)
        return found.session_id, found.rule, None
    parent, child = relation
    if parent.session_id == child.session_id:  # a client naming itself as its own parent
        found = own or child
        return found.session_id, found.rule, None
    if config.children_share_parent:
        return parent.session_id, f"{parent.rule} (shared with child: {child.rule})", None
    return (f"{parent.session_id}/{child.session_id}", f"{child.rule} (child of {parent.rule})",
            parent.session_id)


def _claude_child(own: _Found | None, header_values: Mapping[str, str],
                  prompt: Prompt) -> tuple[_Found, _Found] | None:
    """Claude Code keeps X-Claude-Code-Session-Id on subagent requests and adds the agent's
    own stable id: the session is the parent, the agent id the child. Parent-Agent-Id is not
    used as the parent: the main agent sends no agent id, so it may name a session that never
    exists, and agent ids are unique within a session at any depth."""
    agent = _header_id(header_values, CLAUDE_AGENT)
    if own is None or (agent is None and _header_id(header_values, CLAUDE_PARENT_AGENT) is None):
        return None
    child = (_Found(_normalise_id(agent), f"header {CLAUDE_AGENT}") if agent is not None
             else _from_content(prompt))
    return own, child


def _codex_child(own: _Found | None, header_values: Mapping[str, str],
                 prompt: Prompt) -> tuple[_Found, _Found] | None:
    """Codex gives a spawned thread the root's session-id and its own thread-id (the root
    sends both equal), plus x-codex-parent-thread-id. Older releases gave each subagent its
    own session_id and named the parent only in x-codex-parent-thread-id."""
    thread = _header_id(header_values, CODEX_THREAD)
    if own is not None and thread is not None and _normalise_id(thread) != own.session_id:
        return own, _Found(_normalise_id(thread), f"header {CODEX_THREAD}")
    return _named_parent(own, header_values, CODEX_PARENT_THREAD, prompt)


def _opencode_child(own: _Found | None, header_values: Mapping[str, str],
                    prompt: Prompt) -> tuple[_Found, _Found] | None:
    """OpenCode: the request's own session headers name the child session; x-parent-session-id
    names its parent."""
    return _named_parent(own, header_values, OPENCODE_PARENT, prompt)


def _named_parent(own: _Found | None, header_values: Mapping[str, str], parent_header: str,
                  prompt: Prompt) -> tuple[_Found, _Found] | None:
    parent = _header_id(header_values, parent_header)
    if parent is None:
        return None
    return (_Found(_normalise_id(parent), f"header {parent_header}"),
            own or _from_content(prompt))


# ---- rules 4 and 5: content, system, default ------------------------------------------------

def _from_content(prompt: Prompt) -> _Found:
    system = _hashable_system(prompt.system_parts)
    if prompt.raw_prompt:
        material = {"model": prompt.model, "prompt": prompt.raw_prompt[:PROMPT_KEY_CHARS]}
        return _Found(f"content-{_digest(material)[:ID_HASH_HEX]}", "content")
    if any(prompt.first_user_parts):
        material = {"model": prompt.model, "system": system, "first": prompt.first_user_parts}
        return _Found(f"content-{_digest(material)[:ID_HASH_HEX]}", "content")
    if system:
        return _Found(f"sys-{_digest({'model': prompt.model, 'system': system})[:ID_HASH_HEX]}",
                      "system")
    return _Found(DEFAULT_SESSION, "default")


def _system_digest(prompt: Prompt, system: tuple[str, ...]) -> tuple[str, str]:
    """sha256 hex of (system prompt, tools): the seed key when there is either; and the
    chain's first link, made from it. `system`: the prompt's _hashable_system. Without the
    request's `model`: llama-server serves one model whatever name a client sends, so one
    system prompt under two aliases is one seed (the seed's meta fingerprint still ties it to
    the server's real model). The same system prompt and tools come on every turn: hashed once (0.09 ms
    for Claude Code's), then found by value (the tools' JSON is one string object from
    prompts' memory, so only the system text is compared)."""
    return _DIGESTS.get((system, prompt.tools_json),
                        lambda: _digest_system(system, prompt.tools_json))


_DIGESTS: Memo[tuple[tuple[str, ...], str | None], tuple[str, str]] = Memo(32)
_COMPACT_JSON = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"))


def _digest_system(system: tuple[str, ...], tools_json: str | None) -> tuple[str, str]:
    # The text _digest({"system": ..., "tools": canonical tools}) would hash, built around the
    # tools' JSON made once in prompts.tools_of (a coding agent's tools are tens of KB: dumping
    # them twice was most of identify's time on a Claude Code request, docs/BENCHMARKS.md).
    text = f'{{"system":{_COMPACT_JSON.encode(system)},"tools":{tools_json or "null"}}}'
    digest = hashlib.sha256(text.encode("ascii")).hexdigest()
    return digest, hashlib.blake2b(digest.encode(), digest_size=12).hexdigest()


# Roles whose text the chain leaves out: a client re-sends its model's earlier replies the
# way it likes (reasoning stripped, whitespace trimmed, tool calls re-serialised), which would
# break every conversation's chain at each turn. What the user and the tools said is what
# tells two conversations apart; the reply only counts as a message in its place.
def _chain(prompt: Prompt, head: str) -> tuple[str, ...]:
    """Cumulative hashes of (system block, message 1, message 2, ...); () for a raw prompt.
    blake2b: about twice as fast as sha256 here, and 12 bytes tell conversations apart.
    `head`: the system block's link (_digest_system)."""
    if prompt.raw_prompt is not None or not prompt.messages:
        return ()
    out = [head]
    for message in prompt.messages:
        step = hashlib.blake2b(out[-1].encode(), digest_size=12)
        step.update(_COMPACT_JSON.encode(message).encode())
        out.append(step.hexdigest())
    return tuple(out)


def _chain_chars(prompt: Prompt, system_chars: int) -> tuple[int, ...]:
    """Cumulative characters along the chain (same items as `_chain`)."""
    if prompt.raw_prompt is not None or not prompt.messages:
        return ()
    out = [system_chars]
    for size in prompt.message_sizes:
        out.append(out[-1] + size)
    return tuple(out)


def _hashable_system(parts: tuple[str, ...]) -> tuple[str, ...]:
    """The system parts without Claude Code's billing line, which changes on every request.
    Only its line goes: a bridge may have merged it into one string with the real prompt."""
    kept = []
    for part in parts:
        if part.lstrip().startswith(BILLING_MARK):
            part = part.lstrip().partition("\n")[2]
        if part:
            kept.append(part)
    return tuple(kept)


def _digest(material: object) -> str:
    # ensure_ascii: lone surrogates become \ud800 escapes instead of failing to encode.
    text = json.dumps(material, ensure_ascii=True, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("ascii")).hexdigest()
