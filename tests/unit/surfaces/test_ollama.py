"""The Ollama translation (addon/slotkeeper/ollama.py): requests to llama-server's routes and
answers back, without any server. The real-server tests are in test_ollama_real.py."""

from __future__ import annotations

import json
import struct
import time

import pytest

from slotkeeper.surfaces import ollama, ollama_models, ollama_requests
from slotkeeper.surfaces.ollama import (
    CHAT,
    GENERATE_CHAT,
    GENERATE_INFILL,
    GENERATE_RAW,
    OllamaError,
)
from slotkeeper.surfaces.ollama_answers import AnswerShaper, StreamTranslator
from slotkeeper.surfaces.ollama_models import ModelFiles

PNG_B64 = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="


def test_chat_maps_options_format_think_and_images():
    mapped = ollama_requests.chat_request({
        "model": "gemma:latest",
        "messages": [{"role": "system", "content": "S"},
                     {"role": "user", "content": "look", "images": [PNG_B64]}],
        "options": {"temperature": 0, "top_k": 5, "num_predict": 7, "seed": 3,
                    "stop": ["x"], "repeat_penalty": 1.1, "num_ctx": 8192, "weird": 1},
        "format": {"type": "object"},
        "think": False,
        "stream": False,
    })
    assert mapped.path == "/v1/chat/completions" and mapped.kind == CHAT
    body = mapped.body
    assert body["model"] == "gemma" and body["stream"] is False
    assert body["temperature"] == 0 and body["top_k"] == 5 and body["max_tokens"] == 7
    assert body["seed"] == 3 and body["stop"] == ["x"] and body["repeat_penalty"] == 1.1
    assert "num_ctx" not in body and "weird" not in body
    assert mapped.ignored == ["num_ctx", "weird (unknown)"]
    assert body["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "format",
                                                       "schema": {"type": "object"}}}
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    parts = body["messages"][1]["content"]
    assert parts[0] == {"type": "text", "text": "look"}
    assert parts[1]["image_url"]["url"].startswith("data:image/png;base64,iVBOR")


def test_chat_streams_by_default_and_json_format():
    mapped = ollama_requests.chat_request({"model": "m", "messages": [], "format": "json"})
    assert mapped.stream and mapped.body["stream"] is True
    assert mapped.body["response_format"] == {"type": "json_object"}


def test_num_predict_negative_means_no_limit():
    for n in (-1, -2):
        fields, _ = ollama_requests.map_options({"num_predict": n}, "max_tokens")
        assert "max_tokens" not in fields
    with pytest.raises(OllamaError):
        ollama_requests.map_options({"num_predict": -3}, "max_tokens")


