"""Property-based tests (hypothesis) for slot choice and claims: a live session's slot is never
given away while it is live, choices are deterministic, and no input makes them raise.
Identity properties are in test_identity.py.

- `rank_slots`: a slot whose claim is live never ranks before an idle free or abandoned slot.
- `walk.claim` against a real StateFile: a claim that is live and not the one ranked is
  never overwritten, and no session ever ends up with two slots.
- The router end to end (real StateFile and slot locks in a tmpfs folder, a stub in place of
  llama-server's admin API): for any interleaving of requests, responses, side requests and
  time passing, (1) a session's slot is never claimed by another session while its request is
  in flight there, (2) no session owns two slots, (3) the same sequence gives the same
  decisions."""

from __future__ import annotations

import math
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability import reliability  # noqa: F401  (the fixture)

from slotkeeper.decisions.choice import Claim, SlotView, fallback_slot, is_abandoned, rank_slots
from slotkeeper.identity.identity import Identity
from slotkeeper.routing.router import Router
from slotkeeper.routing.routes import ASSIGNED, KEPT, RESTORED, SEEDED, Route, RouterConfig
from slotkeeper.routing.walk import claim
from slotkeeper.store.locks import SlotLocks
from slotkeeper.store.state import SlotRecord, StateDoc, StateFile
from slotkeeper.upstream.client import ServerProps
from slotkeeper.upstream.registry import UpstreamInfo
from slotkeeper.wire.bodies import Timings

RELIABILITY_AREA = "properties"
URL = "http://upstream:8080"
TTL = 120.0
OWNING = (KEPT, ASSIGNED, RESTORED, SEEDED)  # actions that run in a slot the session owns


@contextmanager
def scratch() -> Path:
    """A folder for a state file and slot locks; on tmpfs when there is one (fsync is free)."""
    base = "/dev/shm" if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(dir=base, prefix="slotkeeper-prop-") as d:
        yield Path(d)


FIXTURE_OK = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]


# ---- rank_slots ---------------------------------------------------------------------------

times = st.floats(min_value=-1e12, max_value=1e12, allow_nan=False)
any_times = st.one_of(times, st.just(math.inf), st.just(-math.inf), st.just(math.nan))
owners = st.sampled_from(["a", "b", "c", "d", "", "\ud800", "x" * 300])


@st.composite
def slot_tables(draw, any_float=False):
    ids = draw(st.lists(st.integers(-5, 1000), min_size=0, max_size=8, unique=True))
    slots = [SlotView(i, is_processing=draw(st.booleans()),
                      n_tokens=draw(st.integers(0, 100_000)), n_ctx=4096) for i in ids]
    claims = {}
    for i in ids + draw(st.lists(st.integers(-5, 1000), max_size=3)):  # claims on gone slots too
        if draw(st.booleans()):
            claims[i] = Claim(draw(owners), draw(any_times if any_float else times),
                              draw(st.booleans()))
    return slots, claims




@settings(max_examples=500, deadline=None, suppress_health_check=FIXTURE_OK)
@given(slot_tables(any_float=True), any_times, st.one_of(st.floats(0, 1e6), any_times))
def test_rank_slots_never_raises_and_is_a_deterministic_permutation(reliability, table, now,
                                                                    ttl):
    reliability.row("rank_slots over 500 random slot tables with any times: NaN, infinite, "
                    "negative; claims on slots that are gone; odd owners",
                    outcome="never raised; always a permutation of the slot ids, the same for "
                            "the same input, and (times finite) in whatever order slots and "
                            "claims are listed")
    slots, claims = table
    ranking = rank_slots(slots, claims, now, ttl)
    assert sorted(ranking) == sorted(s.id for s in slots)
    assert rank_slots(list(slots), dict(claims), now, ttl) == ranking
    finite = all(math.isfinite(x) for x in (now, ttl, *(c.last_used for c in claims.values())))
    if finite:  # (NaN compares false both ways; the state file never holds one: state.py)
        assert rank_slots(list(reversed(slots)), dict(reversed(list(claims.items()))), now,
                          ttl) == ranking  # the order things are listed in does not matter


@settings(max_examples=500, deadline=None, suppress_health_check=FIXTURE_OK)
@given(slot_tables(), times, st.floats(0, 1e6))
def test_a_live_claim_never_ranks_before_an_idle_free_slot(reliability, table, now, ttl):
    reliability.row("rank_slots over 500 random slot tables: ids, busy flags, token counts, "
                    "claims live, stale, abandoned or on slots that are gone",
                    outcome="a live claim never ranked before an idle free or abandoned slot, "
                            "a busy slot never before an idle one")
    slots, claims = table
    ranking = rank_slots(slots, claims, now, ttl)
    position = {slot_id: k for k, slot_id in enumerate(ranking)}
    for live in slots:
        if is_abandoned(claims.get(live.id), now, ttl) or live.is_processing:
            continue
        for free in slots:
            if not free.is_processing and is_abandoned(claims.get(free.id), now, ttl):
                assert position[free.id] < position[live.id], (free, live, claims)
    for busy in slots:  # and a busy slot never before an idle one
        for idle in slots:
            if busy.is_processing and not idle.is_processing:
                assert position[idle.id] < position[busy.id]


