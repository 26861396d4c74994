"""A FAKE llama-swap for the tests (issue #22): one URL, models by name, one REAL llama-server
process per model started and stopped the way llama-swap's default group does it (one model
at a time; a request for another model stops the running one and starts that one).

What it reproduces of llama-swap (read from github.com/mostlygeek/llama-swap, internal/server
and internal/router, December 2026):
- the model comes from the JSON body's `model` (POST completion routes) or from `?model=`
  (`GET /props`); `/upstream/<model>/<path>` forwards any method to that model's server with
  the prefix stripped, and starts (swaps to) the model like any other request, except that a
  path ending in .js/.json/.css/.png/.gif/.jpg/.jpeg/.ico/.txt answers 409 instead of
  starting a model that is not running (llama-swap's default `upstream.ignorePaths`);
- a swap waits until the running model has no request in flight (llama-swap defers an
  eviction that would cut a busy process), stops it with SIGTERM, starts the new process and
  waits for its `/health`;
- `GET /running` (`{"running": [{"model", "state", ...}]}`, states starting/ready/stopping),
  `GET /v1/models` and `/models` (`{"data": [{"id", "status": {"value": loaded|unloaded}}]}`),
  `GET /unload` (stop all, "OK"), `POST /api/models/unload/<model>` ("OK" once stopped),
  `GET /health`.
What it does not: TTLs, groups other than one swap group, the matrix engine, aliases, peers,
profiles, the loading-state stream, the UI, metrics, request queues in arrival order
(waiting requests wake in any order), `/upstream/<model>` redirect without its slash.
"""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from testbed import LlamaServer, free_port

# llama-swap's modelPostJSONRoutes that llama-server answers.
MODEL_ROUTES = frozenset({
    "/v1/chat/completions", "/v1/responses", "/v1/completions", "/v1/messages",
    "/v1/messages/count_tokens", "/v1/embeddings", "/infill", "/completion",
    "/reranking", "/rerank", "/v1/rerank", "/v1/reranking"})
IGNORED_SUFFIXES = (".js", ".json", ".css", ".png", ".gif", ".jpg", ".jpeg", ".ico", ".txt")
HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "host",
                         "content-length", "proxy-connection", "te", "upgrade"})
PROXY_TIMEOUT_S = 900.0


class SwapError(Exception):
    """A model could not be started; the handler answers 502 with this text."""


class FakeLlamaSwap:
    """`models` maps each name to a function making that model's (not yet started)
    LlamaServer on a given port, the way llama-swap's `cmd` runs with `${PORT}`."""

    def __init__(self, models: Mapping[str, Callable[[int], LlamaServer]],
                 port: int | None = None) -> None:
        self.factories = dict(models)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._cond = threading.Condition()
        self._servers: dict[str, LlamaServer] = {}  # started or starting processes
        self._states: dict[str, str] = {}  # model -> starting / ready / stopping
        self._inflight: dict[str, int] = {}
        self._swapping = False
        self.events: list[tuple[str, str]] = []  # ("start"|"stop", model), in order
        self._httpd: ThreadingHTTPServer | None = None
        # Processes are started and stopped from this one long-lived thread: the test bed's
        # PDEATHSIG kills a child when the THREAD that started it ends, and each request
        # handler's thread ends with its request.
        self._manager = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fake-swap")

    # ---- lifecycle ----

    def start(self) -> FakeLlamaSwap:
        self._httpd = ThreadingHTTPServer(("127.0.0.1", self.port), _handler(self))
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        self.unload()
        self._manager.shutdown()

    # ---- what llama-swap's router does ----

    def running(self) -> dict[str, str]:
        with self._cond:
            return dict(self._states)

    def server(self, model: str) -> LlamaServer | None:
        with self._cond:
            return self._servers.get(model)

    def acquire(self, model: str) -> LlamaServer:
        """The model's ready server, swapping to it first if needed; counts a request in
        flight until release()."""
        with self._cond:
            while True:
                if self._states.get(model) == "ready":
                    self._inflight[model] = self._inflight.get(model, 0) + 1
                    return self._servers[model]
                busy = any(self._inflight.get(m, 0) for m in self._servers if m != model)
                if not self._swapping and not busy:
                    break
                self._cond.wait(1.0)
            self._swapping = True
            victims = [m for m in self._servers if m != model]
            for victim in victims:
                self._states[victim] = "stopping"
        try:
            self._manager.submit(self._swap, victims, model).result()
        finally:
            with self._cond:
                self._swapping = False
                self._cond.notify_all()
        return self.acquire(model)

    def _swap(self, victims: list[str], model: str) -> None:
        for victim in victims:
            self._stop_one(victim)
        self._start_one(model)

    def release(self, model: str) -> None:
        with self._cond:
            self._inflight[model] -= 1
            self._cond.notify_all()

    def _start_one(self, model: str) -> None:
        server = self.factories[model](free_port())
        with self._cond:
            self._servers[model] = server
            self._states[model] = "starting"
            self.events.append(("start", model))
        try:
            server.start()
        except Exception as e:  # noqa: BLE001 - the handler answers 502 with what happened
            with self._cond:
                self._servers.pop(model, None)
                self._states.pop(model, None)
            raise SwapError(f"model {model} failed to start: {e}") from None
        with self._cond:
            self._states[model] = "ready"

    def _stop_one(self, model: str) -> None:
        with self._cond:
            server = self._servers.get(model)
            self._states[model] = "stopping"
        if server is not None:
            server.stop()
        with self._cond:
            self._servers.pop(model, None)
            self._states.pop(model, None)
            self.events.append(("stop", model))
            self._cond.notify_all()

    def unload(self, model: str | None = None) -> None:
        """Stop one model (or all) at once and return when stopped, as llama-swap's Unload
        does (requests in flight on it are cut)."""
        with self._cond:
            targets = [m for m in self._servers if model is None or m == model]
        for target in targets:
            self._manager.submit(self._stop_one, target).result()


