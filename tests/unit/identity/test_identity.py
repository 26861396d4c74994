"""Session identity: which session a request belongs to, by which rule (docs/DESIGN.md,
"Session identity"). Payloads follow what each client really sends (see
/work/shared/llama-server-facts.md, "What clients send that identifies a session")."""

from __future__ import annotations

import copy
import hashlib
import json
import re
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mitmproxy.http import Headers

from slotkeeper.identity.identity import SESSION_HEADERS, Identity, IdentityConfig, identify

# A normalised id component: 1-128 safe characters (printable ASCII without space, "/" and
# "~"), or "<up to 48 safe characters>~<16 hex>". A session is one component or two joined
# by "/" (parent/child).
SAFE = r"[\x21-\x2e\x30-\x7d]"
COMPONENT = rf"(?:{SAFE}{{1,128}}|{SAFE}{{0,48}}~[0-9a-f]{{16}})"
NORMALISED_ID = re.compile(rf"^{COMPONENT}(?:/{COMPONENT})?$")
CONTENT_ID = re.compile(r"^content-[0-9a-f]{16}$")
SYSTEM_ID = re.compile(r"^sys-[0-9a-f]{16}$")
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages?beta=true"  # Claude Code adds ?beta=true
RESPONSES = "/v1/responses"


def sha16(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def normalised(raw: str) -> str:
    """The documented rule, restated: verbatim when 1-128 safe characters and not only dots,
    else the first 48 characters with unsafe ones as "_", "~", 16 hex of sha256."""

    def is_safe(c: str) -> bool:
        return 0x21 <= ord(c) <= 0x7D and c != "/"

    text = raw.strip()
    if 0 < len(text) <= 128 and all(map(is_safe, text)) and set(text) != {"."}:
        return text
    return "".join(c if is_safe(c) else "_" for c in text[:48]) + "~" + sha16(text)


# ---- realistic payloads ----------------------------------------------------------------------

CLAUDE_SESSION = "9f2c4d1e-6b7a-4c3d-8e9f-0a1b2c3d4e5f"
CLAUDE_SYSTEM_TEXT = (
    "You are Claude Code, Anthropic's official CLI for Claude.\n" + "Be careful. " * 300
)
CLAUDE_TOOLS = [
    {
        "name": "Bash",
        "description": "Run a shell command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
    },
    {
        "name": "Read",
        "description": "Read a file",
        "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}},
        "cache_control": {"type": "ephemeral"},
    },
]


def claude_body(
    first_prompt: str,
    *,
    turns: int = 1,
    cch: str = "a1b2c",
    user_id: str | None = None,
    system_text: str = CLAUDE_SYSTEM_TEXT,
) -> dict:
    """A Claude Code /v1/messages request after `turns` user turns. The billing block rotates
    per request and cache_control sits on the last user message, as Claude Code sends it."""
    messages: list[dict] = []
    for turn in range(turns):
        text = first_prompt if turn == 0 else f"follow-up {turn}"
        messages.append(
            {
                "role": "user",
                "content": [
                    {
                        "type": "text",
                        "text": "<system-reminder>CLAUDE.md says: use pytest</system-reminder>",
                    },
                    {"type": "text", "text": text},
                ],
            }
        )
        if turn < turns - 1:
            messages.append(
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": f"answer {turn}"},
                        {
                            "type": "tool_use",
                            "id": f"toolu_{turn}",
                            "name": "Bash",
                            "input": {"command": "ls"},
                        },
                    ],
                }
            )
    messages[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
    body = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 32000,
        "stream": True,
        "system": [
            {
                "type": "text",
                "text": "x-anthropic-billing-header: cc_version=2.1.139.abc; "
                f"cc_entrypoint=cli; cch={cch};",
            },
            {"type": "text", "text": system_text, "cache_control": {"type": "ephemeral"}},
        ],
        "tools": CLAUDE_TOOLS,
        "messages": messages,
    }
    if user_id is not None:
        body["metadata"] = {"user_id": user_id}
    return body


CODEX_INSTRUCTIONS = (
    "You are Codex, based on GPT-5. You are running as a coding agent in the Codex CLI. " * 20
)


def codex_body(prompt: str, *, turns: int = 1, cache_key: str | None = None) -> dict:
    """A Codex /v1/responses request: permissions as a developer item, AGENTS.md and the
    environment as user items, then the conversation."""
    items: list[dict] = [
        {
            "type": "message",
            "role": "developer",
            "content": [
                {
                    "type": "input_text",
                    "text": "<permissions instructions>sandbox: workspace-write"
                    "</permissions instructions>",
                }
            ],
        },
        {
            "type": "message",
            "role": "user",
            "content": [
                {
                    "type": "input_text",
                    "text": "# AGENTS.md instructions\nRun the tests.\n" + prompt,
                }
            ],
        },
    ]
    for turn in range(1, turns):
        items.append(
            {
                "type": "function_call",
                "name": "shell",
                "arguments": '{"command":["ls"]}',
                "call_id": f"call_{turn}",
            }
        )
        items.append(
            {"type": "function_call_output", "call_id": f"call_{turn}", "output": "README.md"}
        )
        items.append(
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": f"now step {turn}"}],
            }
        )
    body = {
        "model": "gpt-5-codex",
        "instructions": CODEX_INSTRUCTIONS,
        "input": items,
        "tools": [{"type": "function", "name": "shell", "parameters": {"type": "object"}}],
        "stream": True,
        "store": False,
    }
    if cache_key is not None:
        body["prompt_cache_key"] = cache_key
    return body


OPENCODE_SYSTEM = (
    "You are opencode, an interactive CLI tool that helps users with software engineering tasks. "
    * 30
)


def chat_body(
    first_prompt: str,
    *,
    turns: int = 1,
    system: str | None = OPENCODE_SYSTEM,
    model: str = "qwen3-coder",
    **extra: object,
) -> dict:
    messages: list[dict] = [{"role": "system", "content": system}] if system is not None else []
    for turn in range(turns):
        messages.append(
            {"role": "user", "content": first_prompt if turn == 0 else f"and then {turn}"}
        )
        if turn < turns - 1:
            messages.append({"role": "assistant", "content": f"done {turn}"})
    return {"model": model, "messages": messages, "stream": True, **extra}


