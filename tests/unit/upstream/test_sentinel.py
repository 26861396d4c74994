"""The sentinel against a FAKE server (an asyncio socket server answering /health the way
llama-server does): it holds one probed connection while no request is in flight, none while
one is, and reports a connection the server closed without saying so."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from slotkeeper.upstream import sentinel
from slotkeeper.upstream.sentinel import InFlight, Sentinel

HEALTH = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n"
          b'{"status":"ok"}')


class FakeHealthServer:
    """FAKE llama-server: answers every `GET /health` on a connection until told to drop them
    all (as a dying process does) or until the client closes it."""

    def __init__(self) -> None:
        self.opened = 0
        self.closed_by_client = 0
        self.probes = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    @property
    def open_now(self) -> int:
        return len(self._writers)

    def drop_all(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()

    async def stop(self) -> None:
        self.drop_all()
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.opened += 1
        self._writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"GET /health ")
                self.probes += 1
                writer.write(HEALTH)
                await writer.drain()
        except asyncio.IncompleteReadError:
            self.closed_by_client += 1
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._writers.discard(writer)


async def until(check, seconds: float = 3.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not check():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def watching(flights: InFlight, busy_from_start: bool = False
                   ) -> AsyncIterator[tuple[FakeHealthServer, str, list]]:
    """A fake server watched by a sentinel; yields the server, its URL and the losses seen."""
    fake, lost = FakeHealthServer(), []
    url = await fake.start()
    if busy_from_start:
        flights.started(url)
    guard = Sentinel(lost.append, flights)
    try:
        guard.watch([url])
        yield fake, url, lost
    finally:
        guard.stop()
        await fake.stop()


@pytest.fixture
def fast_probes(monkeypatch):
    monkeypatch.setattr(sentinel, "PROBE_SECONDS", 0.05)
    monkeypatch.setattr(sentinel, "RETRY_SECONDS", 0.05)


def test_in_flight_counts_per_server():
    async def run() -> list[bool]:
        flights = InFlight()
        seen = [flights.busy("a")]
        flights.started("a")
        flights.started("a")
        flights.ended("a")
        seen += [flights.busy("a"), flights.busy("b")]
        flights.ended("a")
        seen.append(flights.busy("a"))
        flights.ended("a")  # an extra end never makes a count negative
        flights.started("a")
        seen.append(flights.busy("a"))
        return seen

    assert asyncio.run(run()) == [False, True, False, False, True]


def test_connection_held_while_idle_and_closed_while_a_request_is_in_flight(fast_probes):
    async def run() -> None:
        flights = InFlight()
        async with watching(flights) as (fake, url, lost):
            await until(lambda: fake.probes >= 2)  # held and probed while idle
            flights.started(url)
            await until(lambda: fake.open_now == 0)
            probes = fake.probes
            await asyncio.sleep(0.3)  # several probe periods: nothing is asked while busy
            assert (fake.probes, fake.opened, fake.closed_by_client) == (probes, 1, 1)
            flights.ended(url)
            await until(lambda: fake.opened == 2 and fake.probes > probes)
            assert lost == []  # closing it ourselves is not a restart

    asyncio.run(run())


def test_a_connection_the_server_drops_is_reported(fast_probes):
    async def run() -> None:
        async with watching(InFlight()) as (fake, url, lost):
            await until(lambda: fake.open_now == 1)
            fake.drop_all()
            await until(lambda: lost == [url])
            await until(lambda: fake.open_now == 1)  # and it watches the server again

    asyncio.run(run())


def test_a_server_dropping_everything_while_busy_reports_nothing(fast_probes):
    """While a request is in flight, that request's own end shows a restart (the addon marks
    the server suspect on an answer that never came or broke off); the sentinel has nothing
    open to lose."""
    async def run() -> None:
        flights = InFlight()
        async with watching(flights, busy_from_start=True) as (fake, url, lost):
            await asyncio.sleep(0.2)
            assert fake.opened == 0
            fake.drop_all()
            flights.ended(url)
            await until(lambda: fake.probes >= 1)
            assert lost == []

    asyncio.run(run())
