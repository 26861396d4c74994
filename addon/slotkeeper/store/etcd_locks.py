"""Slot leases and named locks in etcd (issue #33): what `SlotLocks` does with flock, as keys
on this process's etcd lease, so they die with their holder as a flock does (within the
lease TTL on a SIGKILL, at once on a clean exit).

Keys, under the prefix (names are digests: upstream URLs and session ids never become keys):
  slots/<upstream digest>/<slot>/ex         an exclusive holder (value: its token)
  slots/<upstream digest>/<slot>/sh/<lease> this process holds the slot shared (value: token)
  locks/<kind>/<name digest>                a snapshot or placement lock (value: its token)
Exclusive: put only if nothing is under the slot's key range. Shared: put only if no `ex`."""

from __future__ import annotations

import hashlib
import secrets
import threading

from .etcd_conn import EtcdConnection, b64, range_end
from .state import StoreUnavailable
from .locks import SlotLease, _poll


class EtcdLocks:
    """The `SlotLocks` calls over etcd. As with the files, this process's shared holders of a
    slot share one key (the first one in puts it, the last one out deletes it), and an
    exclusive lease excludes this process's shared holders as it excludes other processes'.

    `try_acquire` answers None while etcd is down (the slow path then passes the request
    through); `acquire`, `snapshot` and `placement` raise StoreUnavailable rather than wait
    on a dead cluster."""

    def __init__(self, conn: EtcdConnection, prefix: str) -> None:
        self.conn = conn
        self.prefix = prefix
        # (upstream, slot) -> [etcd key, its token, holders]
        self._shared: dict[tuple[str, int], list] = {}
        self._mutex = threading.Lock()

    def _slot_prefix(self, upstream: str, slot: int) -> str:
        tag = hashlib.sha256(upstream.encode("utf-8", "surrogatepass")).hexdigest()[:24]
        return f"{self.prefix}slots/{tag}/{int(slot)}/"

    def try_acquire(self, upstream: str, slot: int, exclusive: bool) -> SlotLease | None:
        try:
            if exclusive:
                base = self._slot_prefix(upstream, slot)
                return self._put_if(base + "ex", base, range_end(base))
            return self._try_shared(upstream, int(slot))
        except StoreUnavailable:
            return None

    def _try_shared(self, upstream: str, slot: int) -> SlotLease | None:
        key = (upstream, slot)
        with self._mutex:
            entry = self._shared.get(key)
            if entry is None or entry[2] == 0:
                base = self._slot_prefix(upstream, slot)
                own = f"{base}sh/{self.conn.lease_id():x}"
                # A token, so that a release etcd got late (retried after a blip) cannot
                # delete the key of the holders that came after it.
                token = secrets.token_hex(8)
                if not self._txn([_absent(base + "ex")], own, token):
                    return None
                entry = self._shared[key] = [own, token, 0]
            entry[2] += 1
            return SlotLease(-1, exclusive=False, on_release=lambda: self._release_shared(key))

    def _release_shared(self, key: tuple[str, int]) -> None:
        with self._mutex:
            entry = self._shared[key]
            entry[2] -= 1
            if entry[2] == 0:
                self._delete(entry[0], entry[1])

    def acquire(self, upstream: str, slot: int, exclusive: bool,
                timeout: float) -> SlotLease | None:
        """Blocking with a deadline (worker threads only): polls every 20 ms as the file
        backend does; StoreUnavailable if etcd goes down meanwhile."""
        def attempt() -> SlotLease | None:
            lease = self.try_acquire(upstream, slot, exclusive)
            if lease is None and not self.conn.reachable:
                raise StoreUnavailable("etcd unreachable: no slot lease")
            return lease

        return _poll(attempt, timeout)

    def snapshot(self, snapshot_id: str, timeout: float) -> SlotLease | None:
        return self._named("snapshot", snapshot_id, timeout)

    def placement(self, session: str, timeout: float) -> SlotLease | None:
        return self._named("placement", session, timeout)

    def _named(self, kind: str, name: str, timeout: float) -> SlotLease | None:
        # A digest, never the name itself: session ids come from clients (hostile).
        tag = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:32]
        key = f"{self.prefix}locks/{kind}/{tag}"
        return _poll(lambda: self._put_if(key, key, None), timeout)

    # ---- the transactions ------------------------------------------------------------------

    def _put_if(self, key: str, guard: str, guard_end: str | None) -> SlotLease | None:
        """Put `key` (value: a token of this holder) if nothing exists in [guard, guard_end)
        (or at `guard`): an exclusive lease, deleted on release only while still ours."""
        token = secrets.token_hex(8)
        compare = _absent(guard)
        if guard_end is not None:
            compare["range_end"] = b64(guard_end)
        if not self._txn([compare], key, token):
            return None
        return SlotLease(-1, exclusive=True, on_release=lambda: self._delete(key, token))

    def _txn(self, compare: list[dict], key: str, value: str) -> bool:
        lease = self.conn.lease_id()
        txn = {"compare": compare,
               "success": [{"request_put": {"key": b64(key), "value": b64(value),
                                            "lease": str(lease)}}]}
        return bool(self.conn.call(lambda c: c.transaction(txn)).get("succeeded"))

    def _delete(self, key: str, token: str) -> None:
        """Delete `key` while it still holds `token`. Release never blocks long and never
        raises: a delete etcd does not get is retried by the connection's keep-alive thread."""
        compare = [{"key": b64(key), "target": "VALUE", "result": "EQUAL", "value": b64(token)}]
        txn = {"compare": compare, "success": [{"request_delete_range": {"key": b64(key)}}]}

        def delete() -> None:
            self.conn.call(lambda c: c.transaction(txn))

        try:
            delete()
        except StoreUnavailable:
            self.conn.defer(delete)


def _absent(key: str) -> dict:
    """A compare that holds when no key exists at `key` (or, with a range_end, in the range):
    etcd compares an absent key's create_revision as 0."""
    return {"key": b64(key), "target": "CREATE", "result": "LESS", "create_revision": "1"}
