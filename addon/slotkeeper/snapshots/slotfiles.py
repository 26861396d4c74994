"""Saved slot files: safe names for session ids, metadata beside llama-server's state files,
the checks that decide whether a state file may be restored, and the disk budget.

llama-server writes and reads the state files itself (POST /slots/N?action=save|restore with a
basename inside its --slot-save-path); this module only names, inspects, describes and deletes
them. The measured file format and the reasons behind every check are in docs/DESIGN.md,
section "Slot files".
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

from ..decisions import fingerprints
from .filecheck import changed_since_save, edge_crc32, file_crc32
from .paths import (FILE_NAME_RE, META_RE, SAVING_RE, TEMP_RE, PathOutsideFolder,
                    file_name_for, inside, require)

log = logging.getLogger("slotkeeper.slotfiles")  # the name log filters know

# llama.cpp writes LLAMA_STATE_SEQ_MAGIC ('ggsq') as a little-endian u32, so the file starts
# with these bytes.
STATE_FILE_MAGIC = b"qsgg"
# Measured on b11434; version 3 files (before #27762) are refused by that build, so a version
# we have not measured is refused here rather than handed to a server that may crash on it.
SUPPORTED_STATE_VERSIONS: frozenset[int] = frozenset({4})
# A snapshot whose restore was twice not reused is not worth another restore.
MAX_MISSES = 2
# Orphans younger than this may belong to a save in flight in another proxy process (the
# server has written the state file, the meta is not written yet).
ORPHAN_GRACE_SECONDS = 60.0

KINDS = ("session", "seed", "hand-back")  # what a meta may say it is

# The names live in paths.py (one room for every name we hand the server or delete).
_META_RE, _TEMP_RE, _SAVING_RE = META_RE, TEMP_RE, SAVING_RE

# Header of a version 4 state file (all little-endian):
#   0  magic "qsgg"          4  u32 state version      8  u32 token_words
#   12 token block, token_words * 4 bytes, written by llama-server:
#        i32 -1 (marker), u32 1 (server token state version), u32 n_tokens,
#        i32 tokens[n_tokens], u32 media count (0 for text), media chunks
#   12 + 4 * token_words: the KV cache sections (see DESIGN.md)
_FIXED_HEADER = struct.Struct("<4sII")
_SERVER_BLOCK = struct.Struct("<iII")
_SERVER_BLOCK_MARKER = -1
_SERVER_BLOCK_VERSION = 1
_HEADER_READ_BYTES = _FIXED_HEADER.size + _SERVER_BLOCK.size


@dataclass
class SessionMeta:
    """What we know about a saved state file, kept beside it as "<stem>.json".
    size_bytes is the server's n_written for the save, which the file must still match."""

    session_id: str
    # "session"; "seed": the state after only a shared system prompt; "hand-back": a slot
    # holding only the hand-back prompt (routing/ramhandover.py)
    kind: str
    file_name: str
    fingerprint: str  # model/build/slot layout the state belongs to (ServerProps.fingerprint)
    n_ctx: int
    n_tokens: int
    n_messages: int
    created: float
    last_used: float
    size_bytes: int
    misses: int = 0
    # zlib.crc32 of the state file as saved, 8 hex digits ("": not recorded, by an older proxy).
    # A file whose KV bytes changed but whose size did not restores without complaint and
    # answers from the damaged KV; the checksum refuses it.
    crc32: str = ""
    # zlib.crc32 of the file's first and last EDGE_BYTES (issue #31: the whole-file crc32 read
    # every snapshot in full before each restore, as long as the restore itself on a slow disk;
    # a replaced file differs in its header's tokens, a truncated or grown one in size)
    edge_crc32: str = ""
    # st_mtime_ns of the file once committed: a file written since (by anything) differs, so a
    # change in its middle that keeps size and edges is refused without reading it (0: unknown)
    mtime_ns: int = 0

    def to_json(self) -> str:
        # ASCII escapes: an id with a lone surrogate still round-trips.
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> SessionMeta:
        """Raises ValueError for anything but a well-formed meta. Unknown keys are ignored, so
        a newer proxy's metas stay readable."""
        try:
            raw = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"meta is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("meta is not a JSON object")  # noqa: TRY004 - one error type for callers
        values: dict[str, Any] = {}
        for field in fields(cls):
            if field.name not in raw:
                if field.default is not MISSING:
                    continue
                raise ValueError(f"meta lacks {field.name}")
            values[field.name] = _checked(field.name, str(field.type), raw[field.name])
        meta = cls(**values)
        if meta.kind not in KINDS:
            raise ValueError(f"meta kind {meta.kind!r} is not one of {', '.join(KINDS)}")
        if meta.file_name != file_name_for(meta.session_id):
            raise ValueError(f"meta file_name {meta.file_name!r} is not the session's file name")
        return meta


