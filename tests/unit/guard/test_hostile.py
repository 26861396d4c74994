"""Hostile input at the unit level (no processes): bodies slotkeeper must refuse or pass on, the
management endpoints' access check, and what files the proxy creates. The same inputs are sent
through a real mitmdump in test_hostile_real.py."""

from __future__ import annotations

import gzip
import json
import os
import stat
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
from mitmproxy.test import tflow
from reliability import reliability  # noqa: F401  (the fixture)

from slotkeeper.guard.access import is_loopback, management_access
from slotkeeper.snapshots.paths import FILE_NAME_RE, PathOutsideFolder, file_name_for
from slotkeeper.snapshots.slotfiles import SessionMeta, SlotFolder
from slotkeeper.store.state import SlotRecord, StateFile
from slotkeeper.wire import bodies
from slotkeeper.wire.bodies import BodyError, BodyTooDeep, BodyTooLarge

RELIABILITY_AREA = "hostile input"


def deep(depth: int) -> bytes:
    return b'{"messages":[],"x":' + b"[" * depth + b"]" * depth + b"}"


def test_bodies_that_cannot_be_parsed_never_raise_anything_but_body_errors(reliability):
    with pytest.raises(BodyTooDeep) as too_deep:
        bodies.parse_json_object(deep(5000))
    assert too_deep.value.status == 400
    with pytest.raises(BodyError) as big_int:  # ValueError from int(), not JSONDecodeError
        bodies.parse_json_object(b'{"max_tokens": ' + b"9" * 5000 + b"}")
    assert not isinstance(big_int.value, bodies.BodyRefused)  # passed on: the server says why
    for raw in (b"\xff\xfe{", b"", b"{", b"[1,2]", b"null", b'"x"', b"NaN"):
        with pytest.raises(BodyError):
            bodies.parse_json_object(raw)
    reliability.row(
        "body JSON nested 5,000 deep; an integer of 5,000 digits; invalid UTF-8; truncated JSON",
        outcome="nesting: refused (400 from slotkeeper); the others: a body error, so the "
                "request is passed on unchanged for llama-server's own 400; never an uncaught "
                "exception")


def test_only_deep_bodies_long_enough_to_hurt_are_refused_on_other_routes(reliability):
    assert not bodies.nested_too_deep(deep(5000))  # 10 KB: cannot reach the crash depth
    assert bodies.nested_too_deep(deep(20_000))
    assert not bodies.nested_too_deep(b'{"content": "' + b"x" * 100_000 + b'"}')
    assert bodies.nested_too_deep(b"[" * 100_000)  # unclosed: refused too, no client sends it
    assert not bodies.nested_too_deep(b"x" * 100_000)
    reliability.row("JSON nested 20,000 deep to a route slotkeeper does not read (/tokenize)",
                    outcome="refused (400) when the body is at least 32 KB (the shortest that "
                            "can nest deep enough to segfault llama-server, measured at "
                            "~110,000 levels); shorter ones pass unparsed")


def test_bombs_stop_at_the_limit(reliability):
    limit = 1024 * 1024
    bomb = gzip.compress(b"\0" * (64 * 1024 * 1024), compresslevel=9)
    assert len(bomb) < 100_000
    for encoding, raw in (("gzip", bomb), ("deflate", zlib.compress(b" " * (8 * limit), 9))):
        started = time.monotonic()
        with pytest.raises(BodyTooLarge) as e:
            bodies.decode_body(raw, encoding, limit)
        assert e.value.status == 413 and time.monotonic() - started < 1
    reliability.row("gzip bomb (64 MiB of zeros in 64 KB) and deflate bomb",
                    outcome="inflation stops at slotkeeper_max_body_mb + 1 byte: 413 with a "
                            "JSON error, at most the limit in memory")


# ---- the management endpoints' access check ------------------------------------------------

def flow(method: str, peer: str, auth: str | None = None):
    f = tflow.tflow()
    f.request.method = method
    f.request.path = "/api/sessions/clear"
    f.client_conn.peername = (peer, 50000)
    if auth is not None:
        f.request.headers["Authorization"] = auth
    return f


def status(f, token: str) -> int:
    answer = management_access(f, token)
    return 0 if answer is None else answer.status_code


@pytest.mark.parametrize("peer,loopback", [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("::ffff:127.0.0.1", True),
    ("192.0.2.2", False), ("fd00::2", False), ("::ffff:192.0.2.2", False), ("0.0.0.0", False),
    ("localhost", False), ("", False), ("not an address", False), ("fe80::1%eth0", False),
])
def test_loopback_is_decided_by_the_address_only(peer, loopback):
    assert is_loopback(peer) is loopback


