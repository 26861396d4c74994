"""Slot files: safe names, metadata, state file headers (real ones from llama-server and
synthetic ones), the restore checks, eviction and orphan sweeping."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import stat
import struct
from pathlib import Path

import pytest
import requests
from hypothesis import given, settings
from hypothesis import strategies as st
from testbed import LlamaServer, chat, long_system_prompt

from slotkeeper.snapshots.paths import FILE_NAME_RE, PathOutsideFolder
from slotkeeper.snapshots.slotfiles import (
    MAX_MISSES,
    SUPPORTED_STATE_VERSIONS,
    SessionMeta,
    SlotFolder,
    StateHeader,
    file_name_for,
    parse_state_header,
    read_state_header,
    restorable,
    saved_file_ok,
)

HOSTILE_IDS = ["../../etc/passwd", "/abs", "a\x00b", "tab\there\nnewline\x1b[31m", "x" * 10_000,
               "ünïcödé 会话 🚀", ".", "..", "", "a..b", "...hidden", "-rf", "C:\\win\\path",
               "name.bin", "\ud800 lone surrogate"]


def synthetic_state(n_tokens: int, kv_bytes: int = 64, version: int = 4) -> bytes:
    """The layout llama-server b11434 writes: magic, version, token_words, its token block
    (-1 marker, block version 1, count, tokens, media count 0), then KV data."""
    block = struct.pack(f"<iII{n_tokens}iI", -1, 1, n_tokens, *range(n_tokens), 0)
    return b"qsgg" + struct.pack("<II", version, len(block) // 4) + block + b"\x5a" * kv_bytes


def meta_for(session_id: str, size: int, **changes) -> SessionMeta:
    values = {"session_id": session_id, "kind": "session", "file_name": file_name_for(session_id),
              "fingerprint": "fp", "n_ctx": 4096, "n_tokens": 100, "n_messages": 3,
              "created": 1.0, "last_used": 2.0, "size_bytes": size, "misses": 0}
    return SessionMeta(**(values | changes))


def put_snapshot(folder: SlotFolder, session_id: str, *, n_tokens: int = 100,
                 kv_bytes: int = 64, last_used: float = 2.0) -> SessionMeta:
    data = synthetic_state(n_tokens, kv_bytes)
    folder.state_path(session_id).write_bytes(data)
    meta = meta_for(session_id, len(data), n_tokens=n_tokens, last_used=last_used)
    folder.write_meta(meta)
    return meta


# ---- file names -----------------------------------------------------------------------------

@pytest.mark.parametrize("session_id", HOSTILE_IDS)
def test_hostile_ids_give_safe_names_inside_the_folder(session_id, tmp_path):
    name = file_name_for(session_id)
    assert FILE_NAME_RE.fullmatch(name), name
    assert ".." not in name and "/" not in name and not name.startswith((".", "-"))
    folder = SlotFolder(tmp_path)
    assert folder.state_path(session_id) == tmp_path.resolve() / name
    meta_name = name.removesuffix(".bin") + ".json"
    assert folder.meta_path(session_id) == tmp_path.resolve() / meta_name


def test_names_are_readable_deterministic_and_hash_suffixed():
    assert file_name_for("sess-42") == file_name_for("sess-42")
    assert file_name_for("sess-42").startswith("sess-42-")
    assert file_name_for("../../etc/passwd").startswith("_._etc_passwd-")
    assert file_name_for("").startswith("session-")
    # the same readable prefix, told apart by the hash
    assert file_name_for("a/b") != file_name_for("a_b")
    assert len(file_name_for("y" * 10_000).split("-")[0]) == 40


@settings(max_examples=300)
@given(st.text(alphabet=st.characters(exclude_categories=())), st.text())
def test_any_text_gives_a_distinct_safe_name_inside_the_folder(first, second):
    root = Path("/srv/slots")
    folder = SlotFolder(root)
    for session_id in (first, second):
        name = file_name_for(session_id)
        assert FILE_NAME_RE.fullmatch(name)
        assert folder.state_path(session_id).parent == root
        assert folder.meta_path(session_id).parent == root
    assert (file_name_for(first) == file_name_for(second)) == (first == second)


def test_path_guard_fires_for_a_name_outside_the_folder(tmp_path):
    with pytest.raises(PathOutsideFolder):
        SlotFolder(tmp_path)._inside("../escape.bin")


# ---- SessionMeta ----------------------------------------------------------------------------

def test_meta_round_trips_through_json():
    meta = meta_for("sess \ud800 ü", 1234, kind="seed", misses=1, created=1.5)
    assert SessionMeta.from_json(meta.to_json()) == meta


def test_meta_ignores_unknown_keys_and_defaults_misses():
    raw = json.loads(meta_for("s", 10).to_json())
    del raw["misses"]
    raw["added_by_a_newer_version"] = [1, 2]
    assert SessionMeta.from_json(json.dumps(raw)) == meta_for("s", 10)


@pytest.mark.parametrize("change", [
    {"n_tokens": "100"}, {"n_tokens": True}, {"n_tokens": -1}, {"n_tokens": 1.5},
    {"size_bytes": None}, {"created": "yesterday"}, {"last_used": False}, {"session_id": 7},
    {"kind": "other"}, {"file_name": "../../etc/passwd"}, {"file_name": file_name_for("other")},
    {"fingerprint": ["fp"]}, {"misses": -1},
])
def test_meta_rejects_wrong_values(change):
    raw = json.loads(meta_for("s", 10).to_json()) | change
    with pytest.raises(ValueError):
        SessionMeta.from_json(json.dumps(raw))


@pytest.mark.parametrize("text", ["", "{", "[]", "null", '"s"', "{}", b"\xff\xfe"])
def test_meta_rejects_non_meta_documents(text):
    with pytest.raises(ValueError):
        SessionMeta.from_json(text)


# ---- state headers (synthetic) --------------------------------------------------------------

def test_header_of_the_measured_layout():
    header = parse_state_header(synthetic_state(28))
    assert header == StateHeader(version=4, token_words=32, n_tokens=28)
    assert header.kv_offset == 12 + 4 * 32


@pytest.mark.parametrize("data", [b"", b"qsgg", b"qsgg\x04\x00\x00", b"ggsq" + bytes(20),
                                  b"GGUF" + bytes(100), b"\x00" * 4096])
def test_not_a_state_file(data):
    assert parse_state_header(data) is None


def test_unknown_version_is_reported_with_the_raw_token_word_count():
    header = parse_state_header(synthetic_state(10, version=3))
    assert (header.version, header.n_tokens) == (3, header.token_words)
    assert 3 not in SUPPORTED_STATE_VERSIONS


def test_plain_token_list_of_older_servers_counts_every_word():
    data = b"qsgg" + struct.pack("<II5i", 4, 5, 1, 2, 3, 4, 5) + bytes(64)
    assert parse_state_header(data) == StateHeader(version=4, token_words=5, n_tokens=5)


def test_truncated_inside_the_token_block_still_parses_the_fixed_header():
    header = parse_state_header(synthetic_state(100)[:16])
    assert header is not None and header.n_tokens == header.token_words == 104


def test_read_state_header_of_missing_and_real_files(tmp_path):
    assert read_state_header(tmp_path / "missing.bin") is None
    path = tmp_path / "x.bin"
    path.write_bytes(synthetic_state(7))
    assert read_state_header(path).n_tokens == 7


# ---- restorable -----------------------------------------------------------------------------

GOOD_FILE = synthetic_state(100)
GOOD_SIZE = len(GOOD_FILE)
GOOD_HEADER = parse_state_header(GOOD_FILE)


@pytest.mark.parametrize(("meta", "header", "size", "kwargs", "expected"), [
    (meta_for("s", GOOD_SIZE), GOOD_HEADER, GOOD_SIZE, {}, (True, "ok")),
    (meta_for("s", GOOD_SIZE), GOOD_HEADER, GOOD_SIZE, {"message_count": 9}, (True, "ok")),
    (None, GOOD_HEADER, GOOD_SIZE, {}, (False, "no snapshot")),
    (meta_for("s", GOOD_SIZE, misses=MAX_MISSES), GOOD_HEADER, GOOD_SIZE, {},
     (False, "retired after 2 misses")),
    (meta_for("s", GOOD_SIZE, fingerprint="old"), GOOD_HEADER, GOOD_SIZE, {},
     (False, "model changed")),
    (meta_for("s", GOOD_SIZE), None, 77, {}, (False, "not a llama state file (77 bytes)")),
    (meta_for("s", GOOD_SIZE), dataclasses.replace(GOOD_HEADER, version=3), GOOD_SIZE, {},
     (False, "unknown state file version 3")),
    (meta_for("s", GOOD_SIZE, n_tokens=9000), dataclasses.replace(GOOD_HEADER, n_tokens=9000),
     GOOD_SIZE, {}, (False, "token count 9000 exceeds slot n_ctx 4096")),
    (meta_for("s", GOOD_SIZE), GOOD_HEADER, GOOD_SIZE - 1, {},
     (False, f"file truncated: {GOOD_SIZE - 1} bytes for 100 tokens")),
    # the meta agrees, but the file ends before any KV data
    (meta_for("s", GOOD_HEADER.kv_offset), GOOD_HEADER, GOOD_HEADER.kv_offset, {},
     (False, f"file truncated: {GOOD_HEADER.kv_offset} bytes for 100 tokens")),
    (meta_for("s", GOOD_SIZE), GOOD_HEADER, GOOD_SIZE + 100, {},
     (False, f"file is {GOOD_SIZE + 100} bytes, the save wrote {GOOD_SIZE}")),
    (meta_for("s", GOOD_SIZE, n_tokens=99), GOOD_HEADER, GOOD_SIZE, {},
     (False, "file holds 100 tokens, the save recorded 99")),
    (meta_for("s", GOOD_SIZE, n_messages=12), GOOD_HEADER, GOOD_SIZE, {"message_count": 8},
     (False, "snapshot has 12 messages, request has 8")),
])
def test_restorable_reasons(meta, header, size, kwargs, expected):
    args = {"fingerprint": "fp", "n_ctx": 4096, "message_count": 3} | kwargs
    assert restorable(meta, header, size, **args) == expected


@pytest.mark.parametrize(("header", "size", "n_written", "n_saved", "expected"), [
    (GOOD_HEADER, GOOD_SIZE, GOOD_SIZE, 100, (True, "ok")),
    (GOOD_HEADER, GOOD_SIZE - 4096, GOOD_SIZE, 100,
     (False, f"file is {GOOD_SIZE - 4096} bytes, the server reported {GOOD_SIZE}")),
    (GOOD_HEADER, GOOD_SIZE, GOOD_SIZE, 101,
     (False, "file holds 100 tokens, the server reported 101")),
    (None, 0, GOOD_SIZE, 100, (False, "not a llama state file (0 bytes)")),
    (dataclasses.replace(GOOD_HEADER, version=5), GOOD_SIZE, GOOD_SIZE, 100,
     (False, "unknown state file version 5")),
])
def test_saved_file_checks(header, size, n_written, n_saved, expected):
    assert saved_file_ok(header, size, n_written=n_written, n_saved=n_saved) == expected


# ---- SlotFolder: metadata and checks --------------------------------------------------------

def test_meta_is_written_atomically_and_owner_only(tmp_path):
    folder = SlotFolder(tmp_path)
    meta = put_snapshot(folder, "s1")
    path = folder.meta_path("s1")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [path.name, folder.state_path("s1").name])  # no temp file left
    assert folder.read_meta("s1") == meta
    folder.write_meta(dataclasses.replace(meta, misses=1))
    assert folder.read_meta("s1").misses == 1


def test_write_meta_refuses_a_file_name_that_is_not_the_sessions(tmp_path):
    with pytest.raises(ValueError):
        SlotFolder(tmp_path).write_meta(meta_for("s", 1, file_name=file_name_for("t")))


def test_corrupt_or_foreign_meta_reads_as_none_and_is_logged(tmp_path, caplog):
    folder = SlotFolder(tmp_path)
    assert folder.read_meta("absent") is None
    folder.meta_path("s").write_text("{broken")
    with caplog.at_level(logging.WARNING, logger="slotkeeper.slotfiles"):
        assert folder.read_meta("s") is None
    assert "unreadable slot meta" in caplog.text
    put_snapshot(folder, "t")
    folder.meta_path("u").write_bytes(folder.meta_path("t").read_bytes())  # t's meta under u
    assert folder.read_meta("u") is None
    assert [m.session_id for m in folder.list_sessions()] == ["t"]


def test_check_reads_meta_header_and_size(tmp_path):
    folder = SlotFolder(tmp_path)
    args = {"fingerprint": "fp", "n_ctx": 4096, "message_count": 3}
    assert folder.check("s", **args) == (False, "no snapshot")
    put_snapshot(folder, "s")
    assert folder.check("s", **args) == (True, "ok")
    assert folder.check("s", **(args | {"fingerprint": "new"})) == (False, "model changed")
    size = folder.state_path("s").stat().st_size
    os.truncate(folder.state_path("s"), size - 1)
    assert folder.check("s", **args) == (False, f"file truncated: {size - 1} bytes for 100 tokens")
    folder.state_path("s").unlink()
    assert folder.check("s", **args) == (False, "state file missing")


def test_verify_saved_compares_the_file_with_the_save_answer(tmp_path):
    folder = SlotFolder(tmp_path)
    assert folder.verify_saved("s", n_written=10, n_saved=1) == (False,
                                                                  "state file missing after save")
    folder.state_path("s").write_bytes(synthetic_state(5))
    size = folder.state_path("s").stat().st_size
    assert folder.verify_saved("s", n_written=size, n_saved=5) == (True, "ok")
    assert not folder.verify_saved("s", n_written=size + 1, n_saved=5)[0]


def test_secure_makes_the_state_file_owner_only_but_never_follows_a_link(tmp_path):
    folder = SlotFolder(tmp_path)
    folder.state_path("s").write_bytes(synthetic_state(1))
    folder.state_path("s").chmod(0o644)
    assert folder.secure("s")
    assert stat.S_IMODE(folder.state_path("s").stat().st_mode) == 0o600
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / "target"
    target.write_text("x")
    target.chmod(0o644)
    folder.state_path("link").symlink_to(target)
    assert not folder.secure("link")
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert not folder.secure("missing")


# ---- SlotFolder: deleting -------------------------------------------------------------------

def test_two_misses_retire_the_snapshot(tmp_path):
    folder = SlotFolder(tmp_path)
    put_snapshot(folder, "s")
    assert folder.record_miss("s") == 1
    assert folder.read_meta("s").misses == 1 and folder.state_path("s").exists()
    assert folder.record_miss("s") == MAX_MISSES
    assert not folder.state_path("s").exists() and not folder.meta_path("s").exists()
    assert folder.record_miss("s") == 0  # nothing left to count


def test_delete_and_discard_partial_remove_only_the_sessions_files(tmp_path):
    folder = SlotFolder(tmp_path)
    put_snapshot(folder, "s")
    put_snapshot(folder, "keep")
    assert folder.delete("s") is True
    assert folder.delete("s") is False
    folder.state_path("half").write_bytes(synthetic_state(100)[:50])  # a failed save
    folder.discard_partial("half")
    folder.discard_partial("never-saved")  # nothing there: no error
    assert {m.session_id for m in folder.list_sessions()} == {"keep"}
    assert folder.usage()[0] == 2


def test_make_room_deletes_least_recently_used_until_the_save_fits(tmp_path):
    folder = SlotFolder(tmp_path)
    for session_id, used in (("c", 30.0), ("a", 10.0), ("b", 20.0), ("d", 40.0)):
        put_snapshot(folder, session_id, kv_bytes=1000, last_used=used)
    each = folder.usage()[1] // 4
    folder.max_bytes = 4 * each
    assert folder.make_room(0) == []
    assert folder.make_room(each) == ["a"]
    assert folder.make_room(2 * each, keep={"b"}) == ["c"]
    assert {m.session_id for m in folder.list_sessions()} == {"b", "d"}


def test_make_room_deletes_nothing_when_even_an_empty_folder_would_not_fit(tmp_path):
    folder = SlotFolder(tmp_path)
    put_snapshot(folder, "a", kv_bytes=1000)
    put_snapshot(folder, "b", kv_bytes=1000)
    folder.max_bytes = folder.usage()[1]
    assert folder.make_room(folder.max_bytes + 1) == []
    assert folder.make_room(folder.max_bytes - 10, keep={"a"}) == []
    assert folder.usage()[0] == 4


def test_make_room_deletes_everything_older_than_max_age_except_keep(tmp_path):
    now = 10_000.0
    folder = SlotFolder(tmp_path, max_age_seconds=3600, clock=lambda: now)
    put_snapshot(folder, "old", last_used=now - 3601)
    put_snapshot(folder, "old-but-kept", last_used=now - 7200)
    put_snapshot(folder, "fresh", last_used=now - 3599)
    assert folder.make_room(0, keep={"old-but-kept"}) == ["old"]
    assert {m.session_id for m in folder.list_sessions()} == {"old-but-kept", "fresh"}


def test_sweep_removes_our_orphans_only_after_the_grace_period(tmp_path):
    now = 1_000_000.0
    folder = SlotFolder(tmp_path, clock=lambda: now)
    put_snapshot(folder, "complete")
    folder.state_path("no-meta").write_bytes(synthetic_state(3))
    put_snapshot(folder, "no-state")
    folder.state_path("no-state").unlink()
    put_snapshot(folder, "corrupt-meta")
    folder.meta_path("corrupt-meta").write_text("{")
    temp = tmp_path / (folder.meta_path("x").name + ".0123abcd.tmp")
    temp.write_text("{}")
    foreign = ["user-save.bin", "notes.json", "x-0123.bin", ".hidden-" + "a" * 24 + ".bin",
               "llama.log"]
    for name in foreign:
        (tmp_path / name).write_text("not ours")
    # named like ours, but a link: someone else made it
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.write_text("not ours")
    (tmp_path / file_name_for("linked")).symlink_to(outside)
    foreign.append(file_name_for("linked"))
    for path in tmp_path.iterdir():
        os.utime(path, (now - 30, now - 30))
    assert folder.sweep_orphans() == 0  # all younger than the grace period
    for path in tmp_path.iterdir():
        os.utime(path, (now - 120, now - 120))
    assert folder.sweep_orphans() == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        foreign + [folder.state_path("complete").name, folder.meta_path("complete").name])


def test_usage_counts_only_our_files(tmp_path):
    folder = SlotFolder(tmp_path)
    assert folder.usage() == (0, 0)
    put_snapshot(folder, "s", kv_bytes=500)
    (tmp_path / "user-save.bin").write_bytes(bytes(10_000))
    expected = folder.state_path("s").stat().st_size + folder.meta_path("s").stat().st_size
    assert folder.usage() == (2, expected)


def test_missing_root_has_no_files(tmp_path):
    folder = SlotFolder(tmp_path / "absent")
    assert folder.usage() == (0, 0) and folder.list_sessions() == [] and folder.sweep_orphans() == 0


# ---- real state files from llama-server -----------------------------------------------------

def save(server: LlamaServer, slot: int, file_name: str) -> dict:
    answer = requests.post(f"{server.url}/slots/{slot}?action=save",
                           json={"filename": file_name}, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()


REAL_SLOT = 3  # of the shared test server; the other tests leave it alone


@pytest.fixture(scope="module")
def real_saves(llama: LlamaServer) -> dict[str, tuple[dict, Path]]:
    """Two saves of the shared server (-np 4, --swa-full): a short chat, and one longer than
    Gemma 3's 512-token sliding window. {id: (save answer, state file)}."""
    saves = {}
    for session_id, text in (("real-short", "Hi there"),
                             ("real-long", long_system_prompt(words=600, seed=7))):
        chat(llama.url, [{"role": "user", "content": text}], n_predict=4, id_slot=REAL_SLOT,
             cache_prompt=True)
        name = file_name_for(session_id)
        saves[session_id] = (save(llama, REAL_SLOT, name), llama.slot_save_path / name)
    return saves


