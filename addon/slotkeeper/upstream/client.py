"""The blocking HTTP client for llama-server's admin endpoints. Runs in worker threads only."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import requests
import urllib3
from mitmproxy.proxy.mode_specs import ProxyMode, ReverseMode

from ..decisions import fingerprints
from ..decisions.choice import SlotView
from .costs import Costs
from .model_digest import content_digest
from .slotcalls import SlotCalls

log = logging.getLogger("slotkeeper")


class UpstreamError(Exception):
    """llama-server did not answer as expected; the message says what happened."""


class SlotActionsDisabled(UpstreamError):
    """save/restore/erase answered 501: the server runs without --slot-save-path."""


class SlotsUnavailable(UpstreamError):
    """GET /slots is disabled (--no-slots), failing or too slow: fall back to hashing."""


class Unauthorized(UpstreamError):
    """401: the server runs with --api-key and slotkeeper has not got (the right) one."""


class SlotCallTimeout(UpstreamError):
    """A save/restore/erase got no answer within its bound: go on without that snapshot. The
    server is marked suspect only when it is not busy computing (then it may be hung)."""


UPSTREAM_KEY_OPTION = "slotkeeper_upstream_api_key"
UPSTREAM_KEY_ENV = "SLOTKEEPER_UPSTREAM_API_KEY"
# A slot call is bounded by what it has to do (issue #31): a fixed allowance (connecting, a
# small file), its bytes at the slower of 50 MB/s (a slow network disk: measured here, a 14 MB
# snapshot saves in ~7 ms, 2-3 GB/s) and a quarter of the rate measured on this server (a slow
# disk or a FUSE folder is slower than any floor), and what the server may be busy with: it
# runs slot calls on its main loop between two batches, so behind another slot's prefill a
# call waits up to one batch (llama-server's default -b, 2048 tokens), counted twice over at
# the measured prefill speed (a long prompt's batches run slower than the short answers that
# measured it). A 2 GB snapshot of a large model on a GPU: 5 + 41 + ~1 s.
SLOT_CALL_BASE_S = 5.0
SLOT_IO_FLOOR_BYTES_PER_S = 50 * 1024 * 1024
BATCH_TOKENS = 2048
# The prompt of a hand-back (Upstream.hand_back): one token that no chat template starts
# with, so that it shares at most the BOS token with any prompt and the server takes it as
# another conversation; short, as the server evaluates it.
HAND_BACK_PROMPT = "\n"


def slot_call_timeout(nbytes: int, io_bytes_per_s: float | None = None,
                      prefill_tokens_per_s: float | None = None) -> float:
    """Seconds to wait for a save or restore of about `nbytes` (0: unknown) on a server whose
    measured slot I/O and prefill speeds are given (None: not measured yet)."""
    rate = SLOT_IO_FLOOR_BYTES_PER_S
    if io_bytes_per_s:
        rate = min(rate, io_bytes_per_s / 4)
    busy = 2 * BATCH_TOKENS / prefill_tokens_per_s if prefill_tokens_per_s else 0.0
    return SLOT_CALL_BASE_S + max(nbytes, 0) / rate + busy


def unauthorized_message(url: str) -> str:
    return (f"{url} answered 401 Unauthorized: it runs with --api-key; set "
            f"{UPSTREAM_KEY_OPTION} (or ${UPSTREAM_KEY_ENV}) to its key")


@dataclass(frozen=True)
class ServerProps:
    total_slots: int
    n_ctx: int  # per slot
    model_path: str
    build_info: str
    raw: dict[str, Any]
    # What else the server says about what its KV cells mean (kv_identity): the model's
    # shape, the LoRA adapters. "" when not read (older callers).
    identity: str = ""
    # The model file's content digest (model_digest), "" when this proxy cannot read it.
    content: str = ""

    @property
    def fingerprint(self) -> str:
        """What a state file belongs to: every part of the server's answers that changes what
        a KV cell means (issue #21, item 4), the same whichever proxy on whichever host reads
        them (issue #33): nothing of the proxy's own view of the file (path, inode, mtime).
        A snapshot of another model restores without complaint when its shapes match, and its
        token ids still match the prompt, so the server would reuse KV computed by another
        model. n_ctx per slot is in too (with context-dependent rope scaling the same token's
        K differs). The model file's content digest follows a dot when this proxy could read
        the file: fingerprints.same_model compares it only when both sides have one."""
        key = json.dumps([self.build_info, self.total_slots, self.n_ctx,
                          self.raw.get("model_ftype"), file_name(self.model_path),
                          _text_digest(self.raw.get("chat_template")), self.identity])
        return fingerprints.compose(hashlib.sha256(key.encode()).hexdigest()[:16], self.content)


def file_name(path: object) -> str:
    """The last part of a path as the server wrote it (POSIX or Windows): a copy of one GGUF
    at another folder on another host has the same name."""
    return str(path or "").replace("\\", "/").rsplit("/", 1)[-1]


def _text_digest(text: object) -> str:
    return hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()[:16] \
        if isinstance(text, str) else ""


def lora_identity(adapters: object) -> list[list[Any]] | None:
    """The LoRA adapters by file name and scale (their folder differs from host to host)."""
    if not isinstance(adapters, list):
        return None
    return [[file_name(a.get("path")), a.get("scale")] for a in adapters if isinstance(a, dict)]


class Upstream:
    def __init__(self, base_url: str, timeout: float = 1.0, admin_timeout: float = 600.0,
                 api_key: str = "", on_hang: Callable[[], None] | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout  # for /slots and /props: slower than this means fall back
        self.admin_timeout = admin_timeout  # templates, prefills: the server computes
        self.api_key = api_key  # llama-server's --api-key, sent on slotkeeper's own calls
        self.on_hang = on_hang  # a slot call timed out (the router marks the server suspect)
        self._local = threading.local()  # requests.Session is not thread-safe: one per thread
        # Set when save/restore/erase answered 501 (no --slot-save-path); reset when the
        # server is verified again (it may come back with the flag).
        self.slot_actions_disabled = False
        # What this server costs, measured from its answers and slot calls (issue #31).
        self.costs = Costs()
        self.calls = SlotCalls()  # slot calls in flight; the last /slots view

    @property
    def _http(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
            if self.api_key:
                session.headers["Authorization"] = f"Bearer {self.api_key}"
        return session

    def _send(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        """One request on this thread's kept-alive connection, sent once more on a fresh one
        when the server closed the old one as it was reused: llama-server drops a connection
        idle for 5 s (cpp-httplib's keep-alive timeout), and a request sent in that instant
        meets a closed socket, which requests never retries for a POST (a slot save failed so
        in CI). Every call here may be repeated: reads, and slot actions on one file."""
        url = self.base_url + path
        try:
            return self._http.request(method, url, **kwargs)
        except requests.ConnectionError as e:
            if not _dropped_on_reuse(e):
                raise
        return self._http.request(method, url, **kwargs)

    def _get(self, path: str, optional: bool = False) -> Any:
        """GET one of the server's endpoints, its JSON. `optional`: an endpoint some servers
        do not have, None for its 404/501 (not there is stable; any other failure raises)."""
        try:
            r = self._send("GET", path, timeout=self.timeout)
        except requests.RequestException as e:
            raise UpstreamError(f"GET {path}: {type(e).__name__}") from None
        if optional and r.status_code in (404, 501):
            return None
        if r.status_code == 401:
            raise Unauthorized(unauthorized_message(self.base_url))
        if r.status_code != 200:
            raise UpstreamError(f"GET {path}: HTTP {r.status_code}")
        try:
            return r.json()
        except ValueError:
            raise UpstreamError(f"GET {path}: not JSON") from None

    def props(self) -> ServerProps:
        """/props, and what else tells what the server's KV means (kv_identity). Any of them
        failing fails the whole read (no partial fingerprint: it would look like another
        server and drop every claim)."""
        data = self._get("/props")
        if not isinstance(data, dict):
            raise UpstreamError("GET /props: not an object")
        settings = data.get("default_generation_settings") or {}
        try:
            model_path = str(data.get("model_path", ""))
            return ServerProps(
                total_slots=int(data.get("total_slots", 0)),
                n_ctx=int(settings.get("n_ctx", 0)) if isinstance(settings, dict) else 0,
                model_path=model_path,
                build_info=str(data.get("build_info", "")),
                raw=data,
                identity=self.kv_identity(model_path),
                content=content_digest(model_path),
            )
        except (TypeError, ValueError):
            raise UpstreamError("GET /props: unexpected field types") from None

    def kv_identity(self, model_path: str) -> str:
        """The model's shape as /v1/models says it (parameters, tensor bytes, embedding and
        vocabulary sizes, training context), the LoRA adapters and their scales
        (/lora-adapters). Not visible over
        HTTP: rope/YaRN overrides and control vectors (docs/DESIGN.md); a KV cache of
        another type (-ctk/-ctv) is refused by the server's own restore."""
        models = self._get("/v1/models", optional=True)
        meta: Any = None
        if isinstance(models, dict) and isinstance(models.get("data"), list) and models["data"]:
            first = models["data"][0]
            meta = first.get("meta") if isinstance(first, dict) else None
        loras = lora_identity(self._get("/lora-adapters", optional=True))
        return json.dumps([meta, loras], sort_keys=True, default=str)

    def n_ctx_train(self) -> int:
        """The model's training context (GET /v1/models meta), 0 when the server does not say."""
        try:
            data = self._get("/v1/models")
            return _int(data["data"][0]["meta"]["n_ctx_train"])
        except (UpstreamError, KeyError, IndexError, TypeError):
            return 0

    def slots(self) -> list[SlotView]:
        try:
            data = self._get("/slots")
        except UpstreamError as e:
            stand_in = self.calls.stand_in()
            if stand_in is not None:  # busy with our own save or restore, not dead
                return stand_in
            raise SlotsUnavailable(str(e)) from None
        if not isinstance(data, list):
            raise SlotsUnavailable("GET /slots: not a list")
        views = []
        for item in data:
            if not isinstance(item, dict) or not isinstance(item.get("id"), int):
                raise SlotsUnavailable("GET /slots: malformed slot entry")
            views.append(
                SlotView(
                    id=item["id"],
                    is_processing=bool(item.get("is_processing", False)),
                    n_tokens=_int(item.get("n_prompt_tokens", 0)),
                    n_ctx=_int(item.get("n_ctx", 0)),
                )
            )
        self.calls.last = views
        return views

    def post_json(self, path: str, body: dict[str, Any],
                  timeout: float | None = None) -> dict[str, Any]:
        """POST to one of the server's own endpoints (templates, a prefill), waiting as long
        as an admin call may (or `timeout`: a slot call's bound)."""
        try:
            with self.calls.running(path.startswith("/slots/")):
                r = self._send("POST", path, json=body,
                               timeout=self.admin_timeout if timeout is None else timeout)
        except requests.Timeout:
            if timeout is None:
                raise UpstreamError(f"POST {path}: Timeout") from None
            busy = self.busy()
            if not busy and self.on_hang is not None:
                self.on_hang()
            raise SlotCallTimeout(
                f"POST {path}: no answer in {timeout:.0f} s (the bound for its size and this "
                f"server's speed): " + ("the server is busy computing, not suspect" if busy
                                        else "server marked suspect")) from None
        except requests.RequestException as e:
            raise UpstreamError(f"POST {path}: {type(e).__name__}") from None
        if r.status_code == 401:
            raise Unauthorized(unauthorized_message(self.base_url))
        if r.status_code == 501 and path.startswith("/slots/"):
            self.slot_actions_disabled = True
            raise SlotActionsDisabled(f"POST {path}: llama-server runs without --slot-save-path")
        if r.status_code != 200:
            raise UpstreamError(f"POST {path}: HTTP {r.status_code} {r.text[:200]}")
        try:
            data = r.json()
        except ValueError:
            raise UpstreamError(f"POST {path}: not JSON") from None
        if not isinstance(data, dict):
            raise UpstreamError(f"POST {path}: not an object")
        return data

    def save(self, slot: int, filename: str, expected_bytes: int = 0) -> dict[str, Any]:
        rates = self.costs.rates()
        return self.post_json(f"/slots/{int(slot)}?action=save", {"filename": filename},
                              timeout=slot_call_timeout(expected_bytes, rates.save_bytes_per_s,
                                                        rates.prefill_tokens_per_s))

    def restore(self, slot: int, filename: str, nbytes: int = 0) -> dict[str, Any]:
        rates = self.costs.rates()
        return self.post_json(f"/slots/{int(slot)}?action=restore", {"filename": filename},
                              timeout=slot_call_timeout(nbytes, rates.restore_bytes_per_s,
                                                        rates.prefill_tokens_per_s))

    def erase(self, slot: int) -> dict[str, Any]:
        return self.post_json(f"/slots/{int(slot)}?action=erase", {}, timeout=slot_call_timeout(
            0, prefill_tokens_per_s=self.costs.rates().prefill_tokens_per_s))

    def hand_back(self, slot: int) -> dict[str, Any]:
        """Make llama-server park what `slot` holds in its RAM prompt cache and clear the
        slot: a one-token completion pinned there whose prompt shares nothing with it (the
        server swaps through its cache when a pinned request keeps under half of the slot;
        routing/ramhandover.py). Its KV moves in host memory, so the bound is a slot call's."""
        return self.post_json("/completion", {
            "prompt": HAND_BACK_PROMPT, "n_predict": 0, "id_slot": int(slot),
            "cache_prompt": True, "temperature": 0.0,
        }, timeout=slot_call_timeout(
            0, prefill_tokens_per_s=self.costs.rates().prefill_tokens_per_s))

    def busy(self) -> bool:
        """Is a slot computing (a prefill or a generation)? Then a slot call that waits is
        queued behind it, not lost in a hung server. False when /slots does not answer."""
        try:
            return any(view.is_processing for view in self.slots())
        except UpstreamError:
            return False

    def healthy(self) -> bool:
        try:
            r = self._send("GET", "/health", timeout=self.timeout)
        except requests.RequestException:
            return False
        return r.status_code == 200

    # ---- for the several-models clients (upstream_models.py) ----

    def get_json(self, path: str) -> Any:
        """GET a JSON answer (path may carry a query), with the short timeout of /slots."""
        return self._get(path)

    def post_text(self, path: str) -> str:
        """POST without a body to an endpoint that answers text (llama-swap's unload)."""
        try:
            r = self._send("POST", path, timeout=self.admin_timeout)
        except requests.RequestException as e:
            raise UpstreamError(f"POST {path}: {type(e).__name__}") from None
        if r.status_code != 200:
            raise UpstreamError(f"POST {path}: HTTP {r.status_code} {r.text[:200]}")
        return r.text


def _dropped_on_reuse(error: requests.ConnectionError) -> bool:
    """The connection was closed under a request (reset, or closed before any answer), not
    refused or timed out: a dead server refuses the fresh connection of the second try."""
    cause = error.args[0] if error.args else None
    return isinstance(cause, urllib3.exceptions.ProtocolError)


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def reverse_targets(modes: Sequence[str]) -> list[str]:
    """The base URLs of mitmproxy's reverse modes (`reverse:http://host:port@listen`), in the
    form addon.upstream_of gives flows; other modes have no fixed upstream."""
    urls = []
    for spec in modes:
        try:
            mode = ProxyMode.parse(spec)
        except ValueError:
            continue
        if isinstance(mode, ReverseMode) and mode.scheme in ("http", "https"):
            host, port = mode.address
            host = f"[{host}]" if ":" in host else host
            url = f"{mode.scheme}://{host}:{port}"
            if url not in urls:
                urls.append(url)
    return urls


def check_access(urls: Sequence[str], api_key: str, timeout: float = 5.0) -> list[str]:
    """At start: does each server take slotkeeper's own calls? A 401 (the server runs with
    --api-key and we have no key, or the wrong one) is one clear error line naming the
    option, not a silent fall back to hashing on every request. A server that is not up yet
    says nothing here (the health watcher and the first request deal with it). Returns the
    servers that refused."""
    refused = []
    for url in dict.fromkeys(urls):  # a pool member may also be the reverse mode's target
        try:
            Upstream(url, timeout=timeout, api_key=api_key).props()
        except Unauthorized as e:
            refused.append(url)
            # A warning, not an error: mitmdump exits on an error logged during its startup,
            # and the proxy must keep serving (clients' requests carry their own key).
            log.warning("%s", e)
        except UpstreamError:
            continue
    return refused
