"""The content view and the comment wording on their own (flows made in memory)."""

from __future__ import annotations

import json

import pytest
from mitmproxy.contentviews import Metadata
from mitmproxy.test import tflow

from slotkeeper.contentview import (PRIORITY, SlotkeeperContentview, event_text, outcome_words,
                                    sse_events, timings_of)


@pytest.mark.parametrize(("action", "detail", "words"), [
    ("kept", "", "kept"),
    ("assigned", "saved a", "assigned, saved a"),
    ("restored", "saved b; restored 4,210 tokens in 38 ms",
     "restored 4,210 tokens in 38 ms, saved b"),
    ("restored", "restored 4,210 tokens in 38 ms", "restored 4,210 tokens in 38 ms"),
    ("seeded", "restored seed of 634 tokens in 5 ms",
     "seeded, restored seed of 634 tokens in 5 ms"),
    ("seeded", "built seed of 634 tokens", "seeded, built seed of 634 tokens"),
    ("side", "small request, slot not claimed; displaced a",
     "side, small request, slot not claimed, displaced a"),
])
def test_outcome_words(action, detail, words):
    assert outcome_words(action, detail) == words


TIMINGS = {"cache_n": 4196, "prompt_n": 151, "prompt_ms": 1000.0, "predicted_n": 8,
           "predicted_ms": 400.0}


def routed_flow(response_body: bytes, content_type: str):
    flow = tflow.tflow(resp=True)
    flow.request.path = "/v1/chat/completions"
    flow.request.content = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    flow.request.headers["content-type"] = "application/json"
    flow.response.content = response_body
    flow.response.headers["content-type"] = content_type
    flow.metadata["slotkeeper"] = {"session": "s1", "slot": 2, "action": "restored"}
    flow.comment = "s1 (header x-session-id) -> slot 2, restored 4,210 tokens in 38 ms"
    return flow


def metadata(flow, message):
    return Metadata(flow=flow, http_message=message,
                    content_type=message.headers["content-type"].split(";")[0])


def test_view_of_a_json_answer():
    flow = routed_flow(json.dumps({"choices": [], "timings": TIMINGS}).encode(),
                       "application/json")
    view = SlotkeeperContentview()
    assert view.name == "slotkeeper"
    for message in (flow.request, flow.response):
        assert view.render_priority(message.content, metadata(flow, message)) == PRIORITY > 1
    text = view.prettify(flow.response.content, metadata(flow, flow.response))
    assert '  action: "restored"' in text
    assert "  reused: 4196  #" in text
    assert "  prefill_ms: 1000.0  # (151.0 tokens/s)" in text
    assert "  generation_ms: 400.0  # (20.0 tokens/s)" in text
    assert 'comment: "s1 (header x-session-id) -> slot 2, restored 4,210 tokens in 38 ms"' in text
    assert '"cache_n": 4196' in text  # the body itself


def test_view_of_a_streamed_answer():
    events = [{"choices": [{"delta": {"content": "one"}}]},
              {"choices": [{"delta": {"content": " two"}}]},
              {"choices": [{"delta": {}}], "timings": TIMINGS}]
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    flow = routed_flow(body.encode(), "text/event-stream")
    assert sse_events(body.encode()) == events
    assert timings_of(flow.response) == TIMINGS
    text = SlotkeeperContentview().prettify(flow.response.content,
                                            metadata(flow, flow.response))
    assert "stream:  # 3 events" in text
    assert '  text: "one two"' in text
    assert "  prefilled: 151  #" in text


def test_flows_slotkeeper_did_not_route_are_left_to_other_views():
    flow = routed_flow(b"{}", "application/json")
    del flow.metadata["slotkeeper"]
    view = SlotkeeperContentview()
    assert view.render_priority(b"{}", metadata(flow, flow.response)) == 0
    with pytest.raises(ValueError):
        view.prettify(b"{}", metadata(flow, flow.response))


# Events as llama-server b11434 streams them (captured from the test model), one per route.
@pytest.mark.parametrize(("event", "text"), [
    ({"choices": [{"finish_reason": None, "index": 0, "delta": {"content": " two"}}],
      "object": "chat.completion.chunk"}, " two"),
    ({"choices": [{"text": " three", "index": 0, "logprobs": None, "finish_reason": None}],
      "object": "text_completion"}, " three"),
    ({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "<"}},
     "<"),
    ({"type": "response.output_text.delta", "item_id": "msg_g7", "delta": "im"}, "im"),
    ({"index": 0, "content": " four", "tokens": [2390], "stop": False}, " four"),
    ({"type": "message_delta", "delta": {"stop_reason": "max_tokens"}}, ""),
    ({"type": "response.output_item.done", "item": {"content": [{"text": "x"}]}}, ""),
    ({"choices": [{"delta": {}, "finish_reason": "length"}], "timings": {}}, ""),
    ("not json", ""),
])
def test_stream_text_of_each_route(event, text):
    assert event_text(event) == text
