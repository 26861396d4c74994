"""When a handover of a slot to another session goes through llama-server's own RAM cache
by itself (issue #31): what the two conversations share, against the slot (f_keep) and,
under a high --slot-prompt-similarity, against the request; leaning to "no" where unsure."""

from __future__ import annotations

from types import SimpleNamespace

from slotkeeper.decisions.ramcache import RamModel
from slotkeeper.identity.identity import Identity
from slotkeeper.routing.ramhandover import RamHandover, published_twin
from slotkeeper.store.state import SlotRecord, UpstreamRecord


def incoming(prompt_chars: int, system_key: str = "sys") -> Identity:
    return Identity(session_id="b", rule="header x-session-id", parent_id=None,
                    prompt_chars=prompt_chars, message_count=3, seed_key=system_key,
                    system_chars=2400)


def swaps(sps: float, slot_chars: int, prompt_chars: int, shared: int | None,
          slot_system: str = "sys") -> bool:
    """The slot holds session a's conversation of `slot_chars` (3,000 tokens); the request
    shares `shared` characters of it as the sessions room remembers it (None: not known)."""
    ram = RamHandover(saves=None, snapshots=None, erase_on_handover=False,
                      shared_chars=lambda ident, rec: shared)
    previous = SlotRecord(owner="a", claimed=1, last_used=1, tokens=3000,
                          system_key=slot_system, chars=slot_chars)
    return ram.server_swaps(SimpleNamespace(ram=RamModel(sps=sps)), incoming(prompt_chars),
                            previous, live_tokens=0)


def test_the_same_system_block_keeps_a_short_slot_at_the_default_threshold():
    # f_keep 2,400/3,400: the server keeps the slot (a hand-back's case)
    assert not swaps(0.1, slot_chars=3400, prompt_chars=3800, shared=2400)


def test_the_same_system_block_swaps_a_long_slot_at_the_default_threshold():
    # f_keep 2,400/12,000: the server parks the slot in RAM and loads the request's entry
    assert swaps(0.1, slot_chars=12000, prompt_chars=3800, shared=2400)


def test_under_a_high_threshold_the_same_system_block_swaps_by_itself():
    # six-agents' handover: f_sim 2,400/3,800 = 0.63, under 0.8: counted as nothing kept
    assert swaps(0.8, slot_chars=3400, prompt_chars=3800, shared=2400)
    # a request that is mostly what it shares with the slot is kept
    assert not swaps(0.8, slot_chars=3400, prompt_chars=2800, shared=2400)


def test_near_a_threshold_it_leans_to_no_swap():
    # f_keep 0.49 by characters: the server may count a few more tokens shared and keep it
    assert not swaps(0.1, slot_chars=5000, prompt_chars=3800, shared=2450)
    assert not swaps(0.8, slot_chars=3400, prompt_chars=3050, shared=2400)  # f_sim 0.79


def test_what_is_shared_is_counted_from_the_conversations_not_the_system_block_alone():
    # they share the system block and two example exchanges: a swap predicted from the
    # system block alone (2,400 of 5,000) would leave the slot's tail to a cache that never
    # got it (the short-system-prompt test saw it)
    assert not swaps(0.1, slot_chars=5000, prompt_chars=5200, shared=3300)


def test_unknown_conversations_swap_only_when_the_system_blocks_differ():
    assert not swaps(0.8, slot_chars=3400, prompt_chars=3800, shared=None)
    assert swaps(0.1, slot_chars=3400, prompt_chars=3800, shared=None, slot_system="other")
    assert not swaps(0.0, slot_chars=12000, prompt_chars=3800, shared=None, slot_system="other")


# ---- the hand-back by a file: only where the restore loses nothing ----------------------------

class FakeSnapshots:
    """A FAKE snapshot store: the hand-back file is there; restores are recorded."""

    def __init__(self) -> None:
        self.folder = SimpleNamespace(read_meta=lambda snapshot: object())
        self.restored: list[str] = []

    def restore(self, client, props, slot, snapshot, messages, notes, **how) -> int:
        assert how == {"what": "hand-back file", "priced": False}
        self.restored.append(snapshot)
        return 2


def by_file(previous: SlotRecord | None, published: set[str]) -> bool:
    snapshots = FakeSnapshots()
    ram = RamHandover(saves=None, snapshots=snapshots, erase_on_handover=False)
    info = SimpleNamespace(props=SimpleNamespace(fingerprint="model-a"), client=None,
                           published=lambda session: session in published)
    used = ram._hand_back_from_file(info, 0, previous, "b")
    assert used == bool(snapshots.restored)
    return used


def test_a_slot_is_cleared_by_the_file_only_when_its_session_is_in_the_cache_already():
    a = SlotRecord(owner="a", claimed=1, last_used=1, tokens=900)
    assert by_file(a, published={"a"})
    # a restore overwrites the slot where the call parks it first: a's unsaved KV would go
    assert not by_file(a, published=set())
    assert by_file(None, published=set())  # no session of ours in the slot
    assert by_file(SlotRecord(owner="a", claimed=1, last_used=1, stale=True), published=set())


# ---- a new conversation's opening from another session's copy --------------------------------

def twin(published: set[str], idle: set[int]) -> str | None:
    up = UpstreamRecord(slots={
        0: SlotRecord(owner="a", claimed=1, last_used=1, tokens=731, system_key="sys"),
        1: SlotRecord(owner="b", claimed=2, last_used=2, tokens=731, system_key="sys"),
        2: SlotRecord(owner="x", claimed=3, last_used=3, tokens=900, system_key="other"),
        3: SlotRecord(owner="s", claimed=4, last_used=4, tokens=731, system_key="sys",
                      stale=True)})
    info = SimpleNamespace(published=lambda session: session in published)
    return published_twin(info, up, "sys", frozenset(idle))


def test_the_twin_is_an_idle_session_of_the_same_system_block_already_in_the_cache():
    assert twin(published={"a"}, idle={0, 1, 2, 3}) == "a"
    assert twin(published={"a", "b"}, idle={1, 2, 3}) == "b"  # a is busy: not a


def test_no_twin_when_the_cache_lacks_it_or_its_slot_holds_something_else():
    assert twin(published=set(), idle={0, 1, 2, 3}) is None  # not copied yet: the call
    assert twin(published={"a"}, idle={1, 2, 3}) is None  # a's slot is computing
    assert twin(published={"x"}, idle={2}) is None  # another system block
    assert twin(published={"s"}, idle={3}) is None  # the slot no longer holds s
