"""The state document in etcd (issue #33): what `StateFile` keeps in a JSON file, as one key,
so proxies on several hosts share the claims. The same `StateDoc`, the same three calls."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import TypeVar

from .etcd_conn import EtcdConnection, b64, on_event_loop, unb64
from .etcd_mirror import EtcdMirror
from .state import StateDoc, StoreUnavailable, _finite_float, _no_constant

log = logging.getLogger("slotkeeper.state")
T = TypeVar("T")

# A conflict means another proxy changed the document between our read and our write: read
# again and redo the change. Each round is two round trips; this many only under a storm.
MAX_ATTEMPTS = 50


class EtcdState:
    """`read()` answers from this process's copy, kept current by the watch (etcd_mirror):
    no round trip. A worker first waits (bounded) until the copy holds every revision this
    process has itself written or read under the prefix (`need`), so it sees everything a
    lock it took was ordered after; the event loop never waits (the kept request's lease is
    what makes its copy current enough: etcd_locks). Without a watch (etcd restarting), a
    worker reads the key itself (one round trip).

    `update(change)` is a read-modify-write in one round trip: a transaction that puts only
    if the key's mod_revision is still the copy's, and on a conflict answers the key as it
    is, which the change is redone on. StoreUnavailable when etcd does not answer."""

    def __init__(self, conn: EtcdConnection, mirror: EtcdMirror, prefix: str) -> None:
        self.conn = conn
        self.mirror = mirror
        self.key = prefix + "state"
        # What the addon compares to adopt a reconfigured router's knowledge (StateFile.path)
        self.path = f"etcd {','.join(conn.endpoints)} {self.key}"
        self._cached: tuple[int, StateDoc] = (0, StateDoc())  # (mod_revision, document)
        self._need = 0  # the newest revision under the prefix this process wrote or read
        self._mutex = threading.Lock()  # one writer thread at a time inside this process
        self._cache_lock = threading.Lock()  # the watch thread and writers set _cached
        mirror.listen(self._changed)

    def need(self, revision: int) -> None:
        """A revision under the prefix this process knows of (its lock's write): the next
        read in a worker waits for the copy to hold it."""
        self._need = max(self._need, revision)

    def read(self) -> StateDoc:
        if on_event_loop():
            return self._cached[1]
        if self.mirror.catch_up(self._need):
            return self._cached[1]
        if not self.conn.reachable:
            raise StoreUnavailable(f"etcd {','.join(self.conn.endpoints)} unreachable")
        return self._fetch()[1]

    def last_read(self) -> StateDoc:
        """The copy, as it is: the same as `read` on the event loop."""
        return self._cached[1]

    def _changed(self, key: str | None, value: bytes | None, revision: int) -> None:
        """The watch's news: the key changed, or (key None) the copy was read whole again
        at `revision`."""
        if key is None:
            entry = self.mirror.keys.get(self.key)
            if entry is not None:
                self._adopt(entry[2], entry[0])
            else:
                with self._cache_lock:
                    if self._cached[0] <= revision:  # deleted while nobody watched
                        self._cached = (0, StateDoc())
        elif key == self.key:
            self._adopt(revision, value)

    def _adopt(self, revision: int, raw: bytes | None) -> StateDoc:
        """The document at `revision` (None: deleted), unless the copy has one as new: an
        unchanged revision keeps the same object (walk.keep's `fresh is doc`)."""
        with self._cache_lock:
            cached = self._cached
            if revision <= cached[0]:
                return cached[1]
            doc = StateDoc() if raw is None else _parse(raw, self.key)
            self._cached = (revision, doc)
            return doc

    def _fetch(self) -> tuple[int, StateDoc]:
        answer = self.conn.call(lambda c: c.post(c.get_url("/kv/range"),
                                                 json={"key": b64(self.key)}))
        kvs = answer.get("kvs") or []
        if not kvs:
            return 0, StateDoc()
        revision = int(kvs[0].get("mod_revision", 0))
        self.need(revision)
        return revision, self._adopt(revision, unb64(kvs[0].get("value", "")))

    def update(self, change: Callable[[StateDoc], T]) -> T:
        with self._mutex:
            if not on_event_loop():
                self.mirror.catch_up(self._need)
            revision, base = self._cached
            for _ in range(MAX_ATTEMPTS):
                # The change works on its own copy: the cached document may be in use by
                # readers, and a conflict must not leave it half changed.
                doc = _parse(json.dumps(base.to_json()).encode(), self.key)
                result = change(doc)
                text = json.dumps(doc.to_json(), separators=(",", ":")).encode()
                txn = {
                    "compare": [{"key": b64(self.key), "target": "MOD", "result": "EQUAL",
                                 "mod_revision": str(revision)}],
                    "success": [{"request_put": {"key": b64(self.key), "value": b64(text)}}],
                    "failure": [{"request_range": {"key": b64(self.key)}}],
                }
                answer = self.conn.call(lambda c: c.transaction(txn))
                if answer.get("succeeded"):
                    new_revision = int(answer.get("header", {}).get("revision", 0))
                    self.need(new_revision)
                    with self._cache_lock:
                        if new_revision > self._cached[0]:
                            self._cached = (new_revision, doc)
                    return result
                revision, base = self._conflict(answer)
            raise RuntimeError(f"etcd key {self.key}: {MAX_ATTEMPTS} conflicting writers in a row")

    def _conflict(self, answer: dict) -> tuple[int, StateDoc]:
        """The key as the failed transaction found it: the next attempt's base."""
        responses = answer.get("responses") or [{}]
        kvs = responses[0].get("response_range", {}).get("kvs") or []
        if not kvs:
            return 0, StateDoc()
        revision = int(kvs[0].get("mod_revision", 0))
        self.need(revision)
        return revision, self._adopt(revision, unb64(kvs[0].get("value", "")))


def _parse(raw: bytes, key: str) -> StateDoc:
    try:
        return StateDoc.from_json(json.loads(raw, parse_constant=_no_constant,
                                             parse_float=_finite_float))
    except (ValueError, UnicodeDecodeError, RecursionError, OverflowError) as e:
        # As with the file: a damaged document costs the ownership records only; the next
        # update rewrites it whole.
        log.warning("etcd state %s unreadable (%s): rebuilding it", key, e)
        return StateDoc()
