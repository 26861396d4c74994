"""The routing policy alone: pure functions, no server, no files."""

from __future__ import annotations

from slotkeeper.decisions import policy
from slotkeeper.decisions.policy import MAIN, MOVE, SIDE, Conversation

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


def test_a_request_that_claims_nothing_prefers_a_free_slot_holding_something():
    """Issue #32, item 7b: pinned to an empty slot llama-server never consults its RAM cache;
    pinned to one that holds something it parks that and looks the prompt up."""
    costs = {0: (False, policy.FREE), 1: (False, policy.FREE), 2: (False, policy.SAVE)}
    tokens = {0: 0, 1: 300, 2: 900}
    assert policy.order_for_side([0, 1, 2], costs, tokens) == [1, 0, 2]
    # An empty free slot still comes before a slot whose owner would pay for it.
    assert policy.order_for_side([2, 0], costs, tokens) == [0, 2]
    # Without token counts, the old order.
    assert policy.order_for_side([0, 1, 2], costs) == [0, 1, 2]


def test_a_side_request_goes_unpinned_only_where_nobody_can_lose_kv():
    free = {0: (False, policy.FREE), 1: (False, policy.FREE)}
    assert policy.side_goes_unpinned(0, free, {0: 0, 1: 0})
    assert not policy.side_goes_unpinned(0, free, {0: 40, 1: 0})  # pinned: the RAM cache is seen
    owned = {0: (False, policy.FREE), 1: (False, policy.CURRENT)}
    assert not policy.side_goes_unpinned(0, owned, {0: 0, 1: 0})  # the server could pick 1
    busy = {0: (False, policy.FREE), 1: (True, policy.FREE)}
    assert not policy.side_goes_unpinned(0, busy, {0: 0, 1: 0})
    assert not policy.side_goes_unpinned(0, {}, {})


def test_a_retry_of_the_running_request_waits_for_it_on_its_slot():
    """Issue #23: an SDK that gave up waiting sends the same request again while the original
    still runs; it goes where the original went (MAIN), where a continuation goes SIDE."""
    assert classify(MAIN_CHAIN, running=True) == MAIN
    assert classify(MAIN_CHAIN + ("m4",), running=True) == SIDE
    unknown = Conversation(None, 4, "", 20_000)  # an older record: no chain to compare
    assert classify(MAIN_CHAIN, running=True, current=unknown) == SIDE


# ---- issue #19: prefix first, told by what they are -------------------------------------------

def test_common_prefix_counts_the_leading_items_two_chains_share():
    assert policy.common_prefix(("a", "b", "c"), ("a", "b", "x", "y")) == 2
    assert policy.common_prefix((), ("a",)) == 0
    assert policy.common_prefix(("a", "b"), ("a", "b")) == 2


def test_a_rebuilt_prompt_continues_the_conversation_it_shares_the_most_with():
    """A header-less agent rebuilds its prompt each turn: system, examples, history, then the
    new message with the file and a reminder. No turn extends the previous one; the next turn
    is longer and shares its system prompt and examples (and the history so far)."""
    base = "content-0123456789abcdef"
    turn1 = ("sys", "ex1", "ex1a", "ex2", "ex2a", "file+q1")
    turn2 = ("sys", "ex1", "ex1a", "ex2", "ex2a", "q1", "a1", "file+q2")
    known = {base: Conversation.of(turn1, "s", 6000)}
    assert policy.resolve_content(base, turn2, known, {base: turn1}) == base
    assert policy.rebuilt_from(turn2, known, {base: turn1}) == base
    # Without its chain (forgotten, another process) it forks, as before.
    assert policy.resolve_content(base, turn2, known, {}) != base


def test_a_new_conversation_with_the_same_opening_still_forks():
    """Fault 5: not longer than the known conversation, so not the same agent's next turn."""
    base = "content-0123456789abcdef"
    old = ("sys", "m1", "a1", "m2")
    known = {base: Conversation.of(old, "s", 6000)}
    fork = policy.resolve_content(base, ("sys", "m1x"), known, {base: old})
    assert fork.startswith(base + ".")
    assert policy.rebuilt_from(("sys", "m1", "a1", "m2x"), known, {base: old}) is None


