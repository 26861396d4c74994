"""The shared state file: cheap reads, locked atomic updates, corrupt files rebuilt."""

import json
import multiprocessing
import os
import stat

from slotkeeper.store.state import SlotRecord, StateDoc, StateFile


def claim(state: StateFile, url: str, slot: int, owner: str, now: float = 1.0) -> None:
    def change(doc: StateDoc) -> None:
        doc.upstream(url).slots[slot] = SlotRecord(owner=owner, claimed=now, last_used=now)

    state.update(change)


def test_round_trip_and_owner_lookup(tmp_path):
    state = StateFile(tmp_path / "state.json")
    claim(state, "http://a:1", 2, "sess-1")
    doc = StateFile(tmp_path / "state.json").read()  # a second process's view
    assert doc.upstreams["http://a:1"].slot_of("sess-1") == 2
    assert doc.upstreams["http://a:1"].slot_of("other") is None


def test_file_is_owner_only_and_written_whole(tmp_path):
    state = StateFile(tmp_path / "state.json")
    claim(state, "u", 0, "s")
    assert stat.S_IMODE(os.stat(tmp_path / "state.json").st_mode) == 0o600
    assert json.loads((tmp_path / "state.json").read_text())["version"] == 1
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".state-")] == []


def test_read_is_cached_until_the_file_changes(tmp_path):
    state = StateFile(tmp_path / "state.json")
    claim(state, "u", 0, "s")
    first = state.read()
    assert state.read() is first  # no change: no re-parse
    claim(StateFile(tmp_path / "state.json"), "u", 1, "t", now=2.0)
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


def _claim_many(path: str, worker: int, count: int) -> None:
    state = StateFile(__import__("pathlib").Path(path))
    for i in range(count):
        def change(doc: StateDoc, i=i) -> None:
            up = doc.upstream("u")
            up.slots[len(up.slots)] = SlotRecord(owner=f"w{worker}-{i}", claimed=0, last_used=0)
        state.update(change)


def test_concurrent_processes_lose_no_update(tmp_path):
    path = tmp_path / "state.json"
    procs = [multiprocessing.get_context("spawn").Process(target=_claim_many,
                                                          args=(str(path), w, 25))
             for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    owners = {rec.owner for rec in StateFile(path).read().upstreams["u"].slots.values()}
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
