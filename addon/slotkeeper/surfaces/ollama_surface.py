"""The Ollama surface: the mitmproxy side of the ollama_* modules. Handed each request before
SlotKeeper (front.py), it rewrites `/api/chat` and `/api/generate` into llama-server completion
requests (which SlotKeeper then routes, pins and saves like any other) and leaves a Translation
that turns the answer back into Ollama's. `/api/tags` and `/api/ps` are rewritten to
llama-server's `/v1/models` and `/api/show` to `/props`; `/api/version`, `/`, CORS preflights
and OpenWebUI's load/unload calls are answered here."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import requests
from mitmproxy import ctx, exceptions, http

from ..guard import cors, origins
from ..store.memories import MAX_REMEMBERED_SESSIONS, Recent
from ..wire import bodies, replies
from ..wire.bodies import BodyError, BodyRefused
from ..wire.translation import TRANSLATION_KEY
from . import ollama, ollama_models, ollama_requests
from .ollama import Mapped, OllamaError
from .ollama_answers import AnswerShaper, StreamTranslator
from .ollama_models import ModelFiles

log = logging.getLogger("slotkeeper.ollama")

UPSTREAM_TIMEOUT_S = 30.0  # /tokenize and /apply-template


class OllamaTranslation:
    """A Translation (translation.py) for one Ollama request: `convert` turns llama-server's
    JSON answer into Ollama's; a streamed answer goes through a StreamTranslator."""

    def __init__(self, convert: Callable[[Any], Any], stream: StreamTranslator | None = None
                 ) -> None:
        self.convert = convert
        self.translator = stream

    def response_headers(self, response: http.Response) -> None:
        response.headers["content-type"] = ollama.NDJSON
        response.headers.pop("content-length", None)

    def stream(self, chunk: bytes) -> bytes:
        if self.translator is None:
            return chunk
        return self.translator.feed(chunk)

    def whole(self, response: http.Response) -> None:
        raw = response.content or b""
        if response.status_code != 200:
            # llama-server's (or mitmproxy's) error, in Ollama's shape and with its status.
            _replace(response, response.status_code,
                     ollama.upstream_error(response.status_code, raw))
            return
        try:
            payload = self.convert(json.loads(raw))
        except OllamaError as e:
            _replace(response, e.status, e.message)
            return
        except (ValueError, UnicodeDecodeError, RecursionError):
            _replace(response, 502, "llama-server's answer is not JSON")
            return
        _replace(response, 200, payload=payload)


def _replace(response: http.Response, status: int, error: str = "", payload: Any = None
             ) -> None:
    """Rewrite `response` in place into Ollama's answer (`payload`) or error."""
    made = replies.json_reply(status, payload) if not error else replies.error_reply(
        status, error, replies.OLLAMA)
    response.status_code = status
    response.reason = ""
    for name in ("content-encoding", "transfer-encoding"):
        response.headers.pop(name, None)
    response.headers["content-type"] = "application/json"
    response.content = made.content


