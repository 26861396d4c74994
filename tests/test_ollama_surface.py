"""The OllamaSurface addon's own answers and rewrites, on mitmproxy test flows (no server).
Answers that need llama-server are tested in test_ollama_real.py."""

from __future__ import annotations

import asyncio
import json

from mitmproxy.test import taddons, tflow, tutils

from slotkeeper.ollama_surface import OllamaSurface
from slotkeeper.translation import TRANSLATION_KEY


class _Keeper:
    max_body_bytes = 32 * 1024 * 1024


def run(surface: OllamaSurface, method: str, path: str, body: object = None,
        port: int = 11434, raw: bytes | None = None):
    request = tutils.treq(method=method.encode(), path=path.encode(),
                          content=raw if raw is not None else
                          (json.dumps(body).encode() if body is not None else b""))
    flow = tflow.tflow(req=request)
    flow.client_conn.sockname = ("127.0.0.1", port)
    pending = surface.request(flow)  # as mitmproxy calls a hook: await what it returns
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
