"""The Anthropic <-> chat completions translation on its own (no server): the request as
llama-server's converter builds it, the answer as its Anthropic writers write it, streamed at
any chunk boundary, errors, and the addon's request hook. The real server checks are in
test_anthropic_real.py."""

from __future__ import annotations

import json
import random

import pytest
from mitmproxy import http
from mitmproxy.test import tflow

from corpus import claude_messages_requests
from slotkeeper.identity.identity import identify
from slotkeeper.surfaces import anthropic
from slotkeeper.surfaces.anthropic import (
    NotTranslatable,
    error_from_chat,
    normalize_billing_header,
    to_chat_request,
)
from slotkeeper.surfaces.anthropic_answers import StreamTranslator, message_from_chat
from slotkeeper.surfaces.messages import ORIGINAL_PATH_KEY, AnthropicMessages, MessagesTranslation
from slotkeeper.wire.translation import TRANSLATION_KEY, translation_of

# ---- request ---------------------------------------------------------------------------------

def test_system_string_and_blocks_become_one_system_message():
    assert to_chat_request({"system": "Be brief.", "messages": []})["messages"] == [
        {"role": "system", "content": "Be brief."}]
    blocks = [{"type": "text", "text": "One."}, {"type": "image", "text": "skipped"},
              {"type": "text", "text": " Two.", "cache_control": {"type": "ephemeral"}}, "junk"]
    assert to_chat_request({"system": blocks, "messages": []})["messages"] == [
        {"role": "system", "content": "One. Two."}]
    # No system: no system message; a system of another type: an empty one (as the server).
    assert to_chat_request({"messages": []})["messages"] == []
    assert to_chat_request({"system": 3, "messages": []})["messages"] == [
        {"role": "system", "content": ""}]


def test_billing_header_stamp_is_normalised_as_the_server_does():
    text = "x-anthropic-billing-header: cc_version=2.1.1; cc_entrypoint=cli; cch=a5145;You are"
    assert normalize_billing_header(text) == (
        "x-anthropic-billing-header: cc_version=2.1.1; cc_entrypoint=cli; cch=fffff;You are")
    # Without a ';' right after five characters, or not at the start: unchanged.
    for unchanged in ("x-anthropic-billing-header: cch=a514;", "hello cch=a5145;x",
                      "x-anthropic-billing-header: cc_version=1;", "x-anthropic-billing-header: "
                      "cch=a5145;"[:-1]):
        assert normalize_billing_header(unchanged) == unchanged
    body = {"system": [{"type": "text", "text": text}, {"type": "text", "text": " agent"}],
            "messages": []}
    assert to_chat_request(body)["messages"][0]["content"].endswith("cch=fffff;You are agent")


def test_content_blocks_map_like_the_servers_converter():
    body = {"messages": [
        {"role": "user", "content": "plain"},
        {"role": "user", "content": [
            {"type": "text", "text": "look", "cache_control": {"type": "ephemeral"}},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AAAA"}},
            {"type": "image", "source": {"type": "base64", "data": "BBBB"}},
            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}},
        ]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm ", "signature": "sig"},
            {"type": "thinking", "thinking": "ok"},
            {"type": "text", "text": "calling"},
            {"type": "tool_use", "id": "toolu_1", "name": "Read",
             "input": {"z": 1, "a": "é", "n": [1.5, None]}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "file text"},
            {"type": "tool_result", "tool_use_id": "toolu_2",
             "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"type": "tool_result", "tool_use_id": "toolu_3",
             "content": [{"type": "text", "text": "see"},
                         {"type": "image", "source": {"type": "url", "url": "http://i"}}]},
            {"type": "tool_result", "tool_use_id": "toolu_4"},
            {"type": "text", "text": "next"},
        ]},
        {"role": "assistant"},  # no content: dropped
        {"role": "user"},  # no content: kept as it is (the chat parser rejects it)
        {"role": "user", "content": [{"type": "redacted_thinking", "data": "x"}]},  # dropped
        {"role": "assistant", "content": [{"type": "tool_use", "name": "Bash"}]},
        "not a message",
    ]}
    out = to_chat_request(body)["messages"]
    assert out == [
        {"role": "user", "content": "plain"},
        {"role": "user", "content": [
            {"type": "text", "text": "look", "cache_control": {"type": "ephemeral"}},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,BBBB"}},
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
        ]},
        {"role": "assistant", "content": [{"type": "text", "text": "calling"}],
         "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
             "name": "Read", "arguments": '{"a":"é","n":[1.5,null],"z":1}'}}],
         "reasoning_content": "hmm ok"},
        {"role": "user", "content": [{"type": "text", "text": "next"}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "file text"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "ab"},
        {"role": "tool", "tool_call_id": "toolu_3", "content": [
            {"type": "text", "text": "see"},
            {"type": "image_url", "image_url": {"url": "http://i"}}]},
        {"role": "tool", "tool_call_id": "toolu_4", "content": ""},
        {"role": "user"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "", "type": "function", "function": {"name": "Bash", "arguments": "{}"}}]},
        "not a message",
    ]


