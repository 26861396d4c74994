"""Background work of the addon on the event loop, each started by `running`/`configure` and
stopped by `done` (a script reload leaves nothing behind): the health watcher that polls every
upstream and keeps a sentinel connection to each, and the idle-save timers that save a session
a few seconds after its last request. Blocking calls go to the executor they are given."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Executor

from .store.state import StoreUnavailable
from .upstream.models import split_key
from .upstream.sentinel import InFlight, Sentinel

log = logging.getLogger("slotkeeper")

HEALTH_POLL_SECONDS = 0.5


class HealthWatcher:
    """Poll /health of every upstream seen so far. A failure (down, or 503 while loading a
    model) means it may come back as a fresh server with empty slots: mark it suspect, so
    the next request verifies /slots before trusting a slot to still hold a session.
    Measured: a restart of the test server takes over a second, so 0.5 s polls see it; one
    that falls between two polls is seen by the sentinel (upstream/sentinel.py), whose
    connection to the server ends the moment the server does."""

    def __init__(self, router: Callable[[], object], executor: Executor) -> None:
        self._router = router  # the current router.Router, or None (replaced on configure)
        self._executor = executor
        self._task: asyncio.Task | None = None
        self._in_flight = InFlight()
        self._sentinel = Sentinel(self._lost, self._in_flight)

    def start(self) -> None:
        self.stop()
        self._task = asyncio.get_running_loop().create_task(self._watch())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._sentinel.stop()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_POLL_SECONDS)
            router = self._router()
            if router is not None:
                self._sentinel.watch({split_key(url)[0] for url, _ in router.upstreams.known()})
                await self.poll_once(router)

    def request_started(self, upstream: str) -> None:
        """A routed request went out to `upstream`: its server's sentinel connection closes
        until the last such request ends (upstream/sentinel.py says why)."""
        self._in_flight.started(split_key(upstream)[0])

    def request_ended(self, upstream: str) -> None:
        self._in_flight.ended(split_key(upstream)[0])

    def _lost(self, base_url: str) -> None:
        """The server at `base_url` may have restarted: every upstream key on it (each model
        behind a router) is verified before a request trusts its slots again."""
        router = self._router()
        for url, _ in router.upstreams.known() if router is not None else ():
            if split_key(url)[0] == base_url:
                router.upstreams.mark_suspect(url)

    async def poll_once(self, router) -> None:
        pool = set(router.config.upstreams)
        for url, info in router.upstreams.known():
            if info.healthy and info.answered_within(HEALTH_POLL_SECONDS):
                # It answered a request since the last round: up. A restart keeps a server
                # down for over a second (measured), so a later round, with no answer in the
                # half second before it, still asks it and sees the gap.
                continue
            if url not in pool and info.suspect:
                continue
            healthy = await self._healthy(url, info)
            if url in pool:
                # A pool member is polled whatever its state: down, it is taken out of
                # placement; answering again, it is put back (and verified first).
                if router.upstreams.set_health(url, healthy):
                    log.warning("%s: answering again: back in the pool" if healthy
                                else "%s: /health failed: taken out of the pool", url)
            elif not healthy:
                log.info("%s: /health failed; slots will be verified", url)
                router.upstreams.mark_suspect(url)

    async def _healthy(self, url: str, info) -> bool:
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor,
                                                                    info.client.healthy)
        except Exception:  # the watcher must outlive any one failure (fault 6)
            log.exception("%s: health check failed unexpectedly", url)
            return False


class IdleSaves:
    """One timer per session, not per request: it fires `seconds` after the session's last
    request ended (re-arming itself while requests keep coming), then asks the router to save
    what the session grew (and take a seed its answer left waiting)."""

    def __init__(self, router: Callable[[], object], executor: Executor) -> None:
        self._router = router
        self._executor = executor
        self.seconds = 5
        self._timers: dict[tuple[str, str], asyncio.TimerHandle] = {}
        self._ended: dict[tuple[str, str], float] = {}

    def schedule(self, url: str, session: str, ended: float) -> None:
        key = (url, session)
        self._ended[key] = ended
        if key not in self._timers:
            self._timers[key] = asyncio.get_running_loop().call_later(
                self.seconds, self._fired, key)

    def _fired(self, key: tuple[str, str]) -> None:
        router = self._router()
        ended = self._ended.get(key, 0.0)
        left = ended + self.seconds - (router.clock() if router else ended)
        if router is not None and left > 0.05:
            self._timers[key] = asyncio.get_running_loop().call_later(left, self._fired, key)
            return
        self._timers.pop(key, None)
        self._ended.pop(key, None)
        if router is not None:
            loop = asyncio.get_running_loop()
            self._executor.submit(self._save, loop, router, key, ended)

    def _save(self, loop: asyncio.AbstractEventLoop, router, key: tuple[str, str],
              ended: float) -> None:
        """On a worker. A save put off (another slot generating, the stall over its budget)
        is tried again an idle period later, unless the session came back meanwhile."""
        if _logged(router.when_idle, key[0], key[1], ended) is None:
            loop.call_soon_threadsafe(self._again, key, ended)

    def _again(self, key: tuple[str, str], ended: float) -> None:
        if key not in self._timers:
            self._ended[key] = ended
            self._timers[key] = asyncio.get_running_loop().call_later(
                self.seconds, self._fired, key)

    def cancel_all(self) -> None:
        for timer in self._timers.values():
            timer.cancel()  # the shutdown save covers them
        self._timers.clear()
        self._ended.clear()


def _logged(func, *args):
    try:
        return func(*args)
    except StoreUnavailable as e:  # said once by the store: one line, not a traceback
        log.info("background %s skipped: %s", getattr(func, "__name__", func), e)
        return False
    except Exception:
        log.exception("background %s failed", getattr(func, "__name__", func))
        return False