def test_without_a_token_only_loopback_clients_are_answered(reliability):
    for method in ("GET", "POST", "DELETE"):
        assert status(flow(method, "127.0.0.1"), "") == 0
        assert status(flow(method, "::1"), "") == 0
        assert status(flow(method, "192.0.2.2"), "") == 403
        assert status(flow(method, "192.0.2.2", "Bearer anything"), "") == 403
    body = json.loads(management_access(flow("GET", "192.0.2.2"), "").content)
    assert "slotkeeper_api_token" in body["error"]["message"]
    reliability.row("no slotkeeper_api_token: any call from a non-loopback address",
                    outcome="403 with a JSON error naming slotkeeper_api_token; loopback "
                            "clients answered", area="management access")


def test_with_a_token_changes_need_it_and_so_do_remote_reads(reliability):
    token = "s3cret-Token_123"
    # Loopback reads need it too (issue #21): any local process or web page could read them.
    assert status(flow("GET", "127.0.0.1"), token) == 401
    assert status(flow("HEAD", "::1"), token) == 401
    assert status(flow("GET", "127.0.0.1", f"Bearer {token}"), token) == 0
    assert status(flow("GET", "192.0.2.2"), token) == 401
    assert status(flow("GET", "192.0.2.2", "Bearer wrong"), token) == 401
    assert status(flow("GET", "192.0.2.2", f"Bearer {token}"), token) == 0
    for peer in ("127.0.0.1", "192.0.2.2"):
        for method in ("POST", "DELETE", "PUT", "PATCH"):
            assert status(flow(method, peer), token) == 401
            assert status(flow(method, peer, "Bearer wrong"), token) == 401
            assert status(flow(method, peer, f"Basic {token}"), token) == 401
            assert status(flow(method, peer, f"Bearer {token}x"), token) == 401
            assert status(flow(method, peer, f"Bearer {token[:-1]}"), token) == 401
            assert status(flow(method, peer, "Bearer \udcff\udc80"), token) == 401
            assert status(flow(method, peer, f"Bearer {token}"), token) == 0
            assert status(flow(method, peer, f"bearer  {token} "), token) == 0
    denied = management_access(flow("POST", "192.0.2.2", "Bearer nope"), token)
    assert denied.headers["WWW-Authenticate"].startswith("Bearer")
    f = flow("POST", "192.0.2.2", f"Bearer {token}")
    management_access(f, token)
    assert token not in f.request.headers["Authorization"]  # mitmweb never shows it
    reliability.row("slotkeeper_api_token set: POST/DELETE/PUT/PATCH without the token, with a "
                    "wrong one, a prefix of it, another scheme, or undecodable bytes",
                    outcome="401 with WWW-Authenticate: Bearer, loopback clients included, "
                            "reads (GET/HEAD) included; the token is redacted from the flow",
                    area="management access")


# ---- files the proxy creates ----------------------------------------------------------------

def test_state_files_are_owner_only_and_interrupted_writes_are_swept(tmp_path, reliability):
    folder = tmp_path / "state"
    folder.mkdir()
    old_temp = folder / ".state-abcd1234"
    old_temp.write_text('{"version": 1, "upst')  # a write killed before its rename
    os.utime(old_temp, (time.time() - 3600, time.time() - 3600))
    young_temp = folder / ".state-efgh5678"
    young_temp.write_text("{")  # may be another process's write in flight
    stranger = folder / ".state-of-mind"
    stranger.write_text("not ours")
    os.utime(stranger, (time.time() - 3600, time.time() - 3600))
    state = StateFile(folder / "state.json")
    state.update(lambda doc: doc.upstream("u").slots.__setitem__(
        0, SlotRecord(owner="a", claimed=1.0, last_used=1.0)))
    assert not old_temp.exists() and young_temp.exists() and stranger.exists()
    for name in ("state.json", "state.json.lock"):
        assert stat.S_IMODE((folder / name).stat().st_mode) == 0o600, name
    reliability.row("temp file left by a state write killed before its rename",
                    outcome="removed at the next start once older than a minute; the state "
                            "file and its lock file are created 0600",
                    area="proxy faults")