def test_tool_history_is_converted_both_ways():
    mapped = ollama_requests.chat_request({"model": "m", "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
    ], "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]})
    assistant, tool = mapped.body["messages"][1:]
    call = assistant["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert tool["tool_call_id"] == call["id"] and tool["name"] == "get_weather"
    assert mapped.body["tools"][0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize("body, message", [
    ([], "request body must be a JSON object"),
    ({"messages": []}, "model is required"),
    ({"model": "m", "messages": "hi"}, "messages must be a list"),
    ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "message role"),
    ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "content must be a string"),
    ({"model": "m", "messages": [], "options": {"temperature": "hot"}}, "option temperature"),
    ({"model": "m", "messages": [], "options": {"top_k": 1.5}}, "option top_k"),
    ({"model": "m", "messages": [], "options": []}, "options must be an object"),
    ({"model": "m", "messages": [], "format": "yaml"}, "format must be"),
    ({"model": "m", "messages": [], "think": "max"}, "think must be"),
    ({"model": "m", "messages": [], "stream": "yes"}, "stream must be"),
    ({"model": "m", "messages": [{"role": "user", "content": "x", "images": [5]}]}, "images"),
])
def test_bad_chat_requests_are_clear_400s(body, message):
    with pytest.raises(OllamaError) as e:
        ollama_requests.chat_request(body)
    assert e.value.status == 400 and message in e.value.message


def test_session_fields_of_the_body_are_passed_on_for_identity():
    chat = ollama_requests.chat_request({"model": "m", "messages": [], "chat_id": "c-1", "user": 5})
    assert chat.body["chat_id"] == "c-1" and "user" not in chat.body
    gen = ollama_requests.generate_request({"model": "m", "prompt": "x", "session_id": "s-1"})
    assert gen.body["session_id"] == "s-1"


def test_generate_plain_goes_to_chat_with_system():
    mapped = ollama_requests.generate_request({"model": "m", "prompt": "hi", "system": "S",
                                      "stream": False})
    assert mapped.path == "/v1/chat/completions" and mapped.kind == GENERATE_CHAT
    assert [m["role"] for m in mapped.body["messages"]] == ["system", "user"]
    assert mapped.body["messages"][1]["content"] == "hi"


def test_generate_raw_and_context_send_tokens_to_completion():
    calls = []

    def tokens(text, special):
        calls.append((text, special))
        return [7, 8]

    raw = ollama_requests.generate_request({"model": "m", "prompt": "<x>", "raw": True,
                                   "options": {"num_predict": 4}}, tokens)
    assert raw.path == "/completion" and raw.kind == GENERATE_RAW
    assert raw.body["prompt"] == [7, 8] and raw.body["n_predict"] == 4
    assert raw.body["return_tokens"] is True
    cont = ollama_requests.generate_request({"model": "m", "prompt": "more", "context": [1, 2, 3]},
                                   tokens)
    assert cont.body["prompt"] == [1, 2, 3, 7, 8] and cont.context == [1, 2, 3, 7, 8]
    assert calls == [("<x>", True), ("more", False)]  # no second BOS after a context
    with pytest.raises(OllamaError):
        ollama_requests.generate_request({"model": "m", "prompt": "x", "context": [1, "a"]}, tokens)


def test_generate_suffix_goes_to_infill():
    mapped = ollama_requests.generate_request({"model": "m", "prompt": "def f(", "suffix": "return 1"})
    assert mapped.path == "/infill" and mapped.kind == GENERATE_INFILL
    assert mapped.body["input_prefix"] == "def f(" and mapped.body["input_suffix"] == "return 1"


def test_unload_and_load_are_answered_without_the_server():
    body = {"model": "m:latest", "keep_alive": 0, "prompt": ""}
    assert ollama_requests.is_load_or_unload(body, "/api/generate")
    assert ollama_requests.load_answer(body, "/api/generate")["done_reason"] == "unload"
    assert ollama_requests.load_answer({"model": "m"}, "/api/chat")["done_reason"] == "load"
    assert not ollama_requests.is_load_or_unload({"model": "m", "prompt": "hi"}, "/api/generate")
    assert ollama_requests.is_load_or_unload({"model": "m", "messages": []}, "/api/chat")


TIMINGS = {"cache_n": 100, "prompt_n": 12, "prompt_ms": 80.5, "predicted_n": 3,
           "predicted_ms": 30.0}


def test_whole_chat_answer():
    shaper = AnswerShaper(ollama_requests.chat_request({"model": "m:latest", "messages": []}))
    out = shaper.whole({"choices": [{"finish_reason": "tool_calls", "message": {
        "content": "ok", "reasoning_content": "hmm", "tool_calls": [
            {"id": "c1", "function": {"name": "f", "arguments": '{"a": 1}'}}]}}],
        "timings": TIMINGS})
    assert out["model"] == "m:latest" and out["done"] is True and out["done_reason"] == "stop"
    assert out["message"]["content"] == "ok" and out["message"]["thinking"] == "hmm"
    assert out["message"]["tool_calls"] == [
        {"function": {"index": 0, "name": "f", "arguments": {"a": 1}}, "id": "c1"}]
    # The whole prompt, reused and prefilled (100 + 12), as Ollama counts it (issue #20.6).
    assert out["prompt_eval_count"] == 112 and out["eval_count"] == 3
    assert out["prompt_eval_duration"] == 80_500_000 and out["eval_duration"] == 30_000_000
    assert out["load_duration"] == 0 and out["total_duration"] >= 0


def test_whole_raw_generate_returns_context():
    mapped = ollama_requests.generate_request({"model": "m", "prompt": "x", "raw": True},
                                     lambda text, special: [5])
    out = AnswerShaper(mapped).whole({"content": "y", "tokens": [9, 10], "stop": True,
                                      "stop_type": "limit", "timings": TIMINGS})
    assert out["response"] == "y" and out["done_reason"] == "length"
    assert out["context"] == [5, 9, 10]


def sse(*events: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)


def lines(raw: bytes) -> list[dict]:
    return [json.loads(line) for line in raw.splitlines() if line]


def test_stream_chat_line_by_line_even_split_mid_event():
    shaper = AnswerShaper(ollama_requests.chat_request({"model": "m", "messages": []}))
    translator = StreamTranslator(shaper)
    data = sse({"choices": [{"delta": {"role": "assistant", "content": None}}]},
               {"choices": [{"delta": {"content": "Hel"}}]},
               {"choices": [{"delta": {"content": "lo"}}]},
               {"choices": [{"delta": {}, "finish_reason": "stop"}]},
               {"choices": [], "usage": {}, "timings": TIMINGS}) + b"data: [DONE]\n\n"
    out = b""
    first = translator.feed(data[:70])  # mid-event: nothing half-sent
    assert all(line.startswith(b"{") for line in first.splitlines())
    out += first + translator.feed(data[70:]) + translator.feed(b"")
    objs = lines(out)
    assert [o["message"]["content"] for o in objs] == ["Hel", "lo", ""]
    assert [o["done"] for o in objs] == [False, False, True]
    assert objs[-1]["done_reason"] == "stop" and objs[-1]["prompt_eval_count"] == 112


def test_stream_tool_call_fragments_are_sent_whole():
    shaper = AnswerShaper(ollama_requests.chat_request({"model": "m", "messages": []}))
    translator = StreamTranslator(shaper)
    out = translator.feed(sse(
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "c", "function": {
            "name": "get_weather", "arguments": '{"ci'}}]}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {
            "arguments": 'ty": "Paris"}'}}]}}]},
        {"choices": [{"delta": {}, "finish_reason": "tool_calls"}], "timings": TIMINGS}))
    objs = lines(out)
    assert objs[0]["message"]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert objs[-1]["done"] is True
    assert translator.feed(b"data: [DONE]\n\n") + translator.feed(b"") == b""