def _checked(name: str, type_name: str, value: Any) -> Any:
    # bool is an int subclass: True must not pass for a token count.
    if type_name == "str":
        ok = isinstance(value, str)
    elif type_name == "int":
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    else:  # float: a whole-second timestamp may come back as an int
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
        value = float(value) if ok else value
    if not ok:
        raise ValueError(f"meta {name} must be a non-negative {type_name}, not {value!r}")
    return value


@dataclass(frozen=True)
class StateHeader:
    """The start of a llama-server slot state file."""

    version: int
    token_words: int  # u32 at offset 8: length of llama-server's token block in 4-byte words
    n_tokens: int  # prompt tokens the slot holds after a restore (the save's n_saved)

    @property
    def kv_offset(self) -> int:
        """Where the KV cache data starts; a complete file is always longer than this."""
        return _FIXED_HEADER.size + 4 * self.token_words


def parse_state_header(head: bytes) -> StateHeader | None:
    """Pure: the header from a file's first bytes (24 suffice). None if it is not a llama
    state file. For versions we have not measured, n_tokens is token_words (an upper bound)."""
    if len(head) < _FIXED_HEADER.size:
        return None
    magic, version, token_words = _FIXED_HEADER.unpack_from(head)
    if magic != STATE_FILE_MAGIC:
        return None
    n_tokens = token_words  # older servers wrote the bare token list
    if version in SUPPORTED_STATE_VERSIONS and token_words >= 3 and len(head) >= _HEADER_READ_BYTES:
        marker, block_version, count = _SERVER_BLOCK.unpack_from(head, _FIXED_HEADER.size)
        if marker == _SERVER_BLOCK_MARKER and block_version == _SERVER_BLOCK_VERSION:
            n_tokens = count
    return StateHeader(version=version, token_words=token_words, n_tokens=n_tokens)


def read_state_header(path: Path) -> StateHeader | None:
    """None if the file is missing, unreadable or not a llama state file."""
    try:
        with path.open("rb") as f:
            return parse_state_header(f.read(_HEADER_READ_BYTES))
    except OSError:
        return None


def restorable(meta: SessionMeta | None, header: StateHeader | None, file_size: int, *,
               fingerprint: str, n_ctx: int, message_count: int) -> tuple[bool, str]:
    """Pure: may this state file be restored into a slot of `n_ctx` tokens for a request of
    `message_count` messages? Returns (ok, reason); reason is "ok" when ok.

    The size must equal what the server reported writing: the file size is not linear in the
    token count (sliding-window caches stop growing), and a file only 1-2 bytes short aborts
    llama-server b11434 on restore, so no estimate with a tolerance is safe (DESIGN.md)."""
    if meta is None:
        return False, "no snapshot"
    if meta.misses >= MAX_MISSES:
        return False, f"retired after {meta.misses} misses"
    if not fingerprints.same_model(meta.fingerprint, fingerprint):
        return False, "model changed"
    if header is None:
        return False, f"not a llama state file ({file_size} bytes)"
    if header.version not in SUPPORTED_STATE_VERSIONS:
        return False, f"unknown state file version {header.version}"
    if header.n_tokens > n_ctx:
        return False, f"token count {header.n_tokens} exceeds slot n_ctx {n_ctx}"
    if file_size <= header.kv_offset or file_size < meta.size_bytes:
        return False, f"file truncated: {file_size} bytes for {header.n_tokens} tokens"
    if file_size != meta.size_bytes:
        return False, f"file is {file_size} bytes, the save wrote {meta.size_bytes}"
    if header.n_tokens != meta.n_tokens:
        return False, f"file holds {header.n_tokens} tokens, the save recorded {meta.n_tokens}"
    if meta.n_messages > message_count:
        # The saved tokens cannot be a prefix of a shorter conversation: restoring would only
        # overwrite the slot.
        return False, f"snapshot has {meta.n_messages} messages, request has {message_count}"
    return True, "ok"


