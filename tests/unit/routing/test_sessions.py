"""The sessions room alone (no server): running counts, the wait for a request that already
sent its final event (issue #19), forks and rebuilt prompts of content-identified requests."""

from __future__ import annotations

import threading
import time

from slotkeeper.decisions.choice import Claim
from slotkeeper.identity.identity import identify
from slotkeeper.routing.returns import ReturnTimes
from slotkeeper.routing.sessions import Sessions
from slotkeeper.store.state import StateFile

URL = "http://127.0.0.1:1"


def sessions(tmp_path) -> Sessions:
    return Sessions(StateFile(tmp_path / "state.json"), 100, (), ReturnTimes(time.time))


def ask(messages: list[dict], headers: dict | None = None):
    return identify("/v1/chat/completions", headers or {}, {"messages": messages})


def test_a_next_turn_waits_for_a_request_that_sent_its_final_event(tmp_path):
    s = sessions(tmp_path)
    turn1 = ask([{"role": "system", "content": "s" * 300}, {"role": "user", "content": "q1"}],
                {"x-session-id": "a"})
    turn2 = ask([{"role": "system", "content": "s" * 300}, {"role": "user", "content": "q1"},
                 {"role": "assistant", "content": "r"}, {"role": "user", "content": "q2"}],
                {"x-session-id": "a"})
    other = ask([{"role": "user", "content": "unrelated " * 30}], {"x-session-id": "a"})
    assert s.enter(URL, "a") == 0
    s.remember(URL, "a", turn1)
    # Still generating: a request holding the running conversation and more waits (its
    # client has the answer), an unrelated one does not.
    assert s.should_wait(URL, turn2) and not s.should_wait(URL, other)
    s.finishing(URL, "a")
    assert s.should_wait(URL, other)  # only bookkeeping left: whatever it is, it waits
    threading.Timer(0.2, s.leave, args=(URL, "a"), kwargs={"finishing": True}).start()
    started = time.monotonic()
    waited = s.wait_until_ended(URL, "a", 5.0)
    assert 0.1 < waited < 2.0 and time.monotonic() - started < 2.0
    assert not s.should_wait(URL, turn2)
    # Bounded: a request that never ends is waited for at most the timeout.
    s.enter(URL, "a")
    assert s.wait_until_ended(URL, "a", 0.2) < 1.0


def test_a_rebuilt_prompt_continues_and_a_new_conversation_forks_from_its_prefix(tmp_path):
    s = sessions(tmp_path)
    system = {"role": "system", "content": "x" * 500}
    examples = [{"role": "user", "content": "ex"}, {"role": "assistant", "content": "exa"}]
    turn1 = ask([system, *examples, {"role": "user", "content": "file + q1"}])
    first = s.resolve(URL, turn1)
    s.remember(URL, first.session_id, first)
    turn2 = ask([system, *examples, {"role": "user", "content": "q1"},
                 {"role": "assistant", "content": "a1"}, {"role": "user", "content": "file + q2"}])
    second = s.resolve(URL, turn2)
    assert second.session_id == first.session_id and second.rewrites
    s.remember(URL, second.session_id, second)
    fork = s.resolve(URL, ask([system, *examples, {"role": "user", "content": "other"}]))
    assert fork.session_id != first.session_id and not fork.rewrites
    assert fork.prefix is not None and fork.prefix.session == first.session_id
    assert fork.prefix.items == 3  # the system block and the example exchange