def test_tools_choice_limits_and_sampling_fields():
    body = {"messages": [], "tools": [
        {"name": "Read", "description": "reads", "input_schema": {"type": "object"}},
        {"name": "Nothing"}, "junk"],
        "tool_choice": {"type": "any"}, "stop_sequences": ["END"], "temperature": 0,
        "top_p": 0.9, "top_k": 5, "stream": True, "chat_template_kwargs": {"x": 1},
        "thinking": {"type": "enabled", "budget_tokens": 2048}, "model": "claude-x",
        "context_management": {"edits": []}, "service_tier": "auto"}
    out = to_chat_request(body)
    assert out["tools"] == [
        {"type": "function", "function": {"name": "Read", "description": "reads",
                                          "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "Nothing", "description": "", "parameters": {}}},
        {"type": "function", "function": {"name": "", "description": "", "parameters": {}}}]
    assert out["tool_choice"] == "required"
    assert out["stop"] == ["END"]
    assert out["max_tokens"] == 4096  # the server's default when the client gives none
    assert (out["temperature"], out["top_p"], out["top_k"], out["stream"]) == (0, 0.9, 5, True)
    assert out["chat_template_kwargs"] == {"x": 1}
    assert out["thinking_budget_tokens"] == 2048
    assert out["timings_per_token"] is True  # message_start needs the prompt's counts
    # What the server's converter drops is dropped here too.
    for dropped in ("model", "context_management", "service_tier", "thinking", "system"):
        assert dropped not in out
    assert to_chat_request({"messages": [], "tool_choice": {"type": "auto"}})[
        "tool_choice"] == "auto"
    assert to_chat_request({"messages": [], "tool_choice": {"type": "tool", "name": "R"}})[
        "tool_choice"] == "required"
    # "none" is kept (issue #20.8: it was dropped, so the model could still call tools).
    assert to_chat_request({"messages": [], "tool_choice": {"type": "none"}})[
        "tool_choice"] == "none"
    assert to_chat_request({"messages": [], "thinking": {"type": "enabled"}})[
        "thinking_budget_tokens"] == 10000
    assert "thinking_budget_tokens" not in to_chat_request(
        {"messages": [], "thinking": {"type": "adaptive"}})
    assert "timings_per_token" not in to_chat_request({"messages": [], "stream": False})


def test_slot_fields_and_metadata_are_kept():
    body = {"messages": [], "id_slot": 1, "cache_prompt": False, "max_tokens": 7,
            "metadata": {"user_id": "user_abc_account__session_1234"}}
    out = to_chat_request(body)
    assert (out["id_slot"], out["cache_prompt"], out["max_tokens"]) == (1, False, 7)
    assert out["__metadata_user_id"] == "user_abc_account__session_1234"
    assert out["metadata"] == body["metadata"]


@pytest.mark.parametrize("body", [None, [], "x", {"system": "no messages"}])
def test_bodies_the_server_refuses_are_not_translated(body):
    with pytest.raises(NotTranslatable):
        to_chat_request(body)


def test_corpus_is_there_and_has_tools_and_thinking():
    requests = claude_messages_requests()
    assert len(requests) >= 3
    assert any(r["body"].get("tools") for r in requests)
    assert any(r["body"].get("thinking", {}).get("type") == "enabled" for r in requests)
    assert any(any(isinstance(b, dict) and b.get("type") == "tool_result"
                   for m in r["body"]["messages"] if isinstance(m.get("content"), list)
                   for b in m["content"]) for r in requests)


@pytest.mark.parametrize("index", range(len(claude_messages_requests())))
def test_corpus_identity_is_the_same_after_translation(index):
    """The session of a translated request is the session of the request the client sent: the
    X-Claude-Code-Session-Id header, or metadata.user_id without it."""
    request = claude_messages_requests()[index]
    headers = dict(request["headers"])
    body = request["body"]
    translated = to_chat_request(body)
    before = identify(request["path"], headers, body)
    after = identify(anthropic.chat_path(request["path"]), headers, translated)
    assert (after.session_id, after.rule) == (before.session_id, before.rule)
    assert before.rule == "header x-claude-code-session-id"
    without_header = {k: v for k, v in headers.items()
                      if k.lower() != "x-claude-code-session-id"}
    before = identify(request["path"], without_header, body)
    after = identify(anthropic.chat_path(request["path"]), without_header, translated)
    assert (after.session_id, after.rule) == (before.session_id, before.rule)
    assert before.rule == "body metadata.user_id"
    assert before.session_id == headers["X-Claude-Code-Session-Id"]


# ---- answer: whole ---------------------------------------------------------------------------

def chat_answer(message: dict, finish: str = "stop") -> dict:
    return {"id": "chatcmpl-1", "model": "gemma", "object": "chat.completion",
            "choices": [{"index": 0, "finish_reason": finish, "message": message}],
            "usage": {"completion_tokens": 9, "prompt_tokens": 120, "total_tokens": 129,
                      "prompt_tokens_details": {"cached_tokens": 100}},
            "timings": {"cache_n": 100, "prompt_n": 20, "predicted_n": 9}}


def test_whole_answer_with_thinking_text_and_tools():
    message = {"role": "assistant", "content": "Reading.", "reasoning_content": "plan",
               "tool_calls": [{"type": "function", "id": "call_1", "function": {
                   "name": "Read", "arguments": '{"path": "a"}'}},
                   {"type": "function", "function": {"name": "Bad", "arguments": "{oops"}}]}
    assert message_from_chat(chat_answer(message, "tool_calls")) == {
        "id": "chatcmpl-1", "type": "message", "role": "assistant", "model": "gemma",
        "content": [{"type": "thinking", "thinking": "plan", "signature": ""},
                    {"type": "text", "text": "Reading."},
                    {"type": "tool_use", "id": "call_1", "name": "Read", "input": {"path": "a"}},
                    {"type": "tool_use", "id": "", "name": "Bad", "input": {}}],
        "stop_reason": "tool_use", "stop_sequence": None,
        "usage": {"cache_read_input_tokens": 100, "input_tokens": 20, "output_tokens": 9}}


@pytest.mark.parametrize(("finish", "reason"), [("stop", "end_turn"), ("length", "max_tokens"),
                                                ("tool_calls", "tool_use"), (None, "end_turn")])
def test_stop_reasons(finish, reason):
    answer = message_from_chat(chat_answer({"role": "assistant", "content": ""}, finish))
    assert answer["stop_reason"] == reason
    assert answer["content"] == []


@pytest.mark.parametrize("bad", [{}, {"choices": []}, {"choices": [{"message": "x"}]}, []])
def test_a_non_answer_is_not_translated(bad):
    with pytest.raises(NotTranslatable):
        message_from_chat(bad)


def test_errors_become_anthropic_error_objects_with_the_same_status():
    raw = json.dumps({"error": {"code": 400, "message": "context too long",
                                "type": "exceed_context_size_error", "n_ctx": 4096,
                                "n_prompt_tokens": 5000}}).encode()
    assert error_from_chat(400, raw) == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "context too long", "n_ctx": 4096,
        "n_prompt_tokens": 5000}}
    assert error_from_chat(503, b'{"error":{"code":503,"message":"Loading model",'
                                b'"type":"unavailable_error"}}')["error"]["type"] == \
        "overloaded_error"
    assert error_from_chat(500, b"Internal Server Error") == {"type": "error", "error": {
        "type": "api_error", "message": "Internal Server Error"}}
    assert error_from_chat(413, b'{"error":{"code":413,"message":"too big","type":"slotkeeper"}}'
                           )["error"] == {"type": "request_too_large", "message": "too big"}
    assert error_from_chat(404, b"")["error"] == {"type": "not_found_error", "message": "HTTP 404"}

    response = http.Response.make(400, raw, {"content-type": "application/json"})
    MessagesTranslation().whole(response)
    assert response.status_code == 400
    assert response.headers["content-type"] == "application/json"
    assert json.loads(response.content)["type"] == "error"


