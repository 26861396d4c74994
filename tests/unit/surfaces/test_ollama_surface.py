"""The OllamaSurface addon's own answers and rewrites, on mitmproxy test flows (no server).
Answers that need llama-server are tested in test_ollama_real.py."""

from __future__ import annotations

import asyncio
import json

from mitmproxy.test import taddons, tflow, tutils

from slotkeeper.guard import cors
from slotkeeper.surfaces.ollama_surface import OllamaSurface
from slotkeeper.wire.translation import TRANSLATION_KEY


class _Keeper:
    max_body_bytes = 32 * 1024 * 1024


def run(surface: OllamaSurface, method: str, path: str, body: object = None,
        port: int = 11434, raw: bytes | None = None, headers: dict | None = None):
    request = tutils.treq(method=method.encode(), path=path.encode(),
                          content=raw if raw is not None else
                          (json.dumps(body).encode() if body is not None else b""))
    for name, value in (headers or {}).items():
        request.headers[name] = value
    flow = tflow.tflow(req=request)
    flow.client_conn.sockname = ("127.0.0.1", port)
    pending = surface.on_request(flow)  # as mitmproxy calls a hook: await what it returns
    if pending is not None:
        asyncio.run(pending)
    return flow


def test_surface_answers_and_rewrites():
    surface = OllamaSurface(_Keeper())
    with taddons.context(surface) as tctx:
        tctx.configure(surface, slotkeeper_ollama_port=11434)
        root = run(surface, "GET", "/")
        assert root.response.status_code == 200 and root.response.text == "Ollama is running"
        # `/` on another port is llama-server's own page: left alone.
        assert run(surface, "GET", "/", port=8000).response is None
        version = run(surface, "GET", "/api/version").response
        assert json.loads(version.content)["version"].count(".") == 2
        unload = run(surface, "POST", "/api/generate",
                     {"model": "m", "keep_alive": 0, "prompt": ""}).response
        assert json.loads(unload.content)["done_reason"] == "unload"
        chat = run(surface, "POST", "/api/chat",
                   {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert chat.response is None and chat.request.path == "/v1/chat/completions"
        assert json.loads(chat.request.content)["stream"] is True
        assert TRANSLATION_KEY in chat.metadata
        tags = run(surface, "GET", "/api/tags")
        assert tags.request.path == "/v1/models" and TRANSLATION_KEY in tags.metadata
        show = run(surface, "POST", "/api/show", {"model": "m"})
        assert show.request.method == "GET" and show.request.path == "/props"
        # slotkeeper's own API and unknown paths are not Ollama's.
        sessions = run(surface, "GET", "/api/sessions/current")
        assert sessions.response is None and sessions.request.path == "/api/sessions/current"
        assert run(surface, "GET", "/v1/models").metadata.get(TRANSLATION_KEY) is None


def test_surface_errors_have_ollamas_shape():
    surface = OllamaSurface(_Keeper())
    with taddons.context(surface) as tctx:
        tctx.configure(surface, slotkeeper_ollama_port=11434)
        cases = [
            (run(surface, "GET", "/api/chat"), 405),
            (run(surface, "POST", "/api/chat", raw=b"{nope"), 400),
            (run(surface, "POST", "/api/chat", raw=b"[" * 5000 + b"]" * 5000), 400),
            (run(surface, "POST", "/api/chat", {"model": "m", "messages": [{"role": 1}]}), 400),
            (run(surface, "POST", "/api/pull", {"model": "m"}), 501),
            (run(surface, "POST", "/api/embed", {"model": "m", "input": 5}), 400),
        ]
        for flow, status in cases:
            assert flow.response.status_code == status
            assert set(json.loads(flow.response.content)) == {"error"}


def test_cors_preflight_is_answered_as_ollama_does():
    """#20.3: a browser's preflight from a loopback origin gets 204 and the CORS headers; from
    another origin 403; the answer itself carries Access-Control-Allow-Origin."""
    surface = OllamaSurface(_Keeper())
    with taddons.context(surface) as tctx:
        tctx.configure(surface, slotkeeper_ollama_port=11434)
        for origin, status in (("http://localhost:3000", 204), ("http://127.0.0.1", 204),
                               ("app://obsidian.md", 204), ("https://evil.example", 403)):
            flow = run(surface, "OPTIONS", "/api/chat", headers={
                "Origin": origin, "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type"})
            assert flow.response.status_code == status, origin
            allowed = flow.response.headers.get("access-control-allow-origin")
            assert allowed == (origin if status == 204 else None)
            if status == 204:
                assert "POST" in flow.response.headers["access-control-allow-methods"]
                assert "Content-Type" in flow.response.headers["access-control-allow-headers"]
        version = run(surface, "GET", "/api/version", headers={"Origin": "http://localhost:5173"})
        # The keeper's responseheaders puts them on (every answer meets that hook).
        cors.put_answer_headers(version.response.headers, version.metadata[cors.ANSWER_KEY])
        assert version.response.headers["access-control-allow-origin"] == "http://localhost:5173"
        foreign = run(surface, "GET", "/api/version", headers={"Origin": "https://evil.example"})
        cors.put_answer_headers(foreign.response.headers, foreign.metadata[cors.ANSWER_KEY])
        assert "access-control-allow-origin" not in foreign.response.headers


def test_cors_decision_is_an_input():
    assert cors.preflight("https://evil.example", lambda origin: True)[0] == 204
    assert cors.preflight("http://localhost", lambda origin: False) == (403, {})
    assert not cors.loopback_origin("http://localhost.evil.example")
    assert cors.loopback_origin("http://[::1]:8080")


def test_a_body_over_the_limit_is_answered_413_in_ollamas_shape():
    keeper = _Keeper()
    keeper.max_body_bytes = 10
    surface = OllamaSurface(keeper)
    with taddons.context(surface) as tctx:
        tctx.configure(surface, slotkeeper_ollama_port=11434)
        flow = run(surface, "POST", "/api/chat",
                   {"model": "m", "messages": [{"role": "user", "content": "a long one"}]})
        assert flow.response.status_code == 413
        assert set(json.loads(flow.response.content)) == {"error"}


def test_the_rewritten_body_is_handed_to_slotkeeper_parsed():
    """#18.3: one body read: SlotKeeper takes the surface's parsed body, not a second parse."""
    from slotkeeper.wire import bodies
    surface = OllamaSurface(_Keeper())
    with taddons.context(surface) as tctx:
        tctx.configure(surface, slotkeeper_ollama_port=11434)
        flow = run(surface, "POST", "/api/chat",
                   {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        text, data = flow.metadata[bodies.PARSED_KEY]
        assert text == flow.request.raw_content and json.loads(text) == data
