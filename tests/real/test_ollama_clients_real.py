"""Real Ollama clients other than the Python one, against the real llama-server through
slotkeeper (issue #20): the `ollama` JavaScript client from npm (scripts/install-clients) and
LangChain's ChatOllama (PyPI `langchain-ollama`). Each test checks what these clients read and
real Ollama gives; each failed on the main branch before issue #20."""

from __future__ import annotations

import json
import subprocess

import pytest
import requests
from agents import installed_clients
from pydantic import BaseModel
from test_ollama_real import SERVER_FLAGS, TIMEOUT, ollama_proxy, prompt_tokens
from testbed import BED, free_port

HERE = BED
CHATML_TOOLS = HERE / "templates" / "chatml-tools.jinja"
# The chat template that can think: the server's reasoning parser is on for it.
THINKING_FLAGS = ["--chat-template-file", str(CHATML_TOOLS), "--jinja", "--no-repack"]


def run_js(proxy_url: str, model: str) -> dict:
    modules = installed_clients()["ollama-js"]
    done = subprocess.run(["node", str(HERE / "ollama_js_client.mjs"), str(modules), proxy_url,
                           model], capture_output=True, text=True, timeout=TIMEOUT,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_ollama_js_client_reads_what_real_ollama_gives(make_llama, make_proxy):
    """list, show, chat (whole and streamed), generate with context, embed: the fields the JS
    client hands to applications are the ones Ollama fills."""
    server, proxy = ollama_proxy(make_llama, make_proxy, slotkeeper_small_request_chars=0)
    model = "gemma-3-270m-q4_k_m:latest"
    out = run_js(proxy.url, model)

    # #20.2: modified_at is the model's, not the request's.
    first, second = (listing["models"][0] for listing in out["list"])
    assert first["modified_at"] == second["modified_at"]
    # #20.1: the GGUF's architecture and size, the same in list and show.
    assert first["details"]["family"] == "gemma3" and first["details"]["families"] == ["gemma3"]
    show = out["show"]
    info = show["model_info"]
    assert info["general.architecture"] == "gemma3"
    assert info["gemma3.context_length"] == server.ctx_per_slot
    assert info["general.parameter_count"] > 200_000_000
    assert show["details"]["family"] == "gemma3"
    assert show["details"]["parameter_size"] == first["details"]["parameter_size"] == "268M"

    # #20.6: prompt_eval_count is the whole prompt, also when the slot already held it.
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name three colours."}]
    whole_prompt = prompt_tokens(server, messages)
    assert out["chat"]["prompt_eval_count"] == whole_prompt
    assert out["chatStream"][-1]["done"] and out["chatStream"][-1]["prompt_eval_count"] == \
        whole_prompt
    assert "".join(p["message"]["content"] for p in out["chatStream"]) == \
        out["chat"]["message"]["content"]
    slot = requests.get(server.url + "/slots", timeout=10).json()
    processed = [s.get("n_prompt_tokens_processed") for s in slot if s.get("id_task") is not None]
    assert processed and min(processed) < whole_prompt  # the cache did serve part of it

    # #20.5: a templated generate returns a context; sent back, it continues the same prompt.
    gen, more = out["generate"], out["generateMore"]
    assert gen["response"] and gen["context"] and all(isinstance(t, int) for t in gen["context"])
    assert more["context"][:len(gen["context"])] == gen["context"]
    rendered = requests.post(server.url + "/apply-template", timeout=30, json={
        "messages": [{"role": "user", "content": "Count: one two"}]}).json()["prompt"]
    templated = requests.post(server.url + "/tokenize", timeout=30, json={
        "content": rendered, "add_special": True, "parse_special": True}).json()["tokens"]
    assert gen["context"][:len(templated)] == templated
    assert out["generateStream"][-1]["done"] and out["generateStream"][-1]["context"]

    assert len(out["embed"]["embeddings"]) == 2


def test_ollama_js_json_format_with_a_thinking_template(make_llama, make_proxy):
    """#20.4 through the JS client: `format: "json"` with a template that can think, `think`
    absent: the JSON is the content."""
    server = make_llama(extra=THINKING_FLAGS)
    port = free_port()
    proxy = make_proxy(server, port=port, slotkeeper_ollama_port=port)
    script = HERE / "ollama_js_client.mjs"
    modules = installed_clients()["ollama-js"]
    code = (
        "import { pathToFileURL } from 'node:url';"
        f"const {{ Ollama }} = await import(pathToFileURL({json.dumps(str(modules))} + "
        "'/ollama/dist/index.mjs'));"
        f"const c = new Ollama({{ host: {json.dumps(proxy.url)} }});"
        "const r = await c.chat({ model: 'm', format: 'json', stream: false,"
        " options: { temperature: 0, num_predict: 40 },"
        " messages: [{ role: 'user', content: 'Give a JSON object with a key a.' }] });"
        "process.stdout.write(JSON.stringify(r));")
    done = subprocess.run(["node", "--input-type=module", "-e", code], capture_output=True,
                          text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL, cwd=script.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout)
    assert answer["message"]["content"].lstrip().startswith("{")
    assert not answer["message"].get("thinking")


class Colour(BaseModel):
    name: str
    warm: bool


def test_langchain_chat_ollama(make_llama, make_proxy, monkeypatch):
    """LangChain's ChatOllama: multi-turn, streamed, tools bound with two parallel calls to one
    tool answered in order (#20.7), and with_structured_output (#20.4) on a template that can
    think."""
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
    from langchain_ollama import ChatOllama

    monkeypatch.setenv("LLAMA_SERVER_SLOTS_DEBUG", "1")  # /slots then shows each prompt
    server = make_llama(extra=THINKING_FLAGS)
    port = free_port()
    proxy = make_proxy(server, port=port, slotkeeper_ollama_port=port,
                       slotkeeper_small_request_chars=0)
    llm = ChatOllama(model="gemma-3-270m-q4_k_m", base_url=proxy.url, temperature=0,
                     num_predict=8, client_kwargs={"headers": {"X-Session-Id": "lc-1"}})

    history = [SystemMessage("You are terse."), HumanMessage("Say a colour.")]
    first = llm.invoke(history)
    assert isinstance(first, AIMessage) and first.content
    history += [first, HumanMessage("Another one.")]
    streamed = list(llm.stream(history))
    assert streamed and "".join(str(c.content) for c in streamed)
    total = streamed[0]
    for piece in streamed[1:]:
        total += piece
    # The whole prompt (#20.6), though the slot held all but the new turn: the first turn's
    # prompt and answer are in it.
    assert total.usage_metadata["input_tokens"] > first.usage_metadata["input_tokens"] + \
        first.usage_metadata["output_tokens"]

    def get_weather(city: str) -> str:
        """The weather of a city."""
        return "sunny"

    with_tools = llm.bind_tools([get_weather])
    calls = [{"name": "get_weather", "args": {"city": "Paris"}, "id": "call_paris"},
             {"name": "get_weather", "args": {"city": "Oslo"}, "id": "call_oslo"}]
    answer = with_tools.invoke([
        HumanMessage("Weather in Paris and Oslo?"),
        AIMessage("", tool_calls=calls),
        ToolMessage("sunny", tool_call_id="call_paris", name="get_weather"),
        ToolMessage("snowing", tool_call_id="call_oslo", name="get_weather")])
    assert isinstance(answer, AIMessage)
    prompt = _last_prompt(server)
    # chatml-tools.jinja writes "(result of <id>)" after each tool result: each answers its
    # own call, in order (before #20.7 both named the first call).
    paris = prompt.index("sunny (result of ")
    oslo = prompt.index("snowing (result of ")
    first_id = prompt[paris:].split("(result of ", 1)[1].split(")", 1)[0]
    second_id = prompt[oslo:].split("(result of ", 1)[1].split(")", 1)[0]
    assert first_id != second_id

    structured = ChatOllama(model="m", base_url=proxy.url, temperature=0, num_predict=60,
                            ).with_structured_output(Colour, method="json_schema")
    colour = structured.invoke("Name a colour and say whether it is warm.")
    assert isinstance(colour, Colour) and colour.name


def _last_prompt(server) -> str:
    slots = requests.get(server.url + "/slots", timeout=10).json()
    used = [s for s in slots if s.get("id_task") is not None]
    latest = max(used, key=lambda s: s["id_task"])
    return latest["prompt"]
