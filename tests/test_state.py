"""The shared state file: cheap reads, locked atomic updates, corrupt files rebuilt."""

import json
import multiprocessing
import os
import stat

from slotkeeper.state import SlotRecord, StateDoc, StateFile


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
