"""The Ollama surface: the mitmproxy side of ollama.py. Listed before SlotKeeper, it rewrites
`/api/chat` and `/api/generate` into llama-server completion requests (which SlotKeeper then
routes, pins and saves like any other) and leaves a Translation that turns the answer back
into Ollama's. Model listings are rewritten to llama-server's `/v1/models` and `/props`;
`/api/version`, `/` and OpenWebUI's load/unload calls are answered here."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import requests
from mitmproxy import ctx, exceptions, http

from . import bodies, ollama
from .bodies import BodyError, BodyRefused
from .ollama import AnswerShaper, Mapped, OllamaError, StreamTranslator
from .translation import TRANSLATION_KEY

log = logging.getLogger("slotkeeper.ollama")

TOKENIZE_TIMEOUT_S = 30.0
DEFAULT_MAX_BODY_MB = 32


def ollama_response(status: int, payload: Any) -> http.Response:
    return http.Response.make(status, json.dumps(payload), {"Content-Type": "application/json"})


def ollama_error(status: int, message: str) -> http.Response:
    return http.Response.make(status, ollama.error_body(message),
                              {"Content-Type": "application/json"})


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
            message = ollama.upstream_error(response.status_code, raw)
            _replace(response, response.status_code, ollama.error_body(message))
            return
        try:
            payload = self.convert(json.loads(raw))
        except OllamaError as e:
            _replace(response, e.status, ollama.error_body(e.message))
            return
        except (ValueError, UnicodeDecodeError):
            _replace(response, 502, ollama.error_body("llama-server's answer is not JSON"))
            return
        _replace(response, 200, json.dumps(payload, ensure_ascii=False).encode())


def _replace(response: http.Response, status: int, body: bytes) -> None:
    response.status_code = status
    response.reason = ""
    for name in ("content-encoding", "transfer-encoding"):
        response.headers.pop(name, None)
    response.headers["content-type"] = "application/json"
    response.content = body


class OllamaSurface:
    def __init__(self) -> None:
        self.port = 11434
        # Tokenizing a raw/context prompt is a blocking call to llama-server.
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

    def done(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    # ---- routing ---------------------------------------------------------------------------

    def request(self, flow: http.HTTPFlow) -> Awaitable[None] | None:
        """Ollama's routes; any other request passes on without a coroutine being made for it
        (every request meets this hook)."""
        if flow.response is not None:
            return None
        req = flow.request
        path = req.path.split("?", 1)[0]
        if len(path) > 1:
            path = path.rstrip("/")
        if path == "/":
            if req.method in ("GET", "HEAD") and self._on_ollama_port(flow):
                flow.response = http.Response.make(200, ollama.RUNNING_TEXT,
                                                   {"Content-Type": "text/plain; charset=utf-8"})
            return None
        if not path.startswith("/api/") or path.startswith("/api/sessions"):
            return None
        flow.marked = ":gear:"  # ⚙ like the session API: answered by the proxy itself
        return self._answer(flow, path)

    async def _answer(self, flow: http.HTTPFlow, path: str) -> None:
        try:
            await self._dispatch(flow, path)
        except OllamaError as e:
            flow.response = ollama_error(e.status, e.message)
            log.info("%s %s answered %d: %s", flow.request.method, path, e.status, e.message)

    def _on_ollama_port(self, flow: http.HTTPFlow) -> bool:
        sockname = flow.client_conn.sockname
        return bool(self.port) and bool(sockname) and sockname[1] == self.port

    async def _dispatch(self, flow: http.HTTPFlow, path: str) -> None:
        method = flow.request.method
        if path == "/api/version":
            _expect(method, "GET")
            flow.response = ollama_response(200, {"version": ollama.OLLAMA_VERSION})
        elif path in ("/api/tags", "/api/ps"):
            _expect(method, "GET")
            answer = ollama.tags_answer if path == "/api/tags" else ollama.ps_answer
            _rewrite(flow, "GET", "/v1/models", None)
            _translate(flow, OllamaTranslation(answer))
        elif path == "/api/show":
            _expect(method, "POST")
            model = ollama.model_of(ollama.request_object(self._body(flow)))
            _rewrite(flow, "GET", "/props", None)
            _translate(flow, OllamaTranslation(lambda props: ollama.show_answer(props, model)))
        elif path in ("/api/chat", "/api/generate"):
            _expect(method, "POST")
            await self._completion(flow, path)
        elif path in ("/api/embed", "/api/embeddings"):
            _expect(method, "POST")
            legacy = path == "/api/embeddings"
            mapped = ollama.embed_request(self._body(flow), legacy)
            self._send(flow, path, mapped)
            shaper = AnswerShaper(mapped)
            _translate(flow, OllamaTranslation(lambda data: shaper.embeddings(data, legacy)))
        elif path in ollama.UNSUPPORTED_ROUTES or path.startswith("/api/blobs"):
            raise OllamaError(501, f"{path} is not supported: slotkeeper serves the model "
                                   f"llama-server was started with and manages no models")
        # Any other /api/ path is not Ollama's: it passes on unchanged.

    async def _completion(self, flow: http.HTTPFlow, path: str) -> None:
        body = self._body(flow)
        if ollama.is_load_or_unload(body, path):
            answer = ollama.load_answer(ollama.request_object(body), path)
            flow.response = ollama_response(200, answer)
            flow.comment = f"Ollama {answer['done_reason']}: answered by slotkeeper"
            log.info("%s with nothing to run (%s): answered without llama-server", path,
                     answer["done_reason"])
            return
        if path == "/api/chat":
            mapped = ollama.chat_request(body)
        else:
            url = f"{flow.request.scheme}://{flow.request.host}:{flow.request.port}"
            mapped = await asyncio.get_running_loop().run_in_executor(
                self.pool, ollama.generate_request, body,
                lambda text, special: tokenize(url, text, special))
        self._send(flow, path, mapped)
        shaper = AnswerShaper(mapped)
        streamer = StreamTranslator(shaper) if mapped.stream else None
        _translate(flow, OllamaTranslation(shaper.whole, streamer))

    def _send(self, flow: http.HTTPFlow, path: str, mapped: Mapped) -> None:
        _rewrite(flow, "POST", mapped.path, mapped.body)
        flow.comment = f"Ollama {path} -> {mapped.path}"
        if mapped.ignored:
            log.info("%s: ignored %s (llama-server has no per-request equivalent)", path,
                     ", ".join(mapped.ignored))

    def _body(self, flow: http.HTTPFlow) -> Any:
        raw = flow.request.raw_content
        limit = _max_body_bytes()
        if raw is None:
            raise OllamaError(400, "request body was streamed, not read")
        if len(raw) > limit:
            raise OllamaError(413, f"request body of {len(raw)} bytes exceeds {limit} bytes "
                                   f"(slotkeeper_max_body_mb)")
        try:
            decoded = bodies.decode_body(raw, flow.request.headers.get("content-encoding", ""),
                                         limit)
        except BodyRefused as e:
            raise OllamaError(e.status, str(e)) from None
        except BodyError as e:
            raise OllamaError(400, str(e)) from None
        if not decoded.strip():
            return {}
        try:
            return json.loads(decoded)
        except RecursionError:
            raise OllamaError(400, "request body is JSON nested too deeply") from None
        except ValueError as e:
            raise OllamaError(400, f"request body is not JSON: {str(e)[:200]}") from None


def _expect(method: str, wanted: str) -> None:
    if method != wanted:
        raise OllamaError(405, f"method {method} not allowed: use {wanted}")


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
    req.headers["content-type"] = "application/json"
    req.content = json.dumps(body, ensure_ascii=False).encode()
    req.headers["content-length"] = str(len(req.content))


def _translate(flow: http.HTTPFlow, translation: OllamaTranslation) -> None:
    flow.metadata[TRANSLATION_KEY] = translation


def _max_body_bytes() -> int:
    mb = getattr(ctx.options, "slotkeeper_max_body_mb", DEFAULT_MAX_BODY_MB)
    return mb * 1024 * 1024


def tokenize(url: str, text: str, add_special: bool) -> list[int]:
    """Token ids of `text` from llama-server's own tokenizer (special tokens such as
    `<start_of_turn>` in a raw prompt are parsed, as Ollama does)."""
    try:
        r = requests.post(url + "/tokenize", json={"content": text, "add_special": add_special,
                                                   "parse_special": True},
                          timeout=TOKENIZE_TIMEOUT_S)
    except requests.RequestException as e:
        raise OllamaError(502, f"llama-server did not tokenize the prompt: {e}") from None
    if r.status_code != 200:
        raise OllamaError(r.status_code, ollama.upstream_error(r.status_code, r.content))
    try:
        tokens = r.json().get("tokens")
    except (ValueError, AttributeError):
        tokens = None
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise OllamaError(502, "llama-server's /tokenize answer has no token list")
    return tokens
