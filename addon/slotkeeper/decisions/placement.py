"""Which llama-server of a pool a request goes to (issue #13). Pure: no I/O, no clock; the
router gathers each server's view (router.py `_pool_views`) and acts on the answer.

The rule (docs/DESIGN.md, "Several llama-servers"): a session stays on the server that holds
its KV while that server is up, not draining and not saturated; a new or displaced session goes
where the estimated cost is lowest, cost = tokens it would prefill there + the server's load
in prefill-token equivalents. Two baselines share the same inputs, for the benchmark:
round-robin and least-busy, which ignore where a session's KV is."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

COST = "cost"
ROUND_ROBIN = "round-robin"
LEAST_BUSY = "least-busy"
POLICIES = (COST, ROUND_ROBIN, LEAST_BUSY)

# Why a server was chosen (the flow's detail, a metric label).
STAY = "stay"  # the session's KV is there and the server can take it
CHEAPEST = "cheapest"  # lowest estimated cost (a new session, or its server cannot keep it)
MOVED = "moved"  # the session's server is saturated: cheaper elsewhere even after a restore
TURN = "turn"  # round-robin
LEAST = "least busy"

# Characters per token of a prompt, to estimate its size before the server tokenizes it.
# Measured with gemma-3-270m on tests/testbed.long_system_prompt text: 600 words, 3,786
# characters, 861 tokens = 4.4 characters a token; English prose is about 4 for most
# tokenizers. Only differences between servers matter, so an estimate does.
CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class Weights:
    """Load in prefill-token equivalents (docs/DESIGN.md has the measurement).

    busy: a slot of the server that is processing another request makes a new request there
    wait about as long as prefilling this many more tokens (llama-server batches slots, so the
    new prompt shares every step with the other slot's work).
    queued: a request waiting for a slot (more requests than slots) waits for a whole turn of
    another session; measured turns of the test workloads prefill a few hundred tokens and
    generate a few dozen, so one queued request counts as a long prompt.
    displace: taking a slot that a live session holds costs that session a save now and a
    restore later, a few milliseconds each (7 ms / 5 ms for 2k tokens): small, but it breaks
    ties towards a server with a free slot.
    move_margin: a session leaves its saturated server only when the other server is cheaper
    by at least this much, so two servers of equal load do not swap sessions back and forth."""

    busy: int = 256
    queued: int = 1000
    displace: int = 16
    move_margin: int = 500


@dataclass(frozen=True)
class ServerView:
    """One server of the pool as the router sees it when a request is placed."""

    url: str
    up: bool = True  # answering /health (and /slots when it was asked)
    draining: bool = False  # its sessions are being moved out: take no new ones
    slots: int = 1  # total_slots
    busy: int = 0  # slots processing a request now (/slots is_processing)
    in_flight: int = 0  # requests this proxy sent there that have not ended
    free: int = 0  # idle slots no live session holds: a session placed here displaces nobody
    reuse: int = 0  # tokens of this session's prompt the server can start from (its resident
    #                KV, a snapshot compatible with it, a seed)
    resident: bool = False  # the session's KV is in one of its slots now (the claim is fresh)
    pending: bool = False  # a handover of the session is in progress there (another request
    #                        or process is restoring it): it stays, never two servers at once

    @property
    def running(self) -> int:
        """Requests running there: /slots may lag a request that just started, and another
        proxy's requests show only in /slots; the larger count is the better guess."""
        return max(self.busy, self.in_flight)

    @property
    def queued(self) -> int:
        return max(self.running - self.slots, 0)

    @property
    def placeable(self) -> bool:
        return self.up and not self.draining


@dataclass(frozen=True)
class Placement:
    url: str
    reason: str
    leaving: str | None = None  # the session's current server, when it moves off a live one


def load(server: ServerView, weights: Weights) -> int:
    """The server's load in prefill-token equivalents."""
    busy = min(server.running, server.slots)
    return weights.busy * busy + weights.queued * server.queued


def cost(server: ServerView, prompt_tokens: int, weights: Weights) -> int:
    """Tokens the request would prefill there, plus the server's load; a server without a
    free slot also costs the session it displaces a save and a restore."""
    prefill = max(prompt_tokens - server.reuse, 0)
    displace = 0 if server.free > 0 or server.resident else weights.displace
    return prefill + load(server, weights) + displace


def saturated(server: ServerView) -> bool:
    """More requests than slots: a new one would queue behind another session's turn."""
    return server.queued > 0


def place(servers: Sequence[ServerView], prompt_tokens: int, policy: str = COST,
          weights: Weights = Weights(), turn: int = 0) -> Placement | None:
    """The server for one request, or None when no server can take it (all down or
    draining). `servers` in the pool's order (ties go to the first); `prompt_tokens` the
    request's estimated size; `turn` a counter for round-robin."""
    candidates = [s for s in servers if s.placeable]
    if not candidates:
        return None
    home = next((s for s in servers if s.resident or s.pending), None)
    if policy == ROUND_ROBIN:
        chosen = candidates[turn % len(candidates)]
        return Placement(chosen.url, TURN, _leaving(home, chosen))
    if policy == LEAST_BUSY:
        chosen = min(candidates, key=lambda s: (s.running, -s.free))
        return Placement(chosen.url, LEAST, _leaving(home, chosen))
    if policy != COST:
        raise ValueError(f"unknown placement policy {policy!r}")
    # Ties go to the server with more free slots (sessions placed at the same moment spread
    # out instead of displacing each other), then to the first.
    best = min(candidates, key=lambda s: (cost(s, prompt_tokens, weights), -s.free))
    if home is not None and home.placeable:
        others = [s for s in candidates if s is not home]
        if home.pending or not saturated(home) or not others:
            return Placement(home.url, STAY)
        # Saturated: the session's KV can follow it (saved there, restored on the other
        # server in milliseconds), so elsewhere it would reuse what it holds now.
        carried = [replace(s, reuse=max(s.reuse, home.reuse)) for s in others]
        target = min(carried, key=lambda s: cost(s, prompt_tokens, weights))
        if (cost(target, prompt_tokens, weights) + weights.move_margin
                <= cost(home, prompt_tokens, weights)):
            return Placement(target.url, MOVED, leaving=home.url)
        return Placement(home.url, STAY)
    # A new session, one whose KV was displaced, or one whose server is down or draining (a
    # draining server is still up: the session's KV is saved there before it leaves).
    return Placement(best.url, CHEAPEST, _leaving(home, best))


def _leaving(home: ServerView | None, chosen: ServerView) -> str | None:
    if home is None or home.url == chosen.url or not home.up or not home.resident:
        return None
    return home.url


def estimate_tokens(prompt_chars: int) -> int:
    return prompt_chars // CHARS_PER_TOKEN


def parse_upstreams(items: Sequence[str]) -> list[str]:
    """`slotkeeper_upstreams` items -> normalised base URLs (scheme://host:port), in order,
    without duplicates. Raises ValueError with a message for a bad item."""
    urls: list[str] = []
    for item in items:
        text = item.strip()
        try:
            parts = urlsplit(text)
            port = parts.port
        except ValueError as e:
            raise ValueError(f"{item!r}: {e}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{item!r} is not an http(s)://host:port URL")
        if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
            raise ValueError(f"{item!r}: give the server's base URL only (no path, query or "
                             f"credentials)")
        host = parts.hostname
        if ":" in host:
            host = f"[{host}]"
        url = f"{parts.scheme}://{host}:{port or (443 if parts.scheme == 'https' else 80)}"
        if url not in urls:
            urls.append(url)
    return urls