def test_stream_native_generate_and_errors():
    mapped = ollama_requests.generate_request({"model": "m", "prompt": "x", "raw": True},
                                     lambda text, special: [1])
    translator = StreamTranslator(AnswerShaper(mapped))
    out = translator.feed(sse({"content": "a", "tokens": [4], "stop": False},
                              {"content": "", "tokens": [], "stop": True, "stop_type": "eos",
                               "timings": TIMINGS}))
    objs = lines(out)
    assert objs[0]["response"] == "a" and objs[-1]["context"] == [1, 4]
    broken = StreamTranslator(AnswerShaper(mapped))
    assert lines(broken.feed(b'data: {"error": {"message": "boom"}}\n\n')) == [
        {"error": "boom"}]
    cut = StreamTranslator(AnswerShaper(mapped))
    cut.feed(sse({"content": "a", "stop": False}))
    assert "error" in lines(cut.feed(b""))[0]


def test_listings_from_v1_models_and_props():
    # as b11434 answers (abridged)
    models = {"data": [{"id": "/models/gemma-3-270m-q4_k_m.gguf", "created": 1700000000,
                        "meta": {"n_params": 268_098_176, "size": 253_000_000,
                                 "n_ctx": 4096, "n_ctx_train": 32768,
                                 "ftype": "Q4_K - Medium"}}]}
    tags = ollama_models.tags_answer(models, ModelFiles())["models"][0]
    assert tags["name"] == tags["model"] == "gemma-3-270m-q4_k_m:latest"
    assert tags["details"]["quantization_level"] == "Q4_K_M"
    assert tags["details"]["parameter_size"] == "268M" and tags["size"] == 253_000_000
    ps = ollama_models.ps_answer(models, ModelFiles())["models"][0]
    assert ps["context_length"] == 4096 and ps["expires_at"].startswith("2318")
    show = ollama_models.show_answer({"chat_template": "{{ tools }}", "model_path": "/x/m.gguf",
                               "model_ftype": "Q4_K - Medium",
                               "chat_template_caps": {"supports_tools": True},
                               "default_generation_settings": {"n_ctx": 4096}}, "m:latest",
                               ModelFiles())
    assert show["details"]["quantization_level"] == "Q4_K_M"
    assert ollama_models.display_name("alias:7b") == "alias:7b"
    assert "tools" in show["capabilities"] and show["parameters"] == "num_ctx 4096"
    info = show["model_info"]
    assert info[f"{info['general.architecture']}.context_length"] == 4096


def test_embed_answers():
    mapped = ollama_requests.embed_request({"model": "m", "input": "a"}, legacy=False)
    assert mapped.body["input"] == ["a"] and mapped.path == "/v1/embeddings"
    data = {"data": [{"index": 1, "embedding": [0.2]}, {"index": 0, "embedding": [0.1]}],
            "usage": {"prompt_tokens": 4}}
    out = AnswerShaper(mapped).embeddings(data, legacy=False)
    assert out["embeddings"] == [[0.1], [0.2]] and out["prompt_eval_count"] == 4
    assert AnswerShaper(mapped).embeddings(data, legacy=True) == {"embedding": [0.1]}
    with pytest.raises(OllamaError):
        ollama_requests.embed_request({"model": "m", "input": [1]}, legacy=False)