def test_whole_rewrites_a_response_in_place():
    response = http.Response.make(
        200, json.dumps(chat_answer({"role": "assistant", "content": "Hi"})),
        {"content-type": "application/json; charset=utf-8"})
    MessagesTranslation().whole(response)
    body = json.loads(response.content)
    assert body["content"] == [{"type": "text", "text": "Hi"}]
    assert response.headers["content-type"] == "application/json"
    garbled = http.Response.make(200, b"not json", {})
    MessagesTranslation().whole(garbled)
    assert garbled.status_code == 502
    assert json.loads(garbled.content)["error"]["type"] == "api_error"


# ---- answer: streamed ------------------------------------------------------------------------

def sse(event: dict) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def chunk(delta: dict, finish: str | None = None, timings: dict | None = None) -> dict:
    event = {"choices": [{"finish_reason": finish, "index": 0, "delta": delta}],
             "created": 1, "id": "chatcmpl-9", "model": "gemma", "object": "chat.completion.chunk"}
    if timings:
        event["timings"] = timings
    return event


FIRST_TIMINGS = {"cache_n": 30, "prompt_n": 12, "predicted_n": 1}
# As llama-server streams with timings_per_token: the first token's role-only event has no
# timings, the token itself has them.
STREAM = b"".join([
    sse(chunk({"role": "assistant", "content": None})),
    sse(chunk({"reasoning_content": "Let me "}, timings=FIRST_TIMINGS)),
    sse(chunk({"reasoning_content": "think. é"})),
    sse(chunk({"content": "Listing"})),
    b":\n\n",  # a keep-alive ping
    sse(chunk({"content": " files."})),
    sse(chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                               "function": {"name": "Bash"}}]})),
    sse(chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"command":'}}]})),
    sse(chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"ls"}'}}]})),
    sse(chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                               "function": {"name": "Read", "arguments": "{}"}}]})),
    sse(chunk({}, "tool_calls", {"cache_n": 30, "prompt_n": 12, "predicted_n": 17})),
    b"data: [DONE]\n\n",
])


