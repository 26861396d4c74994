"""Request body decoding, pinning, and timings extraction."""

import gzip
import json
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slotkeeper.wire import bodies
from slotkeeper.wire.bodies import BodyError


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/completion", "/v1/messages",
                                  "/v1/responses?x=1", "/infill/", "/responses"])
def test_completion_paths(path):
    assert bodies.is_completion_path(path)


@pytest.mark.parametrize("path", ["/slots", "/v1/models", "/health", "/v1/chat", "/"])
def test_other_paths(path):
    assert not bodies.is_completion_path(path)


def test_gzip_and_deflate_round_trip():
    raw = b'{"a": 1}'
    assert bodies.decode_body(gzip.compress(raw), "gzip", 100) == raw
    assert bodies.decode_body(zlib.compress(raw), "deflate", 100) == raw
    assert bodies.decode_body(raw, "identity", 100) == raw


def test_gzip_bomb_stops_at_the_limit():
    bomb = gzip.compress(b"0" * 10_000_000)
    with pytest.raises(BodyError, match="exceeds 1000 bytes"):
        bodies.decode_body(bomb, "gzip", 1000)


def test_bad_encodings_are_named():
    with pytest.raises(BodyError, match="not valid gzip"):
        bodies.decode_body(b"not gzip", "gzip", 100)
    with pytest.raises(BodyError, match="unsupported Content-Encoding 'zstd'"):
        bodies.decode_body(b"x", "zstd", 100)


def test_parse_rejects_non_objects():
    with pytest.raises(BodyError, match="not JSON"):
        bodies.parse_json_object(b"{nope")
    with pytest.raises(BodyError, match="JSON list, not an object"):
        bodies.parse_json_object(b"[1]")


def test_pin_sets_slot_and_defaults_cache_prompt():
    out = json.loads(bodies.pin({"messages": []}, 2))
    assert out == {"messages": [], "id_slot": 2, "cache_prompt": True}


def test_pin_keeps_an_explicit_cache_prompt_false():
    out = json.loads(bodies.pin({"cache_prompt": False}, 1))
    assert out["cache_prompt"] is False and out["id_slot"] == 1


def test_pin_appends_the_fields_to_the_clients_own_bytes():
    raw = b'  {"messages": [{"role": "user", "content": "caf\xc3\xa9 \\u00e9"}], "n": 1.50}\n'
    data = bodies.parse_json_object(raw)
    out = bodies.pin(data, 3, raw)
    # The client's text, untouched (spacing, escapes, number format), then the two fields.
    assert out == raw.strip()[:-1] + b',"id_slot":3,"cache_prompt":true}'
    assert json.loads(out) == {**data, "id_slot": 3, "cache_prompt": True}
    assert json.loads(bodies.pin({}, 0, b"{ }")) == {"id_slot": 0, "cache_prompt": True}
    assert json.loads(bodies.pin(data, None, raw)) == {**data, "cache_prompt": True}


@pytest.mark.parametrize("raw", [
    b'{"cache_prompt": false, "messages": []}',  # the client's own choice must stay
    b'{"cache_prompt": null, "messages": []}',  # null: defaulted to true, not duplicated
    b'{"id_slot": 5, "messages": []}',  # a key at the top level is replaced, never doubled
    '{"messages": []}'.encode("utf-16"),  # json.loads reads UTF-16; appending ASCII would not
    b'\xef\xbb\xbf{"messages": []}',  # a BOM: not the bytes an object starts with
])
def test_pin_serializes_again_when_appending_would_be_wrong(raw):
    data = json.loads(raw.decode("utf-8-sig") if raw.startswith(b"\xef") else raw)
    out = bodies.pin(data, 1, raw)
    assert out == bodies.pin(data, 1)  # the serializing path, whole
    assert out.count(b'"id_slot"') == 1 and out.count(b'"cache_prompt"') == 1


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12)


@given(st.dictionaries(st.text(), json_values, max_size=6),
       st.one_of(st.none(), st.integers(0, 64)),
       st.sampled_from([{}, {"indent": 1}, {"ensure_ascii": False}]))
def test_pin_means_the_same_whichever_path_it_takes(data, slot, style):
    raw = json.dumps(data, **style).encode()
    assert json.loads(bodies.pin(data, slot, raw)) == json.loads(bodies.pin(data, slot))


def test_client_slot():
    assert bodies.client_slot({}) is None
    assert bodies.client_slot({"id_slot": -1}) is None
    assert bodies.client_slot({"id_slot": 3}) == 3
    for bad in ("1", 1.5, True, [1]):
        with pytest.raises(BodyError, match="id_slot must be an integer"):
            bodies.client_slot({"id_slot": bad})


def test_cache_prompt_type_checked():
    bodies.check_cache_prompt({"cache_prompt": False})
    with pytest.raises(BodyError, match="cache_prompt must be true or false"):
        bodies.check_cache_prompt({"cache_prompt": "yes"})