@settings(max_examples=300, deadline=None)
@given(st.text(), st.integers(-3, 10_000))
def test_fallback_slot_is_stable_and_in_range(session, count):
    slot = fallback_slot(session, count)
    assert slot == fallback_slot(session, count)
    assert (slot is None) if count <= 0 else (0 <= slot < count)


# ---- walk.claim against a real state file ------------------------------------------------

def ident(session: str, prompt_chars: int = 5000, messages: int = 1) -> Identity:
    return Identity(session_id=session, rule="header x-session-id", parent_id=None,
                    prompt_chars=prompt_chars, message_count=messages, seed_key=None,
                    system_chars=0)


def make_router(folder: Path, clock, lock_timeout: float = 0.0) -> Router:
    config = RouterConfig(ttl=TTL, small_request_chars=2000, lock_timeout=lock_timeout,
                          usage_write_interval=0.0)
    return Router(config, StateFile(folder / "state.json"), SlotLocks(folder / "locks"), None,
                  clock=clock)


@st.composite
def claim_cases(draw):
    n_slots = draw(st.integers(1, 5))
    recs = {}
    for slot in range(n_slots + 1):  # the extra one: a slot the server no longer has
        if draw(st.booleans()):
            recs[slot] = SlotRecord(owner=draw(st.sampled_from("abcde")),
                                    claimed=0.0, last_used=draw(st.floats(0, 1000)),
                                    stale=draw(st.booleans()))
    session = draw(st.sampled_from("abcde"))
    slot = draw(st.integers(0, n_slots - 1))
    current = recs.get(slot)
    # What the caller saw when it ranked: the current claim, nothing, or some other claim.
    expected = draw(st.sampled_from(["current", "none", "other"]))
    expected_claim = {"current": current.claim() if current else None, "none": None,
                      "other": Claim("zz", 1.0)}[expected]
    now = draw(st.floats(0, 1400))
    return recs, session, slot, expected_claim, set(range(n_slots)), now


@settings(max_examples=300, deadline=None, suppress_health_check=FIXTURE_OK)
@given(claim_cases())
def test_claim_never_takes_a_live_claim_it_did_not_rank(reliability, case):
    reliability.row("walk.claim against a real state file, 300 random tables of claims "
                    "(live, stale, abandoned, on slots that are gone) with the caller's view "
                    "current, missing or outdated",
                    outcome="a live claim that was not the one ranked was never overwritten "
                            "(the call refused; at most the session's own claim on a slot the "
                            "server no longer has was dropped); a session never ended up "
                            "with two slots; no other session lost its claim")
    recs, session, slot, expected, live_ids, now = case
    # A session owns at most one slot in any state the router writes.
    seen: set[str] = set()
    recs = {k: r for k, r in recs.items() if not (r.owner in seen or seen.add(r.owner))}
    with scratch() as folder:
        router = make_router(folder, clock=lambda: now)

        def setup(doc: StateDoc) -> None:
            doc.upstream(URL).slots.update(recs)

        router.state.update(setup)
        result = claim(router.state, router.config, router.clock(), URL, slot, ident(session),
                       expected=expected, live_ids=live_ids)
        after = router.state.read().upstreams[URL].slots
    previous = recs.get(slot)
    owned_elsewhere = next((k for k, r in recs.items() if r.owner == session and k != slot), None)
    live_other = (previous is not None and previous.owner != session
                  and not is_abandoned(previous.claim(), now, TTL)
                  and previous.claim() != expected)
    if live_other or (owned_elsewhere is not None and owned_elsewhere in live_ids):
        assert result is None
        # Refused: nothing changed, except that the session's claim on a slot the server no
        # longer has may have been dropped on the way.
        gone = {k for k, r in recs.items() if r.owner == session and k not in live_ids}
        assert {k: r for k, r in after.items() if k not in gone} == \
            {k: r for k, r in recs.items() if k not in gone}
        return
    assert result is not None and result[0] == previous
    assert after[slot].owner == session and after[slot].stale
    assert [k for k, r in after.items() if r.owner == session] == [slot]  # one slot only
    for k, r in recs.items():  # nobody else lost a claim, except on the slot taken
        if k != slot and r.owner != session:
            assert after[k] == r