def ident(
    path: str = CHAT,
    headers: dict | Headers | None = None,
    body: object = None,
    config: IdentityConfig | None = None,
) -> Identity:
    body = body if body is not None else chat_body("hello")
    return identify(path, headers or {}, body, config or IdentityConfig())


# ---- rule 1: headers -------------------------------------------------------------------------


@pytest.mark.parametrize("name", SESSION_HEADERS)
def test_each_builtin_header_names_the_session(name):
    got = ident(headers={name: "sess-42"})
    assert (got.session_id, got.rule, got.parent_id) == ("sess-42", f"header {name}", None)


def test_builtin_header_order_is_the_documented_one():
    assert SESSION_HEADERS == (
        "x-session-id",
        "x-conversation-id",
        "session-id",
        "conversation-id",
        "x-claude-code-session-id",
        "session_id",
        "thread-id",
        "x-session-affinity",
        "x-opencode-session",
        "x-openwebui-chat-id",
        "x-litellm-session-id",
    )


@pytest.mark.parametrize(
    "earlier,later",
    [
        (SESSION_HEADERS[i], SESSION_HEADERS[j])
        for i in range(len(SESSION_HEADERS))
        for j in range(i + 1, len(SESSION_HEADERS))
        # thread-id differing from a session header makes a Codex child: tested on its own
        if SESSION_HEADERS[j] != "thread-id"
    ],
)
def test_earlier_header_wins(earlier, later):
    got = ident(headers={later: "later-value", earlier: "earlier-value"})
    assert (got.session_id, got.rule) == ("earlier-value", f"header {earlier}")


def test_header_names_are_case_insensitive_in_a_plain_dict():
    got = ident(headers={"X-OpenWebUI-Chat-Id": "chat-9"})
    assert (got.session_id, got.rule) == ("chat-9", "header x-openwebui-chat-id")


def test_mitmproxy_headers_object_is_accepted():
    headers = Headers(x_litellm_session_id="lite-1")  # mitmproxy turns _ into - in kwargs
    got = ident(headers=headers)
    assert (got.session_id, got.rule) == ("lite-1", "header x-litellm-session-id")


def test_repeated_header_in_a_dict_reads_like_mitmproxy_joins_it():
    as_dict = ident(headers={"X-Session-Id": "a", "x-session-id": "b"})
    as_headers = ident(headers=Headers([(b"X-Session-Id", b"a"), (b"x-session-id", b"b")]))
    assert as_dict.session_id == as_headers.session_id == f"a,_b~{sha16('a, b')}"


@pytest.mark.parametrize("blank", ["", "   ", "\t\r\n"])
def test_blank_header_values_do_not_match(blank):
    got = ident(headers={"X-Session-Id": blank, "session-id": "next-one"})
    assert (got.session_id, got.rule) == ("next-one", "header session-id")


def test_extra_headers_are_checked_after_the_builtin_ones():
    config = IdentityConfig(extra_headers=("X-My-Session",))
    alone = ident(headers={"x-my-session": "mine"}, config=config)
    assert (alone.session_id, alone.rule) == ("mine", "header x-my-session")
    behind = ident(headers={"x-my-session": "mine", "x-litellm-session-id": "lite"}, config=config)
    assert (behind.session_id, behind.rule) == ("lite", "header x-litellm-session-id")
    unconfigured = ident(headers={"x-my-session": "mine"})
    assert unconfigured.rule == "content"


def test_x_client_request_id_is_never_a_session_key():
    got = ident(headers={"x-client-request-id": "req-1"})
    assert got.rule == "content"


def test_pi_session_affinity_headers():
    sid = "019a2b3c-pi-session"
    got = ident(headers={"session_id": sid, "x-client-request-id": sid, "x-session-affinity": sid})
    assert (got.session_id, got.rule) == (sid, "header session_id")
    nosession_format = ident(headers={"x-session-affinity": sid})
    assert (nosession_format.session_id, nosession_format.rule) == (
        sid,
        "header x-session-affinity",
    )


def test_openwebui_header():
    got = ident(headers={"X-OpenWebUI-Chat-Id": "5f0c1a2b-chat", "X-OpenWebUI-User-Id": "u1"})
    assert (got.session_id, got.rule) == ("5f0c1a2b-chat", "header x-openwebui-chat-id")


def test_litellm_header():
    got = ident(headers={"x-litellm-session-id": "oh-conv-7"})
    assert (got.session_id, got.rule) == ("oh-conv-7", "header x-litellm-session-id")


# ---- rule 2: body ----------------------------------------------------------------------------

BODY_FIELDS = ["session_id", "conversation_id", "chat_id", "id", "prompt_cache_key", "user"]


@pytest.mark.parametrize("field", BODY_FIELDS)
def test_each_body_field_names_the_session(field):
    got = ident(body=chat_body("hello", **{field: "value-1"}))
    assert (got.session_id, got.rule) == ("value-1", f"body {field}")


def test_body_field_order():
    body = chat_body(
        "hello",
        session_id="s",
        conversation_id="c",
        chat_id="ch",
        id="i",
        prompt_cache_key="k",
        user="u",
        metadata={"user_id": "m"},
    )
    expected = [
        ("s", "session_id"),
        ("c", "conversation_id"),
        ("ch", "chat_id"),
        ("i", "id"),
        ("k", "prompt_cache_key"),
        ("m", "metadata.user_id"),
        ("u", "user"),
    ]
    for value, field in expected:
        got = ident(body=body)
        assert (got.session_id, got.rule) == (value, f"body {field}")
        body.pop(field.split(".")[0])
    assert ident(body=body).rule == "content"


def test_header_beats_body():
    got = ident(
        headers={"X-Session-Id": "from-header"},
        body=chat_body("hello", session_id="from-body", prompt_cache_key="k"),
    )
    assert (got.session_id, got.rule) == ("from-header", "header x-session-id")


def test_openwebui_body_chat_id():
    got = ident(body=chat_body("hello", chat_id="7d1f2e3a-chat"))
    assert (got.session_id, got.rule) == ("7d1f2e3a-chat", "body chat_id")


