"""A streamed answer stays in its flow when the client leaves before the stream's end.

mitmproxy keeps a streamed body (`store_streamed_bodies`) only once the server's end of the
message arrives. Clients often leave a moment before that: they close the connection as soon
as they have the final event (`data: [DONE]`, Codex exec on `response.completed`), while the
server's chunked terminator is still in flight. The flow then ends as "client disconnected"
with no body, and mitmweb shows "Content is missing." for an answer the client got whole
(seen once in a CI run). This addon keeps a copy of what was sent and puts it on such a flow."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from mitmproxy import ctx, http

KEY = "slotkeeper_streamed"  # flow.metadata, while the answer streams (removed before saving)

Stream = Callable[[bytes], bytes | Iterable[bytes]]


class StreamCopy:
    """`flow.response.stream` that passes chunks on as the stream it wraps does, and keeps
    what the client was sent."""

    def __init__(self, stream: Stream | None) -> None:
        self._stream = stream
        self._parts: list[bytes] = []

    def __call__(self, chunk: bytes) -> list[bytes]:
        out = chunk if self._stream is None else self._stream(chunk)
        parts = [out] if isinstance(out, bytes) else list(out)
        # An empty bytes would go out as the chunked terminator: drop it, as mitmproxy does
        # for the b"" a stream returns at the end.
        parts = [part for part in parts if part]
        self._parts.extend(parts)
        return parts

    def body(self) -> bytes:
        return b"".join(self._parts)


class StreamedBodies:
    """Comes after every addon that sets `flow.response.stream`, so it wraps the last one."""

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        response = flow.response
        if response is None or not response.stream or not ctx.options.store_streamed_bodies:
            return
        copy = StreamCopy(response.stream if callable(response.stream) else None)
        response.stream = copy
        flow.metadata[KEY] = copy

    def response(self, flow: http.HTTPFlow) -> None:
        flow.metadata.pop(KEY, None)  # mitmproxy has the whole body itself

    def error(self, flow: http.HTTPFlow) -> None:
        copy: StreamCopy | None = flow.metadata.pop(KEY, None)
        if copy is not None and flow.response is not None and flow.response.raw_content is None:
            flow.response.raw_content = copy.body()
