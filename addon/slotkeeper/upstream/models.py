"""Models as a dimension (issue #22): one upstream per (server, model). Behind a llama-server
in router mode or llama-swap, each model has its own slots, so each model is keyed as its own
upstream (`http://host:port#model=NAME`) with a client bound to that model: the rooms (walk,
handover, accounting, upstreams) work on the key as on a single server's URL. A plain
llama-server keeps its plain URL as key.

Pure: keys and the choice of the model that goes. I/O: `ModelUpstream` (the per-model client,
worker threads only) and `detect` (what a base URL serves)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from urllib.parse import quote, unquote

import requests

from .client import SlotsUnavailable, Upstream, UpstreamError, lora_identity
from .upstream_models import (
    RUNNING_STATES,
    SwapClient,
    model_query,
    parse_models,
    parse_router_props,
    parse_running,
)

ROUTER = "router"  # llama-server --models-dir / --models-preset
SWAP = "llama-swap"
SINGLE = "single"  # one llama-server, one model: the base URL is the key

KEY_MARK = "#model="
DETECT_RETRY_S = 10.0


# ---- keys (pure) ---------------------------------------------------------------------------

def model_key(base: str, model: str) -> str:
    """The upstream key of `model` on the server at `base` (the name escaped: it may hold
    `/`, `#` or spaces)."""
    return f"{base}{KEY_MARK}{quote(model, safe='')}"


def split_key(key: str) -> tuple[str, str]:
    """(base URL, model name); the model is "" for a plain server's key."""
    base, mark, model = key.partition(KEY_MARK)
    return base, unquote(model) if mark else ""


def model_of_body(body: Mapping[str, Any] | None) -> str:
    """The model a request names (its JSON body's `model`), "" when none."""
    model = body.get("model") if isinstance(body, Mapping) else None
    return model if isinstance(model, str) else ""


def unload_targets(method: str, path: str, body: bytes | None) -> list[str] | None:
    """The models an unload request names: the router's `POST /models/unload {"model"}`,
    llama-swap's `POST /api/models/unload/<model>` and `GET /unload` ([] = every model).
    None: not an unload."""
    path = path.partition("?")[0]
    if method == "GET" and path == "/unload":
        return []
    if method != "POST":
        return None
    if path.startswith("/api/models/unload/"):
        return [unquote(path.removeprefix("/api/models/unload/"))]
    if path == "/models/unload":
        try:
            data = json.loads(body or b"{}")
        except ValueError:
            return None
        model = model_of_body(data) if isinstance(data, dict) else ""
        return [model] if model else None
    return None


def pick_victims(running: Iterable[str], wanted: str, last_post: Mapping[str, float],
                 busy: Mapping[str, int], places: int) -> list[str]:
    """The models to unload so that `wanted` fits: `places` of them (at least one), the
    router's rule (server_lru_sched::pick_victim): idle models before busy ones, then the
    oldest last POST first (a model never seen used here counts as oldest)."""
    others = [m for m in running if m != wanted]
    others.sort(key=lambda m: (busy.get(m, 0) > 0, last_post.get(m, 0.0), m))
    return others[:max(places, 1)]


# ---- the per-model client ------------------------------------------------------------------