def test_generic_openai_user():
    got = ident(body=chat_body("hello", user="alice@example.com"))
    assert (got.session_id, got.rule) == ("alice@example.com", "body user")


def test_int_ids_are_stringified_but_not_bools_floats_or_containers():
    assert ident(body=chat_body("hello", chat_id=1234)).session_id == "1234"
    for value in (True, 1.5, {"id": "x"}, ["x"], None, "  "):
        got = ident(body=chat_body("hello", chat_id=value))
        assert got.rule == "content", value


@pytest.mark.parametrize(
    "object_id",
    [
        "resp_68af0c",
        "msg_01XFDUDYJgAACzvnptvVoYEL",
        "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT",
        "cmpl-uqkvlQyYK7bGYrRHQ0eXlWi7",
        "rs_1",
        "fc_1",
        "call_abc",
        "toolu_01A",
        "req_1",
        "run_1",
        "asst_1",
        "file_1",
        "batch_1",
    ],
)
def test_api_object_ids_are_not_chat_ids(object_id):
    got = ident(body=chat_body("hello", id=object_id, user="bob"))
    assert (got.session_id, got.rule) == ("bob", "body user")


@pytest.mark.parametrize(
    "chat_id", ["b3f1c2d4-5e6f-7a8b-9c0d-1e2f3a4b5c6d", "conv_6789", "thread_abc", "xyz"]
)
def test_chat_ids_are_accepted(chat_id):
    got = ident(body=chat_body("hello", id=chat_id))
    assert (got.session_id, got.rule) == (chat_id, "body id")


def test_codex_prompt_cache_key():
    got = ident(RESPONSES, body=codex_body("fix it", cache_key="0199a1b2-c3d4-thread"))
    assert (got.session_id, got.rule) == ("0199a1b2-c3d4-thread", "body prompt_cache_key")


def test_claude_code_user_id_legacy_format():
    user_id = (
        f"user_{'ab' * 32}_account_1c2d3e4f-0000-1111-2222-333344445555_session_{CLAUDE_SESSION}"
    )
    got = ident(MESSAGES, body=claude_body("fix the bug", user_id=user_id))
    assert (got.session_id, got.rule) == (CLAUDE_SESSION, "body metadata.user_id")


def test_claude_code_user_id_legacy_format_without_account():
    user_id = f"user_{'ab' * 32}_account__session_{CLAUDE_SESSION}"
    assert ident(MESSAGES, body=claude_body("x", user_id=user_id)).session_id == CLAUDE_SESSION


def test_claude_code_user_id_json_format():
    user_id = json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": CLAUDE_SESSION})
    got = ident(MESSAGES, body=claude_body("fix the bug", user_id=user_id))
    assert (got.session_id, got.rule) == (CLAUDE_SESSION, "body metadata.user_id")


@pytest.mark.parametrize(
    "user_id",
    [
        json.dumps({"device_id": "d1"}),  # JSON without session_id: used whole
        "{not json",
        f"user_{'ab' * 32}_account_x_session_",  # empty session part
    ],
)
def test_claude_code_user_id_without_a_session_is_used_whole(user_id):
    got = ident(MESSAGES, body=claude_body("x", user_id=user_id))
    assert got.rule == "body metadata.user_id"
    assert got.session_id == normalised(user_id)


def test_plain_metadata_user_id_is_used_as_is():
    got = ident(MESSAGES, body=claude_body("x", user_id="customer-17"))
    assert (got.session_id, got.rule) == ("customer-17", "body metadata.user_id")


def test_claude_code_header_and_metadata_agree_and_header_wins():
    user_id = f"user_{'ab' * 32}_account__session_other-session"
    got = ident(
        MESSAGES, {"X-Claude-Code-Session-Id": CLAUDE_SESSION}, claude_body("x", user_id=user_id)
    )
    assert (got.session_id, got.rule) == (CLAUDE_SESSION, "header x-claude-code-session-id")


def test_body_rules_need_a_dict_body():
    for body in (["session_id", "x"], "session_id", 7, None):
        assert identify(CHAT, {}, body).rule == "default"


# ---- rule 3: children ------------------------------------------------------------------------

SHARE = IdentityConfig(children_share_parent=True)


def test_claude_code_main_agent_is_the_session():
    got = ident(MESSAGES, {"X-Claude-Code-Session-Id": CLAUDE_SESSION}, claude_body("x"))
    assert (got.session_id, got.parent_id) == (CLAUDE_SESSION, None)


def test_claude_code_subagent_is_a_child_of_the_session():
    headers = {"X-Claude-Code-Session-Id": CLAUDE_SESSION, "X-Claude-Code-Agent-Id": "a7f3c9e1"}
    got = ident(MESSAGES, headers, claude_body("explore the repo"))
    assert got.session_id == f"{CLAUDE_SESSION}/a7f3c9e1"
    assert got.parent_id == CLAUDE_SESSION
    assert got.rule == "header x-claude-code-agent-id (child of header x-claude-code-session-id)"


def test_claude_code_nested_subagent_stays_flat_under_the_session():
    headers = {
        "X-Claude-Code-Session-Id": CLAUDE_SESSION,
        "X-Claude-Code-Agent-Id": "b2",
        "X-Claude-Code-Parent-Agent-Id": "a7f3c9e1",
    }
    got = ident(MESSAGES, headers, claude_body("x"))
    assert (got.session_id, got.parent_id) == (f"{CLAUDE_SESSION}/b2", CLAUDE_SESSION)


def test_claude_code_subagent_shares_the_parent_when_configured():
    headers = {"X-Claude-Code-Session-Id": CLAUDE_SESSION, "X-Claude-Code-Agent-Id": "a7f3c9e1"}
    got = ident(MESSAGES, headers, claude_body("x"), SHARE)
    assert (got.session_id, got.parent_id) == (CLAUDE_SESSION, None)
    assert (
        got.rule
        == "header x-claude-code-session-id (shared with child: header x-claude-code-agent-id)"
    )