def test_upstream_error_message():
    assert ollama.upstream_error(400, b'{"error": {"code": 400, "message": "bad"}}') == "bad"
    assert ollama.upstream_error(502, b"<html>Bad Gateway</html>") == "<html>Bad Gateway</html>"


# ---- issue #20: what real Ollama clients read ------------------------------------------------

def test_format_without_think_turns_the_reasoning_parser_off():
    """#20.4: with a template that can think, the constrained JSON must land in `content`."""
    for think in (None, False):
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "format": "json"}
        if think is not None:
            body["think"] = think
        assert ollama_requests.chat_request(body).body["reasoning_format"] == "none"
    thinking = ollama_requests.chat_request({"model": "m", "messages": [], "format": "json",
                                             "think": True}).body
    assert "reasoning_format" not in thinking
    plain = ollama_requests.chat_request({"model": "m", "messages": []}).body
    assert "reasoning_format" not in plain


def test_parallel_calls_to_one_tool_get_their_results_in_order():
    """#20.7: two calls to the same tool; each result answers its own call."""
    call = {"function": {"name": "get_weather", "arguments": {"city": "A"}}}
    other = {"function": {"name": "get_weather", "arguments": {"city": "B"}}}
    body = {"model": "m", "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call, other]},
        {"role": "tool", "tool_name": "get_weather", "content": "sunny"},
        {"role": "tool", "tool_name": "get_weather", "content": "rainy"}]}
    messages = ollama_requests.chat_request(body).body["messages"]
    ids = [c["id"] for c in messages[1]["tool_calls"]]
    assert len(set(ids)) == 2
    assert [m["tool_call_id"] for m in messages[2:]] == ids
    # With ids (LangChain's ChatOllama sends them), results in another order than their
    # calls still answer their own call.
    with_ids = {**body, "messages": [
        body["messages"][0],
        {"role": "assistant", "content": "", "tool_calls": [{**call, "id": "call_paris"},
                                                            {**other, "id": "call_rome"}]},
        {"role": "tool", "tool_name": "get_weather", "tool_call_id": "call_rome",
         "content": "rainy"},
        {"role": "tool", "tool_name": "get_weather", "tool_call_id": "call_paris",
         "content": "sunny"}]}
    messages = ollama_requests.chat_request(with_ids).body["messages"]
    assert [(m["tool_call_id"], m["content"]) for m in messages[2:]] == [
        ("call_rome", "rainy"), ("call_paris", "sunny")]


def test_generate_goes_through_the_template_and_returns_a_context():
    """#20.5: a plain generate is templated by the server and sent as tokens, so its answer
    carries a `context`; sending it back continues with the next turn templated, no second
    BOS in the middle."""
    vocab: dict[str, int] = {"<bos>": 1}

    def tokens(text, special):
        out = [1] if special else []
        for word in text.split(" "):
            if word:
                out.append(vocab.setdefault(word, len(vocab) + 1))
        return out

    def render(messages, fields):
        return " ".join(f"[{m['role']}] {m['content']}" for m in messages) + " [model]"

    first = ollama_requests.generate_request({"model": "m", "prompt": "hi", "system": "S"},
                                             tokens, render)
    assert first.path == "/completion" and first.kind == GENERATE_RAW
    assert first.body["prompt"] == first.context and first.context[0] == 1
    answer = AnswerShaper(first).whole({"content": "yo", "tokens": [50, 51], "stop": True,
                                        "stop_type": "eos", "timings": TIMINGS})
    assert answer["context"] == first.context + [50, 51]
    more = ollama_requests.generate_request(
        {"model": "m", "prompt": "again", "context": answer["context"]}, tokens, render)
    turn = [t for t in tokens(render([{"role": "user", "content": "again"}], {}), True) if t != 1]
    assert more.body["prompt"] == answer["context"] + turn
    assert more.body["prompt"].count(1) == 1  # one BOS, at the start
    # With images or think the server must parse them: the chat route, no context.
    chat = ollama_requests.generate_request({"model": "m", "prompt": "x", "think": True},
                                            tokens, render)
    assert chat.path == "/v1/chat/completions"


def test_format_on_generate_reaches_completion_as_json_schema():
    mapped = ollama_requests.generate_request(
        {"model": "m", "prompt": "x", "format": {"type": "object"}},
        lambda text, special: [1], lambda messages, fields: "t")
    assert mapped.body["json_schema"] == {"type": "object"}
    assert "response_format" not in mapped.body


