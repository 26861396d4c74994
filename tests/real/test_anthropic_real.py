"""Anthropic /v1/messages through slotkeeper against the real llama-server: the translated
request renders the very prompt the server renders for the original, gives the same answer at
temperature 0 (whole and streamed, event for event), and Claude-style sessions keep their own
slots. The corpus holds real Claude Code requests (tests/bed/corpus/claude, see its README)."""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from corpus import claude_messages_requests
from testbed import BED, LlamaServer, long_system_prompt

from slotkeeper.surfaces.anthropic import to_chat_request

TIMEOUT_S = 900
# Claude Code's requests are ~9,000 tokens (its tools and system prompt): 2 slots of 16,384.
SLOTS = 2
CONTEXT = 32768
ANSWER_TOKENS = 8
# This machine's CPU has AMX; b11434's AMX matrix multiply (used for repacked weights)
# segfaults at the first decode here (gdb: ggml_backend_amx_mul_mat). Without repacking it runs.
NO_AMX = "--no-repack"
# A template that renders tools, tool calls and results and reasoning (see the file).
TEMPLATE = BED / "templates" / "chatml-tools.jinja"


@pytest.fixture(scope="module")
def big_llama(llama_bin: Path, model_path: Path,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    """The server for answers: the model's default template (ChatML, which leaves tools out,
    so Claude Code's requests stay ~9,000 tokens)."""
    workdir = tmp_path_factory.mktemp("llama-anthropic")
    server = LlamaServer(workdir, np=SLOTS, ctx=CONTEXT, binary=llama_bin, model=model_path,
                         extra=[NO_AMX]).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def render_llama(llama_bin: Path, model_path: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    """The server for renders only (nothing is prefilled): a template that renders every part
    of a request."""
    workdir = tmp_path_factory.mktemp("llama-render")
    server = LlamaServer(workdir, np=1, ctx=4096, binary=llama_bin, model=model_path,
                         extra=[NO_AMX, "--chat-template-file", str(TEMPLATE)]).start()
    yield server
    server.stop()


def small(body: dict[str, Any], stream: bool | None = None) -> dict[str, Any]:
    """The request with a small answer at temperature 0 (greedy: the same prompt gives the
    same text)."""
    out = copy.deepcopy(body)
    out.update(max_tokens=ANSWER_TOKENS, temperature=0)
    if stream is not None:
        out["stream"] = stream
    return out


def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None,
         stream: bool = False) -> requests.Response:
    response = requests.post(url, json=body, headers=headers or {}, timeout=TIMEOUT_S,
                             stream=stream)
    if not stream:
        assert response.status_code == 200, f"{url}: {response.status_code} {response.text[:1000]}"
    return response


def rendered_tokens(llama: LlamaServer, body: dict[str, Any]) -> tuple[int, int, str]:
    """(tokens the server counts for the Anthropic request, tokens of the prompt it renders for
    the translated request, that prompt)."""
    counted = post(llama.url + "/v1/messages/count_tokens", body).json()["input_tokens"]
    prompt = post(llama.url + "/apply-template", to_chat_request(body)).json()["prompt"]
    tokens = post(llama.url + "/tokenize", {"content": prompt, "add_special": True,
                                            "parse_special": True}).json()["tokens"]
    return counted, len(tokens), prompt


# Requests beside the captured ones: every block type the converter knows (no images: the
# test model has no vision projector, and both routes refuse them alike).
HANDMADE = [
    {"system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.1; "
                                         "cc_entrypoint=cli; cch=ab12c;"},
                {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
     "messages": [
         {"role": "user", "content": "List the files."},
         {"role": "assistant", "content": [
             {"type": "thinking", "thinking": "Use ls.", "signature": ""},
             {"type": "text", "text": "Listing."},
             {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}}]},
         {"role": "user", "content": [
             {"type": "tool_result", "tool_use_id": "toolu_1",
              "content": [{"type": "text", "text": "a.py\nb.py"}]},
             {"type": "text", "text": "Which one is bigger?"}]}],
     "tools": [{"name": "Bash", "description": "Run a command",
                "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                                 "required": ["command"]}}],
     "tool_choice": {"type": "auto"}, "thinking": {"type": "enabled", "budget_tokens": 256},
     "stop_sequences": ["\n\n\n"], "metadata": {"user_id": "user_x_account__session_handmade"}},
    {"system": "Answer in one word.",
     "messages": [{"role": "user", "content": [{"type": "text", "text": "Sky colour?"}]},
                  {"role": "assistant", "content": "Blue."},
                  {"role": "user", "content": "Grass colour?"}]},
]


def corpus_bodies() -> list[tuple[str, dict[str, Any]]]:
    captured = [(f"claude-{i}", r["body"]) for i, r in enumerate(claude_messages_requests())]
    return captured + [(f"handmade-{i}", b) for i, b in enumerate(HANDMADE)]


@pytest.mark.parametrize("name", [name for name, _ in corpus_bodies()])
def test_translated_request_renders_the_same_prompt(render_llama, name):
    """llama-server's own count for the Anthropic request equals the tokens of the prompt it
    renders for the translation. Rendering only: no prefill, so every request is checked."""
    body = dict(corpus_bodies())[name]
    counted, translated, prompt = rendered_tokens(render_llama, body)
    assert counted == translated, (counted, translated)
    assert counted > 0
    # Every part is in the render (equal counts of two renders could agree by accident).
    for tool in body.get("tools", []):
        assert f'"name":"{tool["name"]}"' in prompt.replace(": ", ":")
    for message in body["messages"]:
        for block in message["content"] if isinstance(message["content"], list) else []:
            if block["type"] == "tool_use":
                assert f"<tool_call>{block['name']} " in prompt and block["id"] in prompt
            if block["type"] == "tool_result":
                assert f"(result of {block['tool_use_id']})" in prompt
            if block["type"] == "thinking" and block["thinking"]:
                assert f"<think>{block['thinking']}</think>" in prompt


def anthropic_events(response: requests.Response) -> list[tuple[str, dict[str, Any]]]:
    return [(name, data) for _at, name, data in timed_events(response)]


def without_ids(events: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    """Events with what differs between two runs of one prompt blanked: the message id, and the
    usage (the prompt is cached in one run and not in the other)."""
    out = []
    for name, data in events:
        data = copy.deepcopy(data)
        if name == "message_start":
            data["message"]["id"] = "-"
            data["message"]["usage"] = "-"
        if name == "message_delta":
            data["usage"] = "-"
        out.append((name, data))
    return out


def as_the_server_writes(events: list[tuple[str, dict[str, Any]]]
                         ) -> list[tuple[str, dict[str, Any]]]:
    """slotkeeper's events with what the Messages API documents and llama-server's own writer
    leaves out taken back out (issue #20.9-10): `ping` events, `input: {}` on a tool_use
    block's start, and stop_reason "stop_sequence" (the server says "end_turn" beside the
    sequence); and each block's stop (with a thinking block's signature) moved from where
    the API puts it, before the next block starts, to where the server's writer puts every
    block's: just before message_delta."""
    out = []
    closing: list[tuple[str, dict[str, Any]]] = []
    for name, data in events:
        if name == "ping":
            continue
        if name == "content_block_stop" or (
                name == "content_block_delta" and data["delta"]["type"] == "signature_delta"):
            closing.append((name, data))
            continue
        if name == "message_delta":
            out += [e for e in closing if e[0] == "content_block_delta"]
            out += [e for e in closing if e[0] == "content_block_stop"]
        data = copy.deepcopy(data)
        block = data.get("content_block") if name == "content_block_start" else None
        if isinstance(block, dict) and block.get("type") == "tool_use":
            assert block.pop("input") == {}
        if name == "message_delta" and data["delta"]["stop_reason"] == "stop_sequence":
            data["delta"]["stop_reason"] = "end_turn"
        out.append((name, data))
    return out


def assert_one_block_at_a_time(events: list[tuple[str, dict[str, Any]]]) -> None:
    """The Messages API's order: block i starts, gets its deltas and stops before block i+1
    starts; every block that starts stops before message_delta."""
    open_block: int | None = None
    started = 0
    for name, data in events:
        if name == "content_block_start":
            assert open_block is None and data["index"] == started, (name, data, events)
            open_block, started = data["index"], started + 1
        elif name in ("content_block_delta", "content_block_stop"):
            assert data["index"] == open_block, (name, data, events)
            if name == "content_block_stop":
                open_block = None
        elif name == "message_delta":
            assert open_block is None, events
    assert started > 0, events


def answers_compared(llama: LlamaServer, proxy_url: str, body: dict[str, Any],
                     headers: dict[str, str]) -> None:
    through = post(proxy_url + "/v1/messages", small(body, stream=False), headers)
    assert through.headers["X-Slotkeeper-Action"] in ("assigned", "kept"), dict(through.headers)
    translated = through.json()
    used = translated["usage"]
    prompt_tokens = used["input_tokens"] + used["cache_read_input_tokens"]
    # The original, sent to the server's own /v1/messages, finds its whole prompt in the slot
    # the translated request just filled (the server matches slots by tokens): the two render
    # to the same tokens, not just the same number of them. (All but the last token: the
    # server evaluates that one again to sample from it.)
    direct = post(llama.url + "/v1/messages", small(body, stream=False), headers).json()
    assert direct["usage"]["input_tokens"] + direct["usage"]["cache_read_input_tokens"] == \
        prompt_tokens
    assert direct["usage"]["cache_read_input_tokens"] >= prompt_tokens - 1, direct["usage"]
    assert translated["content"] == direct["content"]
    assert translated["content"], translated  # an empty answer would compare equal too
    assert translated["stop_reason"] == direct["stop_reason"] or (
        translated["stop_reason"] == "stop_sequence"
        and translated["stop_sequence"] == direct["stop_sequence"])
    assert translated["usage"]["output_tokens"] == direct["usage"]["output_tokens"]

    with post(llama.url + "/v1/messages", small(body, stream=True), headers,
              stream=True) as response:
        assert response.status_code == 200
        direct_events = anthropic_events(response)
    with post(proxy_url + "/v1/messages", small(body, stream=True), headers,
              stream=True) as response:
        assert response.status_code == 200
        assert response.headers["X-Slotkeeper-Action"] == "kept"
        assert response.headers["content-type"].startswith("text/event-stream")
        proxy_events = anthropic_events(response)
    assert without_ids(as_the_server_writes(proxy_events)) == without_ids(direct_events)
    assert_one_block_at_a_time(proxy_events)
    assert [name for name, _ in proxy_events][-2:] == ["message_delta", "message_stop"]
    start = proxy_events[0][1]["message"]["usage"]
    assert start["input_tokens"] + start["cache_read_input_tokens"] == prompt_tokens
    assert start["cache_read_input_tokens"] >= prompt_tokens - 1  # its kept slot held it


def test_same_answers_direct_and_translated(big_llama, make_proxy):
    """At temperature 0, the server's own /v1/messages and slotkeeper's translation render the
    same tokens and give the same content, stop reason and token counts, whole and streamed
    event for event, on a captured Claude Code request (tools, thinking) and a handmade one
    with every block type (small: pinned too, not a side request)."""
    proxy = make_proxy(big_llama, slotkeeper_small_request_chars=0)
    captured = claude_messages_requests()
    main = max(captured, key=lambda r: len(json.dumps(r["body"])))
    headers = {k: v for k, v in main["headers"] if k.lower() in (
        "x-claude-code-session-id", "anthropic-version", "anthropic-beta")}
    answers_compared(big_llama, proxy.url, main["body"], headers)
    answers_compared(big_llama, proxy.url, HANDMADE[0],
                     {"X-Claude-Code-Session-Id": "handmade-session"})


def slot_by_id(llama: LlamaServer) -> dict[int, dict[str, Any]]:
    return {s["id"]: s for s in requests.get(llama.url + "/slots", timeout=10).json()}


def test_two_claude_sessions_keep_their_own_slots(big_llama, make_proxy):
    """Two Claude-style sessions with one shared system prompt and tools (the case where the
    server's similarity routing puts both on one slot), turns interleaved, streamed: each runs
    on its own slot, /slots agrees, and each next turn reuses >= 90% of its previous prompt."""
    proxy = make_proxy(big_llama)
    system = [{"type": "text", "text": long_system_prompt(900, seed=21)}]
    tools = HANDMADE[0]["tools"]
    conversations: dict[str, list[dict[str, Any]]] = {"cc-session-a": [], "cc-session-b": []}
    seen: dict[str, list[tuple[int, int, int]]] = {name: [] for name in conversations}
    before = slot_by_id(big_llama)
    for turn in range(3):
        for session, messages in conversations.items():
            messages.append({"role": "user", "content": f"({session}) turn {turn}: name a "
                                                        f"colour and a fruit."})
            body = {"system": system, "tools": tools, "messages": messages, "max_tokens": 6,
                    "temperature": 0, "stream": True}
            with post(proxy.url + "/v1/messages?beta=true", body,
                      {"X-Claude-Code-Session-Id": session}, stream=True) as response:
                assert response.status_code == 200
                slot = int(response.headers["X-Slotkeeper-Slot"])
                events = anthropic_events(response)
            usage = events[0][1]["message"]["usage"]
            text = "".join(d["delta"].get("text", "") for n, d in events
                           if n == "content_block_delta")
            assert events[-1][0] == "message_stop"
            messages.append({"role": "assistant", "content": [{"type": "text", "text": text}]})
            prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
            seen[session].append((slot, usage["cache_read_input_tokens"], prompt))
            after = slot_by_id(big_llama)
            # The server ran it on that slot: only that slot has a new task, and it holds the
            # prompt (plus the answer). (Its per-task counts are reset when the task ends.)
            changed = {i for i, s in after.items() if s.get("id_task") != before[i].get("id_task")}
            assert changed == {slot}, (slot, before, after)
            assert after[slot]["n_prompt_tokens"] >= prompt, after[slot]
            before = after
    slots = {name: {slot for slot, _, _ in turns} for name, turns in seen.items()}
    assert all(len(s) == 1 for s in slots.values()), seen
    assert slots["cc-session-a"] != slots["cc-session-b"], seen
    for turns in seen.values():
        for (_, _, previous), (_, reused, _) in zip(turns, turns[1:]):
            assert reused >= 0.9 * previous, turns
    assert "selected slot by id" in big_llama.log_text()


@pytest.mark.parametrize(("body", "status", "kind"), [
    # The chat parser refuses a user message without content.
    ({"messages": [{"role": "user"}], "max_tokens": 4}, 400, "invalid_request_error"),
    # Longer than a slot's context (16,384 tokens): refused after tokenizing, before prefill.
    ({"system": "x", "messages": [{"role": "user", "content": "token " * 20000}],
      "max_tokens": 4}, 400, "invalid_request_error"),
])
def test_server_errors_come_back_as_anthropic_errors(big_llama, make_proxy, body, status, kind):
    """The server's error answer to the translated request becomes an Anthropic error object
    with the same status and message as the server gives for the original."""
    proxy = make_proxy(big_llama)
    direct = requests.post(big_llama.url + "/v1/messages", json=body, timeout=TIMEOUT_S)
    through = requests.post(proxy.url + "/v1/messages", json=body, timeout=TIMEOUT_S,
                            headers={"X-Claude-Code-Session-Id": "errors"})
    assert direct.status_code == through.status_code == status, (direct.text, through.text)
    answer = through.json()
    assert answer["type"] == "error"
    assert answer["error"]["type"] == kind
    assert answer["error"]["message"] == direct.json()["error"]["message"]


def test_count_tokens_passes_through(big_llama, make_proxy):
    proxy = make_proxy(big_llama)
    body = HANDMADE[0]
    direct = post(big_llama.url + "/v1/messages/count_tokens", body).json()
    through = post(proxy.url + "/v1/messages/count_tokens", body)
    assert through.json() == direct
    assert "X-Slotkeeper-Action" not in through.headers


# ---- issue #20: what the Messages API documents, on the real server ---------------------------

def timed_events(response: requests.Response) -> list[tuple[float, str, dict[str, Any]]]:
    events, name = [], None
    for raw in response.iter_lines():
        line = raw.decode()
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            events.append((time.monotonic(), name, json.loads(line[6:])))
    return events


def test_message_start_comes_before_the_prefill(big_llama, make_proxy):
    """#20.10: the API sends message_start as soon as it accepted the request; a client that
    sees nothing for the whole prefill times out. A prompt of ~1,500 new tokens takes seconds
    to prefill here: message_start must come long before the first content."""
    proxy = make_proxy(big_llama)
    body = {"system": long_system_prompt(1100, seed=7), "max_tokens": 4, "temperature": 0,
            "stream": True, "messages": [{"role": "user", "content": "Say hi."}]}
    started = time.monotonic()
    with post(proxy.url + "/v1/messages", body, {"X-Claude-Code-Session-Id": "early-start"},
              stream=True) as response:
        assert response.status_code == 200
        events = timed_events(response)
    names = [name for _, name, _ in events]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    first_content = next(t for t, name, _ in events if name == "content_block_start")
    start_at = events[0][0]
    assert first_content - start_at > 1.0, (start_at - started, first_content - started)
    usage = events[0][2]["message"]["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] > 1000
    assert set(names) <= {"message_start", "ping", "content_block_start", "content_block_delta",
                          "content_block_stop", "message_delta", "message_stop"}


def test_stop_sequence_is_reported(big_llama, make_proxy):
    """#20.9: the answer stopped by a stop sequence says "stop_sequence" and which, whole and
    streamed (llama-server's own writer names the word too)."""
    proxy = make_proxy(big_llama)
    body = {"system": "You repeat the user's text exactly, nothing else.", "temperature": 0,
            "max_tokens": 40, "stop_sequences": ["delta"],
            "messages": [{"role": "user", "content": "alpha beta gamma delta epsilon"}]}
    whole = post(proxy.url + "/v1/messages", body, {"X-Claude-Code-Session-Id": "stops"}).json()
    direct = post(big_llama.url + "/v1/messages", body).json()
    assert direct["stop_sequence"] == "delta", direct  # the model does reach the word
    assert (whole["stop_reason"], whole["stop_sequence"]) == ("stop_sequence", "delta"), whole
    with post(proxy.url + "/v1/messages", {**body, "stream": True},
              {"X-Claude-Code-Session-Id": "stops"}, stream=True) as response:
        events = anthropic_events(response)
    delta = [data for name, data in events if name == "message_delta"][0]["delta"]
    assert delta == {"stop_reason": "stop_sequence", "stop_sequence": "delta"}


@pytest.fixture(scope="module")
def tools_llama(llama_bin: Path, model_path: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    """A server with the template that renders tools, whose /slots shows each prompt
    (LLAMA_SERVER_SLOTS_DEBUG)."""
    workdir = tmp_path_factory.mktemp("llama-tools")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LLAMA_SERVER_SLOTS_DEBUG", "1")
        server = LlamaServer(workdir, np=1, ctx=4096, binary=llama_bin, model=model_path,
                             extra=[NO_AMX, "--jinja", "--chat-template-file",
                                    str(TEMPLATE)]).start()
    yield server
    server.stop()


def last_prompt(llama: LlamaServer) -> str:
    used = [s for s in requests.get(llama.url + "/slots", timeout=10).json()
            if s.get("id_task") is not None]
    return max(used, key=lambda s: s["id_task"])["prompt"]


def test_tool_choice_by_name_offers_only_that_tool(tools_llama, make_proxy):
    """#20.8: {"type": "tool", "name": ...} reaches the model as that tool alone, required
    (llama-server takes no tool name in tool_choice); {"type": "none"} reaches the server as
    "none". gemma-3-270m calls no tools itself, so the prompt the server ran is checked: the
    server's own /v1/messages offers both tools for the same request."""
    proxy = make_proxy(tools_llama)
    tools = [{"name": "Bash", "description": "Run a command",
              "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                               "required": ["command"]}},
             {"name": "Read", "description": "Read a file",
              "input_schema": {"type": "object", "properties": {"path": {"type": "string"}},
                               "required": ["path"]}}]
    body = {"tools": tools, "max_tokens": 2, "temperature": 0,
            "tool_choice": {"type": "tool", "name": "Read", "disable_parallel_tool_use": True},
            "messages": [{"role": "user", "content": "Run ls in the shell."}]}
    post(tools_llama.url + "/v1/messages", body)
    direct = last_prompt(tools_llama)
    assert '"name": "Bash"' in direct and '"name": "Read"' in direct, direct
    through = post(proxy.url + "/v1/messages", body, {"X-Claude-Code-Session-Id": "tc"})
    assert through.json()["type"] == "message"
    translated = last_prompt(tools_llama)
    assert '"name": "Read"' in translated and '"name": "Bash"' not in translated, translated
    none = post(proxy.url + "/v1/messages", {**body, "tool_choice": {"type": "none"}},
                {"X-Claude-Code-Session-Id": "tc"}).json()
    assert none["type"] == "message"
    assert '"name": "Bash"' in last_prompt(tools_llama)
    unknown = requests.post(proxy.url + "/v1/messages", timeout=TIMEOUT_S, json={
        **body, "tool_choice": {"type": "tool", "name": "Write"}})
    assert unknown.status_code == 400 and unknown.json()["type"] == "error"


@pytest.mark.parametrize("stream", [False, True])
def test_refusals_on_messages_have_anthropics_shape(big_llama, make_proxy, stream):
    """#20.11-12: a PDF the server cannot read is refused (not dropped), a body over the limit
    413 and a too-deep body 400, all as {"type": "error", "error": {...}}, streamed or not."""
    proxy = make_proxy(big_llama, slotkeeper_max_body_mb=1)
    pdf = {"max_tokens": 4, "stream": stream, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                        "data": "JVBERi0xLjQK"}},
        {"type": "text", "text": "Summarise the attachment."}]}]}
    # Just over slotkeeper's limit (1 MiB): answered by slotkeeper in Anthropic's shape. A body
    # over mitmproxy's body_size_limit (the limit + 1 MiB, issue #21) is refused by mitmproxy
    # before any hook can answer it (docs/DESIGN.md, "Bounded inputs").
    big = {"max_tokens": 4, "stream": stream,
           "messages": [{"role": "user", "content": "x" * (1024 * 1024 + 64 * 1024)}]}
    cases = [(json.dumps(pdf).encode(), 400, "invalid_request_error"),
             (json.dumps(big).encode(), 413, "request_too_large"),
             (b'{"messages": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", 400,
              "invalid_request_error")]
    for raw, status, kind in cases:
        r = requests.post(proxy.url + "/v1/messages", data=raw, timeout=TIMEOUT_S,
                          headers={"content-type": "application/json"})
        assert r.status_code == status, r.text[:300]
        answer = r.json()
        assert answer["type"] == "error" and answer["error"]["type"] == kind, answer
    assert "Traceback" not in proxy.log_text()