def test_real_state_files_have_the_measured_header(real_saves):
    for session_id, (answer, path) in real_saves.items():
        header = read_state_header(path)
        assert header is not None, session_id
        assert header.version in SUPPORTED_STATE_VERSIONS
        assert header.n_tokens == answer["n_saved"]
        assert header.token_words == answer["n_saved"] + 4  # marker, version, count, media count
        assert path.stat().st_size == answer["n_written"]
        folder = SlotFolder(path.parent)
        assert folder.verify_saved(session_id, n_written=answer["n_written"],
                                   n_saved=answer["n_saved"]) == (True, "ok")
    assert real_saves["real-long"][0]["n_saved"] > 512


def test_real_state_file_size_follows_the_measured_formula(real_saves):
    # gemma-3-270m, f16 KV, 4 unified-off streams: 3 full-attention layers grow 3088 bytes per
    # token, 15 sliding-window layers 15372 bytes per token up to their 512-token window.
    # If this fails, re-measure and update docs/DESIGN.md "Slot files".
    for answer, path in real_saves.values():
        n = answer["n_saved"]
        assert path.stat().st_size == 532 + 3088 * n + 15372 * min(n, 512)


def test_real_file_passes_the_check_and_its_truncations_do_not(real_saves, tmp_path):
    answer, path = real_saves["real-long"]
    data = path.read_bytes()
    folder = SlotFolder(tmp_path)
    args = {"fingerprint": "fp", "n_ctx": 4096, "message_count": 1}
    meta = meta_for("s", answer["n_written"], n_tokens=answer["n_saved"], n_messages=1)
    folder.write_meta(meta)
    # 1-2 bytes short is what crashes llama-server b11434 on restore (DESIGN.md)
    for cut in (len(data) - 1, len(data) - 2, len(data) // 2, 40):
        folder.state_path("s").write_bytes(data[:cut])
        ok, reason = folder.check("s", **args)
        assert not ok and reason.startswith(f"file truncated: {cut} bytes"), reason
    folder.state_path("s").write_bytes(data)
    assert folder.check("s", **args) == (True, "ok")


def test_server_accepts_our_names_for_hostile_ids_and_restores_them(llama: LlamaServer):
    chat(llama.url, [{"role": "user", "content": "Hello"}], n_predict=2, id_slot=REAL_SLOT,
         cache_prompt=True)
    folder = SlotFolder(llama.slot_save_path)
    for session_id in HOSTILE_IDS:
        answer = save(llama, REAL_SLOT, file_name_for(session_id))
        assert folder.state_path(session_id).stat().st_size == answer["n_written"]
        restored = requests.post(f"{llama.url}/slots/{REAL_SLOT}?action=restore",
                                 json={"filename": file_name_for(session_id)}, timeout=120)
        assert restored.status_code == 200, (session_id, restored.text)
        assert restored.json()["n_restored"] == answer["n_saved"]
        folder.delete(session_id)


# ---- the cheap identity check (issue #31) ------------------------------------------------------

def put_saved(folder: SlotFolder, session_id: str, n_tokens: int = 100,
              kv_bytes: int = 300_000) -> SessionMeta:
    """A snapshot as a save records it now: its edges' crc32 and mtime, no whole-file crc32."""
    meta = put_snapshot(folder, session_id, n_tokens=n_tokens, kv_bytes=kv_bytes)
    name = folder.state_path(session_id).name
    meta = dataclasses.replace(meta, edge_crc32=folder.edge_crc32_of(name),
                               mtime_ns=folder.state_path(session_id).stat().st_mtime_ns)
    folder.write_meta(meta)
    return meta


ARGS = {"fingerprint": "fp", "n_ctx": 4096, "message_count": 3}


def rewrite_keeping_mtime(path: Path, data: bytes) -> None:
    """Bytes changed in place with the mtime put back (what the cheap check cannot see)."""
    st_ = path.stat()
    path.write_bytes(data)
    os.utime(path, ns=(st_.st_atime_ns, st_.st_mtime_ns))


def test_cheap_check_accepts_the_saved_file_without_reading_it_whole(tmp_path, monkeypatch):
    folder = SlotFolder(tmp_path)
    put_saved(folder, "s")
    monkeypatch.setattr("slotkeeper.snapshots.filecheck.file_crc32",
                        lambda *_: pytest.fail("whole-file crc32 read on the restore path"))
    assert folder.check("s", **ARGS) == (True, "ok")


def test_cheap_check_refuses_a_truncated_file(tmp_path):
    folder = SlotFolder(tmp_path)
    put_saved(folder, "s")
    path = folder.state_path("s")
    rewrite_keeping_mtime(path, path.read_bytes()[:-4096])
    ok, why = folder.check("s", **ARGS)
    assert not ok and "truncated" in why


def test_cheap_check_refuses_another_sessions_file_of_the_same_size(tmp_path):
    folder = SlotFolder(tmp_path)
    put_saved(folder, "s")
    other = bytearray(synthetic_state(100, 300_000))
    struct.pack_into("<i", other, 24, 7777)  # another conversation: its first token differs
    rewrite_keeping_mtime(folder.state_path("s"), bytes(other))
    ok, why = folder.check("s", **ARGS)
    assert not ok and "edge crc32" in why


def last_bytes_changed(folder: SlotFolder) -> None:
    """The saved file's last 10 bytes changed in place, its mtime put back."""
    put_saved(folder, "s")
    path = folder.state_path("s")
    rewrite_keeping_mtime(path, path.read_bytes()[:-10] + b"X" * 10)


def test_cheap_check_refuses_a_file_whose_last_bytes_changed(tmp_path):
    folder = SlotFolder(tmp_path)
    last_bytes_changed(folder)
    assert not folder.check("s", **ARGS)[0]


def test_cheap_check_refuses_a_file_written_since_its_save(tmp_path):
    folder = SlotFolder(tmp_path)
    put_saved(folder, "s")
    path = folder.state_path("s")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the middle: neither edge
    path.write_bytes(bytes(data))
    os.utime(path, ns=(1, 1))  # a write moves the mtime (forced: a coarse clock may not)
    assert folder.check("s", **ARGS) == (False, "file changed since its save (written to after it)")


def test_a_touched_file_passes_when_its_whole_crc32_still_matches(tmp_path):
    folder = SlotFolder(tmp_path)
    meta = put_saved(folder, "s")
    name = folder.state_path("s").name
    folder.write_meta(dataclasses.replace(meta, crc32=folder.crc32_of(name)))
    os.utime(folder.state_path("s"), ns=(1, 1))  # copied or touched: same bytes
    assert folder.check("s", **ARGS) == (True, "ok")


def test_check_without_content_reads_only_meta_header_and_size(tmp_path):
    folder = SlotFolder(tmp_path)
    last_bytes_changed(folder)
    assert folder.check("s", **ARGS, content=False) == (True, "ok")


def test_edge_crc_of_small_files_covers_every_byte(tmp_path):
    from slotkeeper.snapshots.filecheck import edge_crc32
    path = tmp_path / "f"
    path.write_bytes(b"a" * 1000)
    first = edge_crc32(path)
    path.write_bytes(b"a" * 500 + b"b" + b"a" * 499)
    assert first and edge_crc32(path) != first
    assert edge_crc32(tmp_path / "missing") == ""