def parse_anthropic_sse(raw: bytes) -> list[tuple[str, dict]]:
    events = []
    for block in raw.decode().split("\n\n"):
        if not block or block.startswith(":"):
            continue
        name_line, data_line = block.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: ")
        data = json.loads(data_line[6:])
        assert data["type"] == name_line[7:]
        events.append((name_line[7:], data))
    return events


def test_stream_events_are_the_servers_anthropic_events():
    out = StreamTranslator()(STREAM)
    events = parse_anthropic_sse(out)
    # llama-server's keep-alive comment is the API's `ping` event (issue #20.10).
    assert b"\n:" not in out and not out.startswith(b":")
    start = events[0][1]["message"]
    assert start["usage"] == {"cache_read_input_tokens": 30, "input_tokens": 12,
                              "output_tokens": 0}
    assert (start["id"], start["model"], start["content"]) == ("chatcmpl-9", "gemma", [])
    simplified = [(name, data.get("index"), data.get("delta") or data.get("content_block"))
                  for name, data in events[1:]]
    assert simplified == [
        # One block at a time, as the Messages API streams them: each stops before the next
        # starts (a thinking block's signature_delta just before its stop).
        ("content_block_start", 0, {"type": "thinking", "thinking": ""}),
        ("content_block_delta", 0, {"type": "thinking_delta", "thinking": "Let me "}),
        ("content_block_delta", 0, {"type": "thinking_delta", "thinking": "think. é"}),
        ("content_block_delta", 0, {"type": "signature_delta", "signature": ""}),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, {"type": "text", "text": ""}),
        ("content_block_delta", 1, {"type": "text_delta", "text": "Listing"}),
        ("ping", None, None),
        ("content_block_delta", 1, {"type": "text_delta", "text": " files."}),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, {"type": "tool_use", "id": "call_a", "name": "Bash",
                                    "input": {}}),
        ("content_block_delta", 2, {"type": "input_json_delta", "partial_json": '{"command":'}),
        ("content_block_delta", 2, {"type": "input_json_delta", "partial_json": '"ls"}'}),
        ("content_block_stop", 2, None),
        ("content_block_start", 3, {"type": "tool_use", "id": "call_b", "name": "Read",
                                    "input": {}}),
        ("content_block_delta", 3, {"type": "input_json_delta", "partial_json": "{}"}),
        ("content_block_stop", 3, None),
        ("message_delta", None, {"stop_reason": "tool_use", "stop_sequence": None}),
        ("message_stop", None, None),
    ]
    assert events[-2][1]["usage"] == {"output_tokens": 17}