def test_hostile_state_documents_are_rebuilt_not_raised(tmp_path, reliability):
    path = tmp_path / "state.json"
    state = StateFile(path)
    hostile = [b"", b"\0" * 100, b"{" * 100_000, b"[" * 5000 + b"]" * 5000,
               b'{"version": 1, "upstreams": {"u": {"slots": {"0": {"owner": 5}}}}}',
               b'{"version": 1, "upstreams": {"u": {"slots": {"x": {}}}}}',
               b'{"version": 1, "upstreams": {"u": {"slots": {"0": {"owner": "a", '
               b'"claimed": ' + b"9" * 5000 + b', "last_used": 1}}}}}',
               b'{"version": 1, "upstreams": []}', "{\"version\": 1}".encode("utf-16")]
    # Numbers a float cannot hold, or JSON's non-numbers, in every numeric field (issue #21,
    # item 8: int(inf) raised OverflowError past the rebuild).
    for field in ("claimed", "last_used", "tokens", "saved_tokens", "messages", "chain_length",
                  "chars"):
        for number in (b"Infinity", b"-Infinity", b"NaN", b"1e999", b"-1e999"):
            record = {"owner": "a", "claimed": 1, "last_used": 1, field: "NUMBER"}
            raw = json.dumps({"version": 1, "upstreams": {"u": {"slots": {"0": record}}}})
            hostile.append(raw.replace('"NUMBER"', number.decode()).encode())
    for raw in hostile:
        path.write_bytes(raw)
        assert state.read().upstreams == {}
        state.update(lambda doc: None)  # rewrites it whole
        assert json.loads(path.read_text())["version"] == 1
    reliability.row("state file replaced by garbage, NULs, unclosed or 5,000-deep JSON, wrong "
                    "types, a 5,000-digit number, Infinity, NaN or 1e999 in any numeric field, "
                    "UTF-16",
                    outcome="read as empty (the ownership records are lost, the slot files are "
                            "not) and rewritten whole by the next change; never an exception",
                    lost="who owned which slot: sessions are restored from their files",
                    area="slot folder and files")


