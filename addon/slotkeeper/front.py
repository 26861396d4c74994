"""The front door: slotkeeper's one `request` hook. Each request goes to the addons that act
on a request, in order (the surfaces that rewrite their API into llama-server's, the keeper
that routes a completion, the session API and the metrics that answer their own paths), each
through its `on_request`, as mitmproxy would dispatch their own `request` hooks.

Why one hook and not five: mitmproxy's dispatch costs each request something for every hook
an addon has, before the hook does anything (the hook's arguments are rebuilt per hook, its
result inspected), and most requests concern one addon at most. One hook in place of five cut
7-12 µs per kept request in-process (docs/BENCHMARKS.md, section 3). Like mitmproxy with a
script's addons, an exception in one addon ends the hook for the addons after it (mitmproxy
logs it), and each addon skips a request another one already answered (`flow.response`)."""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import Protocol

from mitmproxy import http


class RequestHandler(Protocol):
    def on_request(self, flow: http.HTTPFlow) -> Awaitable[None] | None: ...


class Front:
    def __init__(self, handlers: Sequence[RequestHandler]) -> None:
        self.handlers = tuple(handlers)

    async def request(self, flow: http.HTTPFlow) -> None:
        for handler in self.handlers:
            pending = handler.on_request(flow)
            if pending is not None:
                await pending
