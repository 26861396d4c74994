"""The routing policy alone: pure functions, no server, no files."""

from __future__ import annotations

from slotkeeper import policy
from slotkeeper.policy import MAIN, MOVE, SIDE, Conversation

MAIN_CHAIN = ("sys-main", "m1", "m2", "m3")


def resident(chain=MAIN_CHAIN, system="main-system", chars=20_000) -> Conversation:
    return Conversation.of(chain, system, chars)


def classify(chain, system="main-system", chars=21_000, running=False, current=None,
             small=2000):
    return policy.classify(chain=chain, system_key=system, prompt_chars=chars,
                           small_request_chars=small,
                           resident=resident() if current is None else current,
                           own_request_running=running)


def test_the_next_turn_is_main():
    assert classify(MAIN_CHAIN + ("m4", "m5")) == MAIN
    assert classify(MAIN_CHAIN) == MAIN  # a retry of the same request


def test_a_title_request_with_its_own_system_prompt_is_side():
    """OpenCode: the title request carries the session's id, its own ~2.5 KB system prompt."""
    assert classify(("sys-title", "t1"), system="title-system", chars=2500) == SIDE


def test_a_much_shorter_prompt_that_does_not_extend_is_side():
    assert classify(("sys-main", "other"), chars=9_000) == SIDE


def test_a_rewritten_conversation_of_similar_size_takes_over():
    """Compaction rewrites the history; it stays the main conversation."""
    assert classify(("sys-main", "summary", "m9"), chars=15_000) == MAIN


def test_a_bigger_conversation_with_another_system_prompt_is_main():
    """The title request came first and holds the slot; the main request is bigger."""
    title = Conversation.of(("sys-title", "t1"), "title-system", 2500)
    assert classify(MAIN_CHAIN, current=title) == MAIN
    assert classify(MAIN_CHAIN, current=title, running=True) == MOVE


def test_two_requests_of_one_session_never_queue_on_one_slot():
    assert classify(MAIN_CHAIN + ("m4",), running=True) == SIDE
    assert policy.classify(chain=MAIN_CHAIN, system_key="s", prompt_chars=9000,
                           small_request_chars=2000, resident=None,
                           own_request_running=True) == MOVE


def test_small_prompts_are_side_whatever_they_are():
    assert classify(MAIN_CHAIN + ("m4",), chars=100) == SIDE


def test_an_unknown_resident_conversation_is_continued():
    unknown = Conversation("main-system", 0, "", 0)
    assert classify(("anything",), current=unknown, chars=5000) == MAIN


def test_content_sessions_fork_when_a_conversation_does_not_extend():
    base = "content-0123456789abcdef"
    first = Conversation.of(MAIN_CHAIN, "s", 9000)
    assert policy.resolve_content(base, ("sys-main", "m1"), {}) == base
    assert policy.resolve_content(base, MAIN_CHAIN + ("m4",), {base: first}) == base
    fork = policy.resolve_content(base, ("sys-main", "m1"), {base: first})
    assert fork.startswith(base + ".") and fork != base
    # the fork's next turn continues the fork, not the first conversation
    forked = Conversation.of(("sys-main", "m1"), "s", 500)
    known = {base: first, fork: forked}
    assert policy.resolve_content(base, ("sys-main", "m1", "x2", "x3"), known) == fork
    # the longest conversation that the request extends wins
    assert policy.resolve_content(base, MAIN_CHAIN + ("m4",), known) == base


def test_save_decisions():
    assert policy.worth_saving(300, 0, 256) and not policy.worth_saving(200, 0, 256)
    assert not policy.worth_saving(300, 300, 256)
    assert policy.grew_enough(5000, 2000, 256, 2048) and not policy.grew_enough(3000, 2000, 256,
                                                                                 2048)


def test_advice_says_nothing_about_slot_counts():
    assert policy.advice(url="u", total_slots=1, slots_readable=True) == []
    assert "GET /slots" in policy.advice(url="u", total_slots=4, slots_readable=False)[0]


def test_verify_slot_reads_which_slot_ran_the_request():
    # (id, tokens in the slot, processing); the request left 30 tokens behind
    assert policy.verify_slot(1, 30, [(0, 0, False), (1, 30, False)]) == (policy.VERIFIED, 1)
    assert policy.verify_slot(0, 30, [(0, 0, False), (1, 30, False)]) == (policy.MISMATCH, 1)
    # two candidates, or the pinned slot already busy with the next request: cannot tell
    assert policy.verify_slot(0, 30, [(0, 5, False), (1, 30, False), (2, 30, False)])[0] == \
        policy.UNKNOWN
    assert policy.verify_slot(0, 30, [(0, 9, True), (1, 30, False)])[0] == policy.UNKNOWN


def test_reuse_of_the_slots_prefix_needs_no_slot_check():
    assert not policy.needs_slot_check(expected_prefix=1000, cache_n=990)
    assert policy.needs_slot_check(expected_prefix=1000, cache_n=10)
    assert policy.needs_slot_check(expected_prefix=0, cache_n=0)  # a cold slot: check


def test_a_request_that_claims_nothing_takes_a_free_slot_then_a_saved_owners():
    costs = {0: (False, policy.SAVE), 1: (False, policy.CURRENT), 2: (False, policy.FREE),
             3: (True, policy.FREE)}
    assert policy.order_for_side([0, 1, 2, 3], costs) == [2, 1, 0, 3]
    # Within one cost, choice's ranking stands; an unknown slot is taken as busy.
    costs = {0: (False, policy.CURRENT), 1: (False, policy.CURRENT)}
    assert policy.order_for_side([1, 0, 5], costs) == [1, 0, 5]


def test_a_retry_of_the_running_request_waits_for_it_on_its_slot():
    """Issue #23: an SDK that gave up waiting sends the same request again while the original
    still runs; it goes where the original went (MAIN), where a continuation goes SIDE."""
    assert classify(MAIN_CHAIN, running=True) == MAIN
    assert classify(MAIN_CHAIN + ("m4",), running=True) == SIDE
    unknown = Conversation(None, 4, "", 20_000)  # an older record: no chain to compare
    assert classify(MAIN_CHAIN, running=True, current=unknown) == SIDE
