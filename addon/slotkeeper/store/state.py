"""The state file every proxy process on the machine shares: who owns which slot of which
upstream, and when it was last used. Small (one entry per slot, not per session), read without
a lock (writers replace it atomically), changed under a portalocker lock."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

import portalocker

from ..decisions.choice import Claim

log = logging.getLogger("slotkeeper.state")

FORMAT_VERSION = 1
_TEMP_NAME = re.compile(r"\.state-[a-z0-9_]{8}")
T = TypeVar("T")


class StoreUnavailable(RuntimeError):
    """A shared store (etcd, issue #33) did not answer: every endpoint refused, timed out or
    has no quorum. The caller passes its request through unpinned: the store is a speed-up,
    never a reason to fail. (The state file never raises it.)"""


@dataclass
class SlotRecord:
    owner: str
    claimed: float
    last_used: float
    stale: bool = False  # the slot no longer holds the owner's KV: restore before use
    tokens: int = 0  # tokens in the slot after the owner's last request
    saved_tokens: int = 0  # tokens in the owner's last saved snapshot (0: none or unknown)
    messages: int = 0  # messages in the owner's last request (a snapshot's prefix check)
    # The conversation the slot holds for its owner (policy.Conversation): what tells its
    # next turn from a side request, in every process. "" / 0: not known (an older proxy).
    system_key: str = ""
    chain_length: int = 0
    chain_head: str = ""
    chars: int = 0

    def claim(self) -> Claim:
        return Claim(owner=self.owner, last_used=self.last_used, stale=self.stale)


@dataclass
class UpstreamRecord:
    fingerprint: str = ""  # model/build/slot layout from /props: a change means a new server
    draining: bool = False  # pool (issue #13): take no new sessions, move its sessions out
    slots: dict[int, SlotRecord] = field(default_factory=dict)

    def slot_of(self, session: str) -> int | None:
        for slot_id, rec in self.slots.items():
            if rec.owner == session:
                return slot_id
        return None

    def claims(self) -> dict[int, Claim]:
        return {slot_id: rec.claim() for slot_id, rec in self.slots.items()}


@dataclass
class StateDoc:
    upstreams: dict[str, UpstreamRecord] = field(default_factory=dict)

    def upstream(self, url: str) -> UpstreamRecord:
        return self.upstreams.setdefault(url, UpstreamRecord())

    def to_json(self) -> dict:
        return {
            "version": FORMAT_VERSION,
            "upstreams": {
                url: {
                    "fingerprint": up.fingerprint,
                    **({"draining": True} if up.draining else {}),
                    "slots": {str(k): asdict(v) for k, v in sorted(up.slots.items())},
                }
                for url, up in self.upstreams.items()
            },
        }

    @classmethod
    def from_json(cls, data: object) -> StateDoc:
        """Strict about shape: anything unexpected raises ValueError, and the caller rebuilds."""
        if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
            raise ValueError("not a slotkeeper state document of this version")
        upstreams = data.get("upstreams")
        if not isinstance(upstreams, dict):
            raise ValueError("upstreams is not an object")
        doc = cls()
        for url, up in upstreams.items():
            if not isinstance(up, dict) or not isinstance(up.get("slots", {}), dict):
                raise ValueError(f"upstream {url!r} is malformed")
            rec = UpstreamRecord(fingerprint=str(up.get("fingerprint", "")),
                                 draining=up.get("draining") is True)
            for key, slot in up.get("slots", {}).items():
                try:
                    rec.slots[int(key)] = _slot_record(slot)
                except (KeyError, TypeError, ValueError, OverflowError) as e:
                    raise ValueError(f"slot {key!r} of {url!r}: {e}") from None
            doc.upstreams[url] = rec
        return doc


def _no_constant(name: str) -> float:
    """`NaN`, `Infinity`, `-Infinity` are not JSON; Python's parser takes them by default.
    We never write them: only a damaged file holds them, and the caller rebuilds it."""
    raise ValueError(f"{name} in the state file")


def _finite_float(text: str) -> float:
    """A number too large for a float (`1e999`) parses as infinity, and int() of it raised
    OverflowError past every check (issue #21, item 8): refused here as damage."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:20]} out of range")
    return value


def fsync_folder(folder: Path) -> None:
    """After a rename, the new directory entry is durable only once the folder itself is
    synced: a power cut right after os.replace could otherwise bring back the old file (or
    none). Best effort: some filesystems refuse fsync on a directory."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _slot_record(raw: object) -> SlotRecord:
    if not isinstance(raw, dict):
        raise TypeError("not an object")
    rec = SlotRecord(
        owner=raw["owner"],
        claimed=float(raw["claimed"]),
        last_used=float(raw["last_used"]),
        stale=raw.get("stale", False),
        tokens=int(raw.get("tokens", 0)),
        saved_tokens=int(raw.get("saved_tokens", 0)),
        messages=int(raw.get("messages", 0)),
        system_key=str(raw.get("system_key", "")),
        chain_length=int(raw.get("chain_length", 0)),
        chain_head=str(raw.get("chain_head", "")),
        chars=int(raw.get("chars", 0)),
    )
    if not isinstance(rec.owner, str) or not isinstance(rec.stale, bool):
        raise TypeError("owner must be a string and stale a boolean")
    if not (math.isfinite(rec.claimed) and math.isfinite(rec.last_used)):
        # Only a damaged file holds NaN or infinity (we write time.time()); NaN would make
        # the slot ranking depend on the order slots are listed in.
        raise ValueError("claimed and last_used must be finite")
    return rec


class StateFile:
    """Read cheaply, change under lock.

    `read()` stats the file and parses it again only when it changed (inode, mtime, size), so
    the fast path costs one stat. `update(fn)` takes the cross-process lock (a sidecar
    `.lock` file, so the atomic rename never swaps the locked inode), reads the newest
    document, lets `fn` change it and writes it to a temp file renamed over the old one.
    Blocking: call it from a worker thread, never on the event loop."""

    def __init__(self, path: Path, lock_timeout: float = 10.0) -> None:
        self.path = path
        self.lock_path = path.with_name(path.name + ".lock")
        self.lock_timeout = lock_timeout
        self._cached: tuple[tuple[int, int, int], StateDoc] | None = None
        self._mutex = threading.Lock()  # one writer thread at a time inside this process
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # Owner-only, like the document (mkstemp makes it 0600): a lock file others can open
        # is a lock file others can hold.
        os.close(os.open(self.lock_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
        self._sweep_temp_files()

    def _sweep_temp_files(self, older_than: float = 60.0) -> None:
        """A process killed between writing its temp file and renaming it leaves the temp file
        behind (the document itself stays whole). Remove those older than a minute: younger
        ones may belong to a write in flight in another process."""
        cutoff = time.time() - older_than
        try:
            entries = list(os.scandir(self.path.parent))
        except OSError:
            return
        for entry in entries:
            if not _TEMP_NAME.fullmatch(entry.name):  # mkstemp(prefix=".state-") names only
                continue
            try:
                if entry.is_file(follow_symlinks=False) and entry.stat().st_mtime < cutoff:
                    os.unlink(entry.path)
                    log.info("removed %s, left by an interrupted state write", entry.path)
            except OSError:
                continue

    def _stat_key(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def read(self) -> StateDoc:
        key = self._stat_key()
        cached = self._cached
        if cached is not None and cached[0] == key:
            return cached[1]
        if key is None:
            return StateDoc()
        doc = self._load()
        self._cached = (key, doc)
        return doc

    def last_read(self) -> StateDoc:
        """The document as this process last read it, without a stat: for a first guess that
        a fresh `read` confirms under a lock (the kept request's fast path)."""
        cached = self._cached
        return cached[1] if cached is not None else self.read()

    def _load(self) -> StateDoc:
        try:
            with open(self.path, "rb") as f:
                return StateDoc.from_json(json.load(f, parse_constant=_no_constant,
                                                    parse_float=_finite_float))
        except FileNotFoundError:
            return StateDoc()
        except (OSError, ValueError, UnicodeDecodeError, RecursionError, OverflowError) as e:
            # A corrupt file costs us the ownership records only (the KV files are separate):
            # start again from an empty document; the next update rewrites it whole.
            log.warning("state file %s unreadable (%s): rebuilding it", self.path, e)
            return StateDoc()

    def update(self, change: Callable[[StateDoc], T]) -> T:
        with self._mutex, portalocker.Lock(
            str(self.lock_path), mode="a", timeout=self.lock_timeout,
            flags=portalocker.LOCK_EX | portalocker.LOCK_NB,  # NB: retried until the timeout
        ):
            doc = self._load()
            result = change(doc)
            self._write(doc)
            return result

    def _write(self, doc: StateDoc) -> None:
        fd, tmp = tempfile.mkstemp(prefix=".state-", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(doc.to_json(), f, separators=(",", ":"))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            fsync_folder(self.path.parent)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        key = self._stat_key()
        if key is not None:
            self._cached = (key, doc)
