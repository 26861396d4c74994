"""The Ollama surface against the real llama-server, driven by the official `ollama` Python
client (PyPI) through a real mitmdump; and OpenWebUI's Ollama calls replayed as its source
sends them (backend/open_webui/routers/ollama.py: send_post_request, unload_model)."""

from __future__ import annotations

import json
import signal
import subprocess
from typing import Any

import ollama
import pytest
import requests
from testbed import (
    BED,
    ADDON_SCRIPT,
    MITMDUMP,
    LlamaServer,
    Proxy,
    end_process,
    free_port,
    long_system_prompt,
    wait_for_mitmproxy,
)

TEMPLATE = BED / "templates" / "gemma3.jinja"
# --embeddings --pooling mean: /v1/embeddings answers only then (measured on b11434: without
# it 501 "This server does not support embeddings", with the model's pooling 'none' 400);
# chat completions still work beside it. --no-repack: this machine's CPU path for repacked
# weights (AMX) segfaults at the first compute in the b11434 build.
SERVER_FLAGS = ["--chat-template-file", str(TEMPLATE), "--embeddings", "--pooling", "mean",
                "--no-repack"]
TIMEOUT = 600


def ollama_proxy(make_llama, make_proxy, **options: Any) -> tuple[LlamaServer, Proxy]:
    server = make_llama(extra=SERVER_FLAGS)
    port = free_port()
    proxy = make_proxy(server, port=port, slotkeeper_ollama_port=port, **options)
    return server, proxy


def client(proxy: Proxy, **headers: str) -> ollama.Client:
    return ollama.Client(host=proxy.url, headers=headers, timeout=TIMEOUT)


def slots(server: LlamaServer) -> list[dict[str, Any]]:
    return requests.get(server.url + "/slots", timeout=10).json()


