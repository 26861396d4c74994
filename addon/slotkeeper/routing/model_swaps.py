"""The models room (issue #22): which upstream key a request for a model runs on, and the save
before the swap. Behind a router (or llama-swap), a request that names a model that is not
loaded makes the server unload another model (its least recently used idle one at
`--models-max`; llama-swap's running one), throwing away every slot of it. Before forwarding,
this room picks that model itself (the router's rule, from the last POST it routed to each
model: our own saves are POSTs too, so letting the router pick after them would unload another
model), saves its resident sessions, marks their claims stale, unloads it, and loads the
requested model; that model's claims are stale too (its slots start empty), so its sessions'
next turns restore from disk like any handover. Blocking except `key_now`: worker threads.

Owns: the per-server memory of loaded models and last POSTs, the swap-time saves, loads and
unloads. Does not touch: which slot (the walk), what a handover restores, leases of a request."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..observe import metrics
from ..snapshots.saves import Saves
from ..store.locks import SlotLocks
from ..store.state import StateFile
from ..upstream.client import SlotsUnavailable, UpstreamError
from ..upstream.models import SINGLE, SWAP, Kinds, ModelUpstream, model_key, pick_victims, split_key
from ..upstream.registry import Upstreams
from ..upstream.upstream_models import RouterClient, RouterView, SwapClient, parse_models

log = logging.getLogger("slotkeeper")

LOAD_WAIT_S = 600.0  # a large model loads in minutes; the request would wait as long anyway
UNLOAD_WAIT_S = 60.0


@dataclass
class Prepared:
    """Where a request for a model runs: its upstream key (the base URL when the server has
    one model; "" when the model is not one the server knows: forward it as it came), and
    the swap-time save done for it ("" when none)."""

    key: str
    model: str = ""
    swap_saved: str = ""


class ModelSwaps:
    def __init__(self, kinds: Kinds, state: StateFile, locks: SlotLocks, saves: Saves,
                 upstreams: Upstreams, in_flight: Callable[[str], int],
                 lock_timeout: float) -> None:
        self.kinds = kinds
        self.state = state
        self.locks = locks
        self.saves = saves
        self.upstreams = upstreams
        self.in_flight = in_flight  # requests running on an upstream key (the pool's count)
        self.lock_timeout = lock_timeout
        self._loaded: dict[str, frozenset[str]] = {}  # base -> models known loaded (hot path)
        self._aliases: dict[str, dict[str, str]] = {}  # base -> alias -> model name
        self._last_post: dict[str, dict[str, float]] = {}  # base -> model -> monotonic time
        self._locks: dict[str, threading.Lock] = {}
        self._mutex = threading.Lock()

    # ---- the hot path: no I/O ------------------------------------------------------------

    def key_now(self, base: str, model: str) -> str | None:
        """The key to keep a session on without asking the server: the base URL for a single
        server, the model's key when this process saw the model loaded; None: take the slow
        path (`prepare`)."""
        kind = self.kinds.known(base)
        if kind == SINGLE:
            return base
        if kind is None or not model:
            return None
        name = self._aliases.get(base, {}).get(model, model)
        return model_key(base, name) if name in self._loaded.get(base, ()) else None

    def touch(self, key: str) -> None:
        """A request was routed to the key's model: the router counts each POST as use."""
        base, model = split_key(key)
        if model:
            self._last_post.setdefault(base, {})[model] = time.monotonic()

    # ---- the slow path -------------------------------------------------------------------

    def prepare(self, base: str, model: str) -> Prepared:
        """The key for a request naming `model` on `base`, with the model loaded: when
        loading it unloads another, that model's sessions are saved first."""
        kind = self.kinds.of(base)
        if kind in (None, SINGLE):
            return Prepared(base)
        if not model:
            return Prepared("")  # the server answers it (no model named)
        with self._lock(base):
            view = self._view(base, kind)
            entry = view.entry(model)
            if entry is None:
                return Prepared("", model)
            key = model_key(base, entry.name)
            if entry.loaded:
                return Prepared(key, entry.name)
            note = ""
            if view.load_would_unload(entry.name):
                note = self._make_room(base, kind, view, entry.name)
            self.saves.mark_all_stale(key)  # it starts with empty slots
            self.upstreams.mark_suspect(key)
            client = self._client(key)
            try:
                client.start_model(LOAD_WAIT_S)
            except UpstreamError as e:
                log.warning("%s: loading %s: %s", base, entry.name, e)
            self._set_loaded(base, self._view(base, kind))
            return Prepared(key, entry.name, note)

    def before_unload(self, base: str, models: list[str] | None) -> int:
        """An unload passing through the proxy (`POST /models/unload`, llama-swap's unload):
        save the sessions of the models it names (None: every model) first. Returns how many
        sessions were saved."""
        kind = self.kinds.of(base)
        if kind in (None, SINGLE):
            return 0
        with self._lock(base):
            view = self._view(base, kind)
            names = [m.name for m in view.models if m.loaded
                     and (models is None or m.name in models or set(m.aliases) & set(models))]
            self._forget(base, names)
            return sum(self._save_model(base, name) for name in names)

    def _make_room(self, base: str, kind: str, view: RouterView, wanted: str) -> str:
        places = len(view.running) - view.max_instances + 1  # llama-swap: every running one
        busy = {m: self.in_flight(model_key(base, m)) for m in view.running}
        victims = pick_victims(view.running, wanted, self._last_post.get(base, {}), busy,
                               places)
        self._forget(base, victims)
        saved = 0
        for victim in victims:
            saved += self._save_model(base, victim)
            try:
                self._client(model_key(base, victim)).stop_model(UNLOAD_WAIT_S)
            except UpstreamError as e:
                log.warning("%s: unloading %s: %s", base, victim, e)
        log.info("%s: %s (%s) unloaded for %s: %d session(s) saved first", base,
                 ", ".join(victims), kind, wanted, saved)
        return f"{', '.join(victims)}: {saved} session(s)"

    def _save_model(self, base: str, model: str) -> int:
        """Save every resident session of the model that is about to go (each under its
        slot's exclusive lease: a request running there finishes first), then mark every
        claim of it stale: its slots are gone with it."""
        key = model_key(base, model)
        info = self.upstreams.verify_if_suspect(key)
        up = self.state.read().upstreams.get(key)
        saved = 0
        try:
            live = {s.id: s.n_tokens for s in info.client.slots()}
        except SlotsUnavailable:
            live = {}
        for slot, rec in sorted(up.slots.items()) if up else []:
            if rec.stale:
                continue
            lease = self.locks.acquire(key, slot, exclusive=True, timeout=self.lock_timeout)
            if lease is None:
                continue
            with lease:
                current = self.state.read().upstreams[key].slots.get(slot)
                if current is None or current.stale or current.owner != rec.owner:
                    continue
                if self.saves.save_if_worth(key, info, slot, current, live.get(slot, 0)):
                    saved += 1
                    metrics.swap_saved(model)
        self.saves.mark_all_stale(key)
        return saved

    # ---- what the server says ------------------------------------------------------------

    def _view(self, base: str, kind: str) -> RouterView:
        client = self._client(base, plain=True)
        if kind == SWAP:
            swap = SwapClient(client)
            running = {r.model: r.state for r in swap.running()}
            models = parse_models(client.get_json("/v1/models"))
            models = tuple(m if m.name not in running else
                           type(m)(m.name, "loaded" if running[m.name] == "ready" else "loading",
                                   m.aliases) for m in models)
            view = RouterView(models=models, max_instances=1)
        else:
            view = RouterClient(client).view()
        self._set_loaded(base, view)
        return view

    def _set_loaded(self, base: str, view: RouterView) -> None:
        self._loaded[base] = frozenset(m.name for m in view.models if m.loaded)
        self._aliases[base] = {a: m.name for m in view.models for a in m.aliases}

    def _forget(self, base: str, models: list[str]) -> None:
        """These models are about to go: the hot path stops keeping sessions on them."""
        self._loaded[base] = self._loaded.get(base, frozenset()) - set(models)

    def _client(self, key: str, plain: bool = False):
        if plain:
            return self.upstreams.make_client(key, max(self.upstreams.slots_timeout, 5.0),
                                              api_key=self.upstreams.api_key)
        client = self.upstreams.get(key).client
        assert isinstance(client, ModelUpstream)
        return client

    def _lock(self, base: str) -> threading.Lock:
        with self._mutex:
            return self._locks.setdefault(base, threading.Lock())
