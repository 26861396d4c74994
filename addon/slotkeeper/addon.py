"""The mitmproxy glue: the SlotKeeper addon's hooks. A completion request is routed in
`on_request` (the router's walk; front.py calls it), rewritten (id_slot, cache_prompt) and
described; its answer is watched for timings in `responseheaders`; it ends in `_end`, the one
place every routed flow finishes (from `response` or `error`), whatever raised before it.
Options: settings.py; what a flow shows: flows.py; background work: watch.py."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mitmproxy import ctx, http

from . import settings
from .decisions import placement
from .decisions.choice import SlotOutOfRange
from .flows import (
    ROUTE_KEY,
    SUMMARY_KEY,
    WATCH_KEY,
    checked_body,
    describe,
    error_response,
    note_pass_through,
    point_at,
    refuse_if_too_deep,
    set_headers,
    timings_of,
    upstream_of,
    without_empty_chunks,
    write_body,
)
from .front import Front
from .guard import cors
from .guard.browser import BodyLimit, BrowserGuard
from .identity.identity import Identity, IdentityConfig, identify
from .manage import scrape
from .manage.api import SessionApi
from .observe import metrics
from .observe.contentview import MitmwebView
from .observe.streamed import StreamedBodies
from .routing.router import Router
from .store import backends
from .store.state import StoreUnavailable
from .routing.routes import CLIENT, KEPT, NoUpstream, Route
from .surfaces.messages import AnthropicMessages
from .surfaces.ollama_surface import OllamaSurface
from .upstream.client import check_access, reverse_targets
from .upstream.models import model_of_body, unload_targets
from .watch import HealthWatcher, IdleSaves
from .wire import bodies
from .wire.bodies import SseTimingsWatcher, Timings
from .wire.translation import translation_of

log = logging.getLogger("slotkeeper")

SHUTDOWN_WAIT_SECONDS = 30.0
CLOSE_WAIT_SECONDS = 2.0


class SlotKeeper:
    def __init__(self) -> None:
        self.router: Router | None = None
        self.store: backends.Store | None = None  # the store the router uses
        self.identity_config = IdentityConfig()
        self.slot_dir_problem = ""  # why sessions cannot be saved, shown by the session API
        self.max_body_bytes = 32 * 1024 * 1024
        self.api_token = ""  # slotkeeper_api_token: see access.management_access
        # Blocking work runs off the event loop, in two pools (issue #11, fault 2):
        # - `pool`: routing and API calls, which may wait (bounded, slotkeeper_lock_timeout)
        #   for a busy slot's lease; more threads than asyncio's default pool gives.
        # - `release_pool`: what ends requests (finish: record, release the lease) and the
        #   idle saves and health polls. It never waits for a lease held by a request, so the
        #   releases that end those waits never queue behind them.
        self.pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="slotkeeper")
        self.release_pool = ThreadPoolExecutor(max_workers=8,
                                               thread_name_prefix="slotkeeper-release")
        self.watcher = HealthWatcher(lambda: self.router, self.release_pool)
        self.idle_saves = IdleSaves(lambda: self.router, self.release_pool)
        self.in_flight = 0  # completion requests routed and not yet finished

    def load(self, loader) -> None:
        settings.declare(loader)

    def configure(self, updated: set[str]) -> None:
        """Check every option first, then build: a bad value raises before any file is
        touched (no state file, lock folder or orphan sweep), and the running router stays
        (fault 6). A new router adopts what the old one knew."""
        if not any(name.startswith("slotkeeper_") for name in updated) and self.router:
            return
        built = settings.build(ctx.options, self.store)
        if self.store is not None and built.store is not self.store:
            # Another etcd (or the file): the old connection's watch and keep-alive end, and
            # its lease is revoked (the leases of requests still in flight on it go too).
            self.store.close()
        self.store = built.store
        self.slot_dir_problem = built.slot_dir_problem
        self.identity_config = built.identity_config
        self.max_body_bytes = built.max_body_bytes
        self.api_token = built.api_token
        self.idle_saves.seconds = built.idle_save_seconds
        router = Router(built.router_config, built.state, built.locks, built.folder,
                        ledger=built.ledger)
        router.accounting.background = in_background(self.release_pool)
        if self.router is not None and self.router.state.path == built.state.path:
            router.adopt(self.router)
        self.router = router

    # ---- a request -------------------------------------------------------------------------

    async def on_request(self, flow: http.HTTPFlow) -> None:
        """A completion is routed; anything else is looked at only for an unload, a body
        nested too deep, or a pool's server (called by front.Front)."""
        if flow.response is not None:
            return
        post = flow.request.method == "POST"
        if not post or not bodies.is_completion_path(flow.request.path) or self.router is None:
            # Not a completion (an unload is not one): nothing to route.
            await save_before_unload(self.router, self.pool, flow)
            if post:
                refuse_if_too_deep(flow, self.max_body_bytes)
            point_at_any(self.router, flow)
            return
        checked = checked_body(flow, self.max_body_bytes)
        if checked is None:
            return
        body_text, data, client_slot = checked
        ident = identify(flow.request.path, flow.request.headers, data, self.identity_config)
        route = self._keep(flow, ident, client_slot, data) or await self._route(
            flow, ident, client_slot, data)
        if route is None:
            return
        try:
            pinned_slot = route.slot if route.action != CLIENT else None
            write_body(flow, bodies.pin(data, pinned_slot, body_text))
        except BaseException:
            # Not forwarded as routed: the lease must not outlive this hook (fault 1).
            route.release()
            raise
        flow.metadata[ROUTE_KEY] = route
        self.in_flight += 1
        self.watcher.request_started(route.upstream)
        describe(flow, ident, route)
        metrics.routed(flow.request.path, route)
        # A kept session is the common case and gets no log line: mitmproxy formats every
        # record, whatever its level, and hands it to every addon as an event (measured on
        # the hot path, docs/BENCHMARKS.md). The flow and the metrics still say it.
        if route.action != KEPT:
            log.info("%s (%s) -> slot %s, %s%s in %.1f ms", route.session, route.rule,
                     route.slot, route.action, f" ({route.detail})" if route.detail else "",
                     route.ms)

    def _keep(self, flow: http.HTTPFlow, ident: Identity, client_slot: int | None,
              data: dict) -> Route | None:
        """The fast path, on the event loop: a session resident on a server that can keep it
        keeps its slot (no network, no thread hop). None: take the slow path (`_route`)."""
        assert self.router is not None
        pool = self.router.pool
        url = (pool.sticky_upstream(ident.session_id) or "") if pool.pooled else upstream_of(flow)
        if client_slot is not None or not url:
            return None
        route = self.router.try_keep(url, ident, model_of_body(data))
        if route is not None and pool.pooled:
            route.placement = placement.STAY
            point_at(flow, route.upstream)
        return route

    async def _route(self, flow: http.HTTPFlow, ident: Identity,
                     client_slot: int | None, data: dict) -> Route | None:
        """The slow path, on a worker: every request the fast path did not keep is placed
        (router.route, through the pool room). None: answered here, or passed through."""
        router = self.router
        assert router is not None
        url = upstream_of(flow)
        if router.pool.pooled:
            url = router.pool.sticky_upstream(ident.session_id) or url
        try:
            route = await asyncio.get_running_loop().run_in_executor(
                self.pool, router.route, url, ident, client_slot, flow.request.path, data)
        except SlotOutOfRange as e:
            flow.response = error_response(400, str(e))
            metrics.request(flow.request.path, "rejected")
            return None
        except NoUpstream as e:
            flow.response = error_response(503, f"no llama-server can take the request: {e}")
            metrics.request(flow.request.path, "error")
            log.warning("%s: %s", ident.session_id, e)
            return None
        except StoreUnavailable as e:  # the store said so once: no traceback per request
            note_pass_through(flow, f"routing failed: {e}", marker="error")
            return None
        except Exception as e:  # a bug or an unforeseen fault: the request still goes through
            log.exception("routing failed; forwarding unpinned")
            note_pass_through(flow, f"routing failed: {type(e).__name__}: {e}", marker="error")
            return None
        if router.pool.pooled:
            point_at(flow, route.upstream)
        return route

    # ---- its answer, and its end -----------------------------------------------------------

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is None:
            return
        headers = flow.response.headers
        # Every answer meets this hook (mitmproxy calls it for one made in a request hook too):
        # the CORS headers decided on the request go on here, not in a hook of their own.
        decided = flow.metadata.get(cors.ANSWER_KEY)
        if decided:
            cors.put_answer_headers(headers, decided)
        route: Route | None = flow.metadata.get(ROUTE_KEY)
        translation = translation_of(flow)
        streamed = "text/event-stream" in headers.get("content-type", "")
        if route is not None and self.router is not None and flow.response.status_code == 200:
            self.router.answer_began(route)
        if route is not None:
            set_headers(headers, {
                "X-Slotkeeper-Session": route.session,
                "X-Slotkeeper-Slot": "" if route.slot is None else str(route.slot),
                "X-Slotkeeper-Source": route.rule,
                "X-Slotkeeper-Action": route.action,
            })
        if streamed and route is not None:
            # Pass each event on as it arrives; watch for the final event's timings.
            watcher = SseTimingsWatcher(on_final=route.final_event)
            flow.metadata[WATCH_KEY] = watcher
            flow.response.stream = watcher
        if streamed and translation is not None and flow.response.status_code == 200:
            # The watcher reads llama-server's own events; the client gets its API's.
            read = flow.response.stream if callable(flow.response.stream) else None
            flow.response.stream = without_empty_chunks(
                translation.stream if read is None
                else lambda chunk: translation.stream(read(chunk)))
            translation.response_headers(flow.response)
        if route is not None and self.router is not None and self.router.pool.pooled:
            headers["X-Slotkeeper-Upstream"] = route.upstream  # which server of the pool

    async def response(self, flow: http.HTTPFlow) -> None:
        route: Route | None = flow.metadata.pop(ROUTE_KEY, None)
        timings = None
        try:
            timings = timings_of(flow) if route is not None else None
            translation = translation_of(flow)
            if translation is not None and flow.response is not None and not flow.response.stream:
                translation.whole(flow.response)  # after the timings were read from the original
            if route is not None and self.router is not None and flow.response is not None:
                self.router.upstreams.note_answer(route.upstream, flow.response.status_code)
            if route is not None:
                self._note_timings(flow, route, timings)
        finally:
            verified = await self._end(route, timings)
        if verified and route is not None:
            # Which slot really ran it (read back after the answer): a streamed answer's
            # headers are gone by now, so only the flow says it there.
            flow.metadata[SUMMARY_KEY]["verified"] = verified
            if verified.startswith("no"):
                flow.comment += f" NOT #{route.slot}: {verified.partition(': ')[2]}"
            if flow.response is not None and not flow.response.stream:
                flow.response.headers["X-Slotkeeper-Verified"] = verified

    async def error(self, flow: http.HTTPFlow) -> None:
        route: Route | None = flow.metadata.pop(ROUTE_KEY, None)
        timings = None
        try:
            if route is not None and self.router is not None:
                suspect_after_error(self.router, flow, route)
            # A client may leave as soon as it has the final event (seen with Codex exec, which
            # exits on `response.completed` while the stream's end is still in flight): the
            # server finished the request, and its timings say what the slot now holds.
            timings = (timings_of(flow) if route is not None and flow.response is not None
                       else None)
            if route is not None and timings is not None:
                flow.metadata[SUMMARY_KEY]["left_after_final_event"] = True
                self._note_timings(flow, route, timings)
        finally:
            await self._end(route, timings)

    def _note_timings(self, flow: http.HTTPFlow, route: Route, timings: Timings | None) -> None:
        metrics.timings(route.upstream, timings)
        info = self.router.upstreams.peek(route.upstream) if self.router is not None else None
        if timings is not None and info is not None:
            info.client.costs.answered(timings.prompt_n, timings.prompt_ms,
                                       timings.predicted_n, timings.predicted_ms)
        if timings is not None:
            flow.metadata[SUMMARY_KEY].update(reused=timings.cache_n, prefilled=timings.prompt_n)

    async def _end(self, route: Route | None, timings: Timings | None) -> str:
        """The one place a routed flow ends: accounting (on a worker unless nothing is due),
        then the route's release, which always runs. Returns the verification."""
        if route is None:
            return ""
        verified = ""
        try:
            router = self.router
            quick = router.finish_quick(route, timings) if router is not None else None
            if quick is not None:
                verified = quick  # no thread hop: nothing to write, nothing to wait for
            elif router is not None:
                verified = await asyncio.get_running_loop().run_in_executor(
                    self.release_pool, router.finish, route, timings)
        except StoreUnavailable as e:  # the answer went out; the store said so once
            log.info("the end of a request not recorded: %s", e)
        except Exception:
            log.exception("recording the end of a request failed")
        finally:
            route.release()
            self.in_flight -= 1
            self.watcher.request_ended(route.upstream)
        if self.idle_saves.seconds and route.slot is not None and self.router is not None:
            self.idle_saves.schedule(route.upstream, route.session, self.router.clock())
        return verified

    # ---- start and stop ----------------------------------------------------------------------

    def running(self) -> None:
        self.watcher.start()
        if self.router is not None:
            self.release_pool.submit(check_at_start, self.router, [
                *self.router.config.upstreams, *reverse_targets(ctx.options.mode)])

    def done(self) -> Awaitable[None]:
        """Stop what `running`/`configure` started. Graceful shutdown (SIGINT/SIGTERM): let
        requests in flight finish, then save every resident session that grew, so a reboot
        loses nothing.

        A plain method returning an awaitable, not `async def`: at shutdown mitmproxy awaits
        what a hook returns, while a script reload calls `done` from sync code and refuses
        coroutine functions (which would leave the old addon running). On reload nothing is
        awaited and nothing is saved (the sessions stay resident for the reloaded addon), and
        the executors are shut down as soon as mitmproxy drops the awaitable."""
        self.watcher.stop()
        self.idle_saves.cancel_all()
        return _WhenAwaited(self._shutdown, otherwise=self._close)

    async def _shutdown(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SHUTDOWN_WAIT_SECONDS
        while self.in_flight > 0 and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.router is not None and self.router.folder is not None:
            try:
                saved = await loop.run_in_executor(self.pool, self.router.accounting.save_all)
                log.info("shutdown: saved %d sessions", saved)
            except StoreUnavailable as e:  # etcd gone first: the slots still hold the KV
                log.warning("shutdown: no session saved: %s", e)
        await close_client_connections(loop.time() + CLOSE_WAIT_SECONDS)
        self._close()

    def _close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.release_pool.shutdown(wait=False, cancel_futures=True)


def suspect_after_error(router: Router, flow: http.HTTPFlow, route: Route) -> None:
    """A routed request that failed. No answer from llama-server at all, or an answer that
    broke off before its final event: it may be restarting. Verify its slots before trusting
    any of them again (the sentinel holds no connection while a request is in flight: this
    request's end is what shows a restart then). A pool member that never answered is taken
    out until its /health answers again (the watcher probes it back in)."""
    client_left = flow.error is not None and "client disconnected" in flow.error.msg.lower()
    if flow.response is None:
        router.upstreams.mark_suspect(route.upstream)
        if (router.pool.pooled and route.upstream in router.config.upstreams
                and not client_left and router.upstreams.set_health(route.upstream, False)):
            log.warning("%s: no answer: taken out of the pool", route.upstream)
    elif not client_left and timings_of(flow) is None:
        log.info("%s: the answer broke off: slots will be verified", route.upstream)
        router.upstreams.mark_suspect(route.upstream)


def check_at_start(router: Router, urls: list[str]) -> None:
    """A 401 at start is one clear line naming the option (check_access); then each server
    that takes our calls is verified before any request needs it (Router.warm_up)."""
    try:
        refused = check_access(urls, router.config.api_key)
        checked = router.warm_up([url for url in urls if url not in refused])
        # one line a user (and the benchmarks) can wait for: requests from now on find the
        # servers verified
        log.info("ready: %s", ", ".join(checked) + " checked" if checked
                 else "no server answered yet; the first request will check it")
    except Exception:  # noqa: BLE001 - a thread's error would vanish; the first request retries
        log.exception("checking the upstreams at start failed")


def in_background(pool: ThreadPoolExecutor) -> Callable[[Callable[[], None]], None]:
    """What runs a state write no answer waits for (a kept request's usage record) on `pool`."""
    def submit(write: Callable[[], None]) -> None:
        def run() -> None:
            try:
                write()
            except StoreUnavailable as e:  # the record is a hint; the store said so once
                log.info("a usage record not written: %s", e)
            except Exception:
                log.exception("writing a usage record failed")

        pool.submit(run)

    return submit


async def close_client_connections(deadline: float) -> None:
    """Shutdown, once the requests in flight have ended: close the client connections still
    open (clients' idle keep-alive ones) the way a client's own disconnect closes them.

    Left open, asyncio.run cancels their tasks after mitmproxy has stopped, and Python 3.12's
    start_server callback then reads each cancelled task's exception: one CancelledError
    traceback per connection (issue #32; plain mitmdump does the same). Cancelling the
    connection's handler instead ends its client task normally, as a disconnect does.
    mitmproxy 12's connection handlers are read with getattr: a later layout only brings the
    tracebacks back."""
    proxyserver = ctx.master.addons.get("proxyserver")
    open_now = getattr(proxyserver, "connections", {})
    for handler in list(open_now.values()):
        client = getattr(handler, "transports", {}).get(getattr(handler, "client", None))
        task = getattr(client, "handler", None)
        if task is not None:
            task.cancel("slotkeeper is shutting down")
    loop = asyncio.get_running_loop()
    while open_now and loop.time() < deadline:
        await asyncio.sleep(0.02)


def point_at_any(router: Router | None, flow: http.HTTPFlow) -> None:
    """Pool: a request that is not placed (listings, /props, ...) goes to a server that is
    up, not necessarily the reverse mode's first one."""
    if router is not None and router.pool.pooled and flow.response is None:
        url = router.pool.any_upstream()
        if url is not None:
            point_at(flow, url)


async def save_before_unload(router: Router | None, pool: ThreadPoolExecutor,
                             flow: http.HTTPFlow) -> None:
    """An unload of a router's or llama-swap's model passing through (issue #22): its
    sessions are saved first, as before a swap."""
    if router is None or router.pool.pooled or flow.response is not None:
        return
    targets = unload_targets(flow.request.method, flow.request.path, flow.request.raw_content)
    if targets is None:
        return
    try:
        await asyncio.get_running_loop().run_in_executor(
            pool, router.models.before_unload, upstream_of(flow), targets or None)
    except Exception:  # the unload still goes through
        log.exception("saving the sessions of an unloaded model failed")


class _WhenAwaited:
    """Runs a coroutine function only if awaited, so an unawaited one leaves no warning; one
    dropped without being awaited runs `otherwise` instead (CPython drops it at once)."""

    def __init__(self, make: Callable[[], Coroutine[Any, Any, None]],
                 otherwise: Callable[[], None]) -> None:
        self._make = make
        self._otherwise: Callable[[], None] | None = otherwise

    def __await__(self):
        self._otherwise = None
        return self._make().__await__()

    def __del__(self) -> None:
        if self._otherwise is not None:
            self._otherwise()


def make_addons() -> list:
    """Fresh addon objects: the entry script calls this each time mitmproxy (re)loads it."""
    keeper = SlotKeeper()
    ollama, messages = OllamaSurface(keeper), AnthropicMessages(keeper)
    api, metrics_endpoint = SessionApi(keeper), scrape.MetricsEndpoint(keeper)
    # The browser guard first (it refuses before anyone answers). A request then goes through
    # the front door to the surfaces that rewrite it into llama-server's own API
    # (translation.py), the keeper, and the addons that answer their own paths. The copy of
    # streamed answers comes after every addon that sets a response's stream.
    front = Front([ollama, messages, keeper, api, metrics_endpoint])
    return [BrowserGuard(), front, ollama, messages, keeper, BodyLimit(), api, metrics_endpoint,
            StreamedBodies(), MitmwebView()]
