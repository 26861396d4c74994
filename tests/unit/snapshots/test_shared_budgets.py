"""The disk budget across proxies (issue #33): a save makes room for the saves in flight in
other proxies too when they share the budget's ledger (etcd); each proxy alone with the file
backend. A FAKE server writes the state files llama-server would."""

from __future__ import annotations

import struct

from store_backends import backend  # noqa: F401 - the fixture

from slotkeeper.snapshots.slotfiles import SessionMeta, SlotFolder
from slotkeeper.snapshots.snapshots import Snapshots
from slotkeeper.upstream.client import ServerProps
from slotkeeper.upstream.costs import Costs

TOKENS, KV = 100, 4000


def state_bytes() -> bytes:
    """A version 4 state file as llama-server b11434 lays it out, TOKENS tokens."""
    block = struct.pack(f"<iII{TOKENS}iI", -1, 1, TOKENS, *range(TOKENS), 0)
    return b"qsgg" + struct.pack("<II", 4, len(block) // 4) + block + b"\x5a" * KV


class FakeServer:
    """FAKE llama-server: its save writes the state file into the slot folder."""

    def __init__(self, folder: SlotFolder) -> None:
        self.folder = folder
        self.slot_actions_disabled = False
        self.costs = Costs()

    def save(self, slot: int, name: str, expected_bytes: int = 0) -> dict:
        data = state_bytes()
        (self.folder.root / name).write_bytes(data)
        return {"n_saved": TOKENS, "n_written": len(data), "timings": {"save_ms": 1.0}}


def put(folder: SlotFolder, session: str, last_used: float) -> None:
    data = state_bytes()
    folder.state_path(session).write_bytes(data)
    folder.write_meta(SessionMeta(session_id=session, kind="session",
                                  file_name=folder.state_path(session).name, fingerprint="fp",
                                  n_ctx=4096, n_tokens=TOKENS, n_messages=1, created=0.0,
                                  last_used=last_used, size_bytes=len(data)))


def test_a_save_makes_room_for_another_proxys_save_in_flight(backend, tmp_path):
    slots = tmp_path / "slots"
    slots.mkdir()
    a_store, b_store = backend.open(), backend.open()
    folder = SlotFolder(slots)
    put(folder, "old1", last_used=1.0)
    put(folder, "old2", last_used=2.0)
    each = folder.usage()[1] // 2
    folder.max_bytes = 3 * each + each // 2  # room for three snapshots, not four
    a = Snapshots(folder, a_store.locks, ledger=a_store.ledger)
    props = ServerProps(total_slots=2, n_ctx=4096, model_path="m.gguf", build_info="b", raw={})
    # Proxy B has begun a save of one snapshot's size, nothing written yet.
    with b_store.ledger.reserve(folder.saving_name("b"), len(state_bytes())):
        assert a.save(FakeServer(folder), props, 0, "new", messages=1) == TOKENS
    left = {m.session_id for m in folder.list_sessions()}
    print(f"{backend.kind}: left {sorted(left)}")
    if backend.kind == "etcd":  # room for B's file too: the least recently used went
        assert left == {"old2", "new"}
    else:  # the file backend: each proxy counts its own saves, as before
        assert left == {"old1", "old2", "new"}
    assert a_store.ledger.last_hour() == len(state_bytes())
