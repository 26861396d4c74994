"""The budgets' accounting in etcd (issue #33): every proxy of a deployment charges one write
budget and sees the others' saves in flight, so the disk and write budgets hold for the
cluster, not once per proxy.

Keys, under the prefix:
  budget/writes/<unix ns, 20 digits>-<random>  bytes one save wrote (value: the count)
  budget/disk/<digest of the temp file's name> a save in flight (value: {"name", "bytes"}), on
                                               the process's lease: it dies with its holder
A write is one put (no read-modify-write: two proxies never conflict); the hour's total is
one range read, which also deletes the keys older than the hour. Wall-clock time stamps: the
proxies' clocks agree within seconds (NTP), nothing against an hour.

While etcd does not answer, the process's own count (a LocalLedger kept beside) stands in,
as it does for the file backend: the budget is then per proxy until etcd is back."""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .budgets import HOUR, LocalLedger, unwritten
from .etcd_conn import EtcdConnection, b64, range_end, unb64
from .state import StoreUnavailable

log = logging.getLogger("slotkeeper.etcd")
# The hour's old write keys are deleted by `last_hour`, which every save that can wait calls;
# a proxy that only ever saves on handovers prunes them every this many writes.
PRUNE_EVERY = 64


class EtcdLedger:
    def __init__(self, conn: EtcdConnection, prefix: str,
                 clock: Callable[[], float] = time.time) -> None:
        self.conn = conn
        self.writes_key = prefix + "budget/writes/"
        self.disk_key = prefix + "budget/disk/"
        self.clock = clock
        self.local = LocalLedger()  # this process's own count: what stands in while etcd is down
        self._writes = 0

    # ---- the write budget --------------------------------------------------------------------

    def _stamp(self, seconds: float) -> str:
        return f"{self.writes_key}{int(seconds * 1e9):020d}"

    def wrote(self, nbytes: int) -> None:
        self.local.wrote(nbytes)
        key = f"{self._stamp(self.clock())}-{secrets.token_hex(4)}"
        try:
            self.conn.call(lambda c: c.post(c.get_url("/kv/put"),
                                            json={"key": b64(key), "value": b64(str(nbytes))}))
        except StoreUnavailable:
            log.info("etcd unreachable: a save's %d bytes counted by this proxy only", nbytes)
            return
        self._writes += 1
        if self._writes % PRUNE_EVERY == 0:
            self.last_hour()

    def last_hour(self) -> int:
        """The cluster's bytes within the hour; at least this process's own (a write etcd did
        not get still counts here)."""
        horizon = self._stamp(self.clock() - HOUR)
        try:
            kvs = self._range(self.writes_key)
            total = sum(_int(unb64(kv.get("value", ""))) for kv in kvs
                        if unb64(kv["key"]).decode() >= horizon)
            if any(unb64(kv["key"]).decode() < horizon for kv in kvs):
                self.conn.call(lambda c: c.post(c.get_url("/kv/deleterange"), json={
                    "key": b64(self.writes_key), "range_end": b64(horizon)}))
        except StoreUnavailable:
            return self.local.last_hour()
        return max(total, self.local.last_hour())

    # ---- the disk budget's saves in flight ---------------------------------------------------

    def _disk_key(self, name: str) -> str:
        digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()
        return self.disk_key + digest[:24]

    @contextmanager
    def reserve(self, name: str, nbytes: int) -> Iterator[None]:
        """A save of `nbytes` into `name` in flight, seen by every proxy until it ends (or its
        holder dies: the key is on the process's lease)."""
        key = self._disk_key(name)
        value = json.dumps({"name": name, "bytes": max(int(nbytes), 0)})
        put = False
        try:
            lease = self.conn.lease_id()
            self.conn.call(lambda c: c.post(c.get_url("/kv/put"), json={
                "key": b64(key), "value": b64(value), "lease": str(lease)}))
            put = True
        except StoreUnavailable:
            log.info("etcd unreachable: the save into %s is reserved in this proxy only", name)
        with self.local.reserve(name, nbytes):
            try:
                yield
            finally:
                if put:
                    self._delete(key)

    def _delete(self, key: str) -> None:
        def delete() -> None:
            self.conn.call(lambda c: c.post(c.get_url("/kv/deleterange"), json={"key": b64(key)}))

        try:
            delete()
        except StoreUnavailable:
            self.conn.defer(delete)  # else it lives as long as the (kept alive) lease

    def reservations(self) -> dict[str, int]:
        """Every proxy's saves in flight (this process's own too, whether etcd got them)."""
        found = self.local.reservations()
        try:
            kvs = self._range(self.disk_key)
        except StoreUnavailable:
            return found
        for kv in kvs:
            try:
                entry = json.loads(unb64(kv.get("value", "")))
                found[str(entry["name"])] = max(_int(entry["bytes"]), 0)
            except (ValueError, KeyError, TypeError):
                continue  # a damaged entry: no room is made for it
        return found

    def pending(self, size_of: Callable[[str], int], exclude: str) -> int:
        return unwritten(self.reservations(), size_of, exclude)

    def _range(self, prefix: str) -> list[dict[str, Any]]:
        answer = self.conn.call(lambda c: c.post(c.get_url("/kv/range"), json={
            "key": b64(prefix), "range_end": b64(range_end(prefix))}))
        return answer.get("kvs") or []


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0