def test_listings_and_show_read_the_gguf_header(tmp_path):
    """#20.1 and #20.2: architecture, family and parameters from the model file; modified_at
    is the file's time, the same on every call."""
    path = tmp_path / "tiny-Q8_0.gguf"
    write_gguf(path, {"general.architecture": "gemma3", "gemma3.context_length": 32768,
                      "general.name": "Tiny", "tokenizer.ggml.tokens": ["a", "b", "c"]},
               [("w", [640, 1000]), ("b", [640])])
    files = ModelFiles()
    models = {"data": [{"id": str(path), "created": 123, "meta": {"n_params": 641_000,
                                                                  "size": 10, "n_ctx": 512}}]}
    tags = ollama_models.tags_answer(models, files)["models"][0]
    assert tags["details"]["family"] == "gemma3" and tags["details"]["families"] == ["gemma3"]
    assert tags["modified_at"] == ollama_models.tags_answer(models, files)["models"][0][
        "modified_at"]
    assert tags["modified_at"].startswith(time.strftime("%Y", time.gmtime(path.stat().st_mtime)))
    show = ollama_models.show_answer({"model_path": str(path),
                                      "default_generation_settings": {"n_ctx": 512}},
                                     "tiny:latest", files)
    info = show["model_info"]
    assert info["general.architecture"] == "gemma3" and info["gemma3.context_length"] == 512
    assert info["general.parameter_count"] == 640 * 1000 + 640
    assert info["general.name"] == "Tiny" and "tokenizer.ggml.tokens" not in info
    assert show["details"]["family"] == "gemma3" and show["details"]["parameter_size"] == "1M"
    assert show["details"]["quantization_level"] == "Q8_0"


def test_show_without_the_file_still_leads_to_the_context_size():
    show = ollama_models.show_answer({"model_path": "/not/here.gguf",
                                      "default_generation_settings": {"n_ctx": 256}},
                                     "m", ModelFiles())
    info = show["model_info"]
    assert info[f"{info['general.architecture']}.context_length"] == 256
    # A remote server's file is not here: the parameter count comes from its /v1/models,
    # so /api/show says what /api/tags says (issue #20.1).
    models = {"data": [{"id": "/not/here.gguf", "meta": {"n_params": 268_098_176}}]}
    files = ModelFiles()
    files.remember_served("/not/here.gguf", ollama_models.served_meta(models))
    remote = ollama_models.show_answer({"model_path": "/not/here.gguf"}, "m", files)
    listed = ollama_models.tags_answer(models, files)["models"][0]["details"]
    assert remote["details"]["parameter_size"] == listed["parameter_size"] == "268M"
    assert remote["model_info"]["general.parameter_count"] == 268_098_176
    assert ollama_models.served_meta({"data": [{"id": "a", "meta": {"n_params": 1}},
                                               {"id": "b", "meta": {"n_params": 2}}]}) == {}
    first = ollama_models.tags_answer({"data": [{"id": "alias", "meta": {}}]}, files := ModelFiles())
    again = ollama_models.tags_answer({"data": [{"id": "alias", "meta": {}}]}, files)
    assert first["models"][0]["modified_at"] == again["models"][0]["modified_at"]


def write_gguf(path, meta: dict, tensors: list[tuple[str, list[int]]]) -> None:
    """A GGUF v3 header (no weights): enough for the metadata reader."""
    def string(s: str) -> bytes:
        b = s.encode()
        return struct.pack("<Q", len(b)) + b

    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta))
    for key, value in meta.items():
        out += string(key)
        if isinstance(value, str):
            out += struct.pack("<I", 8) + string(value)
        elif isinstance(value, int):
            out += struct.pack("<IQ", 10, value)
        else:
            out += struct.pack("<IIQ", 9, 8, len(value)) + b"".join(string(v) for v in value)
    for name, dims in tensors:
        out += string(name) + struct.pack("<I", len(dims)) + b"".join(
            struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", 0, 0)
    path.write_bytes(out)


def test_ignored_settings_name_the_values_sent():
    """The log names each ignored setting with its value (issue #32: said once per client
    and value), from `options` or from the body itself."""
    body = {"options": {"num_ctx": 8192, "weird": [1, 2]}, "keep_alive": "5m"}
    assert ollama.ignored_settings(body, ["num_ctx", "weird (unknown)", "keep_alive"]) == [
        "num_ctx=8192", "weird=[1, 2] (unknown)", 'keep_alive="5m"']
    assert ollama.ignored_settings("junk", ["num_ctx"]) == ["num_ctx=null"]

