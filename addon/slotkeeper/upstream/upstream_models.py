"""The calls the several-models work needs (issue #22), against llama-server's router mode
and llama-swap. Pure parsing of their answers into small dataclasses (`parse_*`), and two
blocking clients that run in worker threads only, on top of an `Upstream` (so its session,
timeouts and headers are shared).

Shapes measured on llama-server b11434 and read from llama-swap's source: docs/DESIGN.md,
"Several models (issue #22)".

Router mode: every per-model GET carries `autoload=false`, and so does every slot action,
so that reading slots or props of an unloaded model never loads it (the router's default
`--models-autoload` would start the model and unload another one for it). llama-swap has no
such switch: `/upstream/<model>/...` starts the model, so `SwapClient` asks `/running` first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from ..decisions.choice import SlotView
from .client import SlotsUnavailable, Upstream, UpstreamError

# The router's model states (server-models.h): a model holds slots only while loaded.
LOADED = "loaded"
RUNNING_STATES = frozenset({"loaded", "loading", "sleeping"})  # count against --models-max


@dataclass(frozen=True)
class ModelEntry:
    """One model of the router's `GET /models` (or llama-swap's `/v1/models`)."""

    name: str
    status: str  # "loaded", "unloaded", "loading", "sleeping", "downloading", ...
    aliases: tuple[str, ...] = ()
    failed: bool = False  # the last load exited with an error

    @property
    def loaded(self) -> bool:
        return self.status == LOADED

    @property
    def running(self) -> bool:
        """Counts against --models-max (a loading or sleeping child holds a place too)."""
        return self.status in RUNNING_STATES


@dataclass(frozen=True)
class RouterProps:
    """`GET /props` without a model, from a router: where the limit is read."""

    max_instances: int  # --models-max; 0 = no limit
    autoload: bool  # --models-autoload (default on)
    build_info: str


@dataclass(frozen=True)
class RouterView:
    """The models and the limit together: what a routing decision needs."""

    models: tuple[ModelEntry, ...]
    max_instances: int

    def entry(self, name: str) -> ModelEntry | None:
        for model in self.models:
            if model.name == name or name in model.aliases:
                return model
        return None

    @property
    def running(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.models if m.running)

    def load_would_unload(self, name: str) -> bool:
        """True when `name` is not running and the running models fill --models-max: loading
        it makes the router unload one of them (its least recently used idle one)."""
        model = self.entry(name)
        if model is None or model.running or self.max_instances <= 0:
            return False
        return len(self.running) >= self.max_instances


@dataclass(frozen=True)
class SwapRunning:
    """One process of llama-swap's `GET /running`."""

    model: str
    state: str  # "starting", "ready", "stopping" (stopped ones are not listed)

    @property
    def ready(self) -> bool:
        return self.state == "ready"


# ---- pure parsing --------------------------------------------------------------------------

def _str(value: object) -> str:
    return value if isinstance(value, str) else ""


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def parse_models(data: object) -> tuple[ModelEntry, ...]:
    """`{"object": "list", "data": [{"id", "aliases", "status": {"value", ...}}, ...]}`.
    An entry without an id is skipped; an answer that is not that shape raises."""
    items = data.get("data") if isinstance(data, Mapping) else None
    if not isinstance(items, list):
        raise UpstreamError("GET /models: no data list")
    models = []
    for item in items:
        if not isinstance(item, Mapping) or not _str(item.get("id")):
            continue
        status = item.get("status")
        status = status if isinstance(status, Mapping) else {}
        aliases = item.get("aliases")
        aliases = tuple(a for a in aliases if isinstance(a, str)) if isinstance(
            aliases, list) else ()
        models.append(ModelEntry(name=item["id"], status=_str(status.get("value")) or "unknown",
                                 aliases=aliases, failed=status.get("failed") is True))
    return tuple(models)


def parse_router_props(data: object) -> RouterProps | None:
    """The router's own `/props` (`"role": "router"`); None for a single-model server."""
    if not isinstance(data, Mapping) or data.get("role") != "router":
        return None
    autoload = data.get("models_autoload")
    return RouterProps(max_instances=max(_int(data.get("max_instances")), 0),
                       autoload=autoload if isinstance(autoload, bool) else True,
                       build_info=_str(data.get("build_info")))


def parse_slots(data: object, what: str = "GET /slots") -> list[SlotView]:
    """A `/slots` answer (a list of `{id, is_processing, n_prompt_tokens, n_ctx}`)."""
    if not isinstance(data, list):
        raise SlotsUnavailable(f"{what}: not a list")
    views = []
    for item in data:
        if not isinstance(item, Mapping) or not isinstance(item.get("id"), int):
            raise SlotsUnavailable(f"{what}: malformed slot entry")
        views.append(SlotView(id=item["id"], is_processing=item.get("is_processing") is True,
                              n_tokens=_int(item.get("n_prompt_tokens")),
                              n_ctx=_int(item.get("n_ctx"))))
    return views


