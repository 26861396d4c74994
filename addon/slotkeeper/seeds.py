"""Seeds: the KV of a shared system prompt (plus tools), prefilled once and saved, so that a new
session with that system prompt starts from it instead of from an empty slot."""

from __future__ import annotations

import logging
import os
from typing import Any

from .bodies import route_of
from .identity import Identity
from .snapshots import Snapshots, seed_id
from .upstream import ServerProps, Upstream, UpstreamError

log = logging.getLogger("slotkeeper.seeds")

# Two user messages that differ in their first character: the rendered prompts agree exactly up
# to where the first user message starts, which is the part every session shares.
_PROBES = ("A", "B")


__all__ = ["SeedBuilder", "seed_id", "seed_messages"]


def common_prefix(a: str, b: str) -> str:
    return a[: len(os.path.commonprefix([a, b]))]


def seed_messages(path: str, body: dict[str, Any]) -> tuple[list[dict], Any] | None:
    """The system part of a request as OpenAI chat messages (what /apply-template renders), and
    its tools; None when the request has no system part we can render the same way."""
    route = route_of(path)
    if route.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        system = []
        for message in messages:
            if not isinstance(message, dict) or message.get("role") not in ("system", "developer"):
                break
            system.append(message)
        return (system, body.get("tools")) if system else None
    if route == "/v1/messages" and not body.get("tools"):
        system = body.get("system")
        if isinstance(system, list):
            system = "\n".join(b.get("text", "") for b in system
                               if isinstance(b, dict) and b.get("type") == "text"
                               and not str(b.get("text", "")).startswith(
                                   "x-anthropic-billing-header"))
        if isinstance(system, str) and system:
            return [{"role": "system", "content": system}], None
    return None


class SeedBuilder:
    """Builds a seed in the slot that a new session was just given (under its exclusive lock),
    so the prefill is the one that session needed anyway: its own request then reuses it."""

    def __init__(self, snapshots: Snapshots, min_chars: int, max_seeds: int) -> None:
        self.snapshots = snapshots
        self.min_chars = min_chars
        self.max_seeds = max_seeds

    def build(self, client: Upstream, props: ServerProps, slot: int, ident: Identity, path: str,
              body: dict[str, Any]) -> int:
        """Prefill the system part in `slot` and save it as the seed; tokens in it, or 0."""
        if ident.seed_key is None or ident.system_chars < self.min_chars or self.max_seeds <= 0:
            return 0
        parts = seed_messages(path, body)
        if parts is None:
            return 0
        messages, tools = parts
        try:
            prompt = self._system_prompt_text(client, messages, tools)
            if not prompt:
                return 0
            prefilled = self._prefill(client, slot, prompt)
        except (UpstreamError, KeyError, TypeError, ValueError) as e:
            log.warning("building the seed for %s failed: %s", ident.session_id, e)
            return 0
        seed = seed_id(ident.seed_key)
        saved = self.snapshots.save(client, props, slot, seed, messages=0, kind="seed")
        if saved:
            log.info("built seed %s: %d tokens (system prompt of %s)", seed, saved,
                     ident.session_id)
            self._prune()
        return prefilled if saved else 0

    def _system_prompt_text(self, client: Upstream, messages: list[dict], tools: Any) -> str:
        renders = []
        for probe in _PROBES:
            payload: dict[str, Any] = {"messages": [*messages, {"role": "user", "content": probe}]}
            if tools:
                payload["tools"] = tools
            r = client.post_json("/apply-template", payload)
            renders.append(r["prompt"])
        return common_prefix(*renders)

    @staticmethod
    def _prefill(client: Upstream, slot: int, prompt: str) -> int:
        r = client.post_json("/completion", {
            "prompt": prompt, "n_predict": 0, "id_slot": slot, "cache_prompt": True,
            "temperature": 0,
        })
        timings = r.get("timings") or {}
        return int(timings.get("prompt_n", 0)) + int(timings.get("cache_n", 0))

    def _prune(self) -> None:
        folder = self.snapshots.folder
        seeds = sorted((m for m in folder.list_sessions() if m.kind == "seed"),
                       key=lambda m: m.last_used, reverse=True)
        for meta in seeds[self.max_seeds:]:
            self.snapshots.delete(meta.session_id)
            log.info("dropped seed %s (more than %d seeds)", meta.session_id, self.max_seeds)