def test_a_new_opening_starts_from_any_conversation_with_its_system_block(tmp_path):
    """An agent's memory request (a long system prompt, then a transcript that grows: no two
    share an opening) starts from the last one's prefix, as llama-server's own cache would
    (issue #23); so does a new conversation of a short system block (issue #32: whether the
    restore pays is priced when it happens)."""
    s = sessions(tmp_path)  # small requests: under 100 characters
    memory = {"role": "system", "content": "remember " * 40}
    first = s.resolve(URL, ask([memory, {"role": "user", "content": "transcript: t1"}]))
    s.remember(URL, first.session_id, first)
    second = s.resolve(URL, ask([memory, {"role": "user", "content": "transcript: t1 t2"}]))
    assert second.session_id != first.session_id
    assert second.prefix is not None and second.prefix.session == first.session_id
    assert second.prefix.items == 1 and second.prefix.chars == second.chain_chars[0]
    assert second.prefix.parent_chars == first.prompt_chars
    # The third shares only the block with both earlier ones: it starts from the latest,
    # whose transcript it extends (the first one's would give it less).
    s.remember(URL, second.session_id, second)
    third = s.resolve(URL, ask([memory, {"role": "user", "content": "transcript: t1 t2 t3"}]))
    assert third.prefix is not None and third.prefix.session == second.session_id
    short = {"role": "system", "content": "be brief"}
    one = s.resolve(URL, ask([short, {"role": "user", "content": "a question " * 20}]))
    s.remember(URL, one.session_id, one)
    other = s.resolve(URL, ask([short, {"role": "user", "content": "another one " * 20}]))
    assert other.session_id != one.session_id
    assert other.prefix is not None and other.prefix.session == one.session_id
    assert other.prefix.chars == other.chain_chars[0]  # the block, not the question


def test_a_new_header_session_takes_the_latest_conversation_with_its_block(tmp_path):
    """The second conversation of a system prompt (its own session id) gets the first as its
    parent, as a content request that opens something new does, whatever the block's length;
    never itself, never a content-identified request (those fork in `resolve`)."""
    s = sessions(tmp_path)  # small requests: under 100 characters
    system = {"role": "system", "content": "you are an agent " * 20}
    first = ask([system, {"role": "user", "content": "task one"}], {"x-session-id": "one"})
    assert s.with_parent(URL, first).prefix is None  # nobody before it
    s.remember(URL, "one", first)
    second = ask([system, {"role": "user", "content": "task two"}], {"x-session-id": "two"})
    parented = s.with_parent(URL, second)
    assert parented.session_id == "two"
    assert parented.prefix is not None and parented.prefix.session == "one"
    assert parented.prefix.items == 1 and parented.prefix.chars == second.chain_chars[0]
    assert parented.prefix.parent_chars == first.prompt_chars
    # Its own later request is no parent of itself: the latest other one is.
    s.remember(URL, "two", second)
    again = ask([system, {"role": "user", "content": "task two, again"}], {"x-session-id": "two"})
    assert s.with_parent(URL, again).prefix.session == "one"
    short = {"role": "system", "content": "be brief"}
    s.remember(URL, "three", ask([short, {"role": "user", "content": "q " * 60}],
                                 {"x-session-id": "three"}))
    fourth = ask([short, {"role": "user", "content": "r " * 60}], {"x-session-id": "four"})
    assert s.with_parent(URL, fourth).prefix.session == "three"
    content = ask([system, {"role": "user", "content": "task five"}])
    assert content.rule == "content" and s.with_parent(URL, content) is content


def test_a_request_tried_twice_is_one_return_and_one_end(tmp_path):
    """The fast path's failed try leaves with `tried`: the session has not gone; its wait
    is the time since its previous request ended, counted once."""
    clock = [100.0]
    s = Sessions(StateFile(tmp_path / "state.json"), 100, (), ReturnTimes(lambda: clock[0]))
    s.enter(URL, "a")
    clock[0] = 101.0
    s.leave(URL, "a")  # its first request ended at 101
    clock[0] = 105.0
    s.enter(URL, "a")  # the fast path's try
    s.leave(URL, "a", tried=True)
    clock[0] = 105.1
    s.enter(URL, "a")  # the slow path
    clock[0] = 106.0
    s.leave(URL, "a")

    def back(now: float) -> float:
        claim = Claim("a", 0.0)
        return s.returns.expected_back([claim], now)(claim)

    assert back(106.0) == 110.0  # ended at 106, usual wait 4 s (not 0 from the tries)