def parse_running(data: object) -> tuple[SwapRunning, ...]:
    """llama-swap's `{"running": [{"model", "state", "cmd", "proxy", "ttl", ...}]}`."""
    items = data.get("running") if isinstance(data, Mapping) else None
    if not isinstance(items, list):
        raise UpstreamError("GET /running: no running list")
    return tuple(SwapRunning(model=item["model"], state=_str(item.get("state")))
                 for item in items
                 if isinstance(item, Mapping) and _str(item.get("model")))


def model_query(model: str, **params: str) -> str:
    """`?model=NAME&...` with the name escaped (model names may hold `/`, `:` or spaces)."""
    pairs = [("model", model), *params.items()]
    return "?" + "&".join(f"{k}={quote(v, safe='')}" for k, v in pairs)


# ---- clients -------------------------------------------------------------------------------

class _SlotActions:
    """save/restore/erase of one model's slot, each client sending them its own way
    (`_slot_action`)."""

    def _slot_action(self, model: str, slot: int, action: str,
                     body: Mapping[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def save(self, model: str, slot: int, filename: str) -> dict[str, Any]:
        return self._slot_action(model, slot, "save", {"filename": filename})

    def restore(self, model: str, slot: int, filename: str) -> dict[str, Any]:
        return self._slot_action(model, slot, "restore", {"filename": filename})

    def erase(self, model: str, slot: int) -> dict[str, Any]:
        return self._slot_action(model, slot, "erase", {})


class RouterClient(_SlotActions):
    """llama-server's router mode (`--models-dir` / `--models-preset`): one URL, the model
    named in each call. Never loads a model as a side effect (`autoload=false`)."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream

    def router_props(self) -> RouterProps | None:
        return parse_router_props(self.upstream.get_json("/props"))

    def models(self) -> tuple[ModelEntry, ...]:
        return parse_models(self.upstream.get_json("/models"))

    def view(self) -> RouterView:
        props = self.router_props()
        if props is None:
            raise UpstreamError("GET /props: not a router (no \"role\": \"router\")")
        return RouterView(models=self.models(), max_instances=props.max_instances)

    def props(self, model: str) -> dict[str, Any]:
        """The model's own `/props` (total_slots, model_path...); UpstreamError when the model
        is not loaded (the router answers 400 "model is not loaded")."""
        data = self.upstream.get_json("/props" + model_query(model, autoload="false"))
        if not isinstance(data, dict):
            raise UpstreamError("GET /props?model=: not an object")
        return data

    def slots(self, model: str) -> list[SlotView]:
        """The model's slots; SlotsUnavailable when it is not loaded (nothing to route to)."""
        try:
            data = self.upstream.get_json("/slots" + model_query(model, autoload="false"))
        except UpstreamError as e:
            raise SlotsUnavailable(str(e)) from None
        return parse_slots(data, "GET /slots?model=")

    def _slot_action(self, model: str, slot: int, action: str,
                     body: Mapping[str, Any]) -> dict[str, Any]:
        path = f"/slots/{int(slot)}?action={action}&autoload=false"
        return self.upstream.post_json(path, {**body, "model": model})

    def unload(self, model: str) -> dict[str, Any]:
        """`POST /models/unload`: answers at once, the child exits afterwards."""
        return self.upstream.post_json("/models/unload", {"model": model})

    def load(self, model: str) -> dict[str, Any]:
        return self.upstream.post_json("/models/load", {"model": model})


class SwapClient(_SlotActions):
    """llama-swap: one URL, each model's llama-server under `/upstream/<model>/`. Any request
    there starts the model (and stops the others of its group), so slots are read, saved
    or restored only for a model `/running` reports ready."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream

    def running(self) -> tuple[SwapRunning, ...]:
        return parse_running(self.upstream.get_json("/running"))

    def ready(self, model: str, running: Sequence[SwapRunning] | None = None) -> bool:
        listed = self.running() if running is None else running
        return any(r.model == model and r.ready for r in listed)

    @staticmethod
    def base(model: str) -> str:
        return "/upstream/" + quote(model, safe="")

    def slots(self, model: str) -> list[SlotView]:
        """The model's slots if it is ready; SlotsUnavailable otherwise (no swap to read)."""
        if not self.ready(model):
            raise SlotsUnavailable(f"model {model!r} is not running")
        try:
            data = self.upstream.get_json(self.base(model) + "/slots")
        except UpstreamError as e:
            raise SlotsUnavailable(str(e)) from None
        return parse_slots(data, "GET /upstream/<model>/slots")

    def _slot_action(self, model: str, slot: int, action: str,
                     body: Mapping[str, Any]) -> dict[str, Any]:
        """Only on a ready model: the same POST to a stopped one would start it and stop
        the model that is running."""
        if not self.ready(model):
            raise UpstreamError(f"model {model!r} is not running: no {action}")
        return self.upstream.post_json(f"{self.base(model)}/slots/{int(slot)}?action={action}",
                                       dict(body))

    def unload(self, model: str) -> None:
        """`POST /api/models/unload/<model>` (answers "OK" once the process stopped)."""
        self.upstream.post_text(f"/api/models/unload/{quote(model, safe='')}")
