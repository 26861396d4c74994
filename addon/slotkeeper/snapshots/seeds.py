"""Seeds: the KV of a shared system prompt (plus tools), prefilled once and saved, so that a new
session with that system prompt starts from it instead of from an empty slot."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from ..decisions import pricing
from ..upstream.client import ServerProps, Upstream, UpstreamError
from ..wire.bodies import route_of
from .snapshots import Snapshots, seed_id

log = logging.getLogger("slotkeeper.seeds")

# Two user messages that differ in their first character: the rendered prompts agree exactly up
# to where the first user message starts, which is the part every session shares.
_PROBES = ("A", "B")


__all__ = ["SeedBuilder", "Taken", "seed_id", "seed_messages"]


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


@dataclass(frozen=True)
class Taken:
    """What taking a seed afterwards did: tokens in the seed (0: none saved), tokens the server
    evaluated to cut the slot down to the system prefix (1 when it reused the prefix), and
    tokens of the session restored afterwards (0: the restore failed, the slot is not the
    session's any more)."""

    seed_tokens: int
    evaluated: int
    restored: int


class SeedBuilder:
    """Takes a seed from a slot that holds a conversation starting with the system prompt,
    after that conversation's answer was sent (issue #23: never on a request's path)."""

    def __init__(self, snapshots: Snapshots, min_chars: int, max_seeds: int) -> None:
        self.snapshots = snapshots
        self.min_chars = min_chars
        self.max_seeds = max_seeds

    def wants(self, props: ServerProps, seed_key: str | None) -> bool:
        """No usable seed of this system prompt yet (and seeds are on)."""
        if seed_key is None or self.max_seeds <= 0:
            return False
        # meta, header and size only: the restore checks the content (issue #31: this ran on
        # every request with a seed key and read the whole seed file)
        ok, _why = self.snapshots.check(props, seed_id(seed_key), 0, content=False)
        return not ok

    def take_afterwards(self, client: Upstream, props: ServerProps, slot: int, seed_key: str,
                        path: str, body: dict[str, Any], session: str, messages: int) -> Taken:
        """The slot holds `session`'s conversation and its snapshot is current (the caller
        saved it, under the slot's exclusive lease). Cut the slot down to the system prefix
        (a /completion of the rendered prefix with cache_prompt: the server keeps the common
        prefix and evaluates one token), save that as the seed, then restore the session."""
        parts = seed_messages(path, body)
        if parts is None:
            return Taken(0, 0, -1)
        try:
            prompt = self._system_prompt_text(client, *parts)
            if not prompt or not self._restores_repay(client, prompt):
                return Taken(0, 0, -1)
            cut = self._prefill(client, slot, prompt)
        except (UpstreamError, KeyError, TypeError, ValueError) as e:
            log.warning("taking the seed of %s failed: %s", session, e)
            return Taken(0, 0, self._restore(client, props, slot, session, messages))
        seed = seed_id(seed_key)
        saved = self.snapshots.save(client, props, slot, seed, messages=0, kind="seed")
        restored = self._restore(client, props, slot, session, messages)
        if saved:
            log.info("took seed %s from %s's slot: %d tokens, %d evaluated to cut it", seed,
                     session, saved, cut[0])
            self._prune()
        return Taken(saved, cut[0], restored)

    @staticmethod
    def _restores_repay(client: Upstream, prompt: str) -> bool:
        """A seed only where restoring it beats prefilling the system prompt (pricing): on a
        large model with a fast GPU it may not, and then every seed is a write for nothing."""
        rates = client.costs.rates()
        if rates.kv_bytes_per_token is None:
            return True
        tokens = len(client.post_json("/tokenize", {"content": prompt}).get("tokens") or [])
        if pricing.restore_pays(rates, rates.file_bytes(tokens), tokens):
            return True
        log.info("no seed of a %d-token system prompt: restoring it would take longer than "
                 "prefilling it at this server's speeds", tokens)
        return False

    def _restore(self, client: Upstream, props: ServerProps, slot: int, session: str,
                 messages: int) -> int:
        notes: list[str] = []
        restored = self.snapshots.restore(client, props, slot, session, messages, notes)
        if not restored:
            log.warning("%s could not be restored after its seed was taken (%s): it will be "
                        "restored on its next request", session, "; ".join(notes))
        return restored

    @staticmethod
    def _system_prompt_text(client: Upstream, messages: list[dict], tools: Any) -> str:
        renders = []
        for probe in _PROBES:
            payload: dict[str, Any] = {"messages": [*messages, {"role": "user", "content": probe}]}
            if tools:
                payload["tools"] = tools
            r = client.post_json("/apply-template", payload)
            renders.append(r["prompt"])
        return common_prefix(*renders)

    @staticmethod
    def _prefill(client: Upstream, slot: int, prompt: str) -> tuple[int, int]:
        """Run the prompt in the slot with cache_prompt, generating nothing: (tokens evaluated,
        tokens reused). The slot holds exactly the prompt's tokens afterwards."""
        r = client.post_json("/completion", {
            "prompt": prompt, "n_predict": 0, "id_slot": slot, "cache_prompt": True,
            "temperature": 0,
        })
        timings = r.get("timings") or {}
        return int(timings.get("prompt_n", 0)), int(timings.get("cache_n", 0))

    def _prune(self) -> None:
        folder = self.snapshots.folder
        seeds = sorted((m for m in folder.list_sessions() if m.kind == "seed"),
                       key=lambda m: m.last_used, reverse=True)
        for meta in seeds[self.max_seeds:]:
            self.snapshots.delete(meta.session_id)
            log.info("dropped seed %s (more than %d seeds)", meta.session_id, self.max_seeds)
