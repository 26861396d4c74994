"""habits: one-off requests and wanted seeds, told by what earlier requests like them did
(issue #23). Pure, no server."""

from __future__ import annotations

import pytest

from slotkeeper.identity.habits import ONE_OFF_AFTER, Habits, names_a_task

KEY = "k" * 64


def one_request(habits: Habits, key: str, name: str) -> None:
    habits.saw(key, name, name, f"{name}-prompt")
    habits.ended(key, name)


def agent_turn(habits: Habits, turn: int) -> None:
    """The agent's own conversation (another system prompt) comes back: its next turn (two
    requests, so the first call is a continuation too)."""
    for part in ("question", "tool result"):
        habits.saw("agent-key", "agent", "agent", f"agent-turn-{turn}-{part}")
        habits.ended("agent-key", "agent")


@pytest.mark.parametrize("session, task", [
    ("title-ses_abc", True), ("summary_ses_1", True), ("ses_1:tags", True), ("memory", True),
    ("ses_abc", False), ("entitled-user", False), ("content-1234abcd", False),
    ("untitled", False), ("tagline-7", False),
])
def test_session_ids_that_name_a_task(session, task):
    assert names_a_task(session) is task


def test_a_named_task_is_a_one_off_from_its_first_request():
    assert Habits().is_one_off(system_key=KEY, opening="title-s1", session_id="title-s1")


def test_a_system_prompt_whose_conversations_end_after_one_request_is_one_off():
    habits = Habits()
    agent_turn(habits, 1)
    for i in range(ONE_OFF_AFTER):
        assert not habits.is_one_off(system_key=KEY, opening=f"m{i}", session_id=f"m{i}")
        one_request(habits, KEY, f"m{i}")  # a memory request after each of the agent's turns
        agent_turn(habits, i + 2)
    assert habits.is_one_off(system_key=KEY, opening="m9", session_id="m9")
    # Its leftovers: the sessions that ran before it was known.
    assert habits.leftovers(KEY) == [f"m{i}" for i in range(ONE_OFF_AFTER)]
    assert habits.leftovers(KEY) == []  # handed out once
    # Another system prompt, or no system prompt: not one-off.
    assert not habits.is_one_off(system_key="other", opening="x", session_id="x")
    assert not habits.is_one_off(system_key=None, opening="m9", session_id="m9")


def test_sessions_started_one_after_another_are_no_evidence():
    """A demo or a benchmark starts three sessions with one system prompt, one turn each,
    before any second turn: nothing came back yet because nothing had the chance."""
    habits = Habits()
    one_request(habits, KEY, "demo-1")
    one_request(habits, KEY, "demo-2")
    assert not habits.is_one_off(system_key=KEY, opening="demo-3", session_id="demo-3")
    agent_turn(habits, 1)  # now something came back, and demo-1 and -2 did not
    assert habits.is_one_off(system_key=KEY, opening="demo-3", session_id="demo-3")


def test_running_or_continued_conversations_are_no_evidence():
    habits = Habits()
    habits.saw(KEY, "a", "a", "a1")  # two agents started at once: both in their first turn
    habits.saw(KEY, "b", "b", "b1")
    agent_turn(habits, 1)
    assert not habits.is_one_off(system_key=KEY, opening="c", session_id="c")
    habits.ended(KEY, "a")
    habits.ended(KEY, "b")
    habits.saw(KEY, "a", "a", "a2")  # a came back: the prompt is conversational
    assert not habits.is_one_off(system_key=KEY, opening="c", session_id="c")
    assert habits.leftovers(KEY) == []
    # A conversation already seen is never a one-off.
    assert not habits.is_one_off(system_key=KEY, opening="b", session_id="b")


def test_a_seed_is_wanted_once_a_second_conversation_uses_the_prompt():
    habits = Habits()
    habits.saw(KEY, "a", "a", "a1")
    assert not habits.seed_wanted(KEY, ending="a")  # one conversation: nobody to restore it
    habits.ended(KEY, "a")
    habits.saw(KEY, "a", "a", "a2")  # a's second turn
    habits.ended(KEY, "a")
    habits.saw(KEY, "b", "b", "b1")
    assert habits.seed_wanted(KEY, ending="b")
    assert not habits.seed_wanted(None)


def test_forks_of_one_opening_want_a_seed():
    """An agent that rebuilds its prompt forks a session per turn: one conversation, and its
    forks restore the seed."""
    habits = Habits()
    one_request(habits, KEY, "content-1")
    habits.saw(KEY, "content-1", "content-1.ab12cd34", "turn-2")
    assert habits.seed_wanted(KEY, ending="content-1")


def test_no_seed_for_a_prompt_of_one_offs():
    habits = Habits()
    one_request(habits, KEY, "m1")
    agent_turn(habits, 1)
    habits.saw(KEY, "m2", "m2", "m2-prompt")
    assert not habits.seed_wanted(KEY, ending="m2")  # m1 and m2 both ended after one request


def test_memory_is_bounded():
    habits = Habits(max_keys=3)
    for i in range(10):
        one_request(habits, f"key{i}", "s")
    assert len(habits._keys) == 3
    for i in range(40):
        one_request(habits, KEY, f"s{i}")
    assert len(habits._keys[KEY].openings) <= 16


def test_a_retry_is_not_a_second_turn():
    habits = Habits()
    habits.saw(KEY, "m1", "m1", "head1")
    habits.saw(KEY, "m1", "m1", "head1")  # the SDK retried the same request
    habits.ended(KEY, "m1")
    habits.ended(KEY, "m1")
    agent_turn(habits, 1)
    one_request(habits, KEY, "m2")
    agent_turn(habits, 2)
    assert habits.is_one_off(system_key=KEY, opening="m3", session_id="m3")