def test_sse_watcher_passes_chunks_and_finds_split_timings():
    final = b'data: {"choices":[],"timings":{"cache_n":40,"prompt_n":7,"predicted_n":3,"prompt_ms":1.5}}\n\n'
    stream = [b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n', final[:30], final[30:],
              b"data: [DONE]\n\n", b""]
    watcher = bodies.SseTimingsWatcher()
    assert [watcher(c) for c in stream] == stream
    assert watcher.timings == bodies.Timings(cache_n=40, prompt_n=7, predicted_n=3, prompt_ms=1.5)


def test_sse_watcher_tells_the_final_event_once_and_only_then():
    """Issue #19: a client may send its next turn the moment it reads the final event; the
    watcher says when that event passes (a finish reason, /completion's stop, [DONE]), not
    before, and a finish reason the model writes in its text (escaped) is not one."""
    seen = []
    watcher = bodies.SseTimingsWatcher(on_final=lambda: seen.append(True))
    watcher(b'data: {"choices":[{"delta":{"content":"\\"finish_reason\\":\\"x"},'
            b'"finish_reason":null}]}\n\n')
    watcher(b'data: {"choices":[{"delta":{},"finish_reason":"st')
    assert seen == [] and not watcher.final
    watcher(b'op"}],"timings":{"cache_n":1,"prompt_n":2}}\n\n')
    watcher(b"data: [DONE]\n\n")
    assert seen == [True] and watcher.final
    completion = bodies.SseTimingsWatcher(on_final=lambda: seen.append("c"))
    completion(b'data: {"content":"","stop":true,"timings":{"cache_n":1,"prompt_n":2}}\n\n')
    assert seen == [True, "c"]


def test_timings_in_json():
    t = bodies.timings_in_json(b'{"timings": {"cache_n": 5, "prompt_n": 2}}')
    assert t is not None and t.prompt_tokens == 7
    assert bodies.timings_in_json(b"not json") is None
    assert bodies.timings_in_json(b'{"timings": {"cache_n": "x"}}') is None


def test_timings_are_read_from_the_end_of_a_whole_answer():
    """Only the trailing `timings` object is parsed; what the model wrote is never taken for
    it, and an answer whose tail is not a timings object is parsed whole."""
    real = {"cache_n": 599, "prompt_n": 1, "predicted_n": 3, "prompt_ms": 5.5}
    fooled = json.dumps({"choices": [{"message": {"content": '{"timings":{"cache_n":7}}'}}],
                         "timings": real}, separators=(",", ":")).encode()
    assert bodies.timings_in_json(fooled) == bodies.Timings(599, 1, 3, 5.5)
    # The text alone (no real timings): its escaped key is not read as one.
    text_only = json.dumps({"content": '"timings":{"cache_n":7}',
                            "usage": {"cache_read_input_tokens": 2, "input_tokens": 3,
                                      "output_tokens": 1}}).encode()
    assert bodies.timings_in_json(text_only) == bodies.Timings(2, 3, 1, 0.0)
    # Spaces after the colon, as another server might write them.
    spaced = b'{"id": "x", "timings": {"cache_n": 4, "prompt_n": 2}}'
    assert bodies.timings_in_json(spaced) == bodies.Timings(4, 2, 0, 0.0)
    # A truncated tail falls back to the whole parse, which fails: no timings, no exception.
    assert bodies.timings_in_json(b'{"timings":{"cache_n":4,') is None


def test_anthropic_usage_is_read_when_there_are_no_timings():
    body = b'{"type":"message","usage":{"cache_read_input_tokens":11,"input_tokens":41,"output_tokens":4}}'
    assert bodies.timings_in_json(body) == bodies.Timings(11, 41, 4, 0.0)


def test_anthropic_stream_merges_message_start_and_the_final_delta():
    stream = [
        b'event: message_start\ndata: {"type":"message_start","message":{"usage":'
        b'{"cache_read_input_tokens":51,"input_tokens":1,"output_tokens":0}}}\n\n',
        b'event: content_block_delta\ndata: {"type":"content_block_delta"}\n\n',
        b'event: message_delta\ndata: {"type":"message_delta","usage":{"output_tokens":4}}\n\n',
    ]
    watcher = bodies.SseTimingsWatcher()
    for chunk in stream:
        watcher(chunk)
    assert watcher.timings == bodies.Timings(cache_n=51, prompt_n=1, predicted_n=4, prompt_ms=0.0)


def test_responses_usage_counts_cached_tokens_inside_input_tokens():
    body = b'{"object":"response","usage":{"input_tokens":26,"output_tokens":4,"input_tokens_details":{"cached_tokens":9}}}'
    assert bodies.timings_in_json(body) == bodies.Timings(9, 17, 4, 0.0)


def test_chat_usage_without_timings_is_not_guessed():
    assert bodies.timings_in_json(b'{"usage":{"prompt_tokens":5,"completion_tokens":1}}') is None
