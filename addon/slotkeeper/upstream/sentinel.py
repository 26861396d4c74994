"""A restarted llama-server noticed the moment it goes, at no cost to any request (issue #32).

One keep-alive connection to each server, watched all the time and probed with `GET /health`
every 2 s, so that the server never closes it as idle (cpp-httplib does after 5 s). A server
process that dies closes it at once, however fast it comes back: the connection ending
without the server saying so (`Connection: close`, which cpp-httplib
sends on the last answer a connection may carry) means the server may be a new one, with
empty slots. The health poll alone missed a restart that fell between two polls (a kept turn
then went to an empty slot and was prefilled in full, its snapshot unused).

While slotkeeper has a routed request in flight to a server (`InFlight`), the sentinel holds no
connection to it: a server that dies then fails that request, whose end marks it suspect (the
addon's `suspect_after_error`), and the connection is opened again the moment the last request
ends, far inside the second a restart takes. Why: with the sentinel probing through the
mixed-agents bench the server prefilled 1.11x slower than behind the best baseline; closed
while requests are in flight, 1.008x (docs/BENCHMARKS.md section 7).

Event-loop code only: a probe is a few bytes on an open connection, no thread."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

log = logging.getLogger("slotkeeper")

# A close is seen the moment it happens whatever this is; it only has to stay under the
# server's 5 s keep-alive timeout. Every 0.5 s, the whole proxy took 0.13-0.18 ms more CPU per
# request than the addon before it in the overhead benchmark; every 2 s, 0.05-0.10 ms
# (docs/BENCHMARKS.md section 3, "The layers").
PROBE_SECONDS = 2.0
RETRY_SECONDS = 0.5
ANSWER_TIMEOUT_SECONDS = 10.0  # a /health answer held longer than this: probe afresh


class ConnectionLost(Exception):
    """The server closed the connection without saying it would."""


class InFlight:
    """How many of slotkeeper's requests are in flight to each server (base URL), with an
    event for each way the count may turn. Event-loop code only."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._events: dict[str, tuple[asyncio.Event, asyncio.Event]] = {}  # (idle, busy)

    def started(self, url: str) -> None:
        self._counts[url] = self._counts.get(url, 0) + 1
        idle, busy = self._events_of(url)
        idle.clear()
        busy.set()

    def ended(self, url: str) -> None:
        left = self._counts.pop(url, 0) - 1
        if left > 0:
            self._counts[url] = left
            return
        idle, busy = self._events_of(url)
        busy.clear()
        idle.set()

    def busy(self, url: str) -> bool:
        return url in self._counts

    async def until_idle(self, url: str) -> None:
        await self._events_of(url)[0].wait()

    async def until_busy(self, url: str) -> None:
        await self._events_of(url)[1].wait()

    def _events_of(self, url: str) -> tuple[asyncio.Event, asyncio.Event]:
        events = self._events.get(url)
        if events is None:
            events = self._events[url] = (asyncio.Event(), asyncio.Event())
            events[1 if self.busy(url) else 0].set()
        return events


class Sentinel:
    """Watches each base URL given to `watch` until `stop`; calls `on_lost(url)` from the event
    loop each time the server may have restarted (its connection lost, or refused). Holds no
    connection to a server while `in_flight` has a request to it."""

    def __init__(self, on_lost: Callable[[str], None], in_flight: InFlight) -> None:
        self._on_lost = on_lost
        self._in_flight = in_flight
        self._tasks: dict[str, asyncio.Task] = {}

    def watch(self, urls: Iterable[str]) -> None:
        for url in urls:
            if url not in self._tasks and urlsplit(url).scheme == "http":
                self._tasks[url] = asyncio.get_running_loop().create_task(self._guard(url))

    def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()

    async def _guard(self, url: str) -> None:
        parts = urlsplit(url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        while True:
            await self._in_flight.until_idle(url)
            try:
                reader, writer = await asyncio.open_connection(host, port)
            except OSError:  # down: the health poll says so too; this keeps trying
                await asyncio.sleep(RETRY_SECONDS)
                continue
            try:
                await self._probe_while_idle(url, reader, writer, f"{host}:{port}")
            except (ConnectionLost, OSError, asyncio.IncompleteReadError, ValueError):
                log.info("%s: its connection closed: slots will be verified", url)
                self._on_lost(url)
            except TimeoutError:
                pass  # a slow answer is not a restart: open a fresh connection
            finally:
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()

    async def _probe_while_idle(self, url: str, reader: asyncio.StreamReader,
                                writer: asyncio.StreamWriter, host: str) -> None:
        """Probes until the connection ends, or returns (closing it quietly) the moment a
        request to the server starts."""
        if self._in_flight.busy(url):
            return
        probe = asyncio.ensure_future(_probe_until_closed(reader, writer, host))
        started = asyncio.ensure_future(self._in_flight.until_busy(url))
        try:
            await asyncio.wait({probe, started}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            started.cancel()
            if not probe.done():
                probe.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await probe
        if not probe.cancelled():
            probe.result()  # a lost connection raises here


async def _probe_until_closed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                              host: str) -> None:
    """Returns when the server said it closes the connection; raises ConnectionLost when it
    closed it without saying so."""
    request = (f"GET /health HTTP/1.1\r\nHost: {host}\r\nUser-Agent: slotkeeper\r\n\r\n"
               ).encode()
    while True:
        writer.write(request)
        await writer.drain()
        closing = await asyncio.wait_for(_read_answer(reader), ANSWER_TIMEOUT_SECONDS)
        if closing:
            return
        try:  # idle until the next probe, unless the server closes the connection first
            extra = await asyncio.wait_for(reader.read(1), PROBE_SECONDS)
        except TimeoutError:
            continue
        raise ConnectionLost("closed" if not extra else "unasked bytes")


async def _read_answer(reader: asyncio.StreamReader) -> bool:
    """Reads one answer; True when the server will close the connection after it."""
    head = await reader.readuntil(b"\r\n\r\n")
    headers = {}
    for line in head.decode("latin-1").split("\r\n")[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = headers.get("content-length")
    if length is None:
        raise ConnectionLost("an answer without a length")  # never llama-server's /health
    await reader.readexactly(int(length))
    return headers.get("connection", "").lower() == "close"