def saved_file_ok(header: StateHeader | None, file_size: int, *, n_written: int,
                  n_saved: int) -> tuple[bool, str]:
    """Pure: does the file on disk match what the save answer reported? Catches a save whose
    last buffered bytes were lost (llama.cpp reports n_written before the file is closed)."""
    if header is None:
        return False, f"not a llama state file ({file_size} bytes)"
    if header.version not in SUPPORTED_STATE_VERSIONS:
        return False, f"unknown state file version {header.version}"
    if file_size != n_written:
        return False, f"file is {file_size} bytes, the server reported {n_written}"
    if header.n_tokens != n_saved:
        return False, f"file holds {header.n_tokens} tokens, the server reported {n_saved}"
    return True, "ok"


def eviction_order(metas: Iterable[SessionMeta], sizes: dict[str, int], *, now: float,
                   max_age_seconds: int, max_bytes: int, total_bytes: int,
                   incoming_bytes: int, keep: set[str] | frozenset[str]) -> list[str]:
    """Pure: which sessions to delete, in order, before writing `incoming_bytes`: everything
    unused for longer than max_age_seconds, then least recently used first until the total
    fits max_bytes. Never an id in `keep`. If even deleting every candidate would not make
    room, no session is deleted for room: emptying the folder would not let the save fit."""
    candidates = sorted((m for m in metas if m.session_id not in keep), key=lambda m: m.last_used)
    doomed: list[str] = []
    if max_age_seconds:
        doomed = [m.session_id for m in candidates if now - m.last_used > max_age_seconds]
    remaining = total_bytes - sum(sizes.get(s, 0) for s in doomed)
    if not max_bytes or remaining + incoming_bytes <= max_bytes:
        return doomed
    rest = [m.session_id for m in candidates if m.session_id not in doomed]
    if remaining - sum(sizes.get(s, 0) for s in rest) + incoming_bytes > max_bytes:
        return doomed
    for session_id in rest:
        if remaining + incoming_bytes <= max_bytes:
            break
        doomed.append(session_id)
        remaining -= sizes.get(session_id, 0)
    return doomed


