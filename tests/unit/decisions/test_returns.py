"""Which slot's owner is expected back last (decisions/returns.py, routing/returns.py): the
slot a session without one takes. Pure functions and a memory with a hand-moved clock."""

from __future__ import annotations

from slotkeeper.decisions import returns
from slotkeeper.decisions.choice import Claim, SlotView, rank_slots
from slotkeeper.routing.returns import ReturnTimes

TTL = 3600.0


def test_a_session_is_expected_its_usual_wait_after_its_last_end():
    assert returns.expected_return(100.0, 5.0, 102.0) == 105.0


def test_an_overdue_session_is_expected_as_late_again_as_it_is_overdue():
    # due at 105, it is 111: six seconds late, expected six seconds from now
    assert returns.expected_return(100.0, 5.0, 111.0) == 117.0
    # with no wait known, the longer idle the later: least recently used first
    assert returns.expected_return(90.0, 0.0, 100.0) > returns.expected_return(95.0, 0.0, 100.0)


def test_the_usual_wait_is_a_median_that_one_long_absence_does_not_move():
    assert returns.usual_wait([]) == 0.0
    assert returns.usual_wait([4.0, 5.0, 3600.0]) == 5.0
    assert returns.usual_wait([4.0, 6.0]) == 5.0


def test_a_session_wait_follows_a_change_within_two_turns():
    wait = returns.next_wait(None, 4.0)
    assert wait == 4.0
    wait = returns.next_wait(returns.next_wait(wait, 20.0), 20.0)
    assert wait >= 15.0


def test_without_anything_known_the_least_recently_used_slot_goes_first():
    slots = [SlotView(i, n_tokens=500) for i in range(3)]
    claims = {0: Claim("a", 50.0), 1: Claim("b", 40.0), 2: Claim("c", 60.0)}
    assert rank_slots(slots, claims, 100.0, TTL) == [1, 0, 2]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def take_turns(times: ReturnTimes, clock: Clock, sessions: list[str], rounds: int,
               turn_s: float = 1.0) -> None:
    for _ in range(rounds):
        for session in sessions:
            times.came_back(session)
            clock.now += turn_s
            times.went(session)


def test_agents_taking_turns_give_up_the_slot_of_the_one_that_just_spoke():
    """Six agents in turn on four slots: the least recently used owner is the next to speak,
    so taking its slot changes hands on every turn; the one that just spoke is back last."""
    clock = Clock()
    times = ReturnTimes(clock)
    agents = [f"agent{k}" for k in range(1, 7)]
    take_turns(times, clock, agents, rounds=2)
    # agent1 is about to speak; slots held by agent3..agent6 (agent6 spoke last)
    claims = {i: Claim(agent, 0.0) for i, agent in enumerate(agents[2:])}
    slots = [SlotView(i, n_tokens=900) for i in claims]
    times.came_back("agent1")
    # every owner loses nothing if taken (in the server's RAM cache, or saved)
    ranking = rank_slots(slots, claims, clock.now, TTL,
                         times.expected_back(claims.values(), clock.now), set(claims))
    assert claims[ranking[0]].owner == "agent6", [claims[s].owner for s in ranking]
    assert claims[ranking[-1]].owner == "agent3", [claims[s].owner for s in ranking]
    # the same slots ranked the old way: agent3's, the next to speak, first
    assert claims[rank_slots(slots, {i: Claim(c.owner, clock.now - 4 + i)
                                     for i, c in claims.items()}, clock.now, TTL)[0]].owner \
        == "agent3"


def test_a_session_never_seen_twice_is_given_the_usual_wait():
    clock = Clock()
    times = ReturnTimes(clock)
    take_turns(times, clock, ["a", "b", "c"], rounds=2, turn_s=2.0)  # waits of 4 s
    times.came_back("new")
    clock.now += 1.0
    times.went("new")
    back = times.expected_back([Claim("new", 0.0)], clock.now)
    assert back(Claim("new", 0.0)) == clock.now + 4.0


def test_a_session_that_broke_its_rhythm_goes_before_one_keeping_it():
    clock = Clock()
    times = ReturnTimes(clock)
    take_turns(times, clock, ["steady", "gone"], rounds=3, turn_s=1.0)  # waits of 1 s
    for _ in range(30):  # "gone" stops; "steady" goes on alone
        times.came_back("steady")
        clock.now += 1.0
        times.went("steady")
    claims = {0: Claim("gone", 0.0), 1: Claim("steady", 0.0)}
    slots = [SlotView(0, n_tokens=500), SlotView(1, n_tokens=500)]
    ranking = rank_slots(slots, claims, clock.now, TTL,
                         times.expected_back(claims.values(), clock.now), {0, 1})
    assert ranking == [0, 1]


def test_two_tries_of_one_request_count_one_return():
    """The fast path's try and then the slow path's: one return, one wait."""
    clock = Clock()
    times = ReturnTimes(clock)
    take_turns(times, clock, ["a"], rounds=1)
    clock.now += 6.0
    times.came_back("a")  # the fast path's try
    clock.now += 0.01
    times.came_back("a")  # the slow path's, the same request
    clock.now += 1.0
    times.went("a")
    back = times.expected_back([Claim("a", 0.0)], clock.now)
    assert back(Claim("a", 0.0)) == clock.now + 6.0


def test_a_slot_whose_owner_would_be_saved_on_the_path_goes_after_every_free_one():
    """mixed-agents with the owner expected back last and nothing else (BENCHMARKS section 7,
    "Expected back, tried"): a one-off took the slot of the session that had just spoken, not
    yet in the server's RAM cache, and waited 7.5 s for its save. Expected back last decides
    only among the slots whose owners lose nothing; the others follow, coldest first."""
    clock = Clock()
    times = ReturnTimes(clock)
    take_turns(times, clock, ["sdk", "agent", "notes"], rounds=3)
    claims = {0: Claim("agent", clock.now - 2), 1: Claim("sdk", clock.now - 3),
              2: Claim("notes", clock.now - 1)}  # "notes" just spoke: back last
    slots = [SlotView(i, n_tokens=6000) for i in claims]
    back = times.expected_back(claims.values(), clock.now)
    # "agent" spoke after "sdk": back later, so its slot first; "notes" last, though back last
    assert rank_slots(slots, claims, clock.now, TTL, back, {0, 1}) == [0, 1, 2]
    # nobody free to take: the coldest first, whoever is expected back when
    assert rank_slots(slots, claims, clock.now, TTL, back, set()) == [1, 0, 2]
    # everybody free: the one expected back last first
    assert rank_slots(slots, claims, clock.now, TTL, back, {0, 1, 2})[0] == 2