# ---- HTTP ----------------------------------------------------------------------------------

def _handler(swap: FakeLlamaSwap) -> type[BaseHTTPRequestHandler]:
    class Handler(_SwapHandler):
        pass

    Handler.swap = swap
    return Handler


class _SwapHandler(BaseHTTPRequestHandler):
    swap: FakeLlamaSwap
    protocol_version = "HTTP/1.0"  # each answer ends with the connection: streams need no framing

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet tests
        return

    def do_GET(self) -> None:  # noqa: N802
        self._route("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._route("POST")

    def _route(self, method: str) -> None:
        parts = urlsplit(self.path)
        path, query = parts.path, parse_qs(parts.query)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if path.startswith("/upstream/"):
            return self._upstream(method, path, parts.query, body)
        if method == "GET" and path == "/health":
            return self._text(200, "OK")
        if method == "GET" and path == "/running":
            running = self.swap.running()
            return self._json(200, {"running": [
                {"model": m, "state": s, "cmd": "", "proxy": "", "ttl": 0, "name": "",
                 "description": ""} for m, s in sorted(running.items())]})
        if method == "GET" and path in ("/v1/models", "/models"):
            running = self.swap.running()
            return self._json(200, {"object": "list", "data": [
                {"id": m, "object": "model", "owned_by": "llama-swap",
                 "status": {"value": "loaded" if m in running else "unloaded"}}
                for m in sorted(self.swap.factories)]})
        if method == "GET" and path == "/unload":
            self.swap.unload()
            return self._text(200, "OK")
        if method == "POST" and path.startswith("/api/models/unload/"):
            model = unquote(path.removeprefix("/api/models/unload/"))
            if model not in self.swap.factories:
                return self._error(404, "model not found")
            self.swap.unload(model)
            return self._text(200, "OK")
        if method == "GET" and path == "/props":
            return self._dispatch(method, (query.get("model") or [""])[0], path, parts.query,
                                  body)
        if method == "POST" and path in MODEL_ROUTES:
            try:
                model = json.loads(body or b"{}").get("model", "")
            except (ValueError, AttributeError):
                model = ""
            return self._dispatch(method, model if isinstance(model, str) else "", path,
                                  parts.query, body)
        return self._error(404, f"no route for {method} {path}")

    def _upstream(self, method: str, path: str, query: str, body: bytes) -> None:
        model, _, rest = path.removeprefix("/upstream/").partition("/")
        model = unquote(model)
        rest = "/" + rest
        if model not in self.swap.factories:
            return self._error(404, "model not found")
        if rest.endswith(IGNORED_SUFFIXES) and self.swap.running().get(model) != "ready":
            return self._error(409, f"model {model} is not loaded; path matches "
                                    f"upstream.ignorePaths")
        self._dispatch(method, model, rest, query, body)

    def _dispatch(self, method: str, model: str, path: str, query: str, body: bytes) -> None:
        if not model:
            return self._error(400, "could not find a model in the request")
        if model not in self.swap.factories:
            return self._error(404, f"could not find suitable handler for {model}")
        try:
            server = self.swap.acquire(model)
        except SwapError as e:
            return self._error(502, str(e))
        try:
            self._forward(server.port, method, path + (f"?{query}" if query else ""), body)
        finally:
            self.swap.release(model)

    def _forward(self, port: int, method: str, target: str, body: bytes) -> None:
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=PROXY_TIMEOUT_S)
        answered = False
        try:
            conn.request(method, target, body if method == "POST" else None, headers)
            resp = conn.getresponse()
            answered = True
            self.send_response(resp.status)
            for name, value in resp.getheaders():
                if name.lower() not in HOP_HEADERS:
                    self.send_header(name, value)
            self.end_headers()
            while chunk := resp.read1(65536):
                self.wfile.write(chunk)
                self.wfile.flush()
        except (OSError, http.client.HTTPException) as e:
            if not answered:  # after the status line, closing the connection says it all
                self._error(502, f"upstream: {type(e).__name__}")
        finally:
            conn.close()

    def _json(self, status: int, data: Any) -> None:
        self._send(status, json.dumps(data).encode(), "application/json")

    def _text(self, status: int, text: str) -> None:
        self._send(status, text.encode(), "text/plain; charset=utf-8")

    def _error(self, status: int, message: str) -> None:
        self._json(status, {"error": {"code": status, "message": message}})

    def _send(self, status: int, raw: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)


def llama_factory(workdir: Path, **kwargs: Any) -> Callable[[int], LlamaServer]:
    """A model of the fake: a real LlamaServer (test model, testbed flags) on the port given,
    its log in `workdir`."""
    return lambda port: LlamaServer(workdir, port=port, **kwargs)