class SlotFolder:
    """llama-server's --slot-save-path as the proxy sees it. Only files named by our scheme
    are ever listed, counted or deleted: the folder may hold the user's own saves."""

    def __init__(self, root: Path, *, max_bytes: int = 0, max_age_seconds: int = 0,
                 clock: Callable[[], float] = time.time) -> None:
        self.root = Path(root).resolve()
        self.max_bytes = max_bytes  # 0 = unlimited
        self.max_age_seconds = max_age_seconds  # 0 = unlimited
        self.clock = clock

    # ---- paths -------------------------------------------------------------------------------

    def _inside(self, name: str) -> Path:
        # file_name_for cannot produce a separator or "..", so this only fires on a bug; a
        # bug here would mean deleting files outside the folder.
        return inside(self.root, name)

    def state_path(self, session_id: str) -> Path:
        return self._inside(file_name_for(session_id))

    def meta_path(self, session_id: str) -> Path:
        return self._inside(file_name_for(session_id).removesuffix(".bin") + ".json")

    # ---- metadata ----------------------------------------------------------------------------

    def _load_meta(self, path: Path) -> SessionMeta | None:
        try:
            return SessionMeta.from_json(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError, RecursionError) as e:
            log.warning("ignoring unreadable slot meta %s: %s", path, e)
            return None

    def read_meta(self, session_id: str) -> SessionMeta | None:
        path = self.meta_path(session_id)
        meta = self._load_meta(path)
        if meta is not None and meta.session_id != session_id:
            log.warning("ignoring slot meta %s: it belongs to another session id", path)
            return None
        return meta

    def write_meta(self, meta: SessionMeta) -> None:
        """Atomic (temp file + os.replace) and owner-only: the meta names the session."""
        if meta.file_name != file_name_for(meta.session_id):
            raise ValueError(f"file_name {meta.file_name!r} is not the session's file name")
        target = self.meta_path(meta.session_id)
        temp = self._inside(f"{target.name}.{secrets.token_hex(4)}.tmp")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(meta.to_json())
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, target)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise

    def list_sessions(self) -> list[SessionMeta]:
        metas = []
        for path in self._our_files(_META_RE):
            meta = self._load_meta(path)
            if meta is not None and path.name == self.meta_path(meta.session_id).name:
                metas.append(meta)
        return metas

    # ---- checks ------------------------------------------------------------------------------

    def check(self, session_id: str, *, fingerprint: str, n_ctx: int,
              message_count: int, content: bool = True) -> tuple[bool, str]:
        """May the snapshot be restored? Its meta, header and size always; with `content`,
        its edges' crc32 too (a snapshot saved by an older proxy: its whole-file crc32).
        Nothing here reads a whole new snapshot (issue #31)."""
        meta = self.read_meta(session_id)
        path = self.state_path(session_id)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            if meta is not None and meta.misses < MAX_MISSES:
                return False, "state file missing"
            size = 0
        ok, why = restorable(meta, read_state_header(path), size, fingerprint=fingerprint,
                             n_ctx=n_ctx, message_count=message_count)
        if not ok or meta is None or not content:
            return ok, why
        changed = changed_since_save(path, mtime_ns=meta.mtime_ns, edge=meta.edge_crc32,
                                     crc=meta.crc32)
        return (False, changed) if changed else (ok, why)

    def size_of(self, session_id: str) -> int:
        """The snapshot file's size in bytes (0: none)."""
        try:
            return self.state_path(session_id).stat().st_size
        except OSError:
            return 0

    def file_size(self, name: str) -> int:
        """The size of a save's temp file `name` so far (0: none, or not such a name)."""
        try:
            return self._size(self._inside(require(_SAVING_RE, name)))
        except PathOutsideFolder:
            return 0

    def saving_name(self, session_id: str) -> str:
        """A fresh name for the server to write a new snapshot of the session under."""
        return f"{file_name_for(session_id).removesuffix('.bin')}.saving-{secrets.token_hex(4)}.bin"

    def commit_saved(self, session_id: str, saving_name: str) -> None:
        """The verified new snapshot replaces the old one (atomically: a reader sees either)."""
        require(SAVING_RE, saving_name)
        os.replace(self._inside(saving_name), self.state_path(session_id))

    def discard_saving(self, saving_name: str) -> None:
        """A failed save: only its own partial file goes; the previous snapshot stays whole."""
        require(SAVING_RE, saving_name)
        self._unlink(self._inside(saving_name))

    def crc32_of(self, name: str) -> str:
        return file_crc32(self._inside(name))

    def edge_crc32_of(self, name: str) -> str:
        return edge_crc32(self._inside(name))

    def verify_saved(self, session_id: str, *, n_written: int, n_saved: int,
                     name: str | None = None) -> tuple[bool, str]:
        """Right after a save answered 200: does the file (the session's, or `name` in the
        folder) match the answer? If not, the caller should discard it."""
        path = self._inside(name) if name is not None else self.state_path(session_id)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return False, "state file missing after save"
        return saved_file_ok(read_state_header(path), size, n_written=n_written, n_saved=n_saved)

    def secure(self, session_id: str) -> bool:
        """chmod 0600 the server-written state file (it holds the conversation's KV). False if
        we may not (the server runs as another user): then its umask decides."""
        path = self.state_path(session_id)
        try:
            if path.is_symlink():  # chmod would change the link's target, wherever it is
                return False
            os.chmod(path, 0o600)
            return True
        except OSError as e:
            log.debug("cannot chmod state file of %s: %s", session_id, e)
            return False

    # ---- deleting ----------------------------------------------------------------------------

    def record_miss(self, session_id: str) -> int:
        """Count a restore that was not reused. At MAX_MISSES the snapshot is retired: the meta
        is first rewritten with the count (so check() refuses it even if a delete fails),
        then both files are deleted. Returns the new count (0 if there is no snapshot)."""
        meta = self.read_meta(session_id)
        if meta is None:
            return 0
        meta.misses += 1
        self.write_meta(meta)
        if meta.misses >= MAX_MISSES:
            log.info("retiring snapshot of %s after %d misses", session_id, meta.misses)
            self.delete(session_id)
        return meta.misses

    def delete(self, session_id: str) -> bool:
        """Delete both files; True if either existed."""
        return self._unlink(self.state_path(session_id)) | self._unlink(self.meta_path(session_id))

    def discard_partial(self, session_id: str) -> None:
        """After a failed save: the server may have left a partial file under the session's
        name (it writes in place, over the previous snapshot), so neither file is usable."""
        self.delete(session_id)

    @staticmethod
    def _unlink(path: Path) -> bool:
        try:
            path.unlink()
            return True
        except FileNotFoundError:
            return False
        except OSError as e:  # a read-only folder answers EROFS even for a missing file
            log.warning("cannot delete %s: %s", path, e)
            return False

    def make_room(self, incoming_bytes: int, *, keep: set[str] | frozenset[str] = frozenset()
                  ) -> list[str]:
        """Before a save: delete sessions older than max_age, then least recently used ones
        until our files plus incoming_bytes fit max_bytes. Returns the deleted ids."""
        if not self.max_bytes and not self.max_age_seconds:
            return []
        metas = self.list_sessions()
        sizes = {m.session_id: self._size(self.state_path(m.session_id))
                 + self._size(self.meta_path(m.session_id)) for m in metas}
        doomed = eviction_order(metas, sizes, now=self.clock(),
                                max_age_seconds=self.max_age_seconds, max_bytes=self.max_bytes,
                                total_bytes=self.usage()[1], incoming_bytes=incoming_bytes,
                                keep=keep)
        for session_id in doomed:
            self.delete(session_id)
            log.info("deleted snapshot of %s to make room", session_id)
        return doomed

    def sweep_orphans(self, *, grace_seconds: float = ORPHAN_GRACE_SECONDS) -> int:
        """At start: delete our leftover temp files, state files without a readable meta, and
        metas without a state file, if older than grace_seconds. Returns files deleted."""
        cutoff = self.clock() - grace_seconds
        doomed: list[Path] = [*self._our_files(_TEMP_RE), *self._our_files(_SAVING_RE)]
        for state in self._our_files(FILE_NAME_RE):
            meta_path = state.with_suffix(".json")
            meta = self._load_meta(meta_path)
            if meta is None or meta.file_name != state.name:
                doomed += [state, meta_path]
        for meta_path in self._our_files(_META_RE):
            if not meta_path.with_suffix(".bin").exists():
                doomed.append(meta_path)
        deleted = 0
        for path in dict.fromkeys(doomed):  # a path may be listed twice
            try:
                if path.stat().st_mtime <= cutoff:
                    path.unlink()
                    deleted += 1
            except FileNotFoundError:
                continue
        if deleted:
            log.info("swept %d orphaned slot files from %s", deleted, self.root)
        return deleted

    # ---- accounting --------------------------------------------------------------------------

    def usage(self) -> tuple[int, int]:
        """(file count, total bytes) of our files: state files, metas and temp files."""
        count = total = 0
        for pattern in (FILE_NAME_RE, _META_RE, _TEMP_RE, _SAVING_RE):
            for path in self._our_files(pattern):
                count += 1
                total += self._size(path)
        return count, total

    def _our_files(self, pattern: re.Pattern[str]) -> list[Path]:
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return []
        # Symlinks are never ours: the server and write_meta create regular files.
        return [Path(entry.path) for entry in entries
                if pattern.fullmatch(entry.name) and entry.is_file(follow_symlinks=False)]

    @staticmethod
    def _size(path: Path) -> int:
        try:
            return path.stat().st_size
        except FileNotFoundError:
            return 0