def feed_in_pieces(stream: bytes, cuts: list[int]) -> bytes:
    translate = StreamTranslator()
    out, last = [], 0
    for cut in [*cuts, len(stream)]:
        out.append(translate(stream[last:cut]))
        last = cut
    out.append(translate(b""))
    return b"".join(out)


def test_stream_split_at_any_boundary_gives_the_same_events():
    whole = StreamTranslator()(STREAM)
    # Every single split point (inside "data:", inside a UTF-8 character, between \n\n) ...
    for cut in range(1, len(STREAM)):
        assert feed_in_pieces(STREAM, [cut]) == whole, cut
    # ... byte by byte, and random splits.
    assert feed_in_pieces(STREAM, list(range(1, len(STREAM)))) == whole
    rng = random.Random(7)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(STREAM)), rng.randint(1, 30)))
        assert feed_in_pieces(STREAM, cuts) == whole


def test_stream_events_come_out_as_their_chunks_arrive():
    """Nothing is held back: each complete event is answered by the call that completes it."""
    translate = StreamTranslator()
    events = [e + b"\n\n" for e in STREAM.split(b"\n\n") if e]
    assert translate(events[0]) == b""  # the role alone: message_start waits for the timings
    assert [name for name, _ in parse_anthropic_sse(translate(events[1]))] == [
        "message_start", "content_block_start", "content_block_delta"]
    assert translate(events[2][:10]) == b""  # half an event: nothing yet
    assert parse_anthropic_sse(translate(events[2][10:]))[0][0] == "content_block_delta"


def test_text_only_stream_with_crlf_and_length_stop():
    stream = (sse(chunk({"role": "assistant", "content": None}, timings=FIRST_TIMINGS))
              + sse(chunk({"content": "Hi"})) + sse(chunk({}, "length", {"predicted_n": 2}))
              + b"data: [DONE]\n\n").replace(b"\n", b"\r\n")
    events = parse_anthropic_sse(feed_in_pieces(stream, [5, 40]))
    assert [name for name, _ in events] == ["message_start", "content_block_start",
                                            "content_block_delta", "content_block_stop",
                                            "message_delta", "message_stop"]
    assert events[1][1]["index"] == 0
    assert events[4][1]["delta"]["stop_reason"] == "max_tokens"
    assert events[4][1]["usage"] == {"output_tokens": 2}


def test_error_inside_a_stream_becomes_an_anthropic_error_event():
    stream = (sse(chunk({"role": "assistant", "content": None}, timings=FIRST_TIMINGS))
              + sse({"error": {"code": 500, "message": "boom", "type": "server_error"}}))
    translate = StreamTranslator()
    events = parse_anthropic_sse(translate(stream) + translate(b""))
    assert events[-1] == ("error", {"type": "error", "error": {"type": "api_error",
                                                               "message": "boom"}})
    assert [name for name, _ in events].count("error") == 1


@pytest.mark.parametrize("stream", [b"", sse(chunk({"content": "cut"}))])
def test_a_stream_that_ends_without_its_end_says_so(stream):
    translate = StreamTranslator()
    events = parse_anthropic_sse(translate(stream) + translate(b""))
    assert events[-1][0] == "error"
    assert events[-1][1]["error"]["type"] == "api_error"
    assert translate.finished


