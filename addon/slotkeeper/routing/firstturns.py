"""The first-turns room (issue #23): what the walk adds so that first turns and one-off
requests are never slower or costlier than llama-server alone. Blocking: worker threads.

- which new requests are one-offs (habits.py decides; here their leftovers are removed);
- what each conversation request tells habits (`began`: seen, and ended on release);
- seeds taken *after* an answer, under the route's exclusive lease, never on its path
  (`after`): save the session, cut the slot to the system prefix, save the seed, restore the
  session. docs/DESIGN.md, "First turns and one-off requests"."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ..identity.habits import Habits
from ..identity.identity import Identity
from ..observe import metrics
from ..snapshots.saves import Saves
from ..snapshots.seeds import SeedBuilder
from ..snapshots.snapshots import Snapshots, seed_id
from ..store.state import StateDoc, StateFile
from ..upstream.registry import Upstreams
from ..wire.bodies import Timings
from .routes import ASSIGNED, OWNING, RESTORED, Route

log = logging.getLogger("slotkeeper")


class FirstTurns:
    """Owns: the habits memory, one-offs' leftovers, seeds taken afterwards. Does not touch:
    which slot a request gets (the walk), leases (the route holds one)."""

    def __init__(self, state: StateFile, upstreams: Upstreams, saves: Saves,
                 snapshots: Snapshots | None, seeds: SeedBuilder | None,
                 seed_min_chars: int) -> None:
        self.state = state
        self.upstreams = upstreams
        self.saves = saves
        self.snapshots = snapshots
        self.seeds = seeds
        self.seed_min_chars = seed_min_chars
        self.habits = Habits()

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
        up = self.state.read().upstreams.get(route.upstream)
        rec = up.slots.get(route.slot) if up is not None else None
        tokens = timings.prompt_tokens + max(timings.predicted_n - 1, 0)
        if (rec is None or rec.owner != route.session or rec.stale
                or not self.saves.save_if_worth(route.upstream, info, route.slot, rec, tokens)):
            return  # the session's KV could not be kept: never cut it
        started = time.monotonic()
        taken = self.seeds.take_afterwards(info.client, props, route.slot, key, *source,
                                           route.session, route.messages)
        if taken.seed_tokens:  # tokens the server prefilled for it: 1 when it cut the slot
            metrics.seed_built(taken.evaluated, time.monotonic() - started)
        if taken.restored == 0:
            self.saves.mark_stale(route.upstream, route.slot, route.session)


def talk_of(rule: str, session: str) -> str:
    """The conversation a session belongs to for habits: a content id's forks are one."""
    return session.split(".", 1)[0] if rule == "content" else session
