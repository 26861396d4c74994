"""The blocking HTTP client for llama-server's admin endpoints. Runs in worker threads only."""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from typing import Any

import requests

from .choice import SlotView


class UpstreamError(Exception):
    """llama-server did not answer as expected; the message says what happened."""


class SlotActionsDisabled(UpstreamError):
    """save/restore/erase answered 501: the server runs without --slot-save-path."""


class SlotsUnavailable(UpstreamError):
    """GET /slots is disabled (--no-slots), failing or too slow: fall back to hashing."""


@dataclass(frozen=True)
class ServerProps:
    total_slots: int
    n_ctx: int  # per slot
    model_path: str
    build_info: str
    raw: dict[str, Any]

    @property
    def fingerprint(self) -> str:
        """What a state file belongs to: the same model, build and slot count. Not n_ctx:
        measured, a file restores into a server with another -c and the same -np; the token
        count is checked against n_ctx separately."""
        key = json.dumps([self.model_path, self.build_info, self.total_slots])
        return hashlib.sha256(key.encode()).hexdigest()[:16]


class Upstream:
    def __init__(self, base_url: str, timeout: float = 1.0, admin_timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout  # for /slots and /props: slower than this means fall back
        self.admin_timeout = admin_timeout  # save/restore wait while the slot finishes a request
        self._local = threading.local()  # requests.Session is not thread-safe: one per thread
        # Set when save/restore/erase answered 501 (no --slot-save-path); reset when the
        # server is verified again (it may come back with the flag).
        self.slot_actions_disabled = False

    @property
    def _http(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
        return session

    def _get(self, path: str) -> Any:
        try:
            r = self._http.get(self.base_url + path, timeout=self.timeout)
        except requests.RequestException as e:
            raise UpstreamError(f"GET {path}: {type(e).__name__}") from None
        if r.status_code != 200:
            raise UpstreamError(f"GET {path}: HTTP {r.status_code}")
        try:
            return r.json()
        except ValueError:
            raise UpstreamError(f"GET {path}: not JSON") from None

    def props(self) -> ServerProps:
        data = self._get("/props")
        if not isinstance(data, dict):
            raise UpstreamError("GET /props: not an object")
        settings = data.get("default_generation_settings") or {}
        try:
            return ServerProps(
                total_slots=int(data.get("total_slots", 0)),
                n_ctx=int(settings.get("n_ctx", 0)) if isinstance(settings, dict) else 0,
                model_path=str(data.get("model_path", "")),
                build_info=str(data.get("build_info", "")),
                raw=data,
            )
        except (TypeError, ValueError):
            raise UpstreamError("GET /props: unexpected field types") from None

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
        return views

    def post_json(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST to one of the server's own endpoints (templates, a prefill), waiting as long
        as an admin call may."""
        try:
            r = self._http.post(self.base_url + path, json=body, timeout=self.admin_timeout)
        except requests.RequestException as e:
            raise UpstreamError(f"POST {path}: {type(e).__name__}") from None
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

    def save(self, slot: int, filename: str) -> dict[str, Any]:
        return self.post_json(f"/slots/{int(slot)}?action=save", {"filename": filename})

    def restore(self, slot: int, filename: str) -> dict[str, Any]:
        return self.post_json(f"/slots/{int(slot)}?action=restore", {"filename": filename})

    def erase(self, slot: int) -> dict[str, Any]:
        return self.post_json(f"/slots/{int(slot)}?action=erase", {})

    def healthy(self) -> bool:
        try:
            r = self._http.get(self.base_url + "/health", timeout=self.timeout)
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
            r = self._http.post(self.base_url + path, timeout=self.admin_timeout)
        except requests.RequestException as e:
            raise UpstreamError(f"POST {path}: {type(e).__name__}") from None
        if r.status_code != 200:
            raise UpstreamError(f"POST {path}: HTTP {r.status_code} {r.text[:200]}")
        return r.text


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
