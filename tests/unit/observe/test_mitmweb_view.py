"""The content view and the comment wording on their own (flows made in memory)."""

from __future__ import annotations

import json

import pytest
from mitmproxy.contentviews import Metadata
from mitmproxy.test import tflow

from slotkeeper.observe.contentview import (
    PRIORITY,
    SlotkeeperContentview,
    event_text,
    flow_comment,
    sse_events,
    timings_of,
)

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


@pytest.mark.parametrize(("summary", "comment"), [
    ({"session": "s1", "slot": 2, "action": "kept", "rule": "header x-session-id", "detail": "",
      "reused": 4210, "prefilled": 35}, "s1 #2 kept"),
    ({"session": "web-2", "slot": 1, "action": "restored", "rule": "body session_id",
      "detail": "saved s3; restored 464 tokens in 5 ms"}, "web-2 #1 restored"),
    ({"session": "s1", "slot": None, "action": "unpinned", "rule": "default", "detail": ""},
     "s1 unpinned"),
    # A long id by its end (content-<hash>, parent/child and UUIDs differ there).
    ({"session": "3f2a9c71-0b6e-4d1a-9c55-1e2f3a4b5c6d", "slot": 0, "action": "assigned",
      "rule": "header x-claude-code-session-id", "detail": ""}, "…5c6d #0 assigned"),
    ({"session": "parent/child-7", "slot": 3, "action": "seeded"}, "…ld-7 #3 seeded"),
])
def test_flow_comment_puts_session_slot_action_first(summary, comment):
    assert flow_comment(summary) == comment


def test_markers_are_plain_symbols_mitmweb_knows():
    """mitmweb shows a marker only for a shortcode of its emoji table (anything else becomes
    a red-circle emoji); these must be symbols with a text presentation, which text fonts
    draw (no emoji font needed)."""
    import unicodedata

    from mitmproxy.utils.emoji import emoji

    from slotkeeper.flows import MARKERS

    assert len(set(MARKERS.values())) == len(MARKERS)
    for action, marker in MARKERS.items():
        char = emoji[marker]
        assert len(char) == 1, (action, char)  # no variation selector forcing emoji style
        assert ord(char) < 0x2c00, (action, char)  # BMP symbols, not the emoji planes
        assert unicodedata.category(char) == "So", (action, char)
        assert char not in EMOJI_PRESENTATION, (action, char)


# Characters below U+2C00 that browsers draw as coloured emoji by default
# (Unicode's Emoji_Presentation=Yes), so a machine without an emoji font shows a box.
EMOJI_PRESENTATION = set("⌚⌛⏩⏪⏫⏬⏰⏳◽◾☔☕♈♉♊♋♌♍♎♏♐♑♒♓♿⚓⚡⚪⚫⚽⚾⛄⛅⛎⛔⛪⛲⛳⛵⛺⛽✅✊✋✨❌❎❓❔❕❗➕➖➗➰➿⬛⬜⭐⭕")