def test_garbage_in_a_stream_is_skipped():
    stream = (b"data: {not json\n\ndata: [1,2]\n\nevent: x\n\n"
              + sse(chunk({"content": "ok"})) + sse(chunk({}, "stop", {"predicted_n": 1})))
    events = parse_anthropic_sse(feed_in_pieces(stream, [3, 17]))
    assert [name for name, _ in events] == ["message_start", "content_block_start",
                                            "content_block_delta", "content_block_stop",
                                            "message_delta", "message_stop"]


# ---- the addon's request hook ----------------------------------------------------------------

class _Keeper:
    max_body_bytes = 1024 * 1024


def post(path: str, body: object, headers: dict | None = None) -> http.HTTPFlow:
    flow = tflow.tflow()
    flow.request.method = "POST"
    flow.request.path = path
    flow.request.content = body if isinstance(body, bytes) else json.dumps(body).encode()
    for name, value in (headers or {}).items():
        flow.request.headers[name] = value
    return flow


def test_messages_request_is_rewritten_to_chat_completions():
    surface = AnthropicMessages(_Keeper())
    body = {"system": "S", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
            "stream": True}
    flow = post("/v1/messages?beta=true", body, {"accept-encoding": "gzip, br, zstd"})
    surface.on_request(flow)
    assert flow.request.headers["accept-encoding"] == "identity"
    assert flow.request.path == "/v1/chat/completions?beta=true"
    assert flow.metadata[ORIGINAL_PATH_KEY] == "/v1/messages?beta=true"
    assert isinstance(translation_of(flow), MessagesTranslation)
    sent = json.loads(flow.request.content)
    assert sent == to_chat_request(body)
    assert flow.request.headers["content-length"] == str(len(flow.request.content))


def test_gzip_body_is_read_and_sent_plain():
    import gzip
    surface = AnthropicMessages(_Keeper())
    body = {"messages": [{"role": "user", "content": "hi"}]}
    flow = post("/v1/messages", gzip.compress(json.dumps(body).encode()),
                {"content-encoding": "gzip"})
    surface.on_request(flow)
    assert "content-encoding" not in flow.request.headers
    assert json.loads(flow.request.content)["messages"] == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/v1/messages/count_tokens", {"messages": []}),
    ("GET", "/v1/messages", {"messages": []}),
    ("POST", "/v1/chat/completions", {"messages": []}),
    ("POST", "/v1/messages", b"{not json"),
    ("POST", "/v1/messages", {"system": "no messages"}),
    ("POST", "/v1/messages", [1, 2]),
])
def test_other_requests_pass_untouched(method, path, body):
    surface = AnthropicMessages(_Keeper())
    flow = post(path, body)
    flow.request.method = method
    before = flow.request.content
    surface.on_request(flow)
    assert flow.request.path == path
    assert flow.request.content == before
    assert TRANSLATION_KEY not in flow.metadata


def test_a_body_over_the_limit_is_left_for_slotkeeper_to_refuse():
    keeper = _Keeper()
    keeper.max_body_bytes = 10
    flow = post("/v1/messages", {"messages": [{"role": "user", "content": "a long message"}]})
    AnthropicMessages(keeper).on_request(flow)
    assert flow.request.path == "/v1/messages"
    assert TRANSLATION_KEY not in flow.metadata


def test_translation_can_be_switched_off():
    surface = AnthropicMessages(_Keeper())
    surface.enabled = False
    flow = post("/v1/messages", {"messages": []})
    surface.on_request(flow)
    assert flow.request.path == "/v1/messages"


# ---- issue #20: what the Messages API documents -----------------------------------------------

TOOLS = [{"name": "Read", "input_schema": {"type": "object"}},
         {"name": "Bash", "input_schema": {"type": "object"}}]


