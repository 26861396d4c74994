"""The mitmproxy glue: options, hooks, and what a flow shows about its routing."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mitmproxy import ctx, exceptions, http

from . import bodies, metrics, placement
from .api import SessionApi
from .bodies import BodyError, BodyRefused, SseTimingsWatcher, Timings
from .contentview import MitmwebView, flow_comment
from .identity import Identity, IdentityConfig, identify
from .locks import SlotLocks
from .messages import AnthropicMessages
from .ollama_surface import OllamaSurface
from .replies import error_reply as error_response
from .router import (ASSIGNED, CLIENT, FALLBACK, KEPT, RESTORED, SEEDED, SIDE, UNPINNED,
                     NoUpstream, Route, Router, RouterConfig)
from .slotfiles import SlotFolder
from .state import StateFile
from .translation import translation_of

log = logging.getLogger("slotkeeper")

ROUTE_KEY = "slotkeeper_route"  # flow.metadata: the Route object
SUMMARY_KEY = "slotkeeper"  # flow.metadata: a plain dict, shown by mitmweb and `~meta`
WATCH_KEY = "slotkeeper_sse"
HEALTH_POLL_SECONDS = 0.5
# Disk budget by default (fault 7): every idle save rewrites a session's whole snapshot, GBs
# each on a large model, so "no limit" let a long-running proxy fill the disk. 20 GiB holds
# ~1,400 2k-token snapshots of the test model (14 MB each) or about ten 32k-token snapshots of
# a 7-8B model (~2 GB each); 0 still means no limit.
DEFAULT_DISK_MAX_MB = 20 * 1024
SHUTDOWN_WAIT_SECONDS = 30.0

# One marker per outcome. mitmweb shows a marker only as the character of a known emoji
# shortcode (any other string becomes a red-circle emoji), so these are shortcodes of plain
# symbols that common text fonts have (DejaVu Sans: Debian's default) and that browsers draw
# as text: coloured emoji showed as empty boxes on a machine without an emoji font.
# `~marker heavy_check_mark` finds the kept flows in mitmdump and saved flows; mitmweb filters
# on the character itself, so use `~comment "· kept"` there.
MARKERS = {
    KEPT: ":heavy_check_mark:",  # ✔
    ASSIGNED: ":arrow_forward:",  # ▶
    RESTORED: ":leftwards_arrow_with_hook:",  # ↩
    SEEDED: ":shamrock:",  # ☘
    SIDE: ":arrow_right_hook:",  # ↪
    CLIENT: ":point_up:",  # ☝
    FALLBACK: ":warning:",  # ⚠
    UNPINNED: ":black_small_square:",  # ▪
    "error": ":heavy_multiplication_x:",  # ✖
}


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                              "state")
    return Path(base) / "slotkeeper"


def upstream_of(flow: http.HTTPFlow) -> str:
    """Each upstream has its own slot space, keyed by its URL. In reverse mode the request
    already points at the target, so several `--mode reverse:URL@PORT` stay apart."""
    req = flow.request
    host = req.host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 literal needs its brackets in a URL (fault 6)
    return f"{req.scheme}://{host}:{req.port}"


def point_at(flow: http.HTTPFlow, url: str) -> None:
    """Send the flow to `url` (a pool server's base URL, placement.parse_upstreams form).
    mitmproxy opens the server connection from the request's scheme, host and port after the
    request hook, in reverse mode too; the Host header follows them (Request.host/port
    setters), so the server sees its own address, as with one reverse-mode upstream."""
    if upstream_of(flow) == url:
        return
    scheme, _, rest = url.partition("://")
    host, _, port = rest.rpartition(":")
    req = flow.request
    req.scheme = scheme
    req.host = host.strip("[]")
    req.port = int(port)


class SlotKeeper:
    def __init__(self) -> None:
        self.router: Router | None = None
        self.identity_config = IdentityConfig()
        self.slot_dir_problem = ""  # why sessions cannot be saved, shown by the session API
        self.max_body_bytes = 32 * 1024 * 1024
        self.api_token = ""  # slotkeeper_api_token: see api.management_access
        # Blocking work runs off the event loop, in two pools (issue #11, fault 2):
        # - `pool`: routing and API calls, which may wait (bounded, slotkeeper_lock_timeout)
        #   for a busy slot's lease; more threads than asyncio's default pool gives.
        # - `release_pool`: what ends requests (finish: record, release the lease) and the
        #   idle saves and health polls. It never waits for a lease held by a request, so the
        #   releases that end those waits never queue behind them.
        self.pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="slotkeeper")
        self.release_pool = ThreadPoolExecutor(max_workers=8,
                                               thread_name_prefix="slotkeeper-release")
        self._watcher: asyncio.Task | None = None
        self.idle_save_seconds = 5
        self._idle_timers: dict[tuple[str, str], asyncio.TimerHandle] = {}
        self._idle_ended: dict[tuple[str, str], float] = {}
        self.in_flight = 0  # completion requests routed and not yet finished

    def load(self, loader) -> None:
        loader.add_option("slotkeeper_ttl", int, 120,
                          "Seconds after its last use that a session's slot may be given to "
                          "another session before colder ones.")
        loader.add_option("slotkeeper_state_file", str, "",
                          "The JSON state file shared by every slotkeeper process on this "
                          "machine (default: $XDG_STATE_HOME/slotkeeper/state.json).")
        loader.add_option("slotkeeper_slots_timeout_ms", int, 1000,
                          "How long to wait for GET /slots and /props before falling back to "
                          "hashing sessions over the slot count.")
        loader.add_option("slotkeeper_session_headers", Sequence[str], [],
                          "Extra request header names that carry a session id, checked after "
                          "the built-in ones.")
        loader.add_option("slotkeeper_small_request_chars", int, 2000,
                          "Requests whose prompt has fewer characters are side requests "
                          "(titles, tags): placed without claiming a slot.")
        loader.add_option("slotkeeper_children_share_parent", bool, False,
                          "Subagent requests use their parent's session (and slot) instead of "
                          "a session of their own.")
        loader.add_option("slotkeeper_slot_count", int, 0,
                          "Slot count to hash sessions over when /props does not say.")
        loader.add_option("slotkeeper_slot_dir", str, "",
                          "llama-server's --slot-save-path, shared with the proxy: enables "
                          "saving and restoring sessions.")
        loader.add_option("slotkeeper_min_save_tokens", int, 256,
                          "Sessions with fewer tokens are not saved (re-prefilling them is "
                          "cheap).")
        loader.add_option("slotkeeper_keep_prefix", bool, False,
                          "On handover, keep the slot's old content instead of erasing it, so a "
                          "shared prefix (system prompt) can be reused.")
        loader.add_option("slotkeeper_save_every_tokens", int, 2048,
                          "Save a session that keeps its slot each time it grew by this many "
                          "tokens since its last save.")
        loader.add_option("slotkeeper_idle_save_seconds", int, 5,
                          "Save a session that grew once it has been idle this long (0: never), "
                          "so a crash of llama-server loses at most the turn in flight.")
        loader.add_option("slotkeeper_seed_min_chars", int, 2000,
                          "System prompts (plus tools) at least this long get a seed: their KV "
                          "saved once and restored into new sessions' slots.")
        loader.add_option("slotkeeper_max_seeds", int, 8, "How many seeds to keep (0: none).")
        loader.add_option("slotkeeper_disk_max_mb", int, DEFAULT_DISK_MAX_MB,
                          "Most MiB the saved sessions may take in the slot folder; least "
                          "recently used ones are removed first (0: no limit).")
        loader.add_option("slotkeeper_disk_max_age_hours", int, 0,
                          "Saved sessions unused for longer are removed (0: no limit).")
        loader.add_option("slotkeeper_max_body_mb", int, 32,
                          "Largest request body (after decoding) slotkeeper reads, in MiB.")
        loader.add_option("slotkeeper_lock_timeout", int, 600,
                          "Most seconds a request waits for a busy slot (a handover, a "
                          "client-pinned or fallback request) before it is placed another way.")
        loader.add_option("slotkeeper_upstreams", Sequence[str], [],
                          "Several llama-servers behind this address (repeat the option, one "
                          "base URL each, e.g. http://127.0.0.1:8081): each session is placed "
                          "on one of them and its KV moved when it has to leave. Empty: the "
                          "reverse mode's one upstream.")
        loader.add_option("slotkeeper_placement", str, placement.COST,
                          "How a request's server is chosen among slotkeeper_upstreams: cost "
                          "(the session's KV against each server's load), or the baselines "
                          "round-robin and least-busy.", choices=list(placement.POLICIES))
        loader.add_option("slotkeeper_api_token", str, "",
                          "Bearer token for the management endpoints (/api/..., /metrics). "
                          "Unset: they answer loopback clients only. Set: they answer every "
                          "client, and POST/DELETE calls need 'Authorization: Bearer <token>'.")

    def configure(self, updated: set[str]) -> None:
        """Check every option first, then build: a bad value raises before any file is
        touched (no state file, lock folder or orphan sweep), and the running router stays
        (fault 6). A new router adopts what the old one knew."""
        if not any(name.startswith("slotkeeper_") for name in updated) and self.router:
            return
        opts = ctx.options
        for name in ("slotkeeper_ttl", "slotkeeper_small_request_chars", "slotkeeper_slot_count",
                     "slotkeeper_min_save_tokens", "slotkeeper_idle_save_seconds",
                     "slotkeeper_seed_min_chars", "slotkeeper_max_seeds",
                     "slotkeeper_disk_max_mb", "slotkeeper_disk_max_age_hours",
                     "slotkeeper_lock_timeout"):
            if getattr(opts, name) < 0:
                raise exceptions.OptionsError(f"{name} must be 0 or more")
        for name in ("slotkeeper_slots_timeout_ms", "slotkeeper_save_every_tokens",
                     "slotkeeper_max_body_mb"):
            # slots_timeout_ms=0 made every /slots read time out at once: every request fell
            # back and the upstream watcher died.
            if getattr(opts, name) < 1:
                raise exceptions.OptionsError(f"{name} must be at least 1")
        if opts.slotkeeper_api_token and not all(
                "!" <= c <= "~" for c in opts.slotkeeper_api_token):
            raise exceptions.OptionsError("slotkeeper_api_token must be printable ASCII "
                                          "without spaces (it is sent in a header)")
        for header in opts.slotkeeper_session_headers:
            if not header or not all(c.isalnum() or c in "-_" for c in header):
                raise exceptions.OptionsError(
                    f"slotkeeper_session_headers: {header!r} is not a header name")
        if opts.slotkeeper_placement not in placement.POLICIES:
            raise exceptions.OptionsError(f"slotkeeper_placement must be one of "
                                          f"{', '.join(placement.POLICIES)}")
        try:
            upstreams = tuple(placement.parse_upstreams(opts.slotkeeper_upstreams))
        except ValueError as e:
            raise exceptions.OptionsError(f"slotkeeper_upstreams: {e}") from None
        state_path = (Path(opts.slotkeeper_state_file).expanduser() if opts.slotkeeper_state_file
                      else default_state_dir() / "state.json")
        slot_dir = Path(opts.slotkeeper_slot_dir).expanduser() if opts.slotkeeper_slot_dir else None
        slot_dir_usable = slot_dir is not None and slot_dir.is_dir() and os.access(
            slot_dir, os.R_OK | os.W_OK | os.X_OK)
        # Everything is checked: from here on, files are made and the router replaced.
        try:
            state = StateFile(state_path)
            locks = SlotLocks(state_path.parent / "locks")
        except OSError as e:
            raise exceptions.OptionsError(f"slotkeeper_state_file {state_path}: {e}") from None
        folder = None
        if slot_dir is None:
            self.slot_dir_problem = ("slotkeeper_slot_dir is not set: set it to llama-server's "
                                     "--slot-save-path to save and restore sessions")
        elif not slot_dir_usable:
            # Pinning still works without it: say so loudly, and in the session API.
            self.slot_dir_problem = (f"slotkeeper_slot_dir {slot_dir} is not a folder this "
                                     f"process can read and write (it must be "
                                     f"llama-server's --slot-save-path): sessions are "
                                     f"pinned but not saved")
            log.warning(self.slot_dir_problem)
        else:
            self.slot_dir_problem = ""
            folder = SlotFolder(slot_dir,
                                max_bytes=opts.slotkeeper_disk_max_mb * 1024 * 1024,
                                max_age_seconds=opts.slotkeeper_disk_max_age_hours * 3600)
            swept = folder.sweep_orphans()
            if swept:
                log.info("removed %d orphaned files from %s", swept, slot_dir)
        self.identity_config = IdentityConfig(
            extra_headers=tuple(opts.slotkeeper_session_headers),
            children_share_parent=opts.slotkeeper_children_share_parent,
        )
        self.max_body_bytes = opts.slotkeeper_max_body_mb * 1024 * 1024
        self.api_token = opts.slotkeeper_api_token
        self.idle_save_seconds = opts.slotkeeper_idle_save_seconds
        router = Router(
            RouterConfig(
                ttl=float(opts.slotkeeper_ttl),
                slots_timeout=opts.slotkeeper_slots_timeout_ms / 1000,
                small_request_chars=opts.slotkeeper_small_request_chars,
                slot_count=opts.slotkeeper_slot_count,
                lock_timeout=float(opts.slotkeeper_lock_timeout),
                min_save_tokens=opts.slotkeeper_min_save_tokens,
                erase_on_handover=not opts.slotkeeper_keep_prefix,
                save_every_tokens=opts.slotkeeper_save_every_tokens,
                seed_min_chars=opts.slotkeeper_seed_min_chars,
                max_seeds=opts.slotkeeper_max_seeds,
                upstreams=upstreams,
                placement=opts.slotkeeper_placement,
            ),
            state, locks, folder,
        )
        if self.router is not None and self.router.state.path == state_path:
            router.adopt(self.router)
        self.router = router

    # ---- hooks -----------------------------------------------------------------------------

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None:
            return
        if flow.request.method != "POST":
            self._point_at_any(flow)
            return
        if not bodies.is_completion_path(flow.request.path) or self.router is None:
            self._refuse_if_too_deep(flow)
            self._point_at_any(flow)
            return
        try:
            body_text, data = self._read_body(flow)
        except BodyRefused as e:
            # Too large, or nested deeper than anything we (or llama-server) should parse:
            # answered here, never forwarded.
            flow.response = error_response(e.status, str(e))
            metrics.request(flow.request.path, "rejected")
            log.info("%s %s refused (%d): %s", flow.request.method, flow.request.path, e.status, e)
            return
        except BodyError as e:
            note_pass_through(flow, str(e))
            return
        try:
            client_slot = bodies.client_slot(data)
            bodies.check_cache_prompt(data)
        except BodyError as e:
            flow.response = error_response(400, str(e))
            metrics.request(flow.request.path, "rejected")
            return
        ident = identify(flow.request.path, flow.request.headers, data, self.identity_config)
        route = await self._route(flow, ident, client_slot, data)
        if route is None:
            return
        try:
            pinned_slot = route.slot if route.action != CLIENT else None
            write_body(flow, bodies.pin(data, pinned_slot, body_text))
        except Exception:
            # Not forwarded as routed: the lease must not outlive this hook (fault 1).
            route.release()
            raise
        flow.metadata[ROUTE_KEY] = route
        self.in_flight += 1
        describe(flow, ident, route)
        metrics.routed(flow.request.path, route)
        # A kept session is the common case and gets no log line: mitmproxy formats every
        # record, whatever its level, and hands it to every addon as an event (measured on
        # the hot path, docs/BENCHMARKS.md). The flow and the metrics still say it.
        if route.action != KEPT:
            log.info("%s (%s) -> slot %s, %s%s in %.1f ms", route.session, route.rule,
                     route.slot, route.action, f" ({route.detail})" if route.detail else "",
                     route.ms)

    def _point_at_any(self, flow: http.HTTPFlow) -> None:
        """Pool: a request that is not placed (listings, /props, ...) goes to a server that
        is up, not necessarily the reverse mode's first one."""
        router = self.router
        if router is not None and router.pooled and flow.response is None:
            url = router.any_upstream()
            if url is not None:
                point_at(flow, url)

    async def _route(self, flow: http.HTTPFlow, ident: Identity,
                     client_slot: int | None, data: dict) -> Route | None:
        route = await self._place_and_route(flow, ident, client_slot, data)
        if route is not None and self.router is not None and self.router.pooled:
            point_at(flow, route.upstream)
        return route

    async def _place_and_route(self, flow: http.HTTPFlow, ident: Identity,
                               client_slot: int | None, data: dict) -> Route | None:
        assert self.router is not None
        url = upstream_of(flow)
        if self.router.pooled:
            # The fast path only for a session resident on a server that can keep it; the
            # slow path places every other request (router.place).
            url = self.router.sticky_upstream(ident.session_id) or ""
        route = (self.router.try_keep(url, ident) if client_slot is None and url else None)
        if route is not None:
            if self.router.pooled:
                route.placement = placement.STAY
            return route
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self.pool, self.router.route, url or upstream_of(flow), ident, client_slot,
                flow.request.path, data)
        except NoUpstream as e:
            flow.response = error_response(503, f"no llama-server can take the request: {e}")
            metrics.request(flow.request.path, "error")
            log.warning("%s: %s", ident.session_id, e)
            return None
        except Exception as e:  # a bug or an unforeseen fault: the request still goes through
            log.exception("routing failed; forwarding unpinned")
            note_pass_through(flow, f"routing failed: {type(e).__name__}: {e}", marker="error")
            return None

    def _read_body(self, flow: http.HTTPFlow) -> tuple[bytes, dict]:
        """The decoded body's JSON text, and the object parsed from it: a surface that
        rewrote the body left both (bodies.PARSED_KEY), else the one body read."""
        raw = flow.request.raw_content
        parsed = flow.metadata.pop(bodies.PARSED_KEY, None)
        if parsed is not None and raw is not None and parsed[0] == raw:
            return parsed
        text = bodies.read_body(raw, flow.request.headers.get("content-encoding", ""),
                                self.max_body_bytes)
        return text, bodies.parse_json_object(text)

    def _refuse_if_too_deep(self, flow: http.HTTPFlow) -> None:
        """Any other POST is forwarded as it came, except JSON nested deep enough to crash
        llama-server (a segfault at ~110,000 levels on every endpoint, b11434): 400."""
        raw = flow.request.raw_content
        if not raw or len(raw) > self.max_body_bytes:
            return
        try:
            body = bodies.decode_body(raw, flow.request.headers.get("content-encoding", ""),
                                      self.max_body_bytes)
        except BodyError:
            return
        if bodies.nested_too_deep(body):
            flow.response = error_response(400, "request body is JSON nested too deeply")
            log.info("%s %s refused (400): JSON nested too deeply", flow.request.method,
                     flow.request.path)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is None:
            return
        route: Route | None = flow.metadata.get(ROUTE_KEY)
        translation = translation_of(flow)
        headers = flow.response.headers
        streamed = "text/event-stream" in headers.get("content-type", "")
        if route is not None:
            set_headers(headers, {
                "X-Slotkeeper-Session": route.session,
                "X-Slotkeeper-Slot": "" if route.slot is None else str(route.slot),
                "X-Slotkeeper-Source": route.rule,
                "X-Slotkeeper-Action": route.action,
            })
        if streamed and route is not None:
            # Pass each event on as it arrives; watch for the final event's timings.
            watcher = SseTimingsWatcher()
            flow.metadata[WATCH_KEY] = watcher
            flow.response.stream = watcher
        if streamed and translation is not None and flow.response.status_code == 200:
            # The watcher reads llama-server's own events; the client gets its API's.
            read = flow.response.stream if callable(flow.response.stream) else None
            flow.response.stream = _without_empty_chunks(
                translation.stream if read is None
                else lambda chunk: translation.stream(read(chunk)))
            translation.response_headers(flow.response)
        if route is not None and self.router is not None and self.router.pooled:
            headers["X-Slotkeeper-Upstream"] = route.upstream  # which server of the pool

    async def response(self, flow: http.HTTPFlow) -> None:
        route: Route | None = flow.metadata.pop(ROUTE_KEY, None)
        timings = self._timings(flow) if route is not None else None
        translation = translation_of(flow)
        if translation is not None and flow.response is not None and not flow.response.stream:
            translation.whole(flow.response)  # after the timings were read from the original
        if route is None or self.router is None:
            return
        if flow.response is not None:
            self.router.note_answer(route.upstream, flow.response.status_code)
        metrics.timings(route.upstream, timings)
        if timings is not None:
            flow.metadata[SUMMARY_KEY].update(reused=timings.cache_n, prefilled=timings.prompt_n)
        verified = await self._finish(route, timings)
        if verified:
            # Which slot really ran it (read back after the answer): a streamed answer's
            # headers are gone by now, so only the flow says it there.
            flow.metadata[SUMMARY_KEY]["verified"] = verified
            if verified.startswith("no"):
                flow.comment += f" NOT #{route.slot}: {verified.partition(': ')[2]}"
            if flow.response is not None and not flow.response.stream:
                flow.response.headers["X-Slotkeeper-Verified"] = verified

    async def error(self, flow: http.HTTPFlow) -> None:
        route: Route | None = flow.metadata.pop(ROUTE_KEY, None)
        if route is None or self.router is None:
            return
        if flow.response is None:
            # No answer from llama-server at all: it may be restarting. Verify its slots
            # before trusting any of them again; a pool member is taken out until its
            # /health answers again (the watcher probes it back in).
            self.router.mark_suspect(route.upstream)
            client_left = flow.error is not None and "client disconnected" in \
                flow.error.msg.lower()
            if (self.router.pooled and route.upstream in self.router.config.upstreams
                    and not client_left):
                if self.router.set_health(route.upstream, False):
                    log.warning("%s: no answer: taken out of the pool", route.upstream)
        # A client may leave as soon as it has the final event (seen with Codex exec, which
        # exits on `response.completed` while the stream's end is still in flight): the
        # server finished the request, and its timings say what the slot now holds.
        timings = self._timings(flow) if flow.response is not None else None
        if timings is not None:
            flow.metadata[SUMMARY_KEY].update(reused=timings.cache_n, prefilled=timings.prompt_n,
                                              left_after_final_event=True)
            metrics.timings(route.upstream, timings)
        await self._finish(route, timings)

    async def _finish(self, route: Route, timings: Timings | None) -> str:
        assert self.router is not None
        loop = asyncio.get_running_loop()
        verified = ""
        try:
            quick = self.router.finish_quick(route, timings)
            if quick is not None:
                verified = quick  # no thread hop: nothing to write, nothing to wait for
            else:
                verified = await loop.run_in_executor(self.release_pool, self.router.finish,
                                                      route, timings)
        except Exception:
            route.release()
            log.exception("recording the end of a request failed")
        finally:
            self.in_flight -= 1
        if self.idle_save_seconds and route.slot is not None:
            self._schedule_idle_save(route.upstream, route.session, self.router.clock())
        return verified

    def _schedule_idle_save(self, url: str, session: str, ended: float) -> None:
        """One timer per session, not per request: it fires `idle_save_seconds` after the
        session's last request ended (re-arming itself while requests keep coming)."""
        key = (url, session)
        self._idle_ended[key] = ended
        if key not in self._idle_timers:
            self._idle_timers[key] = asyncio.get_running_loop().call_later(
                self.idle_save_seconds, self._idle_timer_fired, key)

    def _idle_timer_fired(self, key: tuple[str, str]) -> None:
        router = self.router
        ended = self._idle_ended.get(key, 0.0)
        left = ended + self.idle_save_seconds - (router.clock() if router else ended)
        if router is not None and left > 0.05:
            self._idle_timers[key] = asyncio.get_running_loop().call_later(
                left, self._idle_timer_fired, key)
            return
        self._idle_timers.pop(key, None)
        self._idle_ended.pop(key, None)
        if router is not None:
            self.release_pool.submit(_logged, router.save_if_idle, key[0], key[1], ended)

    def _timings(self, flow: http.HTTPFlow) -> Timings | None:
        watcher: SseTimingsWatcher | None = flow.metadata.pop(WATCH_KEY, None)
        if watcher is not None:
            return watcher.timings
        if flow.response is None or flow.response.status_code != 200:
            return None
        return bodies.timings_in_json(flow.response.content or b"")

    def running(self) -> None:
        self._watcher = asyncio.get_running_loop().create_task(self._watch_upstreams())

    async def _watch_upstreams(self) -> None:
        """Poll /health of every upstream seen so far. A failure (down, or 503 while loading a
        model) means it may come back as a fresh server with empty slots: mark it suspect, so
        the next request verifies /slots before trusting a slot to still hold a session.
        Measured: a restart of the test server takes over a second, so 0.5 s polls see it."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(HEALTH_POLL_SECONDS)
            router = self.router
            if router is None:
                continue
            pool = set(router.config.upstreams)
            for url, info in router.known_upstreams():
                if info.healthy and info.answered_within(HEALTH_POLL_SECONDS):
                    # It answered a request since the last round: up. A restart keeps a
                    # server down for over a second (measured), so a later round, with no
                    # answer in the half second before it, still asks it and sees the gap.
                    continue
                if url in pool:
                    await self._probe_member(router, url, info)
                    continue
                if info.suspect:
                    continue
                try:
                    healthy = await loop.run_in_executor(self.release_pool, info.client.healthy)
                except Exception:  # the watcher must outlive any one failure (fault 6)
                    log.exception("%s: health check failed unexpectedly", url)
                    healthy = False
                if not healthy:
                    log.info("%s: /health failed; slots will be verified", url)
                    router.mark_suspect(url)

    async def _probe_member(self, router: Router, url: str, info) -> None:
        """A pool member is polled whatever its state: down, it is taken out of placement;
        answering again, it is put back (and verified before its slots are trusted)."""
        loop = asyncio.get_running_loop()
        try:
            healthy = await loop.run_in_executor(self.release_pool, info.client.healthy)
        except Exception:
            log.exception("%s: health check failed unexpectedly", url)
            healthy = False
        if router.set_health(url, healthy):
            if healthy:
                log.warning("%s: answering again: back in the pool", url)
            else:
                log.warning("%s: /health failed: taken out of the pool", url)

    def done(self) -> Awaitable[None]:
        """Graceful shutdown (SIGINT/SIGTERM): let requests in flight finish, then save every
        resident session that grew, so a reboot loses nothing.

        A plain method returning an awaitable, not `async def`: at shutdown mitmproxy awaits
        what a hook returns, while a script reload calls `done` from sync code and refuses
        coroutine functions (which would leave the old addon running). On reload nothing is
        awaited and nothing is saved: the sessions stay resident for the reloaded addon."""
        if self._watcher is not None:
            self._watcher.cancel()
        for timer in self._idle_timers.values():
            timer.cancel()  # the shutdown save covers them
        self._idle_timers.clear()
        return _WhenAwaited(self._shutdown)

    async def _shutdown(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SHUTDOWN_WAIT_SECONDS
        while self.in_flight > 0 and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.router is not None and self.router.folder is not None:
            saved = await loop.run_in_executor(self.pool, self.router.save_all)
            log.info("shutdown: saved %d sessions", saved)
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.release_pool.shutdown(wait=False, cancel_futures=True)


class _WhenAwaited:
    """Runs a coroutine function only if awaited, so an unawaited one leaves no warning."""

    def __init__(self, make: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self._make = make

    def __await__(self):
        return self._make().__await__()


def _without_empty_chunks(stream: Callable[[bytes], bytes]) -> Callable[[bytes], list[bytes]]:
    """A translation often has nothing to send for a chunk (half an event, an event the client
    API has no counterpart for). mitmproxy sends each returned bytes as one HTTP/1 chunk, and
    an empty one is the chunked terminator `0\r\n\r\n`: the client would see the body end
    there (measured: the Ollama client then read the real terminator as the next status
    line). An empty list sends nothing."""
    def send(chunk: bytes) -> list[bytes]:
        out = stream(chunk)
        return [out] if out else []
    return send


def _logged(func, *args) -> None:
    try:
        func(*args)
    except Exception:
        log.exception("background %s failed", getattr(func, "__name__", func))


def write_body(flow: http.HTTPFlow, body: bytes) -> None:
    """Forward a plain JSON body with an exact Content-Length, whatever encoding and framing
    (gzip, chunked) it arrived with."""
    flow.request.raw_content = body  # plain: no content-encoding is left to apply
    set_headers(flow.request.headers, {"content-length": str(len(body))},
                drop=(b"content-encoding", b"transfer-encoding"))


def set_headers(headers: http.Headers, values: dict[str, str],
                drop: tuple[bytes, ...] = ()) -> None:
    """Set several headers (replacing any of the same names) and remove the `drop` ones in one
    pass over the raw fields: each `headers[name] = value` scans them all again, which showed
    on the hot path."""
    new = tuple((name.encode(), value.encode("utf-8", "surrogateescape"))
                for name, value in values.items())
    gone = {name.lower() for name, _ in new}.union(drop)
    headers.fields = tuple(f for f in headers.fields if f[0].lower() not in gone) + new


def describe(flow: http.HTTPFlow, ident: Identity, route: Route) -> None:
    """The flow comment (a column in mitmweb), its marker and metadata."""
    flow.marked = MARKERS.get(route.action, "")
    flow.metadata[SUMMARY_KEY] = {
        "session": route.session,
        "rule": route.rule,
        "parent": ident.parent_id,
        "slot": route.slot,
        "action": route.action,
        "detail": route.detail,
        "routing_ms": round(route.ms, 2),
        **({"server": route.upstream, "placement": route.placement} if route.placement else {}),
        "prompt_chars": ident.prompt_chars,
        "messages": ident.message_count,
    }
    flow.comment = flow_comment(flow.metadata[SUMMARY_KEY])


def note_pass_through(flow: http.HTTPFlow, why: str, marker: str = UNPINNED) -> None:
    flow.comment = f"passed through unchanged: {why}"
    flow.marked = MARKERS[marker]
    flow.metadata[SUMMARY_KEY] = {"action": "passed through", "why": why}
    metrics.request(flow.request.path, "error" if marker == "error" else "passed_through")
    log.info("%s %s passed through unchanged: %s", flow.request.method, flow.request.path, why)


def make_addons() -> list:
    """Fresh addon objects: the entry script calls this each time mitmproxy (re)loads it."""
    keeper = SlotKeeper()
    # Surfaces that rewrite a request into llama-server's own API come first (translation.py).
    return [OllamaSurface(keeper), AnthropicMessages(keeper), keeper, SessionApi(keeper),
            metrics.MetricsEndpoint(keeper),
            MitmwebView()]
