"""A seed left waiting for a quiet server (FirstTurns.seed_if_idle) is taken after the
session's later turns, which were kept on its slot and left no seed of their own. The
session's snapshot is saved first with its current message count; the restore after the cut
must check against that count. With the count of the request that left the seed, the restore
refused the newer snapshot ("snapshot has 6 messages, request has 4", six-agents at the end
of the bench) and the session's slot was left holding only the seed. Fakes stand in for the
server calls (named below); the state file and the slot locks are real."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from slotkeeper.routing.firstturns import FirstTurns, PendingSeed
from slotkeeper.snapshots.seeds import Taken
from slotkeeper.store.locks import SlotLocks
from slotkeeper.store.state import SlotRecord, StateFile
from slotkeeper.upstream.registry import UpstreamInfo

URL = "http://127.0.0.1:1"


class FakeSaves:
    """Saves: says every save succeeded, records slots marked stale."""

    def __init__(self) -> None:
        self.stale: list[int] = []

    def save_if_worth(self, url, info, slot, rec, tokens) -> bool:
        return True

    def mark_stale(self, url, slot, session) -> None:
        self.stale.append(slot)


class FakeSeeds:
    """SeedBuilder: records the message count the session is to be restored with."""

    def __init__(self) -> None:
        self.messages: list[int] = []

    def wants(self, props, key) -> bool:
        return True

    def take_afterwards(self, client, props, slot, key, path, body, session, messages) -> Taken:
        self.messages.append(messages)
        return Taken(seed_tokens=611, evaluated=1, restored=900 if messages >= 6 else 0)


def first_turns(tmp_path: Path, recorded_messages: int) -> tuple[FirstTurns, FakeSeeds,
                                                                   FakeSaves]:
    state = StateFile(tmp_path / "state.json")

    def put(doc) -> bool:
        doc.upstream(URL).slots[0] = SlotRecord(owner="agent5", claimed=0.0, last_used=0.0,
                                                tokens=981, messages=recorded_messages)
        return True

    state.update(put)
    info = UpstreamInfo(client=SimpleNamespace(), props=SimpleNamespace())
    upstreams = SimpleNamespace(peek=lambda url: info, get=lambda url: info)
    seeds, saves = FakeSeeds(), FakeSaves()
    turns = FirstTurns(state, SlotLocks(tmp_path / "locks"),
                       upstreams, saves, snapshots=None,  # type: ignore[arg-type]
                       seeds=seeds, seed_min_chars=0)  # type: ignore[arg-type]
    # left by the session's first answer (4 messages); its two later turns were kept
    turns.pending[(URL, "agent5")] = PendingSeed(slot=0, key="k", messages=4,
                                                 source=("/v1/chat/completions", {}))
    return turns, seeds, saves


def test_the_restore_after_a_later_seed_checks_the_sessions_current_messages(tmp_path: Path):
    turns, seeds, saves = first_turns(tmp_path, recorded_messages=6)
    assert turns.seed_if_idle(URL, "agent5", quiet=True) is True
    assert seeds.messages == [6]
    assert saves.stale == []  # restored: the slot is still the session's


def test_a_busy_server_leaves_the_seed_waiting(tmp_path: Path):
    turns, seeds, _ = first_turns(tmp_path, recorded_messages=6)
    assert turns.seed_if_idle(URL, "agent5", quiet=False) is None
    assert seeds.messages == []
    assert (URL, "agent5") in turns.pending