def test_tool_choice_names_none_and_parallel_as_the_api_means_them():
    """#20.8: a named tool is the only one the model may call; none and
    disable_parallel_tool_use reach the server."""
    named = to_chat_request({"messages": [], "tools": TOOLS,
                             "tool_choice": {"type": "tool", "name": "Bash",
                                             "disable_parallel_tool_use": True}})
    assert named["tool_choice"] == "required"
    assert [t["function"]["name"] for t in named["tools"]] == ["Bash"]
    assert named["parallel_tool_calls"] is False
    none = to_chat_request({"messages": [], "tools": TOOLS, "tool_choice": {"type": "none"}})
    assert none["tool_choice"] == "none" and len(none["tools"]) == 2
    with pytest.raises(NotTranslatable):
        to_chat_request({"messages": [], "tools": TOOLS,
                         "tool_choice": {"type": "tool", "name": "Write"}})


def test_a_stop_sequence_is_named_in_the_answer():
    """#20.9: stop_reason "stop_sequence" and the sequence, streamed and not; the request asks
    the server for its `__verbose` copy, which names the stopping word."""
    assert to_chat_request({"messages": [], "stop_sequences": ["END"]})["verbose"] is True
    assert "verbose" not in to_chat_request({"messages": []})
    whole = {"id": "c", "model": "m", "choices": [{"finish_reason": "stop", "message": {
        "role": "assistant", "content": "one two"}}], "usage": {},
        "__verbose": {"stop_type": "word", "stopping_word": "END"}}
    answer = message_from_chat(whole)
    assert (answer["stop_reason"], answer["stop_sequence"]) == ("stop_sequence", "END")
    eos = dict(whole, __verbose={"stop_type": "eos", "stopping_word": ""})
    assert (message_from_chat(eos)["stop_reason"], message_from_chat(eos)["stop_sequence"]) == (
        "end_turn", None)
    final = chunk({"content": "two"})
    final["__verbose"] = {"stop_type": "word", "stopping_word": "END"}
    stream = b"".join([sse(chunk({"content": "one"}, timings=FIRST_TIMINGS)), sse(final),
                       sse(chunk({}, "stop", {"predicted_n": 2})), b"data: [DONE]\n\n"])
    events = parse_anthropic_sse(StreamTranslator()(stream))
    delta = [data for name, data in events if name == "message_delta"][0]["delta"]
    assert delta == {"stop_reason": "stop_sequence", "stop_sequence": "END"}


def test_message_start_goes_out_when_the_slot_takes_the_prompt():
    """#20.10: with return_progress the server sends a progress event before the prefill:
    message_start comes then, with the prompt's counts; later progress events are pings."""
    assert to_chat_request({"messages": [], "stream": True})["return_progress"] is True
    translate = StreamTranslator()
    progress = chunk({"role": "assistant", "content": None})
    progress["prompt_progress"] = {"total": 500, "cache": 480, "processed": 480,
                                   "time_ms": 1}
    first = parse_anthropic_sse(translate(sse(progress)))
    assert [name for name, _ in first] == ["message_start"]
    assert first[0][1]["message"]["usage"] == {"cache_read_input_tokens": 480,
                                               "input_tokens": 20, "output_tokens": 0}
    assert parse_anthropic_sse(translate(sse(progress))) == [("ping", {"type": "ping"})]
    rest = parse_anthropic_sse(translate(sse(chunk({"content": "hi"}, timings=FIRST_TIMINGS))
                                         + sse(chunk({}, "stop", {"predicted_n": 1}))))
    assert [name for name, _ in rest] == ["content_block_start", "content_block_delta",
                                          "content_block_stop", "message_delta", "message_stop"]


def test_documents_files_and_tool_errors_are_passed_or_refused():
    """#20.11: a text document reaches the model, a PDF or a Files API source is refused with
    the API's error, is_error is said to the model."""
    text_doc = {"type": "document", "title": "Notes",
                "source": {"type": "text", "media_type": "text/plain", "data": "buy milk"}}
    content_doc = {"type": "document", "source": {"type": "content", "content": [
        {"type": "text", "text": "part one"}]}}
    out = to_chat_request({"messages": [{"role": "user", "content": [
        text_doc, content_doc, {"type": "text", "text": "summarise"}]}]})["messages"]
    assert out[0]["content"][0] == {"type": "text", "text": "Notes\n\nbuy milk"}
    assert out[0]["content"][1] == {"type": "text", "text": "part one"}
    for block in ({"type": "document", "source": {"type": "base64",
                                                   "media_type": "application/pdf",
                                                   "data": "JVBERi0="}},
                  {"type": "document", "source": {"type": "file", "file_id": "file_1"}},
                  {"type": "image", "source": {"type": "file", "file_id": "file_2"}}):
        with pytest.raises(anthropic.Unsupported):
            to_chat_request({"messages": [{"role": "user", "content": [block]}]})
    results = to_chat_request({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "is_error": True,
         "content": "no such file"}]}]})["messages"]
    assert results == [{"role": "tool", "tool_call_id": "t1", "content": "Error: no such file"}]