def test_claude_code_parent_agent_alone_makes_a_content_child():
    headers = {"X-Claude-Code-Session-Id": CLAUDE_SESSION, "X-Claude-Code-Parent-Agent-Id": "a7"}
    got = ident(MESSAGES, headers, claude_body("x"))
    parent, child = got.session_id.split("/")
    assert parent == CLAUDE_SESSION and CONTENT_ID.match(child)
    assert got.rule == "content (child of header x-claude-code-session-id)"


def test_claude_code_agent_without_a_session_falls_back_to_content():
    got = ident(MESSAGES, {"X-Claude-Code-Agent-Id": "a7"}, claude_body("x"))
    assert CONTENT_ID.match(got.session_id) and got.parent_id is None and got.rule == "content"


def test_claude_code_subagent_child_id_is_normalised_on_its_own():
    headers = {"X-Claude-Code-Session-Id": CLAUDE_SESSION, "X-Claude-Code-Agent-Id": "../x"}
    got = ident(MESSAGES, headers, claude_body("x"))
    assert got.session_id == f"{CLAUDE_SESSION}/.._x~{sha16('../x')}"


CODEX_ROOT = "0199aa00-root-thread"


def test_codex_root_thread_sends_equal_session_and_thread_ids():
    headers = {"session-id": CODEX_ROOT, "thread-id": CODEX_ROOT, "x-client-request-id": CODEX_ROOT}
    got = ident(RESPONSES, headers, codex_body("x", cache_key=CODEX_ROOT))
    assert (got.session_id, got.rule, got.parent_id) == (CODEX_ROOT, "header session-id", None)


def test_codex_spawned_thread_is_a_child_of_the_session():
    headers = {
        "session-id": CODEX_ROOT,
        "thread-id": "0199bb11-child",
        "x-openai-subagent": "collab_spawn",
        "x-codex-parent-thread-id": CODEX_ROOT,
    }
    got = ident(RESPONSES, headers, codex_body("x"))
    assert (got.session_id, got.parent_id) == (f"{CODEX_ROOT}/0199bb11-child", CODEX_ROOT)
    assert got.rule == "header thread-id (child of header session-id)"


def test_codex_grandchild_thread_stays_flat_under_the_session():
    headers = {
        "session-id": CODEX_ROOT,
        "thread-id": "0199cc22-grandchild",
        "x-codex-parent-thread-id": "0199bb11-child",
        "x-openai-subagent": "collab_spawn",
    }
    got = ident(RESPONSES, headers, codex_body("x"))
    assert (got.session_id, got.parent_id) == (f"{CODEX_ROOT}/0199cc22-grandchild", CODEX_ROOT)


def test_codex_thread_shares_the_session_when_configured():
    headers = {
        "session-id": CODEX_ROOT,
        "thread-id": "0199bb11-child",
        "x-codex-parent-thread-id": CODEX_ROOT,
    }
    got = ident(RESPONSES, headers, codex_body("x"), SHARE)
    assert (got.session_id, got.parent_id) == (CODEX_ROOT, None)
    assert got.rule == "header session-id (shared with child: header thread-id)"


def test_codex_older_subagent_with_its_own_session_id_names_its_parent_thread():
    headers = {"session_id": "0199dd33-sub", "x-codex-parent-thread-id": CODEX_ROOT}
    got = ident(RESPONSES, headers, codex_body("x"))
    assert (got.session_id, got.parent_id) == (f"{CODEX_ROOT}/0199dd33-sub", CODEX_ROOT)
    assert got.rule == "header session_id (child of header x-codex-parent-thread-id)"
    shared = ident(RESPONSES, headers, codex_body("x"), SHARE)
    assert (shared.session_id, shared.rule) == (
        CODEX_ROOT,
        "header x-codex-parent-thread-id (shared with child: header session_id)",
    )


def test_codex_subagent_label_alone_is_not_a_parent():
    headers = {"session_id": "0199ee44-review", "x-openai-subagent": "review"}
    got = ident(RESPONSES, headers, codex_body("x"))
    assert (got.session_id, got.rule, got.parent_id) == (
        "0199ee44-review",
        "header session_id",
        None,
    )


OPENCODE_CHILD = {
    "x-session-affinity": "ses_child123",
    "X-Session-Id": "ses_child123",
    "x-opencode-session": "ses_child123",
    "x-parent-session-id": "ses_parent456",
    "User-Agent": "opencode/1.0.0",
}


def test_opencode_subagent_is_a_child_of_the_parent_session():
    got = ident(CHAT, OPENCODE_CHILD, chat_body("find the tests"))
    assert (got.session_id, got.parent_id) == ("ses_parent456/ses_child123", "ses_parent456")
    assert got.rule == "header x-session-id (child of header x-parent-session-id)"


def test_opencode_subagent_shares_the_parent_when_configured():
    got = ident(CHAT, OPENCODE_CHILD, chat_body("find the tests"), SHARE)
    assert (got.session_id, got.parent_id) == ("ses_parent456", None)
    assert got.rule == "header x-parent-session-id (shared with child: header x-session-id)"


def test_opencode_main_session():
    headers = {k: v for k, v in OPENCODE_CHILD.items() if k != "x-parent-session-id"}
    got = ident(CHAT, headers, chat_body("x"))
    assert (got.session_id, got.rule, got.parent_id) == (
        "ses_child123",
        "header x-session-id",
        None,
    )


def test_a_session_naming_itself_as_parent_is_not_a_child():
    got = ident(CHAT, {"X-Session-Id": "ses_a", "x-parent-session-id": "ses_a"}, chat_body("x"))
    assert (got.session_id, got.parent_id) == ("ses_a", None)


def test_parent_header_without_an_own_session_makes_a_content_child():
    got = ident(CHAT, {"x-parent-session-id": "ses_parent456"}, chat_body("x"))
    parent, child = got.session_id.split("/")
    assert (
        parent == "ses_parent456" and got.parent_id == "ses_parent456" and CONTENT_ID.match(child)
    )
    assert got.rule == "content (child of header x-parent-session-id)"