class OllamaSurface:
    def __init__(self, keeper) -> None:
        self.keeper = keeper  # its max_body_bytes bounds what is read here too
        self.port = 11434
        self.allowed_origin: cors.Allowed = cors.loopback_origin
        self.files = ModelFiles()
        self._warmed: set[str] = set()  # servers whose model file was read off the event loop
        # (client, setting=value) already logged as ignored: a client that sends num_ctx on
        # every request is told once, not on every request (issue #32).
        self._said_ignored: Recent[tuple[str, str, str], bool] = Recent(MAX_REMEMBERED_SESSIONS)
        # Tokenizing, templating and the model facts are blocking calls to llama-server.
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="slotkeeper-ollama")

    def load(self, loader) -> None:
        loader.add_option("slotkeeper_ollama_port", int, 11434,
                          "The listening port where `GET /` and `HEAD /` answer \"Ollama is "
                          "running\" (Ollama clients probe it); 0: on no port. The /api/... "
                          "routes of Ollama are translated on every port.")

    def configure(self, updated: set[str]) -> None:
        if "slotkeeper_ollama_port" in updated:
            port = ctx.options.slotkeeper_ollama_port
            if not 0 <= port <= 65535:
                raise exceptions.OptionsError("slotkeeper_ollama_port must be 0-65535")
            self.port = port
        if "slotkeeper_ollama_origins" in updated:  # declared by the browser guard (issue #21)
            extra = tuple(ctx.options.slotkeeper_ollama_origins)
            self.allowed_origin = lambda origin: origins.origin_allowed(origin, extra)

    def done(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    # ---- routing ---------------------------------------------------------------------------

    def on_request(self, flow: http.HTTPFlow) -> Awaitable[None] | None:
        """Ollama's routes; any other request passes on without a coroutine being made for it
        (every request comes here, from front.Front)."""
        if flow.response is not None:
            return None
        req = flow.request
        path = bodies.route_of(req.path)
        if path != "/" and (not path.startswith("/api/") or path.startswith("/api/sessions")
                            or path.startswith("/api/upstreams")):
            return None
        origin = req.headers.get("origin", "")
        if cors.is_preflight(req.method, origin,
                             req.headers.get("access-control-request-method", "")):
            status, headers = cors.preflight(origin, self.allowed_origin)
            flow.response = http.Response.make(status, b"", headers)
            flow.marked = ":gear:"
            return None
        # The guard decided them already where it runs; the same rule either way.
        flow.metadata.setdefault(cors.ANSWER_KEY,
                                 cors.answer_headers(origin, self.allowed_origin))
        if path == "/":
            if req.method in ("GET", "HEAD") and self._on_ollama_port(flow):
                flow.response = http.Response.make(200, ollama.RUNNING_TEXT,
                                                   {"Content-Type": "text/plain; charset=utf-8"})
            return None
        flow.marked = ":gear:"  # ⚙ like the session API: answered by the proxy itself
        return self._answer(flow, path)

    async def _answer(self, flow: http.HTTPFlow, path: str) -> None:
        try:
            await self._dispatch(flow, path)
        except OllamaError as e:
            flow.response = replies.error_reply(e.status, e.message, replies.OLLAMA)
            log.info("%s %s answered %d: %s", flow.request.method, path, e.status, e.message)

    def _on_ollama_port(self, flow: http.HTTPFlow) -> bool:
        sockname = flow.client_conn.sockname
        return bool(self.port) and bool(sockname) and sockname[1] == self.port

    async def _dispatch(self, flow: http.HTTPFlow, path: str) -> None:
        method = flow.request.method
        if path == "/api/version":
            _expect(method, "GET")
            flow.response = replies.json_reply(200, {"version": ollama.OLLAMA_VERSION})
        elif path in ("/api/tags", "/api/ps"):
            _expect(method, "GET")
            await self._warm(flow)
            files = self.files
            answer = (ollama_models.tags_answer if path == "/api/tags"
                      else ollama_models.ps_answer)
            _rewrite(flow, "GET", "/v1/models", None)
            _translate(flow, OllamaTranslation(lambda models: answer(models, files)))
        elif path == "/api/show":
            _expect(method, "POST")
            model = ollama_requests.model_of(ollama_requests.request_object(self._body(flow)))
            await self._warm(flow)
            files = self.files
            _rewrite(flow, "GET", "/props", None)
            _translate(flow, OllamaTranslation(
                lambda props: ollama_models.show_answer(props, model, files)))
        elif path in ("/api/chat", "/api/generate"):
            _expect(method, "POST")
            await self._completion(flow, path)
        elif path in ("/api/embed", "/api/embeddings"):
            _expect(method, "POST")
            legacy = path == "/api/embeddings"
            body = self._body(flow)
            mapped = ollama_requests.embed_request(body, legacy)
            self._send(flow, path, mapped, body)
            shaper = AnswerShaper(mapped)
            _translate(flow, OllamaTranslation(lambda data: shaper.embeddings(data, legacy)))
        elif path in ollama.UNSUPPORTED_ROUTES or path.startswith("/api/blobs"):
            raise OllamaError(501, f"{path} is not supported: slotkeeper serves the model "
                                   f"llama-server was started with and manages no models")
        # Any other /api/ path is not Ollama's: it passes on unchanged.

    async def _warm(self, flow: http.HTTPFlow) -> None:
        """Read the server's model file (its GGUF header, ~0.1 s) in a worker thread once, so
        the listing's translation, in a response hook, finds it cached."""
        url = _server_url(flow)
        if url not in self._warmed:
            self._warmed.add(url)
            await self._run(_read_model_facts, url, self.files)

    async def _run(self, func: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, func, *args)

    async def _completion(self, flow: http.HTTPFlow, path: str) -> None:
        body = self._body(flow)
        if ollama_requests.is_load_or_unload(body, path):
            answer = ollama_requests.load_answer(ollama_requests.request_object(body), path)
            flow.response = replies.json_reply(200, answer)
            flow.comment = f"Ollama {answer['done_reason']}: answered by slotkeeper"
            log.info("%s with nothing to run (%s): answered without llama-server", path,
                     answer["done_reason"])
            return
        if path == "/api/chat":
            mapped = ollama_requests.chat_request(body)
        else:
            url = _server_url(flow)
            mapped = await self._run(
                ollama_requests.generate_request, body,
                lambda text, special: tokenize(url, text, special),
                lambda messages, fields: render(url, messages, fields))
        self._send(flow, path, mapped, body)
        shaper = AnswerShaper(mapped)
        streamer = StreamTranslator(shaper) if mapped.stream else None
        _translate(flow, OllamaTranslation(shaper.whole, streamer))

    def _send(self, flow: http.HTTPFlow, path: str, mapped: Mapped, body: Any) -> None:
        _rewrite(flow, "POST", mapped.path, mapped.body)
        flow.comment = f"Ollama {path} -> {mapped.path}"
        if mapped.ignored:
            self._say_ignored(flow, path, ollama.ignored_settings(body, mapped.ignored))

    def _say_ignored(self, flow: http.HTTPFlow, path: str, settings: list[str]) -> None:
        """One log line for the settings this client has not sent with these values before
        (a client: its address and User-Agent)."""
        peer = flow.client_conn.peername
        client = (str(peer[0]) if peer else "", flow.request.headers.get("user-agent", ""))
        fresh = [s for s in settings if (*client, s) not in self._said_ignored]
        for setting in fresh:
            self._said_ignored[(*client, setting)] = True
        if fresh:
            log.info("%s: ignored %s (llama-server has no per-request equivalent; said once "
                     "per client and value)", path, ", ".join(fresh))

    def _body(self, flow: http.HTTPFlow) -> Any:
        """The request's JSON (an empty body is {}): the one body read (bodies.read_body)."""
        try:
            decoded = bodies.read_body(flow.request.raw_content,
                                       flow.request.headers.get("content-encoding", ""),
                                       self.keeper.max_body_bytes)
            return bodies.parse_json(decoded) if decoded.strip() else {}
        except BodyRefused as e:
            raise OllamaError(e.status, str(e)) from None
        except BodyError as e:
            raise OllamaError(400, f"request {e}" if str(e).startswith("body") else str(e)
                              ) from None


def _expect(method: str, wanted: str) -> None:
    if method != wanted:
        raise OllamaError(405, f"method {method} not allowed: use {wanted}")


def _server_url(flow: http.HTTPFlow) -> str:
    return f"{flow.request.scheme}://{flow.request.host}:{flow.request.port}"


def _rewrite(flow: http.HTTPFlow, method: str, path: str, body: dict[str, Any] | None) -> None:
    req = flow.request
    req.method = method
    req.path = path
    for name in ("content-encoding", "transfer-encoding", "accept-encoding"):
        req.headers.pop(name, None)  # our translation reads the answer as plain bytes
    if body is None:
        req.headers.pop("content-type", None)
        req.content = b""
        req.headers.pop("content-length", None)
        return
    text = json.dumps(body, ensure_ascii=False).encode()
    req.headers["content-type"] = "application/json"
    req.content = text
    req.headers["content-length"] = str(len(text))
    # SlotKeeper reads this body next: it need not decode and parse it again.
    flow.metadata[bodies.PARSED_KEY] = (text, body)


def _translate(flow: http.HTTPFlow, translation: OllamaTranslation) -> None:
    flow.metadata[TRANSLATION_KEY] = translation


def _post(url: str, path: str, payload: dict[str, Any], what: str) -> Any:
    try:
        r = requests.post(url + path, json=payload, timeout=UPSTREAM_TIMEOUT_S)
    except requests.RequestException as e:
        raise OllamaError(502, f"llama-server did not {what}: {e}") from None
    return _json_of(r, path)


def _json_of(r: requests.Response, path: str) -> Any:
    if r.status_code != 200:
        raise OllamaError(r.status_code, ollama.upstream_error(r.status_code, r.content))
    try:
        return r.json()
    except ValueError:
        raise OllamaError(502, f"llama-server's {path} answer is not JSON") from None


def _read_model_facts(url: str, files: ModelFiles) -> None:
    """The model's GGUF header (when its file is on this machine) and what /v1/models says of
    it (the parameter count, also for a remote server), into `files`."""
    try:
        props = requests.get(url + "/props", timeout=UPSTREAM_TIMEOUT_S).json()
        models = requests.get(url + "/v1/models", timeout=UPSTREAM_TIMEOUT_S).json()
    except (requests.RequestException, ValueError):
        return  # the listing's own request to the server will say what is wrong
    path = props.get("model_path") if isinstance(props, dict) else None
    if not isinstance(path, str):
        return
    files.metadata(path)
    served = ollama_models.served_meta(models)
    if served:
        files.remember_served(path, served)


def tokenize(url: str, text: str, add_special: bool) -> list[int]:
    """Token ids of `text` from llama-server's own tokenizer (special tokens such as
    `<start_of_turn>` in a raw prompt are parsed, as Ollama does)."""
    answer = _post(url, "/tokenize", {"content": text, "add_special": add_special,
                                      "parse_special": True}, "tokenize the prompt")
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise OllamaError(502, "llama-server's /tokenize answer has no token list")
    return tokens


def render(url: str, messages: list[dict[str, Any]], fields: dict[str, Any]) -> str:
    """The prompt llama-server's chat template makes of `messages` (its /apply-template)."""
    answer = _post(url, "/apply-template", {"messages": messages, **fields},
                   "apply its chat template")
    prompt = answer.get("prompt") if isinstance(answer, dict) else None
    if not isinstance(prompt, str):
        raise OllamaError(502, "llama-server's /apply-template answer has no prompt")
    return prompt