def test_no_block_is_dropped_in_silence():
    """#20.11, "never silence": a search result and a document inside a tool result reach the
    model as text; a block type or image source the translation does not know is refused
    naming it; an encrypted redacted_thinking block (Anthropic's own models') is the one
    block left out."""
    search = {"type": "search_result", "title": "Docs", "source": "https://example.test/a",
              "content": [{"type": "text", "text": "the answer is 42"}]}
    doc = {"type": "document", "source": {"type": "text", "data": "file body"}}
    out = to_chat_request({"messages": [
        {"role": "user", "content": [search, {"type": "text", "text": "what is it?"}]},
        {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "xx"},
                                          {"type": "tool_use", "id": "t1", "name": "read",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [doc, search]}]}]})["messages"]
    assert out[0]["content"][0] == {"type": "text",
                                    "text": "Docs\n\nhttps://example.test/a\n\nthe answer is 42"}
    assert "reasoning_content" not in out[1] and out[1]["tool_calls"][0]["id"] == "t1"
    assert out[2] == {"role": "tool", "tool_call_id": "t1",
                      "content": "file body" + out[0]["content"][0]["text"]}
    for content in ([{"type": "server_tool_use", "id": "s1", "name": "web_search"}],
                    [{"type": "image", "source": {"type": "s3", "uri": "x"}}],
                    [{"type": "tool_result", "tool_use_id": "t1",
                      "content": [{"type": "web_search_result", "url": "u"}]}],
                    [{"text": "a block without a type"}]):
        with pytest.raises(anthropic.Unsupported) as refused:
            to_chat_request({"messages": [{"role": "user", "content": content}]})
        assert "not supported" in str(refused.value)


@pytest.mark.parametrize(("body", "limit", "status", "kind"), [
    ({"messages": [{"role": "user", "content": "x" * 100}]}, 50, 413, "request_too_large"),
    (b"[" * 5000 + b"]" * 5000, 1024 * 1024, 400, "invalid_request_error"),
    (b"{not json", 1024 * 1024, 400, "invalid_request_error"),
    ({"system": "no messages"}, 1024 * 1024, 400, "invalid_request_error"),
    ({"messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                        "data": "JVBERi0="}}]}]},
     1024 * 1024, 400, "invalid_request_error"),
])
def test_every_refusal_has_anthropics_error_shape(body, limit, status, kind):
    """#20.12 (and #20.11's refusals): answered on /v1/messages in the API's error shape."""
    keeper = _Keeper()
    keeper.max_body_bytes = limit
    flow = post("/v1/messages", body)
    AnthropicMessages(keeper).on_request(flow)
    assert flow.response.status_code == status
    answer = json.loads(flow.response.content)
    assert answer["type"] == "error" and answer["error"]["type"] == kind
    assert answer["error"]["message"]


def test_slotkeepers_own_errors_on_the_route_become_anthropic_errors():
    """An error SlotKeeper answers after the translation was set (503: no server) goes
    through MessagesTranslation.whole like llama-server's own."""
    from slotkeeper.wire import replies
    flow = post("/v1/messages", {"messages": [{"role": "user", "content": "hi"}]})
    AnthropicMessages(_Keeper()).on_request(flow)
    flow.response = replies.error_reply(503, "no llama-server can take the request")
    translation_of(flow).whole(flow.response)
    answer = json.loads(flow.response.content)
    assert answer == {"type": "error", "error": {"type": "overloaded_error",
                                                 "message": "no llama-server can take the "
                                                            "request"}}