def test_a_slash_in_a_client_id_cannot_look_like_parent_and_child():
    from_client = ident(CHAT, {"X-Session-Id": "ses_parent456/ses_child123"}, chat_body("x"))
    from_child_rule = ident(CHAT, OPENCODE_CHILD, chat_body("x"))
    assert from_child_rule.session_id == "ses_parent456/ses_child123"
    assert (
        from_client.session_id
        == f"ses_parent456_ses_child123~{sha16('ses_parent456/ses_child123')}"
    )
    assert "/" not in from_client.session_id


# ---- rules 4 and 5: content, system, default -------------------------------------------------


def test_claude_code_content_key_is_stable_across_turns():
    turn1 = ident(MESSAGES, body=claude_body("fix the login bug", turns=1, cch="11111"))
    turn3 = ident(MESSAGES, body=claude_body("fix the login bug", turns=3, cch="22222"))
    assert CONTENT_ID.match(turn1.session_id) and turn1.rule == "content"
    assert turn1.session_id == turn3.session_id
    assert turn3.message_count == 5 > turn1.message_count == 1


def test_two_sessions_with_one_system_prompt_get_different_content_keys():
    a = ident(MESSAGES, body=claude_body("fix the login bug"))
    b = ident(MESSAGES, body=claude_body("write the release notes"))
    assert a.session_id != b.session_id
    assert a.seed_key == b.seed_key  # same system + tools: they share one seed snapshot


def test_billing_block_is_ignored_by_content_and_seed():
    a = ident(MESSAGES, body=claude_body("x", cch="00000"))
    b = ident(MESSAGES, body=claude_body("x", cch="fffff"))
    assert (a.session_id, a.seed_key) == (b.session_id, b.seed_key)
    other_system = ident(MESSAGES, body=claude_body("x", system_text="You are someone else."))
    assert other_system.session_id != a.session_id and other_system.seed_key != a.seed_key


def test_billing_line_merged_into_a_system_string_is_ignored_but_the_rest_counts():
    def bridged(cch: str, rest: str) -> dict:
        return chat_body(
            "x", system=f"x-anthropic-billing-header: cc_version=2.1; cch={cch};\n{rest}"
        )

    a, b = (
        ident(body=bridged("1", "You are Claude Code.")),
        ident(body=bridged("2", "You are Claude Code.")),
    )
    c = ident(body=bridged("1", "You are another agent."))
    assert a.session_id == b.session_id != c.session_id
    assert a.seed_key == b.seed_key != c.seed_key


def test_chat_content_key_is_stable_across_turns():
    assert (
        ident(body=chat_body("hi there", turns=1)).session_id
        == ident(body=chat_body("hi there", turns=4)).session_id
    )


def test_chat_content_key_ignores_a_later_system_message():
    body = chat_body("hi there", turns=2)
    later = copy.deepcopy(body)
    later["messages"].append({"role": "system", "content": "Reminder: be brief."})
    assert ident(body=body).session_id == ident(body=later).session_id


def test_chat_content_key_depends_on_model_system_and_first_message():
    base = ident(body=chat_body("hi there")).session_id
    assert ident(body=chat_body("hi there", model="other-model")).session_id != base
    assert ident(body=chat_body("hi there", system="Another system prompt")).session_id != base
    assert ident(body=chat_body("bye there")).session_id != base


def test_chat_content_key_ignores_key_order_and_cache_control():
    a = chat_body("x")
    a["messages"][1]["content"] = [
        {"type": "text", "text": "look", "cache_control": {"type": "ephemeral"}},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    ]
    b = copy.deepcopy(a)
    b["messages"][1]["content"] = [
        {"text": "look", "type": "text"},
        {"image_url": {"url": "data:image/png;base64,AAAA"}, "type": "image_url"},
    ]
    c = copy.deepcopy(b)
    c["messages"][1]["content"][1]["image_url"]["url"] = "data:image/png;base64,BBBB"
    assert ident(body=a).session_id == ident(body=b).session_id != ident(body=c).session_id


def test_content_key_ignores_key_order_inside_a_block():
    def image(source: dict) -> dict:
        return {
            "model": "m",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image", "source": source},
                    ],
                }
            ],
        }

    a = image({"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo"})
    b = image({"data": "iVBORw0KGgo", "media_type": "image/png", "type": "base64"})
    c = image({"type": "base64", "media_type": "image/jpeg", "data": "iVBORw0KGgo"})
    assert ident(MESSAGES, body=a).session_id == ident(MESSAGES, body=b).session_id
    assert ident(MESSAGES, body=a).session_id != ident(MESSAGES, body=c).session_id


def test_content_key_golden_value():
    """Content keys name saved snapshots: changing the hashed material orphans them all."""
    body = {
        "model": "m",
        "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
    }
    material = json.dumps(
        {"first": ["U"], "model": "m", "system": ["S"]},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=True,
    )
    assert (
        ident(body=body).session_id
        == "content-" + hashlib.sha256(material.encode()).hexdigest()[:16]
    )


def test_codex_responses_content_key_is_stable_across_turns():
    turn1 = ident(RESPONSES, body=codex_body("add a flag"))
    turn2 = ident(RESPONSES, body=codex_body("add a flag", turns=3))
    other = ident(RESPONSES, body=codex_body("remove a flag"))
    assert turn1.rule == "content" and turn1.session_id == turn2.session_id != other.session_id


def test_responses_input_string_is_the_first_user_message():
    a = ident(RESPONSES, body={"model": "m", "instructions": "Be terse.", "input": "What is 2+2?"})
    b = ident(
        RESPONSES,
        body={
            "model": "m",
            "instructions": "Be terse.",
            "input": [
                {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "4"},
                {"role": "user", "content": "and 3+3?"},
            ],
        },
    )
    assert a.rule == "content" and a.session_id == b.session_id
    assert (a.message_count, b.message_count) == (1, 3)


def test_completion_prompt_key_uses_the_first_2000_characters():
    start = "### System: you are a storyteller.\n" + "Once upon a time. " * 120  # > 2000 chars
    turn1 = ident("/completion", body={"prompt": start + "\nUser: go on\nAssistant:"})
    turn2 = ident(
        "/completion",
        body={"prompt": start + "\nUser: go on\nAssistant: ok.\nUser: more\nAssistant:"},
    )
    other = ident("/completion", body={"prompt": "### System: you are a poet.\n" + start})
    assert turn1.rule == "content" and CONTENT_ID.match(turn1.session_id)
    assert turn1.session_id == turn2.session_id != other.session_id
    assert turn1.seed_key is None and turn1.system_chars == 0