def test_state_writes_sync_the_folder_after_the_rename(tmp_path, monkeypatch, reliability):
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append("folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    state = StateFile(tmp_path / "state.json")
    state.update(lambda doc: doc.upstream("u"))
    assert synced == ["file", "folder"]  # the data, then the rename's directory entry
    reliability.row("power cut right after a state write's rename",
                    outcome="the file is fsynced before the rename and its folder after it, so "
                            "the new document survives (not the old one, or none)",
                    area="slot folder and files")


def test_saving_names_stay_in_the_folder_and_a_failed_save_keeps_the_old_file(tmp_path):
    folder = SlotFolder(tmp_path)
    for session in ("../../etc/passwd", "a" * 300, "\x00", "é/☕", "..", ""):
        name = folder.saving_name(session)
        assert "/" not in name and ".." not in name and not FILE_NAME_RE.fullmatch(name)
        assert name.startswith(file_name_for(session).removesuffix(".bin"))
    old = folder.state_path("s")
    old.write_bytes(b"old snapshot")
    saving = folder.saving_name("s")
    (tmp_path / saving).write_bytes(b"partial")
    assert folder.usage()[0] == 2  # the partial file counts against the disk budget
    folder.discard_saving(saving)
    assert old.read_bytes() == b"old snapshot" and not (tmp_path / saving).exists()
    (tmp_path / saving).write_bytes(b"new snapshot")
    folder.commit_saved("s", saving)
    assert old.read_bytes() == b"new snapshot" and not (tmp_path / saving).exists()
    with pytest.raises(PathOutsideFolder):
        folder.discard_saving("../x.saving-00000000.bin")


def test_fault9_backstop_path_checks_hold_under_python_O(tmp_path):
    """Issue #11 fault 9: the backstop checks were `assert`s, gone under `python -O`; there a
    name outside the folder reached os.replace / unlink. Now they are real checks."""
    code = (
        "import sys; from pathlib import Path\n"
        "from slotkeeper.snapshots.slotfiles import SlotFolder\n"
        "from slotkeeper.snapshots.paths import PathOutsideFolder, inside\n"
        f"folder = SlotFolder(Path({str(tmp_path)!r}))\n"
        "refused = 0\n"
        "for call in (lambda: folder.discard_saving('../x.saving-00000000.bin'),\n"
        "             lambda: folder.commit_saved('s', '../victim'),\n"
        "             lambda: inside(folder.root, '../escape')):\n"
        "    try:\n"
        "        call()\n"
        "    except PathOutsideFolder:\n"
        "        refused += 1\n"
        "print(refused)\n")
    victim = tmp_path.parent / "victim"
    victim.write_text("keep me")
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "3", out.stderr
    assert victim.read_text() == "keep me"


def test_a_snapshot_changed_in_place_is_refused_by_its_checksum(tmp_path):
    folder = SlotFolder(tmp_path)
    path = folder.state_path("s")
    body = b"qsgg" + (4).to_bytes(4, "little") + (7).to_bytes(4, "little") + (
        (-1).to_bytes(4, "little", signed=True) + (1).to_bytes(4, "little")
        + (3).to_bytes(4, "little") + b"\1\0\0\0" * 3 + b"\0\0\0\0") + b"KV" * 500
    path.write_bytes(body)
    meta = SessionMeta(session_id="s", kind="session", file_name=path.name, fingerprint="f",
                       n_ctx=4096, n_tokens=3, n_messages=1, created=1.0, last_used=1.0,
                       size_bytes=len(body), crc32=folder.crc32_of(path.name))
    folder.write_meta(meta)
    assert folder.check("s", fingerprint="f", n_ctx=4096, message_count=2) == (True, "ok")
    path.write_bytes(body[:-2] + b"XX")  # same size, other bytes
    ok, why = folder.check("s", fingerprint="f", n_ctx=4096, message_count=2)
    assert not ok and "crc32" in why
    folder.write_meta(SessionMeta(**{**meta.__dict__, "crc32": ""}))  # an older proxy's meta
    assert folder.check("s", fingerprint="f", n_ctx=4096, message_count=2)[0]


def test_old_saving_files_are_swept_young_ones_kept(tmp_path):
    folder = SlotFolder(tmp_path)
    old, young = folder.saving_name("a"), folder.saving_name("b")
    for name in (old, young):
        (tmp_path / name).write_bytes(b"x")
    os.utime(tmp_path / old, (time.time() - 3600, time.time() - 3600))
    assert folder.sweep_orphans() == 1
    assert not (tmp_path / old).exists() and (tmp_path / young).exists()


def test_mitmproxys_body_limit_follows_slotkeepers():
    from mitmproxy.addons import proxyserver
    from mitmproxy.test import taddons

    from slotkeeper.guard.browser import BodyLimit

    class MaxBody:  # declares the option as SlotKeeper does, without its files
        def load(self, loader):
            loader.add_option("slotkeeper_max_body_mb", int, 32, "")

    limit = BodyLimit()
    with taddons.context(proxyserver.Proxyserver(), MaxBody(), limit) as tctx:
        tctx.configure(limit)
        assert tctx.options.body_size_limit == "33m"
        tctx.options.update(slotkeeper_max_body_mb=1)
        assert tctx.options.body_size_limit == "2m"
        tctx.options.update(body_size_limit="500m")  # the user's own: left alone
        tctx.options.update(slotkeeper_max_body_mb=4)
        assert tctx.options.body_size_limit == "500m"

    # The shipped mitm.conf's value is the default's limit, not the user's: a --set of
    # slotkeeper_max_body_mb on top of that file still moves it, down and up.
    limit = BodyLimit()
    with taddons.context(proxyserver.Proxyserver(), MaxBody(), limit) as tctx:
        tctx.options.update(body_size_limit="33m")
        tctx.options.update(slotkeeper_max_body_mb=8)
        tctx.configure(limit)
        assert tctx.options.body_size_limit == "9m"
        tctx.options.update(slotkeeper_max_body_mb=100)
        assert tctx.options.body_size_limit == "101m"


def test_the_shipped_conf_s_body_limit_is_the_default_s():
    import yaml

    from slotkeeper.guard.browser import limit_for

    conf = yaml.safe_load((Path(__file__).resolve().parents[3] / "addon" / "slotkeeper" / "mitm.conf")
                          .read_text())
    assert conf["body_size_limit"] == limit_for(conf["slotkeeper_max_body_mb"])


def test_the_upstream_key_option_comes_before_the_environment(monkeypatch):
    from types import SimpleNamespace

    from slotkeeper.settings import upstream_key_of

    monkeypatch.delenv("SLOTKEEPER_UPSTREAM_API_KEY", raising=False)
    assert upstream_key_of(SimpleNamespace(slotkeeper_upstream_api_key="")) == ""
    monkeypatch.setenv("SLOTKEEPER_UPSTREAM_API_KEY", "from-env")
    assert upstream_key_of(SimpleNamespace(slotkeeper_upstream_api_key="")) == "from-env"
    assert upstream_key_of(SimpleNamespace(slotkeeper_upstream_api_key="opt")) == "opt"
