"""The first-turns room (issue #23): what the walk adds so that first turns and one-off
requests are never slower or costlier than llama-server alone. Blocking: worker threads.

- which new requests are one-offs (habits.py decides; here their leftovers are removed);
- what each conversation request tells habits (`began`: seen, and ended on release);
- seeds taken *after* an answer, under the route's exclusive lease, never on its path
  (`after`): save the session, cut the slot to the system prefix, save the seed, restore the
  session. docs/DESIGN.md, "First turns and one-off requests". On a server whose RAM cache
  slotkeeper trusts, the seed waits for a quiet server instead (`seed_if_idle`): new
  conversations load their idle parent from that cache meanwhile (routing/ramhandover.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..identity.habits import Habits
from ..identity.identity import Identity
from ..observe import metrics
from ..snapshots.saves import Saves
from ..snapshots.seeds import SeedBuilder
from ..snapshots.snapshots import Snapshots, seed_id
from ..store.locks import SlotLocks
from ..store.state import StateDoc, StateFile
from ..upstream.registry import UpstreamInfo, Upstreams
from ..wire.bodies import Timings
from .routes import ASSIGNED, OWNING, RESTORED, Route

log = logging.getLogger("slotkeeper")


@dataclass(frozen=True)
class PendingSeed:
    """A seed an answer left for a quiet server: the slot the session held, its system
    prompt's key, the request it can be cut from, the session's messages."""

    slot: int
    key: str
    source: tuple[str, dict[str, Any]]
    messages: int


class FirstTurns:
    """Owns: the habits memory, one-offs' leftovers, seeds taken afterwards. Does not touch:
    which slot a request gets (the walk), leases (the route holds one)."""

    def __init__(self, state: StateFile, locks: SlotLocks, upstreams: Upstreams, saves: Saves,
                 snapshots: Snapshots | None, seeds: SeedBuilder | None,
                 seed_min_chars: int, idle_work: bool = True) -> None:
        self.state = state
        self.locks = locks
        self.upstreams = upstreams
        self.saves = saves
        self.snapshots = snapshots
        self.seeds = seeds
        self.seed_min_chars = seed_min_chars
        self.idle_work = idle_work  # False: no idle period ever comes to take a waiting seed
        self.habits = Habits()
        self.pending: dict[tuple[str, str], PendingSeed] = {}  # (server, session)

    # ---- before: one-offs ----------------------------------------------------------------------

    def one_off(self, url: str, ident: Identity) -> Callable[[], None] | None:
        """A new conversation's request that will not be continued (placed without a claim):
        then what removes what earlier requests with its system prompt left, for the walk to
        call once the request has started from what it could use of them (its parent's
        snapshot, issue #23: an agent's memory requests grow by a turn each). None: not a
        one-off."""
        if not self.habits.is_one_off(system_key=ident.seed_key,
                                      opening=talk_of(ident.rule, ident.session_id),
                                      session_id=ident.session_id):
            return None
        return lambda: self._drop_leftovers(url, ident.seed_key)

    def _drop_leftovers(self, url: str, seed_key: str | None) -> None:
        """Their snapshots, the prompt's seed and their claims will never be restored: removed
        now, not when the disk budget is full."""
        sessions = self.habits.leftovers(seed_key)
        if not sessions or seed_key is None:
            return
        if self.snapshots is not None:
            for snapshot in [*sessions, seed_id(seed_key)]:
                if (self.snapshots.folder.read_meta(snapshot) is not None
                        and self.snapshots.delete(snapshot)):
                    log.info("removed %s: its system prompt's requests are one-offs", snapshot)
        gone = set(sessions)

        def drop(doc: StateDoc) -> bool:
            up = doc.upstream(url)
            mine = [slot for slot, rec in up.slots.items() if rec.owner in gone]
            for slot in mine:
                del up.slots[slot]
            return bool(mine)

        if self.state.update(drop):
            log.info("released the slots of one-offs %s", ", ".join(sorted(gone)))

    # ---- during: what habits learn ------------------------------------------------------------

    def began(self, route: Route, ident: Identity, path: str, body: dict | None) -> None:
        """A conversation request runs on its slot (an OWNING route): seen now, ended when
        the route is released; a handover's route may give a seed afterwards."""
        talk = talk_of(route.rule, route.session)
        self.habits.saw(ident.seed_key, talk, route.session,
                        ident.chain[-1] if ident.chain else "")
        route.on_release(lambda: self.habits.ended(ident.seed_key, talk))
        if (route.action in (ASSIGNED, RESTORED) and body is not None and self.seeds is not None
                and ident.system_chars >= self.seed_min_chars):
            route.seed_source = (path, body)

    # ---- after: the seed --------------------------------------------------------------------------

    def after(self, route: Route, timings: Timings | None) -> None:
        """Called after the answer, while the route still holds its lease: take the seed of
        its system prompt if a second conversation uses it and none exists yet."""
        source, lease = route.seed_source, route.lease
        if (source is None or timings is None or lease is None or not lease.exclusive
                or self.seeds is None or route.slot is None or route.action not in OWNING):
            return
        info = self.upstreams.get(route.upstream)
        props, key = info.props, route.seed_key
        if (props is None or info.client.slot_actions_disabled
                or not self.habits.seed_wanted(key, ending=talk_of(route.rule, route.session))
                or not self.seeds.wants(props, key)):
            return
        pending = PendingSeed(route.slot, key, source, route.messages)
        if info.ram.confirmed and self.idle_work:
            # its save, cut and restore would hold the answer's end and stall every slot
            # (six-agents: 1.36 s at the bench's cap), while the RAM cache serves the next
            # conversations from an idle parent: it waits for a quiet server
            self.pending[(route.upstream, route.session)] = pending
            return
        self._take(route.upstream, info, route.session, pending,
                   timings.prompt_tokens + max(timings.predicted_n - 1, 0))

    def seed_if_idle(self, url: str, session: str, quiet: bool) -> bool | None:
        """The idle period after the session's request: take the seed its answer left
        waiting, on a quiet server. None: not now (busy, or the slot's lease is taken)."""
        pending = self.pending.get((url, session))
        if pending is None:
            return False
        info = self.upstreams.peek(url)
        if (info is None or info.props is None or self.seeds is None
                or not self.seeds.wants(info.props, pending.key)):
            self.pending.pop((url, session), None)
            return False
        if not quiet:
            return None
        lease = self.locks.try_acquire(url, pending.slot, exclusive=True)
        if lease is None:
            return None
        self.pending.pop((url, session), None)
        seen = info.last_seen.get(session)
        with lease:
            return self._take(url, info, session, pending, seen.tokens if seen else 0)

    def _take(self, url: str, info: UpstreamInfo, session: str, pending: PendingSeed,
              tokens: int) -> bool:
        """Under the slot's exclusive lease: save the session, take the seed from its slot,
        restore it. Never cuts a slot whose session could not be kept."""
        up = self.state.read().upstreams.get(url)
        rec = up.slots.get(pending.slot) if up is not None else None
        if (rec is None or rec.owner != session or rec.stale or self.seeds is None
                or info.props is None
                or not self.saves.save_if_worth(url, info, pending.slot, rec, tokens)):
            return False  # the session's KV could not be kept: never cut it
        started = time.monotonic()
        # the session's turns since the answer that left the seed (kept on the slot, they
        # leave none) grew the snapshot just saved: the restore checks against its count,
        # not the older request's (with that, six-agents' seeds left the slot empty)
        messages = max(pending.messages, info.messages_of(session, rec.messages))
        taken = self.seeds.take_afterwards(info.client, info.props, pending.slot, pending.key,
                                           *pending.source, session, messages)
        if taken.seed_tokens:  # tokens the server prefilled for it: 1 when it cut the slot
            metrics.seed_built(taken.evaluated, time.monotonic() - started)
        if taken.restored == 0:
            self.saves.mark_stale(url, pending.slot, session)
        return bool(taken.seed_tokens)


def talk_of(rule: str, session: str) -> str:
    """The conversation a session belongs to for habits: a content id's forks are one."""
    return session.split(".", 1)[0] if rule == "content" else session
