"""The state document in etcd (issue #33): what `StateFile` keeps in a JSON file, as one key,
so proxies on several hosts share the claims. The same `StateDoc`, the same three calls."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import TypeVar

from .etcd_conn import EtcdConnection, b64, unb64
from .state import StateDoc, _finite_float, _no_constant

log = logging.getLogger("slotkeeper.state")
T = TypeVar("T")

# A conflict means another proxy changed the document between our read and our write: read
# again and redo the change. Each round is two round trips; this many only under a storm.
MAX_ATTEMPTS = 50


class EtcdState:
    """`read()` fetches the key (one round trip) and re-parses only when its mod_revision
    changed, so an unchanged document is the same object (walk.keep's `fresh is doc`).
    `update(change)` is a read-modify-write: a transaction that puts only if the key's
    mod_revision is still the one read, redone on a conflict. Blocking: worker threads, or
    one quick call on the event loop. StoreUnavailable when etcd does not answer."""

    def __init__(self, conn: EtcdConnection, prefix: str) -> None:
        self.conn = conn
        self.key = prefix + "state"
        # What the addon compares to adopt a reconfigured router's knowledge (StateFile.path)
        self.path = f"etcd {','.join(conn.endpoints)} {self.key}"
        self._cached: tuple[int, StateDoc] | None = None  # (mod_revision, document)
        self._mutex = threading.Lock()  # one writer thread at a time inside this process

    def read(self) -> StateDoc:
        return self._fetch()[1]

    def last_read(self) -> StateDoc:
        """The document as this process last read it, without a round trip: a first guess
        that a fresh `read` confirms under a lock (the kept request's fast path)."""
        cached = self._cached
        return cached[1] if cached is not None else self.read()

    def _fetch(self) -> tuple[int, StateDoc]:
        answer = self.conn.call(lambda c: c.post(c.get_url("/kv/range"),
                                                 json={"key": b64(self.key)}))
        kvs = answer.get("kvs") or []
        if not kvs:
            return 0, StateDoc()
        revision = int(kvs[0].get("mod_revision", 0))
        cached = self._cached
        if cached is not None and cached[0] == revision:
            return cached
        doc = _parse(unb64(kvs[0].get("value", "")), self.key)
        self._cached = (revision, doc)
        return revision, doc

    def update(self, change: Callable[[StateDoc], T]) -> T:
        with self._mutex:
            for _ in range(MAX_ATTEMPTS):
                revision, cached = self._fetch()
                # The change works on its own copy: the cached document may be in use by
                # readers, and a conflict must not leave it half changed.
                doc = _parse(json.dumps(cached.to_json()).encode(), self.key)
                result = change(doc)
                text = json.dumps(doc.to_json(), separators=(",", ":")).encode()
                txn = {
                    "compare": [{"key": b64(self.key), "target": "MOD", "result": "EQUAL",
                                 "mod_revision": str(revision)}],
                    "success": [{"request_put": {"key": b64(self.key), "value": b64(text)}}],
                }
                answer = self.conn.call(lambda c: c.transaction(txn))
                if answer.get("succeeded"):
                    new_revision = int(answer.get("header", {}).get("revision", 0))
                    self._cached = (new_revision, doc)
                    return result
            raise RuntimeError(f"etcd key {self.key}: {MAX_ATTEMPTS} conflicting writers in a row")


def _parse(raw: bytes, key: str) -> StateDoc:
    try:
        return StateDoc.from_json(json.loads(raw, parse_constant=_no_constant,
                                             parse_float=_finite_float))
    except (ValueError, UnicodeDecodeError, RecursionError, OverflowError) as e:
        # As with the file: a damaged document costs the ownership records only; the next
        # update rewrites it whole.
        log.warning("etcd state %s unreadable (%s): rebuilding it", key, e)
        return StateDoc()