def test_completion_prompt_forms():
    as_list = ident("/v1/completions", body={"model": "m", "prompt": ["Hello", " world"]})
    as_string = ident("/v1/completions", body={"model": "m", "prompt": "Hello world"})
    as_object = ident(
        "/completion", body={"model": "m", "prompt": {"prompt_string": "Hello world"}}
    )
    tokens = ident("/completion", body={"model": "m", "prompt": [15496, 995]})
    assert as_list.session_id == as_string.session_id == as_object.session_id != tokens.session_id
    assert (tokens.prompt_chars, tokens.message_count) == (len("15496 995 "), 1)


def test_infill_reads_every_infill_field_in_server_order():
    body = {
        "input_extra": [{"filename": "a.py", "text": "def a(): pass\n"}],
        "input_prefix": "def b():\n    ",
        "input_suffix": "\n",
        "prompt": "ret",
    }
    got = ident("/infill", body=body)
    assert got.rule == "content"
    assert (got.prompt_chars, got.message_count) == (
        len("a.pydef a(): pass\ndef b():\n    \nret"),
        1,
    )


def test_route_decides_which_fields_are_prefilled():
    body = {
        "model": "m",
        "prompt": "stray prompt",
        "messages": [{"role": "user", "content": "real"}],
    }
    chat, raw = ident(CHAT, body=body), ident("/completion", body=body)
    assert (chat.prompt_chars, raw.prompt_chars) == (4, len("stray prompt"))
    assert chat.session_id != raw.session_id


def test_unknown_route_goes_by_the_body_shape():
    chat_shape = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert (
        ident("/v2/whatever", body=chat_shape).session_id == ident(CHAT, body=chat_shape).session_id
    )


def test_system_rule_when_only_a_system_prompt_exists():
    only_system = ident(
        body={"model": "m", "messages": [{"role": "system", "content": "You summarise."}]}
    )
    assert SYSTEM_ID.match(only_system.session_id) and only_system.rule == "system"
    instructions = ident(RESPONSES, body={"model": "m", "instructions": "You summarise."})
    assert instructions.session_id == only_system.session_id


def test_system_rule_ignores_the_billing_line():
    a = ident(
        MESSAGES,
        body={"model": "m", "system": "x-anthropic-billing-header: cch=1;\nSys", "messages": []},
    )
    b = ident(
        MESSAGES,
        body={"model": "m", "system": "x-anthropic-billing-header: cch=2;\nSys", "messages": []},
    )
    assert a.rule == "system" and a.session_id == b.session_id


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"model": "m"},
        {"messages": []},
        {"prompt": ""},
        {"messages": [{"role": "user", "content": ""}]},
        [],
        "text",
        3,
    ],
)
def test_default_when_there_is_nothing_to_hash(body):
    got = identify(CHAT, {}, body)
    assert (got.session_id, got.rule, got.parent_id) == ("default", "default", None)


def test_no_user_message_uses_the_first_other_message():
    a = ident(body={"model": "m", "messages": [{"role": "assistant", "content": "Welcome!"}]})
    b = ident(body={"model": "m", "messages": [{"role": "assistant", "content": "Hello!"}]})
    assert a.rule == "content" and a.session_id != b.session_id


# ---- sizes and the seed key ------------------------------------------------------------------

TOOL = [{"type": "function", "function": {"name": "f"}}]
TOOL_JSON_CHARS = len('[{"function":{"name":"f"},"type":"function"}]')  # 45


def test_chat_sizes():
    body = {
        "model": "m",
        "tools": TOOL,
        "messages": [
            {"role": "system", "content": "abc"},
            {"role": "user", "content": "hello"},
            {
                "role": "assistant",
                "content": "hey",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "f", "arguments": "{}"},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "result"},
        ],
    }
    got = ident(body=body)
    assert got.system_chars == 3 + TOOL_JSON_CHARS
    # "hello" + "hey" + "f" + "{}" + "result": ids, roles and types are not prompt text
    assert got.prompt_chars == got.system_chars + 5 + 3 + 1 + 2 + 6
    assert got.message_count == 4


def test_anthropic_sizes_count_the_billing_block():
    body = {
        "model": "m",
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cch=1;"},
            {"type": "text", "text": "Sys"},
        ],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    }
    got = ident(MESSAGES, body=body)
    assert got.system_chars == len("x-anthropic-billing-header: cch=1;") + 3
    assert (got.prompt_chars, got.message_count) == (got.system_chars + 2, 1)


def test_responses_sizes():
    body = codex_body("go")
    got = ident(RESPONSES, body=body)
    tools_chars = len(json.dumps(body["tools"], sort_keys=True, separators=(",", ":")))
    developer = body["input"][0]["content"][0]["text"]
    assert got.system_chars == len(CODEX_INSTRUCTIONS) + len(developer) + tools_chars
    assert got.prompt_chars == got.system_chars + len(body["input"][1]["content"][0]["text"])
    assert got.message_count == 2


def test_seed_key_is_shared_by_sessions_with_one_system_and_tools():
    a = ident(body=chat_body("one", tools=TOOL))
    b = ident(body=chat_body("two", turns=3, tools=TOOL))
    assert SHA256_HEX.match(a.seed_key) and a.seed_key == b.seed_key


def test_seed_key_changes_with_system_and_tools():
    base = ident(body=chat_body("one", tools=TOOL)).seed_key
    assert ident(body=chat_body("one", tools=TOOL, system="other")).seed_key != base
    assert ident(body=chat_body("one", tools=TOOL + TOOL)).seed_key != base
    assert ident(body=chat_body("one")).seed_key != base


def test_seed_key_ignores_cache_control_on_tools():
    moved = copy.deepcopy(CLAUDE_TOOLS)
    del moved[1]["cache_control"]
    moved[0]["cache_control"] = {"type": "ephemeral"}
    a = ident(MESSAGES, body=claude_body("x"))
    b = ident(MESSAGES, body={**claude_body("x"), "tools": moved})
    assert a.seed_key == b.seed_key