# ---- the router end to end ------------------------------------------------------------------

@dataclass
class StubLlama:
    """Stands in for llama-server's admin API (GET /props, /slots, erase) inside the router;
    the slots' busy flags and token counts come from the model."""

    n_slots: int
    busy: dict[int, int] = field(default_factory=dict)  # slot -> requests in flight there
    tokens: dict[int, int] = field(default_factory=dict)
    slot_actions_disabled: bool = False

    def props(self) -> ServerProps:
        return ServerProps(total_slots=self.n_slots, n_ctx=4096, model_path="m.gguf",
                           build_info="b0", raw={})

    def slots(self) -> list[SlotView]:
        return [SlotView(i, is_processing=self.busy.get(i, 0) > 0,
                         n_tokens=self.tokens.get(i, 0), n_ctx=4096)
                for i in range(self.n_slots)]

    def n_ctx_train(self) -> int:
        return 0

    def erase(self, slot: int) -> dict:
        self.tokens[slot] = 0
        return {"id_slot": slot, "n_erased": 0}

    def healthy(self) -> bool:
        return True


requests_ = st.tuples(st.just("request"), st.sampled_from(["s0", "s1", "s2", "s3", "s4"]),
                      st.booleans())  # (op, session, side request?)
finishes = st.tuples(st.just("finish"), st.integers(0, 50), st.integers(0, 3000))
waits = st.tuples(st.just("wait"), st.sampled_from([0.5, 3.0, 60.0, 150.0]))
operations = st.lists(st.one_of(requests_, requests_, finishes, waits), min_size=1,
                      max_size=40)


def simulate(ops: list[tuple], n_slots: int) -> list[tuple]:
    """Run the operations through a real Router; check the invariants after every step;
    return its decisions."""
    clock = [1000.0]
    stub = StubLlama(n_slots)
    in_flight: list[Route] = []
    decisions = []
    with scratch() as folder:
        router = make_router(folder, clock=lambda: clock[0])
        router.upstreams.put(URL, UpstreamInfo(stub))  # type: ignore[arg-type]
        for op in ops:
            if op[0] == "request":
                _, session, side = op
                who = ident(session, prompt_chars=100 if side else 5000)
                route = router.try_keep(URL, who) or router.route(URL, who, None,
                                                                  "/v1/chat/completions", {})
                decisions.append((session, route.action, route.slot))
                if route.slot is not None:
                    stub.busy[route.slot] = stub.busy.get(route.slot, 0) + 1
                in_flight.append(route)
            elif op[0] == "finish" and in_flight:
                route = in_flight.pop(op[1] % len(in_flight))
                tokens = op[2]
                router.finish(route, Timings(cache_n=tokens // 2, prompt_n=tokens - tokens // 2,
                                             predicted_n=4, prompt_ms=1.0))
                if route.slot is not None:
                    stub.busy[route.slot] -= 1
                    stub.tokens[route.slot] = tokens + 3
            elif op[0] == "wait":
                clock[0] += op[1]
            check_invariants(router, in_flight)
        for route in in_flight:
            route.release()
    return decisions


def check_invariants(router: Router, in_flight: list[Route]) -> None:
    doc = router.state.read()
    slots = doc.upstreams[URL].slots if URL in doc.upstreams else {}
    owners = [r.owner for r in slots.values()]
    assert len(owners) == len(set(owners)), f"a session owns two slots: {slots}"
    for route in in_flight:
        if route.action in OWNING:
            rec = slots.get(route.slot)
            assert rec is not None and rec.owner == route.session, (
                f"{route.session}'s slot {route.slot} was given to "
                f"{rec.owner if rec else 'nobody'} while its request was in flight")
    exclusive = [r for r in in_flight if r.lease is not None and r.lease.exclusive]
    for r in exclusive:  # a handover or side request has its slot to itself
        others = [o for o in in_flight if o is not r and o.slot == r.slot and o.lease]
        assert not others, (r, others)


@settings(max_examples=150, deadline=None, suppress_health_check=FIXTURE_OK)
@given(operations, st.integers(1, 4))
def test_router_never_gives_away_a_slot_in_use_and_decides_deterministically(reliability, ops,
                                                                             n_slots):
    reliability.row("the router over 150 random interleavings of up to 40 requests (5 "
                    "sessions, side requests among them), responses in any order and time "
                    "jumps past the TTL, on 1-4 slots; real state file and slot locks, a stub "
                    "for llama-server's admin API",
                    outcome="no session's slot was claimed by another while its request was in "
                            "flight there; no session owned two slots; a handover or side "
                            "request never shared its slot; the same sequence gave the same "
                            "decisions; nothing raised")
    first = simulate(ops, n_slots)
    assert simulate(ops, n_slots) == first