def prefilled_tokens(proxy: Proxy | str) -> float:
    """The proxy's count of prefilled prompt tokens so far (its /slotkeeper/metrics). Ollama's
    prompt_eval_count is the whole prompt (issue #20.6), so what was prefilled is read here."""
    url = proxy.url if isinstance(proxy, Proxy) else proxy
    text = requests.get(url + "/slotkeeper/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith('slotkeeper_prompt_tokens_total{kind="prefilled"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def prompt_tokens(server: LlamaServer, messages: list[dict[str, Any]], **extra: Any) -> int:
    """How many tokens the server's template makes of `messages` (its own count)."""
    text = requests.post(server.url + "/apply-template", json={"messages": messages, **extra},
                         timeout=30).json()["prompt"]
    return len(requests.post(server.url + "/tokenize", json={"content": text,
                                                            "add_special": True,
                                                            "parse_special": True},
                             timeout=30).json()["tokens"])


def test_ollama_client_chat_generate_embed_and_listings(make_llama, make_proxy):
    # Every request claims its session's slot, however short (the default leaves prompts
    # under 2000 characters unpinned, as side requests).
    server, proxy = ollama_proxy(make_llama, make_proxy, slotkeeper_small_request_chars=0)
    c = client(proxy, **{"X-Session-Id": "ollama-client-1"})

    # Probes and listings.
    root = requests.get(proxy.url + "/", timeout=10)
    assert root.status_code == 200 and root.text == "Ollama is running"
    assert requests.head(proxy.url + "/", timeout=10).status_code == 200
    version = c._client.get("/api/version").json()["version"]  # the client has no method
    assert all(part.isdigit() for part in version.split("."))
    listed = c.list().models
    assert [m.model for m in listed] == ["gemma-3-270m-q4_k_m:latest"]
    assert listed[0].size and listed[0].size > 100_000_000
    assert listed[0].details.quantization_level == "Q4_K_M"
    name = listed[0].model
    shown = c.show(name)
    assert "completion" in shown.capabilities
    assert shown.modelinfo[f"{shown.modelinfo['general.architecture']}.context_length"] == \
        server.ctx_per_slot
    running = c.ps().models
    assert [m.model for m in running] == [name] and running[0].context_length == \
        server.ctx_per_slot

    # Chat, not streamed and streamed: the final object carries the server's counts.
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name three colours."}]
    whole = c.chat(model=name, messages=messages, stream=False,
                   options={"temperature": 0, "num_predict": 6, "num_ctx": 99999})
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 6
    assert whole.message.role == "assistant" and whole.message.content
    assert whole.prompt_eval_count > 0 and whole.total_duration > whole.eval_duration > 0
    prefilled = prefilled_tokens(proxy)
    parts = list(c.chat(model=name, messages=messages, stream=True,
                        options={"temperature": 0, "num_predict": 6}))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert len(parts) >= 3 and parts[-1].eval_count == 6
    # The same prompt again: the slot already holds it, so (almost) nothing is prefilled;
    # prompt_eval_count is still the whole prompt, as Ollama reports it (issue #20.6).
    assert prefilled_tokens(proxy) - prefilled <= 2
    assert parts[-1].prompt_eval_count == whole.prompt_eval_count
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert "num_ctx" in proxy.log_text()  # ignored, and said so

    # Generate: plain (the chat template applies, `system` included), streamed and not.
    gen = c.generate(model=name, prompt="Say hi.", system="Be brief.", stream=False,
                     options={"temperature": 0, "num_predict": 4})
    assert gen.done and gen.response and gen.eval_count == 4
    streamed = list(c.generate(model=name, prompt="Say hi.", system="Be brief.", stream=True,
                               options={"temperature": 0, "num_predict": 4}))
    assert "".join(p.response for p in streamed) == gen.response and streamed[-1].done

    # Raw generate returns the conversation's tokens; sending them back continues it.
    first = c.generate(model=name, prompt="<start_of_turn>user\nCount: one two",
                       raw=True, stream=False, options={"temperature": 0, "num_predict": 3})
    assert first.context and all(isinstance(t, int) for t in first.context)
    prefilled = prefilled_tokens(proxy)
    more = c.generate(model=name, prompt=" four", context=first.context, stream=False,
                      options={"temperature": 0, "num_predict": 3})
    assert more.context[:len(first.context)] == first.context
    assert len(more.context) > len(first.context) + 3
    # The continued context was in the slot: only the new turn was prefilled (the turn is
    # templated now, issue #20.5: "<start_of_turn>user\n four<end_of_turn>..." is ~10 tokens).
    turn = len(more.context) - more.eval_count - len(first.context)
    assert prefilled_tokens(proxy) - prefilled <= turn + 2
    assert more.prompt_eval_count == len(more.context) - more.eval_count

    # Embeddings, both generations of the route.
    embedded = c.embed(model=name, input=["hello", "world"])
    assert len(embedded.embeddings) == 2 and len(embedded.embeddings[0]) == 640
    assert embedded.embeddings[0] != embedded.embeddings[1]
    assert len(c.embeddings(model=name, prompt="hello").embedding) == 640


def test_tools_and_tool_results_reach_the_template(make_llama, make_proxy):
    """Ollama's tool calls (arguments as an object) and tool results are converted to the
    server's form: the server prefilled exactly as many tokens as its template makes of the
    same conversation written in OpenAI's form by hand (a fresh server: nothing cached), and
    that is more than without the tool turns. gemma-3-270m is too small to call tools itself;
    the answer direction is covered in test_ollama.py."""
    server, proxy = ollama_proxy(make_llama, make_proxy)
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}]
    answer = client(proxy, **{"X-Session-Id": "tools-1"}).chat(
        model="gemma-3-270m-q4_k_m", tools=tools, stream=False,
        options={"temperature": 0, "num_predict": 3}, messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "sunny, 21 C", "tool_name": "get_weather"}])
    assert answer.done
    by_hand = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "x", "type": "function", "function": {
                       "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "x", "content": "sunny, 21 C"}]
    expected = prompt_tokens(server, by_hand, tools=tools)
    assert answer.prompt_eval_count == expected
    assert expected > prompt_tokens(server, by_hand[:1], tools=tools) + 15


def test_bad_requests_get_ollama_errors(make_llama, make_proxy):
    server, proxy = ollama_proxy(make_llama, make_proxy)
    c = client(proxy)
    cases = [
        (lambda: c.chat(model="m", messages=[{"role": "user", "content": "x"}],
                        options={"temperature": "hot"}), 400, "option temperature"),
        (lambda: c.chat(model="m", messages=[{"role": "robot", "content": "x"}]), 400,
         "message role"),
        (lambda: c.generate(model="m", prompt="def f(", suffix="return 1"), 501,
         "Infill is not supported by this model"),  # llama-server's own answer, reshaped
        (lambda: c.pull("m"), 501, "not supported"),
    ]
    for call, status, text in cases:
        with pytest.raises(ollama.ResponseError) as e:
            result = call()
            if not isinstance(result, ollama.ChatResponse | ollama.GenerateResponse):
                list(result)  # a stream raises when iterated
        assert e.value.status_code == status and text in e.value.error, e.value
    r = requests.post(proxy.url + "/api/chat", data=b"{not json", timeout=10)
    assert r.status_code == 400 and "not JSON" in r.json()["error"]
    r = requests.get(proxy.url + "/api/chat", timeout=10)
    assert r.status_code == 405 and set(r.json()) == {"error"}
    assert "Traceback" not in proxy.log_text()


def test_ollama_sessions_prefill_only_their_new_tokens(make_llama, make_proxy):
    """Four chats sharing a long system prompt, turns interleaved, each through its own
    Ollama client with OpenWebUI's chat-id header: every later turn prefills (the proxy's
    prefilled-token count, from the server's prompt_n) only about its new tokens, which the
    server's own tokenizer counts from the growing conversation; prompt_eval_count is the
    whole conversation, as Ollama reports it."""
    server, proxy = ollama_proxy(make_llama, make_proxy)
    system = long_system_prompt(600, seed=3)
    chats = {f"owui-chat-{i}": [{"role": "system", "content": system}] for i in range(4)}
    clients = {chat_id: client(proxy, **{"X-OpenWebUI-Chat-Id": chat_id}) for chat_id in chats}
    questions = ["Name a colour.", "Name an animal of that colour.", "Where does it live?"]
    sizes: dict[str, list[int]] = {chat_id: [] for chat_id in chats}
    for turn, question in enumerate(questions):
        for chat_id, messages in chats.items():
            messages.append({"role": "user", "content": f"({chat_id}) {question}"})
            before = prefilled_tokens(proxy)
            answer = clients[chat_id].chat(model="gemma-3-270m-q4_k_m", messages=messages,
                                           stream=turn % 2 == 0,
                                           options={"temperature": 0, "num_predict": 8})
            if turn % 2 == 0:
                answer = list(answer)
                text = "".join(p.message.content for p in answer)
                answer = answer[-1]
            else:
                text = answer.message.content
            total = prompt_tokens(server, messages)
            assert answer.prompt_eval_count == total
            if turn:
                new = total - sizes[chat_id][-1]
                prefilled = prefilled_tokens(proxy) - before
                assert prefilled <= 1.1 * new + 2, (chat_id, turn, new, prefilled)
            sizes[chat_id].append(total)
            messages.append({"role": "assistant", "content": text})
    # Without pinning the server re-prefills the conversation past the shared system prompt
    # (measured: 451 tokens where 150 were new); here each turn costs only its new tokens,
    # and the proxy's sessions are the chat ids.
    current = requests.get(proxy.url + "/api/sessions/current", timeout=10).json()
    owners = json.dumps(current)
    assert all(chat_id in owners for chat_id in chats)


def test_openwebui_request_sequence_replayed(make_llama, make_proxy):
    """OpenWebUI (not installable here) replayed from its source: /api/version and /api/tags
    and /api/ps, then /api/chat streamed with its forwarded user-info headers and the chat id,
    a short title request with the same chat id, and its unload (keep_alive 0, empty
    prompt), which must not reach llama-server."""
    server, proxy = ollama_proxy(make_llama, make_proxy)
    user = {"Content-Type": "application/json", "X-OpenWebUI-User-Name": "Ada",
            "X-OpenWebUI-User-Id": "u-1", "X-OpenWebUI-User-Email": "ada@example.org",
            "X-OpenWebUI-User-Role": "admin"}
    assert requests.get(proxy.url + "/api/version", headers=user, timeout=10).ok
    model = requests.get(proxy.url + "/api/tags", headers=user,
                         timeout=10).json()["models"][0]["model"]
    assert requests.get(proxy.url + "/api/ps", headers=user, timeout=10).json()["models"]
    chat = {**user, "X-OpenWebUI-Chat-Id": "3f2a-owui-chat"}
    body = {"model": model, "stream": True, "options": {"temperature": 0, "num_predict": 5},
            "messages": [{"role": "system", "content": long_system_prompt(500, seed=5)},
                         {"role": "user", "content": "Hello!"}]}
    with requests.post(proxy.url + "/api/chat", data=json.dumps(body), headers=chat,
                       stream=True, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "application/x-ndjson"
        assert r.headers["X-Slotkeeper-Session"] == "3f2a-owui-chat"
        assert r.headers["X-Slotkeeper-Source"] == "header x-openwebui-chat-id"
        owned = r.headers["X-Slotkeeper-Slot"]
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1]["done"] and not any(line["done"] for line in lines[:-1])
    title = {"model": model, "stream": False, "options": {"num_predict": 5}, "messages": [
        {"role": "user", "content": "Create a concise title for: Hello!"}]}
    r = requests.post(proxy.url + "/api/chat", data=json.dumps(title), headers=chat,
                      timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["done"]
    assert r.headers["X-Slotkeeper-Action"] == "side"  # short: it does not take the slot
    assert r.headers["X-Slotkeeper-Slot"] != owned
    before = [(s["id"], s.get("id_task")) for s in slots(server)]
    r = requests.post(proxy.url + "/api/generate", headers=user, timeout=10,
                      data=json.dumps({"model": model, "keep_alive": 0, "prompt": ""}))
    assert r.status_code == 200 and r.json()["done_reason"] == "unload"
    assert [(s["id"], s.get("id_task")) for s in slots(server)] == before


def test_main_port_and_ollama_port_in_one_mitmdump(make_llama, tmp_path):
    """mitm.conf's setup: two reverse modes to one server. `/` says "Ollama is running" only
    on the Ollama port (the main port still reaches llama-server's own page); /api/chat works
    on both, with one slot space."""
    server = make_llama(extra=SERVER_FLAGS)
    main, ollama_port = free_port(), free_port()
    log = tmp_path / "mitmdump.log"
    cmd = [str(MITMDUMP), "-s", str(ADDON_SCRIPT), "--set", "listen_host=127.0.0.1",
           "--set", f"confdir={tmp_path / 'conf'}",
           "--set", f"slotkeeper_state_file={tmp_path / 'state.json'}",
           "--set", f"slotkeeper_ollama_port={ollama_port}",
           "--mode", f"reverse:{server.url}@{main}",
           "--mode", f"reverse:{server.url}@{ollama_port}"]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        for port in (main, ollama_port):
            wait_for_mitmproxy(proc, port, log, 30)
        assert requests.get(f"http://127.0.0.1:{ollama_port}/", timeout=10).text == \
            "Ollama is running"
        assert requests.get(f"http://127.0.0.1:{main}/", timeout=10).text != \
            "Ollama is running"
        actions = []
        for port in (ollama_port, main):
            c = ollama.Client(host=f"http://127.0.0.1:{port}",
                              headers={"X-Session-Id": "both-ports"}, timeout=TIMEOUT)
            before = prefilled_tokens(f"http://127.0.0.1:{main}")
            c.chat(model="m", stream=False, options={"num_predict": 2}, messages=[
                {"role": "system", "content": long_system_prompt(400, seed=8)},
                {"role": "user", "content": "hi"}])
            actions.append(prefilled_tokens(f"http://127.0.0.1:{main}") - before)
        assert actions[1] <= 2  # the second port's request found the first one's slot
    finally:
        end_process(proc, signal.SIGINT)


def test_embeddings_between_turns_keep_the_session_cache(make_llama, make_proxy):
    """Embedding requests are not routed (the server places them): on a 2-slot server they run
    in both slots (/slots says so), yet the chat's next turn still prefills only its new
    tokens (measured: 16 after 425 at the first turn)."""
    server = make_llama(np=2, ctx=8192, extra=SERVER_FLAGS)
    proxy = make_proxy(server)
    c = client(proxy, **{"X-Session-Id": "embed-and-chat"})
    messages = [{"role": "system", "content": long_system_prompt(400, seed=1)}]
    prefilled = []
    for turn, question in enumerate(["Name a colour.", "And an animal?", "Where?"]):
        messages.append({"role": "user", "content": question})
        before = prefilled_tokens(proxy)
        reply = c.chat(model="m", messages=messages, stream=False,
                       options={"num_predict": 6, "temperature": 0})
        messages.append({"role": "assistant", "content": reply.message.content})
        prefilled.append(prefilled_tokens(proxy) - before)
        if turn == 1:
            for i in range(4):
                assert c.embed(model="m", input=[f"text number {i} " * 20]).embeddings
            embed_tokens = {s.get("n_prompt_tokens") for s in slots(server)}
            assert len(embed_tokens) == 1 and embed_tokens != {prefilled[0]}
    assert prefilled[0] > 300 and prefilled[2] < 40, prefilled


def test_an_ignored_setting_is_logged_once_per_client_and_value(make_llama, make_proxy):
    """An Ollama client that sends `options.num_ctx` on every request (LangChain's ChatOllama
    and OpenWebUI do) gets one log line for it, not one a request (issue #32); a new value is
    said again, and so is the same value from another client."""
    server, proxy = ollama_proxy(make_llama, make_proxy)
    messages = [{"role": "user", "content": "Say hi."}]
    options = {"temperature": 0, "num_predict": 2, "num_ctx": 8192}
    first = client(proxy)
    for _ in range(10):
        assert first.chat(model="gemma", messages=messages, options=options).done
    log = proxy.log_text()
    assert log.count("num_ctx=8192") == 1, log
    first.chat(model="gemma", messages=messages, options={**options, "num_ctx": 4096})
    other = requests.post(proxy.url + "/api/chat", timeout=TIMEOUT,  # another client's agent
                          headers={"User-Agent": "another-client/1.0"},
                          json={"model": "gemma", "messages": messages, "options": options,
                                "stream": False})
    assert other.status_code == 200, other.text
    log = proxy.log_text()
    assert log.count("num_ctx=4096") == 1 and log.count("num_ctx=8192") == 2, log