def test_tools_sent_again_are_found_not_made_again():
    """An agent's tools come on every turn: the second time they are found (the very string
    made the first time), and the seed key is the same as when made."""
    from slotkeeper.identity import prompts

    tools = [{**TOOL[0], "description": f"found again {uuid.uuid4()}"}]
    first, _ = prompts.tools_of(tools)
    again, _ = prompts.tools_of(copy.deepcopy(tools))
    assert first is not None and again is first
    assert ident(body=chat_body("one", tools=tools)).seed_key == ident(
        body=chat_body("two", tools=copy.deepcopy(tools))).seed_key


@pytest.mark.parametrize("a, b", [(True, 1), (1, 1.0), (False, 0)])
def test_tools_equal_in_python_but_not_in_json_stay_apart(a, b):
    """`true == 1 == 1.0` in Python: the memory of tools must not take one for the other."""
    from slotkeeper.identity import prompts

    tag = str(uuid.uuid4())
    first = prompts.tools_of([{"name": tag, "strict": a}])[0]
    second = prompts.tools_of([{"name": tag, "strict": b}])[0]
    assert first != second
    got = [json.loads(text)[0]["strict"] for text in (first, second)]
    assert [(type(v), v) for v in got] == [(type(a), a), (type(b), b)]


def test_tools_too_deep_to_pickle_are_still_made():
    from slotkeeper.identity import prompts

    deep: list = []
    inner = deep
    for _ in range(5000):
        inner.append([])
        inner = inner[0]
    text, chars = prompts.tools_of(deep)
    assert text is not None and "<deep>" in text and chars == len(text)


def test_seed_key_needs_a_system_prompt_or_tools():
    assert ident(body=chat_body("one", system=None)).seed_key is None
    assert SHA256_HEX.match(ident(body=chat_body("one", system=None, tools=TOOL)).seed_key)
    assert (
        ident(
            MESSAGES,
            body={
                "model": "m",
                "system": "x-anthropic-billing-header: cch=1;",
                "messages": [{"role": "user", "content": "hi"}],
            },
        ).seed_key
        is None
    )


# ---- normalisation of hostile ids ------------------------------------------------------------


@pytest.mark.parametrize(
    "raw,expected",
    [
        ("../../etc/passwd", f".._.._etc_passwd~{sha16('../../etc/passwd')}"),
        ("/etc/passwd", f"_etc_passwd~{sha16('/etc/passwd')}"),
        ("C:\\Windows\\system32", "C:\\Windows\\system32"),  # printable, no "/": kept verbatim
        ("a\x00b", f"a_b~{sha16('a' + chr(0) + 'b')}"),
        ("\x1b[31mred\x07", f"_[31mred_~{sha16(chr(27) + '[31mred' + chr(7))}"),
        ("x" * 10240, f"{'x' * 48}~{sha16('x' * 10240)}"),
        ("café-☕", f"caf_-_~{sha16('café-☕')}"),
        ("has space", f"has_space~{sha16('has space')}"),
        ("  padded\t", "padded"),
        ("a" * 128, "a" * 128),
        ("a" * 129, f"{'a' * 48}~{sha16('a' * 129)}"),
        ("..", f"..~{sha16('..')}"),
        (".", f".~{sha16('.')}"),
        ("a~b", f"a_b~{sha16('a~b')}"),
        # a verbatim id can never pose as a hashed one
        ("x~0123456789abcdef", f"x_0123456789abcdef~{sha16('x~0123456789abcdef')}"),
    ],
)
def test_hostile_ids_are_normalised(raw, expected):
    got = ident(headers={"X-Session-Id": raw})
    assert got.session_id == expected == normalised(raw)
    assert NORMALISED_ID.match(got.session_id)


def test_non_utf8_header_bytes_are_normalised():
    got = ident(headers=Headers([(b"X-Session-Id", b"ab\xff")]))
    assert got.session_id == f"ab_~{sha16('ab' + chr(0xDCFF))}"


def test_empty_ids_never_become_sessions():
    got = ident(headers={"X-Session-Id": ""}, body=chat_body("x", session_id="   ", user=""))
    assert got.rule == "content"


def test_body_ids_are_normalised_too():
    got = ident(body=chat_body("x", chat_id="../chat\n"))
    assert got.session_id == f".._chat~{sha16('../chat')}"


def test_longest_parent_child_session_fits_the_api_id_limit():
    headers = {"X-Session-Id": "c" * 128, "x-parent-session-id": "p" * 128}
    got = ident(headers=headers)
    assert got.session_id == f"{'p' * 128}/{'c' * 128}" and len(got.session_id) <= 300


# ---- properties ------------------------------------------------------------------------------

# Text with everything a hostile client can get into a str: control characters, non-ASCII and
# lone surrogates (JSON "\ud800" escapes; mitmproxy's surrogateescape for non-UTF-8 bytes).
hostile_chars = (
    st.characters(exclude_categories=())  # any code point, but surrogates are rare
    | st.characters(categories=["Cs", "Cc"])  # so weight surrogates and controls
    | st.sampled_from("/~. _-")
)  # and the characters the id rules care about
# lists, not st.text: st.text merges the alphabets into one interval set and loses the weights
hostile_text = st.lists(hostile_chars, max_size=60).map("".join) | st.sampled_from(
    [
        "",
        " ",
        "/",
        "~",
        "..",
        "a/b",
        "user_x_account__session_",
        '{"session_id": "s"}',
        "x-anthropic-billing-header: cch=1;\nS",
        "resp_1",
        "\ud800",
    ]
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | hostile_text,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(hostile_text, children, max_size=4)
    ),
    max_leaves=20,
)
BODY_KEYS = [
    "model",
    "messages",
    "system",
    "tools",
    "input",
    "instructions",
    "prompt",
    "input_extra",
    "input_prefix",
    "input_suffix",
    "metadata",
    "session_id",
    "conversation_id",
    "chat_id",
    "id",
    "prompt_cache_key",
    "user",
]
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "developer", "user", "assistant", "tool"])
            | json_values
        },
        optional={"content": json_values, "type": json_values, "tool_calls": json_values},
    ),
    max_size=5,
)
structured_bodies = st.fixed_dictionaries(
    {},
    optional={
        **{key: json_values for key in BODY_KEYS},
        "messages": messages,
        "input": messages | hostile_text,
        "metadata": st.fixed_dictionaries({"user_id": json_values}),
    },
)
bodies = structured_bodies | json_values
HEADER_NAMES = list(SESSION_HEADERS) + [
    "x-claude-code-agent-id",
    "x-claude-code-parent-agent-id",
    "x-codex-parent-thread-id",
    "x-openai-subagent",
    "x-parent-session-id",
    "x-client-request-id",
    "x-extra",
]
header_dicts = st.dictionaries(
    st.sampled_from(HEADER_NAMES) | hostile_text, hostile_text, max_size=6
)
paths = (
    st.sampled_from(
        [
            CHAT,
            MESSAGES,
            RESPONSES,
            "/completion",
            "/v1/completions",
            "/infill",
            "/responses/",
            "/unknown",
        ]
    )
    | hostile_text
)
configs = st.builds(
    IdentityConfig,
    extra_headers=st.lists(st.sampled_from(["x-extra"]) | hostile_text, max_size=3).map(tuple),
    children_share_parent=st.booleans(),
)


