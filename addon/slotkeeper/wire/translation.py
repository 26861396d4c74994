"""The seam for surfaces that speak another API than llama-server's OpenAI one (Ollama's
`/api/*`, Anthropic's `/v1/messages`).

A surface addon, listed before SlotKeeper, rewrites a request into llama-server's
`/v1/chat/completions` (or another completion path) in its `request` hook and leaves a
`Translation` in `flow.metadata[TRANSLATION_KEY]`. SlotKeeper then routes the rewritten
request like any other and, once it has read llama-server's own answer (its `timings`),
hands the answer to the translation: so routing, pinning and the timings check always see
llama-server's form, and the client always gets its own. The translation is applied whether or
not the request was routed (a pass-through still needs its answer translated)."""

from __future__ import annotations

from typing import Protocol

from mitmproxy import http

TRANSLATION_KEY = "slotkeeper_translation"


class Translation(Protocol):
    def response_headers(self, response: http.Response) -> None:
        """Before any byte of the answer goes to the client: set its status line and headers
        (e.g. `content-type: application/x-ndjson`)."""

    def stream(self, chunk: bytes) -> bytes:
        """A streamed answer: each chunk of llama-server's SSE stream, as it arrives, and b""
        once at its end; returns what the client gets for it (may be b"": SlotKeeper then
        sends nothing, never an empty HTTP chunk)."""

    def whole(self, response: http.Response) -> None:
        """A non-streamed answer (or an error): rewrite `response` in place."""


def translation_of(flow: http.HTTPFlow) -> Translation | None:
    return flow.metadata.get(TRANSLATION_KEY)
