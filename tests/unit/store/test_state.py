"""The shared state file: cheap reads, locked atomic updates, corrupt files rebuilt."""

import json
import multiprocessing
import os
import stat
import time

from store_backends import backend  # noqa: F401 - the fixture

from slotkeeper.store.state import SlotRecord, StateDoc, StateFile


def claim(state, url: str, slot: int, owner: str, now: float = 1.0) -> None:
    def change(doc: StateDoc) -> None:
        doc.upstream(url).slots[slot] = SlotRecord(owner=owner, claimed=now, last_used=now)

    state.update(change)


def test_round_trip_and_owner_lookup(backend):
    state = backend.open().state
    claim(state, "http://a:1", 2, "sess-1")
    doc = backend.open().state.read()  # a second process's view
    assert doc.upstreams["http://a:1"].slot_of("sess-1") == 2
    assert doc.upstreams["http://a:1"].slot_of("other") is None


def test_file_is_owner_only_and_written_whole(tmp_path):
    state = StateFile(tmp_path / "state.json")
    claim(state, "u", 0, "s")
    assert stat.S_IMODE(os.stat(tmp_path / "state.json").st_mode) == 0o600
    assert json.loads((tmp_path / "state.json").read_text())["version"] == 1
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".state-")] == []


def test_read_is_cached_until_the_file_changes(backend):
    state = backend.open().state
    claim(state, "u", 0, "s")
    first = state.read()
    assert state.read() is first  # no change: no re-parse
    assert state.last_read() is first
    claim(backend.open().state, "u", 1, "t", now=2.0)
    # The file is read again at once; etcd's copy follows through its watch (a millisecond or
    # so: the locks, not the read, order one process's decisions after another's).
    deadline = time.monotonic() + 2.0
    while state.read().upstreams["u"].slot_of("t") != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert state.read().upstreams["u"].slot_of("t") == 1


def test_corrupt_file_is_rebuilt_not_fatal(tmp_path, caplog):
    path = tmp_path / "state.json"
    for garbage in (b"{not json", b'{"version": 1, "upstreams": []}', b"\xff\xfe",
                    b'{"version": 1, "upstreams": {"u": {"slots": {"x": {}}}}}'):
        path.write_bytes(garbage)
        state = StateFile(path)
        assert state.read().upstreams == {}
        claim(state, "u", 0, "s")
        assert StateFile(path).read().upstreams["u"].slot_of("s") == 0
    assert "rebuilding" in caplog.text


def _claim_many(args: list[str], worker: int, count: int) -> None:
    from pathlib import Path

    from slotkeeper.store.backends import open_store
    state = open_store(Path(args[0]), args[1], args[2]).state
    for i in range(count):
        def change(doc: StateDoc, i=i) -> None:
            up = doc.upstream("u")
            up.slots[len(up.slots)] = SlotRecord(owner=f"w{worker}-{i}", claimed=0, last_used=0)
        state.update(change)


def test_concurrent_processes_lose_no_update(backend):
    procs = [multiprocessing.get_context("spawn").Process(target=_claim_many,
                                                          args=(backend.args(), w, 25))
             for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    owners = {rec.owner for rec in backend.open().state.read().upstreams["u"].slots.values()}
    assert len(owners) == 100


def test_only_idle_empty_slots_that_held_a_session_lose_their_claim():
    """A verification's /slots read (upstreams._reconcile): a slot the server shows empty and
    idle lost its owner's KV (restart, cleared); a claim whose first request is still in
    flight (tokens not recorded yet: queued, or the slot processing its prompt with 0 tokens)
    keeps its claim, or that session's first turn would never be saved (seen in the
    corrupt-files test with four first requests at once on a fresh proxy)."""
    from slotkeeper.decisions.choice import SlotView
    from slotkeeper.upstream.registry import _reconcile

    url = "http://127.0.0.1:1"
    doc = StateDoc()
    up = doc.upstream(url)
    up.fingerprint = "fp"
    up.slots = {0: SlotRecord("in-flight", 1.0, 1.0),                 # first request running
                1: SlotRecord("queued", 1.0, 1.0),                    # not started by the server
                2: SlotRecord("lost", 1.0, 1.0, tokens=500),          # held KV, slot now empty
                3: SlotRecord("busy-again", 1.0, 1.0, tokens=500),    # its next turn running
                4: SlotRecord("resident", 1.0, 1.0, tokens=500)}
    live = {0: SlotView(0, is_processing=True), 1: SlotView(1),
            2: SlotView(2), 3: SlotView(3, is_processing=True), 4: SlotView(4, n_tokens=500)}
    cleared: list[int] = []
    assert _reconcile(doc, url, "fp", live, cleared)
    assert {slot for slot, rec in up.slots.items() if rec.stale} == {2}
    assert cleared == [2]
    # Another fingerprint: the server was replaced, every claim goes.
    assert _reconcile(doc, url, "other", live, [])
    assert up.slots == {}


def test_concurrent_threads_of_one_process_and_another_lose_no_update(backend):
    """Two views (two processes' worth) written from several threads each at once."""
    import threading

    views = [backend.open().state, backend.open().state]

    def work(i: int) -> None:
        for n in range(10):
            claim_next(views[i % 2], f"t{i}-{n}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    owners = {rec.owner for rec in backend.open().state.read().upstreams["u"].slots.values()}
    assert len(owners) == 40


def claim_next(state, owner: str) -> None:
    def change(doc: StateDoc) -> None:
        up = doc.upstream("u")
        up.slots[len(up.slots)] = SlotRecord(owner=owner, claimed=0, last_used=0)

    state.update(change)


def test_a_failed_change_writes_nothing(backend):
    state = backend.open().state
    claim(state, "u", 0, "s")

    def broken(doc: StateDoc) -> None:
        doc.upstream("u").slots[1] = SlotRecord(owner="half", claimed=0, last_used=0)
        raise RuntimeError("a bug in the change")

    import pytest
    with pytest.raises(RuntimeError):
        state.update(broken)
    assert backend.open().state.read().upstreams["u"].slot_of("half") is None
    assert state.read().upstreams["u"].slot_of("half") is None


def test_hostile_session_ids_stay_values(backend):
    """A session id is the client's: in etcd it is a JSON value in the state key, never a key."""
    state = backend.open().state
    hostile = "../../x\x00\udcff/\n" + "é" * 10
    claim(state, "u", 0, hostile)
    assert backend.open().state.read().upstreams["u"].slot_of(hostile) == 0
