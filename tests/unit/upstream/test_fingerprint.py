"""One fingerprint whoever computes it (issue #33): from what the server says and the model
file's content, never from the proxy's own view of the file (path, inode, mtime)."""

from __future__ import annotations

import os
import shutil
import struct
import threading
import time
from pathlib import Path

from slotkeeper.decisions.fingerprints import same_model
from slotkeeper.snapshots.slotfiles import SessionMeta, restorable
from slotkeeper.upstream import model_digest
from slotkeeper.upstream.client import ServerProps, file_name, lora_identity
from slotkeeper.upstream.model_digest import content_digest


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def write_gguf(path: Path, weights: bytes = bytes(range(256)) * 64, name: str = "base") -> Path:
    """A small GGUF file: two keys, two tensors of 8,192 bytes each."""
    kv = _string("general.name") + struct.pack("<I", 8) + _string(name)
    kv += _string("llama.context_length") + struct.pack("<I", 4) + struct.pack("<I", 4096)
    half = len(weights) // 2
    tensors = b""
    for i, offset in enumerate((0, half)):
        tensors += _string(f"blk.{i}.weight") + struct.pack("<I", 1) + struct.pack("<Q", half)
        tensors += struct.pack("<I", 24) + struct.pack("<Q", offset)  # type i8: 1 byte each
    header = b"GGUF" + struct.pack("<IQQ", 3, 2, 2) + kv + tensors
    header += bytes(-len(header) % 32)
    path.write_bytes(header + weights)
    return path


def props(model_path: str, content: str = "", **raw) -> ServerProps:
    return ServerProps(total_slots=2, n_ctx=4096, model_path=model_path, build_info="b11434",
                       raw=raw, identity='[{"n_params": 1}, null]', content=content)


def test_a_copy_at_another_path_and_inode_has_the_same_digest(tmp_path):
    (tmp_path / "a").mkdir()
    original = write_gguf(tmp_path / "a" / "model.gguf")
    copy = tmp_path / "b" / "model.gguf"
    copy.parent.mkdir()
    shutil.copyfile(original, copy)
    os.utime(copy, (1, 1))
    assert os.stat(copy).st_ino != os.stat(original).st_ino
    assert content_digest(str(original)) == content_digest(str(copy)) != ""


def test_two_callers_at_once_read_the_file_once(tmp_path, monkeypatch):
    """The start-up check and a fresh proxy's first request both want the digest: the second
    waits for the first one's instead of reading the file beside it (on the test bed ~0.2 s
    of CPU on a 2-core machine, while the first request waits)."""
    model = write_gguf(tmp_path / "model.gguf")
    reads: list[str] = []
    digest = model_digest._digest

    def slow_digest(path):
        reads.append(path)
        time.sleep(0.3)
        return digest(path)

    monkeypatch.setattr(model_digest, "_digest", slow_digest)
    results: list[str] = []
    callers = [threading.Thread(target=lambda: results.append(content_digest(str(model))))
               for _ in range(2)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert len(reads) == 1 and len(results) == 2 and results[0] == results[1] != ""


def test_two_finetunes_with_one_header_differ(tmp_path):
    """A finetune changes the weights of the tensors it trains; its header may be identical."""
    base = write_gguf(tmp_path / "base.gguf")
    weights = bytearray(bytes(range(256)) * 64)
    weights[len(weights) // 4 * 3] ^= 1  # the middle of the second tensor
    tuned = write_gguf(tmp_path / "tuned.gguf", bytes(weights))
    assert content_digest(str(base)) != content_digest(str(tuned))
    renamed = write_gguf(tmp_path / "renamed.gguf", name="tuned")  # a header change too
    assert content_digest(str(renamed)) != content_digest(str(base))


def test_an_unreadable_or_foreign_file_has_no_digest(tmp_path):
    assert content_digest(str(tmp_path / "absent.gguf")) == ""
    assert content_digest("models/model.gguf") == ""  # relative: the server's folder, not ours
    (tmp_path / "text.gguf").write_text("not a model")
    assert content_digest(str(tmp_path / "text.gguf")) == ""
    truncated = write_gguf(tmp_path / "t.gguf")
    truncated.write_bytes(truncated.read_bytes()[:40])
    model_digest._cache.clear()
    assert content_digest(str(truncated)) == ""


def test_the_fingerprint_ignores_where_the_file_is():
    here = props("/models/gemma.gguf", content="c1")
    there = props("/srv/other/gemma.gguf", content="c1")
    assert here.fingerprint == there.fingerprint
    # A proxy on a host without the file: the server's own answers, the same model.
    blind = props("/srv/other/gemma.gguf")
    assert same_model(here.fingerprint, blind.fingerprint)
    assert same_model(blind.fingerprint, here.fingerprint)
    # Windows paths too.
    assert file_name("C:\\models\\gemma.gguf") == "gemma.gguf"


def test_the_fingerprint_tells_models_apart():
    base = props("/m/gemma.gguf", content="c1")
    assert not same_model(base.fingerprint, props("/m/gemma.gguf", content="c2").fingerprint)
    assert not same_model(base.fingerprint, props("/m/other.gguf", content="c1").fingerprint)
    templated = props("/m/gemma.gguf", content="c1", chat_template="{{ messages }}")
    assert not same_model(base.fingerprint, templated.fingerprint)
    assert lora_identity([{"path": "/a/x.gguf", "scale": 1.0}]) == \
        lora_identity([{"path": "/b/x.gguf", "scale": 1.0}]) != \
        lora_identity([{"path": "/b/x.gguf", "scale": 0.5}])
    assert lora_identity(None) is None


def test_a_snapshot_of_the_old_fingerprint_is_refused_not_restored():
    """Before issue #33 a fingerprint was 16 hex digits over the proxy's view of the file:
    it names no model now, so its snapshots are refused as "model changed"."""
    meta = SessionMeta(session_id="s", kind="session", file_name="s.bin",
                       fingerprint="0123456789abcdef", n_ctx=4096, n_tokens=10, n_messages=1,
                       created=0.0, last_used=0.0, size_bytes=100)
    ok, why = restorable(meta, None, 100, fingerprint=props("/m/g.gguf").fingerprint,
                         n_ctx=4096, message_count=3)
    assert (ok, why) == (False, "model changed")
    assert same_model("fp", "fp") and not same_model("fp", "other")