class ModelUpstream(Upstream):
    """An `Upstream` bound to one model of a router or of llama-swap: `/slots`, `/props` and
    the slot actions (and a seed's `/apply-template`, `/completion`) go to that model.
    Never loads the model as a side effect: the router gets `autoload=false`; llama-swap is
    asked `/running` first (any `/upstream/<model>/...` request would start it)."""

    def __init__(self, key: str, kind: str, timeout: float = 1.0, **kwargs: Any) -> None:
        base, model = split_key(key)
        super().__init__(base, timeout=timeout, **kwargs)
        self.model = model
        self.kind = kind

    def _swap_ready(self) -> bool:
        try:
            running = parse_running(super()._get("/running"))
        except UpstreamError:
            return False
        return any(r.model == self.model and r.ready for r in running)

    def start_model(self, wait: float) -> None:
        """Load the model and return once it answers (bounded by `wait` seconds): the
        router's `POST /models/load` then its status, llama-swap's `/upstream/<model>/health`
        (which starts the model and answers once it is ready)."""
        if self.kind == SWAP:
            url = self.base_url + SwapClient.base(self.model) + "/health"
            try:
                self._http.get(url, timeout=wait)
            except requests.RequestException as e:
                raise UpstreamError(f"starting {self.model!r}: {type(e).__name__}") from None
            return
        try:
            super().post_json("/models/load", {"model": self.model})
        except UpstreamError as e:
            if "already" not in str(e):
                raise
        self.wait_status(lambda status: status == "loaded", wait)

    def stop_model(self, wait: float) -> None:
        """Unload the model and return once it no longer holds a place (bounded)."""
        if self.kind == SWAP:
            self.post_text(f"/api/models/unload/{quote(self.model, safe='')}")
            return
        try:
            super().post_json("/models/unload", {"model": self.model})
        except UpstreamError as e:
            if "not running" not in str(e):
                raise
        self.wait_status(lambda status: status not in RUNNING_STATES, wait)

    def wait_status(self, done: Callable[[str], bool], wait: float) -> None:
        """Poll the router's `/models` until the model's status is `done` (or it failed);
        an answer that is late or missing (a loaded machine, the router busy spawning) is
        asked again until `wait` is over."""
        deadline = time.monotonic() + wait
        status = "unknown"
        while time.monotonic() < deadline:
            try:
                models = parse_models(super()._get("/models"))
            except UpstreamError as e:
                status = f"unknown ({e})"
            else:
                entry = next((m for m in models if m.name == self.model), None)
                if entry is None or done(entry.status) or (entry.failed and not entry.running):
                    return
                status = entry.status
            time.sleep(0.2)
        raise UpstreamError(f"model {self.model!r} still {status} after {wait:.0f} s")

    def _get(self, path: str, optional: bool = False) -> Any:
        if self.kind == SWAP:
            if not self._swap_ready():
                raise UpstreamError(f"GET {path}: model {self.model!r} is not running")
            return super()._get(SwapClient.base(self.model) + path, optional)
        query = model_query(self.model, autoload="false")
        return super()._get(path + ("&" + query[1:] if "?" in path else query), optional)

    def post_json(self, path: str, body: dict[str, Any],
                  timeout: float | None = None) -> dict[str, Any]:
        if self.kind == SWAP:
            if not self._swap_ready():
                raise UpstreamError(f"POST {path}: model {self.model!r} is not running")
            return super().post_json(SwapClient.base(self.model) + path, body, timeout)
        if path.startswith("/slots/"):
            path += "&autoload=false" if "?" in path else "?autoload=false"
        return super().post_json(path, {**body, "model": self.model}, timeout)

    def kv_identity(self, model_path: str) -> str:
        """The router answers `/v1/models` itself (every model, in its own order), so the
        model's shape is read from its own entry of `/models` (its `meta` while loaded);
        `/lora-adapters` is asked of the model, None when the router does not pass it on.
        llama-swap's `/upstream/<model>/...` is the model's own server: as a single one."""
        if self.kind == SWAP:
            return super().kv_identity(model_path)
        try:
            listed = super()._get("/models")
            loras = self._get("/lora-adapters", optional=True)
        except UpstreamError:
            listed, loras = None, None
        items = listed.get("data") if isinstance(listed, dict) else None
        meta = next((m.get("meta") for m in items or () if isinstance(m, dict)
                     and m.get("id") == self.model), None)
        return json.dumps([meta, lora_identity(loras)], sort_keys=True, default=str)

    def slots(self):
        if self.kind == SWAP and not self._swap_ready():
            raise SlotsUnavailable(f"model {self.model!r} is not running")
        return super().slots()

    def n_ctx_train(self) -> int:
        return 0  # the router's /v1/models lists every model; not needed per model


# ---- what a base URL serves ----------------------------------------------------------------

def detect(client: Upstream) -> str | None:
    """ROUTER when `/props` says `"role": "router"`, SINGLE for any other props, SWAP when
    `/props` (no model) fails and `/running` answers llama-swap's list; None: not known yet
    (the server does not answer)."""
    try:
        props = client.get_json("/props")
    except UpstreamError:
        props = None
    if isinstance(props, dict):
        return ROUTER if parse_router_props(props) is not None else SINGLE
    try:
        parse_running(client.get_json("/running"))
    except UpstreamError:
        return None
    return SWAP


class Kinds:
    """What each base URL serves (ROUTER, SWAP, SINGLE), detected once and remembered; and
    the client of an upstream key (a ModelUpstream for a model's key)."""

    def __init__(self, timeout: float, api_key: str = "") -> None:
        self.timeout = timeout
        self.api_key = api_key  # llama-server's --api-key (issue #21): detection asks too
        self._kinds: dict[str, str] = {}
        self._failed: dict[str, float] = {}  # base -> when detection last found no answer

    def known(self, base: str) -> str | None:
        return self._kinds.get(base)

    def of(self, base: str) -> str | None:
        """Detected on first use (blocking: worker threads); None while it does not answer
        (asked again after DETECT_RETRY_S, so a server that is down costs no extra wait on
        every request)."""
        kind = self._kinds.get(base)
        if kind is None and time.monotonic() - self._failed.get(base, -DETECT_RETRY_S) >= (
                DETECT_RETRY_S):
            kind = detect(Upstream(base, timeout=self.timeout, api_key=self.api_key))
            if kind is not None:
                self._kinds[base] = kind
            else:
                self._failed[base] = time.monotonic()
        return kind

    def client(self, key: str, timeout: float, **kwargs: Any) -> Upstream:
        """`kwargs`: the Upstream's own (api_key, on_hang)."""
        base, model = split_key(key)
        if not model:
            return Upstream(key, timeout=timeout, **kwargs)
        return ModelUpstream(key, self._kinds.get(base) or ROUTER, timeout=timeout, **kwargs)