def test_a_request_sharing_little_with_the_slot_is_side_and_its_next_turn_main():
    """A chat UI's title request carries the chat's id and a transcript of the chat in one
    message (no system prompt): it shares nothing with the chat's conversation (issue #19)."""
    chat = Conversation.of(("nosys", "doc+q1"), None, 4000)
    title = ("nosys", "title task + transcript")
    assert policy.classify(chain=title, system_key=None, prompt_chars=3900,
                           small_request_chars=2000, resident=chat,
                           own_request_running=False, common_chars=0) == SIDE
    # Another system prompt: the sizes decide, whatever it shares (OpenCode's title came
    # first and holds the slot; the main request is bigger).
    title_first = Conversation.of(("sys-title", "t1"), "title-system", 2500)
    assert policy.classify(chain=MAIN_CHAIN, system_key="main-system", prompt_chars=21_000,
                           small_request_chars=2000, resident=title_first,
                           own_request_running=True, common_chars=0) == MOVE
    # Compaction keeps the system prompt and tools (most of the prompt): still main.
    assert classify(("sys-main", "summary", "m9"), chars=15_000) == MAIN
    assert policy.classify(chain=("sys-main", "summary", "m9"), system_key="main-system",
                           prompt_chars=15_000, small_request_chars=2000, resident=resident(),
                           own_request_running=False, common_chars=12_000) == MAIN
    # An edited message: side first; its next turn (extends it, longer) is the main one.
    edited = Conversation.of(("nosys", "doc+q1 edited"), None, 4000)
    assert policy.classify(chain=("nosys", "doc+q1 edited", "a", "q2"), system_key=None,
                           prompt_chars=4500, small_request_chars=2000, resident=chat,
                           own_request_running=False, common_chars=0,
                           last_side=edited) == MAIN


def test_a_rebuilt_prompt_resolved_by_sessions_is_the_main_conversation():
    assert policy.classify(chain=("sys-main", "other", "more"), system_key="main-system",
                           prompt_chars=21_000, small_request_chars=2000, resident=resident(),
                           own_request_running=False, rewrites=True, common_chars=10) == MAIN


def test_a_request_holding_the_running_conversation_and_more_is_its_next_turn():
    running = Conversation.of(MAIN_CHAIN, "s", 9000)
    assert policy.strictly_extends(MAIN_CHAIN + ("a", "q"), running)
    assert not policy.strictly_extends(MAIN_CHAIN, running)  # a retry: the same request
    assert not policy.strictly_extends(("sys-main", "x", "y", "z", "w"), running)
    assert not policy.strictly_extends(MAIN_CHAIN + ("a",), None)


def test_a_parents_snapshot_is_restored_for_a_fork_only_when_the_server_will_reuse_it():
    """A restore keeps only the sliding window's cells of a Gemma 3 slot: a fork diverging
    more than the window before the snapshot's end reuses nothing (docs/DESIGN.md)."""
    near_end = policy.Prefix("parent", items=3, chars=9_000, parent_chars=10_000)
    assert policy.prefix_restore_tokens(near_end, snapshot_tokens=2_500,
                                        snapshot_messages=3) == 2_250
    far = policy.Prefix("parent", items=3, chars=4_000, parent_chars=10_000)
    assert policy.prefix_restore_tokens(far, snapshot_tokens=2_500, snapshot_messages=5) == 0
    # A snapshot older than the divergence is all prefix.
    assert policy.prefix_restore_tokens(far, snapshot_tokens=1_000, snapshot_messages=2) == 1_000
    assert policy.prefix_restore_tokens(far, snapshot_tokens=0, snapshot_messages=0) == 0
    # The system block alone (a memory request's parent, issue #23): within the window of
    # the snapshot's end, it is restored.
    block = policy.Prefix("parent", items=1, chars=29_000, parent_chars=29_600)
    assert policy.prefix_restore_tokens(block, snapshot_tokens=4_727,
                                        snapshot_messages=1) == 4_727 * 29_000 // 29_600
    assert policy.prefix_restore_tokens(policy.Prefix("parent", items=0, chars=0,
                                                      parent_chars=29_600),
                                        snapshot_tokens=4_727, snapshot_messages=1) == 0

