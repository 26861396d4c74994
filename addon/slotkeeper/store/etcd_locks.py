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
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable

from .etcd_conn import EtcdConnection, b64, on_event_loop, range_end
from .etcd_mirror import EtcdMirror
from .locks import SlotLease
from .state import StoreUnavailable

log = logging.getLogger("slotkeeper.etcd")

# How long a non-blocking exclusive try waits for idle shared keys to go once asked (a want):
# on loopback they go in ~5 ms (the watch's news, one delete); a slot whose shared holder
# runs a request stays held, and the caller moves on after this.
WANT_WAIT = 0.25
WAKE_SECONDS = 0.1  # a lock waiter re-tries at least this often (the watch wakes it sooner)


class _Held:
    """This process's shared key on one slot. It outlives its holders (lingers): the next
    kept request reuses it with no round trip, until another process wants the slot
    exclusive (a key under wants/), then it is deleted as soon as it is idle."""

    def __init__(self, key: str, token: str) -> None:
        self.key = key
        self.token = token
        self.revision = math.inf  # its put's revision; inf while being put
        self.holders = 0
        self.wanted = False  # another holder waits for the slot: no new holder joins
        self.gone = False  # the key is gone (deleted, or its lease expired)


class EtcdLocks:
    """The `SlotLocks` calls over etcd. As with the files, this process's shared holders of a
    slot share one key, and an exclusive lease excludes this process's shared holders as it
    excludes other processes'.

    On the event loop a shared lease comes from memory or not at all: a lingering key of this
    process that nobody wants and whose put the watch has delivered (so the state copy holds
    every claim made before it: a claim needs the slot exclusive, which our key excludes).
    Otherwise None, and a worker takes it with one transaction.

    `try_acquire` answers None while etcd is down (the slow path then passes the request
    through); `acquire`, `snapshot` and `placement` raise StoreUnavailable rather than wait
    on a dead cluster."""

    def __init__(self, conn: EtcdConnection, mirror: EtcdMirror, prefix: str,
                 need: Callable[[int], None] = lambda revision: None) -> None:
        self.conn = conn
        self.mirror = mirror
        self.prefix = prefix
        self.need = need  # the state's: a lock's revision, which its next read must hold
        self._wants = prefix + "wants/"
        self._held: dict[str, _Held] = {}  # slot key prefix -> this process's shared key
        self._mutex = threading.Lock()
        mirror.listen(self._changed)

    def _slot_prefix(self, upstream: str, slot: int) -> str:
        tag = hashlib.sha256(upstream.encode("utf-8", "surrogatepass")).hexdigest()[:24]
        return f"{self.prefix}slots/{tag}/{int(slot)}/"

    def try_acquire(self, upstream: str, slot: int, exclusive: bool) -> SlotLease | None:
        base = self._slot_prefix(upstream, slot)
        try:
            if exclusive:
                return None if on_event_loop() else self._exclusive(base, WANT_WAIT)
            return self._shared(base)
        except StoreUnavailable:
            return None

    # ---- shared -----------------------------------------------------------------------------

    def _usable(self, held: _Held, loop: bool) -> bool:
        """On the loop, the state copy must hold the key's put already; a worker's next
        state read waits for it (`need`). And the lease the key hangs on must be sure to be
        alive: with etcd cut off, nobody else can take the slot until it runs out, and from
        then on anybody may (the keep-alive notices a dead etcd only on its next refresh)."""
        return (not held.wanted and not held.gone and held.revision != math.inf
                and self.conn.reachable and self.conn.lease_alive
                and (not loop or self.mirror.current(held.revision)))

    def _shared(self, base: str) -> SlotLease | None:
        loop = on_event_loop()
        # The lease (granted on first use: a round trip) before the mutex the loop takes too.
        lease = 0 if loop or not self.conn.reachable else self.conn.lease_id()
        with self._mutex:
            held = self._held.get(base)
            if held is not None and self._usable(held, loop):
                held.holders += 1
                if not loop:
                    self.need(int(held.revision))
                return self._lease(base, held)
            if held is not None or loop or not self.conn.reachable:
                return None  # wanted, going or being put; or the loop: a worker puts it
            # A token, so that a release etcd got late (retried after a blip) cannot
            # delete the key of the holders that came after it.
            held = self._held[base] = _Held(f"{base}sh/{lease:x}", secrets.token_hex(8))
        try:
            revision = self._txn([_absent(base + "ex")], held.key, held.token)
        except BaseException:
            self._forget(base, held)
            raise
        if not revision:
            self._forget(base, held)
            return None
        with self._mutex:
            held.revision = revision
            held.holders += 1
            held.wanted = any(k.startswith(self._want_prefix(base)) for k in
                              list(self.mirror.keys))
        self.need(revision)
        return self._lease(base, held)

    def _lease(self, base: str, held: _Held) -> SlotLease:
        return SlotLease(-1, exclusive=False, on_release=lambda: self._release(base, held))

    def _release(self, base: str, held: _Held) -> None:
        with self._mutex:
            held.holders -= 1
            idle = held.holders == 0 and (held.wanted or held.gone)
        if idle:
            self._drop(base, held, at_once=not on_event_loop())

    def _drop(self, base: str, held: _Held, at_once: bool) -> None:
        """Delete an idle key that is wanted (on the release thread, or `at_once` in this
        worker); forget it once gone."""
        def delete() -> None:
            self._delete(held.key, held.token)
            self._forget(base, held)

        if held.gone:
            self._forget(base, held)
        elif at_once:
            try:
                delete()
            except StoreUnavailable:
                self.conn.defer(delete)
        else:
            self.conn.later(delete)

    def _forget(self, base: str, held: _Held) -> None:
        with self._mutex:
            if self._held.get(base) is held and held.holders == 0:
                del self._held[base]

    # ---- exclusive ----------------------------------------------------------------------------

    def _exclusive(self, base: str, wait: float, blocking: bool = False) -> SlotLease | None:
        """Put `ex` if nothing is under the slot. Shared keys in the way (lingering ones of
        idle processes, perhaps): ask them to go with a want, and wait up to `wait`. Not
        `blocking` (a try), an exclusive holder in the way is not waited for."""
        self._drop_own_idle(base)
        lease = self._put_if(base + "ex", base, range_end(base))
        if lease is not None or wait <= 0 or (not blocking and base + "ex" in self.mirror.keys):
            return lease
        want = f"{self._want_prefix(base)}{self.conn.lease_id():x}"
        token = secrets.token_hex(8)
        self._put(want, token)
        try:
            return self._until(lambda: self._put_if(base + "ex", base, range_end(base)), wait)
        finally:
            self._let_go(want, token)

    def _drop_own_idle(self, base: str) -> None:
        with self._mutex:
            held = self._held.get(base)
            idle = held is not None and held.holders == 0 and held.revision != math.inf
            if idle:
                held.wanted = True
        if idle:
            self._drop(base, held, at_once=True)

    def acquire(self, upstream: str, slot: int, exclusive: bool,
                timeout: float) -> SlotLease | None:
        """Blocking with a deadline (worker threads only): woken by the watch when a key
        under the prefix changes; StoreUnavailable if etcd goes down meanwhile."""
        base = self._slot_prefix(upstream, slot)
        if exclusive:
            return self._exclusive(base, timeout, blocking=True)
        return self._until(lambda: self._shared(base), timeout)

    def snapshot(self, snapshot_id: str, timeout: float) -> SlotLease | None:
        return self._named("snapshot", snapshot_id, timeout)

    def placement(self, session: str, timeout: float) -> SlotLease | None:
        return self._named("placement", session, timeout)

    def _named(self, kind: str, name: str, timeout: float) -> SlotLease | None:
        # A digest, never the name itself: session ids come from clients (hostile).
        tag = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:32]
        key = f"{self.prefix}locks/{kind}/{tag}"
        return self._until(lambda: self._put_if(key, key, None), timeout)

    def _until(self, attempt: Callable[[], SlotLease | None],
               timeout: float) -> SlotLease | None:
        """`attempt` until it gives a lease or `timeout` passes, sleeping on the watch (no
        20 ms polling: a release wakes the waiters as soon as the watch delivers it)."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.conn.reachable:
                raise StoreUnavailable("etcd unreachable: no lease")
            lease = attempt()
            left = deadline - time.monotonic()
            if lease is not None or left <= 0:
                return lease
            self.mirror.wait_change(min(left, WAKE_SECONDS))

    # ---- the transactions ------------------------------------------------------------------

    def _want_prefix(self, base: str) -> str:
        return self._wants + base[len(self.prefix) + len("slots/"):]

    def _put_if(self, key: str, guard: str, guard_end: str | None) -> SlotLease | None:
        """Put `key` (value: a token of this holder) if nothing exists in [guard, guard_end)
        (or at `guard`): an exclusive lease, deleted on release (by the release thread)
        only while still ours."""
        token = secrets.token_hex(8)
        compare = _absent(guard)
        if guard_end is not None:
            compare["range_end"] = b64(guard_end)
        revision = self._txn([compare], key, token)
        if not revision:
            return None
        self.need(revision)
        return SlotLease(-1, exclusive=True, on_release=lambda: self._let_go(key, token))

    def _let_go(self, key: str, token: str) -> None:
        """A release: made at once in a worker (whoever waits gets it sooner), by the release
        thread when on the event loop (a route's end), never waited for there."""
        if on_event_loop():
            self.conn.later(lambda: self._delete(key, token))
            return
        try:
            self._delete(key, token)
        except StoreUnavailable:
            self.conn.defer(lambda: self._delete(key, token))

    def _txn(self, compare: list[dict], key: str, value: str) -> int:
        """The put's revision, or 0 when a compare failed."""
        txn = {"compare": compare, "success": [self._put_request(key, value)]}
        answer = self.conn.call(lambda c: c.transaction(txn))
        return int(answer.get("header", {}).get("revision", 0)) if answer.get("succeeded") else 0

    def _put(self, key: str, value: str) -> None:
        request = self._put_request(key, value)["request_put"]
        self.conn.call(lambda c: c.post(c.get_url("/kv/put"), json=request))

    def _put_request(self, key: str, value: str) -> dict:
        return {"request_put": {"key": b64(key), "value": b64(value),
                                "lease": str(self.conn.lease_id())}}

    def _delete(self, key: str, token: str) -> None:
        """Delete `key` while it still holds `token`. StoreUnavailable from here (on the
        release thread) has the keep-alive thread retry it once etcd answers."""
        compare = [{"key": b64(key), "target": "VALUE", "result": "EQUAL", "value": b64(token)}]
        txn = {"compare": compare, "success": [{"request_delete_range": {"key": b64(key)}}]}
        self.conn.call(lambda c: c.transaction(txn))

    # ---- what the watch says ---------------------------------------------------------------

    def _changed(self, key: str | None, value: bytes | None, revision: int) -> None:
        if key is None:
            self._recheck()
        elif value is not None and key.startswith(self._wants):
            base = self.prefix + "slots/" + key[len(self._wants):].rsplit("/", 1)[0] + "/"
            self._wanted(base)
        elif value is None and "/sh/" in key:
            self._gone(key[:key.rindex("sh/")], key, revision)

    def _wanted(self, base: str) -> None:
        with self._mutex:
            held = self._held.get(base)
            if held is None or held.wanted or held.revision == math.inf:
                return
            held.wanted = True
            idle = held.holders == 0
        if idle:
            self._drop(base, held, at_once=False)

    def _gone(self, base: str, key: str, revision: int) -> None:
        with self._mutex:
            held = self._held.get(base)
            # A delete older than the key's put is that of an earlier key of ours.
            if held is None or held.key != key or revision <= held.revision:
                return
            held.gone = True
            busy = held.holders
        if busy:
            log.warning("etcd lost this process's lease on %s while %d requests held it (the "
                        "lease expired)", base, busy)
        else:
            self._forget(base, held)

    def _recheck(self) -> None:
        """The copy was read whole: keys of ours that went and wants that came meanwhile."""
        keys = dict(self.mirror.keys)
        with self._mutex:
            entries = list(self._held.items())
        for base, held in entries:
            if held.revision == math.inf:
                continue
            kept = keys.get(held.key)
            if kept is None or kept[1] != held.revision:
                self._gone(base, held.key, max(held.revision + 1, self.mirror.revision))
            elif any(k.startswith(self._want_prefix(base)) for k in keys):
                self._wanted(base)


def _absent(key: str) -> dict:
    """A compare that holds when no key exists at `key` (or, with a range_end, in the range):
    etcd compares an absent key's create_revision as 0."""
    return {"key": b64(key), "target": "CREATE", "result": "LESS", "create_revision": "1"}