def check_invariants(got: Identity) -> None:
    assert NORMALISED_ID.match(got.session_id), got.session_id
    assert got.rule
    if got.parent_id is not None:
        assert NORMALISED_ID.match(got.parent_id) and "/" not in got.parent_id
        assert got.session_id.startswith(got.parent_id + "/")
    assert got.prompt_chars >= got.system_chars >= 0
    assert got.message_count >= 0
    assert got.seed_key is None or SHA256_HEX.match(got.seed_key)


@settings(max_examples=400, deadline=None)
@given(paths, header_dicts, bodies, configs)
def test_identify_never_raises_and_is_deterministic(path, headers, body, config):
    got = identify(path, headers, body, config)
    check_invariants(got)
    assert identify(path, dict(headers), copy.deepcopy(body), config) == got


@settings(max_examples=300, deadline=None)
@given(hostile_text)
def test_any_header_value_becomes_a_valid_id_or_nothing(value):
    got = identify(CHAT, {"X-Session-Id": value}, {})
    if value.strip():
        assert got.rule == "header x-session-id"
        assert got.session_id == normalised(value)
        check_invariants(got)
        assert "/" not in got.session_id
    else:
        assert got.rule == "default"


@settings(max_examples=300, deadline=None)
@given(hostile_text, hostile_text)
def test_distinct_client_ids_stay_distinct(a, b):
    if a.strip() and b.strip() and a.strip() != b.strip():
        assert (
            identify(CHAT, {"X-Session-Id": a}, {}).session_id
            != identify(CHAT, {"X-Session-Id": b}, {}).session_id
        )


class Odd:
    """Not JSON at all: identify must still answer."""


@pytest.mark.parametrize(
    "body",
    [
        Odd(),
        {1: "x", (2, 3): "y"},
        {"messages": {1, 2}},
        b"bytes",
        10**5000,
        {"prompt": 10**5000, "model": 10**5000},
        {"session_id": 10**5000},
        {
            "tools": [{"x": 10**5000, "y": Odd(), 1: 2}],
            "messages": [{"role": "system", "content": "s"}],
        },
        {"metadata": {"user_id": "{" + "[" * 100000}},
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["deep"]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]
                    ],
                }
            ]
        },
    ],
    ids=lambda body: type(body).__name__,
)  # pytest cannot print a 5000-digit int as an id
def test_non_json_and_extreme_bodies(body):
    for path in (CHAT, MESSAGES, RESPONSES, "/completion", "/infill", "/unknown"):
        check_invariants(identify(path, {}, body))


def test_very_deep_nesting_does_not_overflow_the_stack():
    deep: object = "leaf"
    for _ in range(100_000):
        deep = [deep]
    for body in (
        {"messages": [{"role": "user", "content": deep}]},
        {"prompt": deep},
        {"tools": [deep]},
        {"input": [{"role": "user", "content": deep}]},
        {"system": deep, "messages": []},
    ):
        for path in (CHAT, MESSAGES, RESPONSES, "/completion"):
            check_invariants(identify(path, {}, body))


def test_fault9_seed_key_is_one_seed_under_two_model_aliases():
    """Issue #11 fault 9: one system prompt under two model aliases built two seeds. The server
    serves one model whatever the alias; the seed's meta fingerprint ties it to that model."""
    a = ident(body=chat_body("one", tools=TOOL, model="gemma"))
    b = ident(body=chat_body("one", tools=TOOL, model="gemma-3-270m-it"))
    assert a.seed_key is not None and a.seed_key == b.seed_key


def test_chain_names_each_message_prefix():
    turn1 = ident(body=chat_body("one"))
    turn2_body = chat_body("one")
    turn2_body["messages"] += [{"role": "assistant", "content": "reply"},
                               {"role": "user", "content": "two"}]
    turn2 = ident(body=turn2_body)
    assert len(turn1.chain) == 2 and len(turn2.chain) == 4
    assert turn2.chain[:len(turn1.chain)] == turn1.chain
    other_system = ident(body=chat_body("one", system="another system prompt"))
    assert other_system.chain[0] != turn1.chain[0]
    assert ident(body={"prompt": "raw text"}, path="/completion").chain == ()
    # A client that re-sends its model's earlier reply differently (reasoning stripped)
    # still continues the conversation; a different user message does not.
    rerendered = chat_body("one")
    rerendered["messages"] += [{"role": "assistant", "content": "reply, trimmed"},
                               {"role": "user", "content": "two"}]
    assert ident(body=rerendered).chain == turn2.chain
    other_user = chat_body("one")
    other_user["messages"] += [{"role": "assistant", "content": "reply"},
                               {"role": "user", "content": "three"}]
    assert ident(body=other_user).chain[:3] == turn2.chain[:3]
    assert ident(body=other_user).chain[3] != turn2.chain[3]
