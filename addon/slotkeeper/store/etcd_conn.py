"""One process's connection to an etcd cluster (issue #33): the endpoints tried in turn, a
quick "down" verdict so a dead cluster costs a request no wait, and the process's lease that
every lock it holds is attached to, kept alive by a thread of its own.

Through etcd's JSON gateway with etcd3gw (synchronous, requests-based): every store call is
made from a worker thread or the connection's own threads (on the event loop a kept request
answers from the watch-fed copy, etcd_mirror.py, and makes none), so a blocking client fits, and it adds no gRPC or protobuf beside
mitmproxy's own pins (docs/DESIGN.md, "Beyond one machine")."""

from __future__ import annotations

import asyncio
import atexit
import base64
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import etcd3gw
from etcd3gw import exceptions as etcd_errors

from .state import StoreUnavailable

log = logging.getLogger("slotkeeper.etcd")
T = TypeVar("T")

# Once every endpoint failed, calls fail at once (no request waits on a dead cluster) and the
# keep-alive thread probes this often, so pinning resumes about this long after etcd returns.
DOWN_RETRY_SECONDS = 1.0
REQUEST_TIMEOUT = 2.0  # one call to one member; a lost quorum answers nothing until then
# A probe is one small read: a member with a quorum answers it in milliseconds, so a short
# bound keeps the members still without a leader from delaying the return of the others.
PROBE_TIMEOUT = 0.5
# Spared from the lease's sure life: a kept request decided from memory starts within
# milliseconds of the check; this covers that and the clocks' rate difference many times.
LEASE_MARGIN = 0.25


def b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def on_event_loop() -> bool:
    """Called from the event loop's thread (the kept request's fast path): the store then
    answers from memory or says no, never makes a round trip (a worker retries with one)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def range_end(prefix: str) -> str:
    """The end of the key range that starts with `prefix` (etcd's "prefix" convention)."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return bytes(raw).decode()


class EtcdConnection:
    """Endpoints, the down verdict, and the process's lease. Thread-safe."""

    def __init__(self, endpoints: tuple[str, ...], lease_ttl: int) -> None:
        self.endpoints = endpoints
        self.lease_ttl = lease_ttl
        self._clients = [_client(url, REQUEST_TIMEOUT) for url in endpoints]
        self._probes = [_client(url, PROBE_TIMEOUT) for url in endpoints]
        self._good = 0  # the endpoint that answered last: tried first
        self.down_since: float | None = None  # monotonic; None while etcd answers
        self.failures = 0  # calls that found every endpoint down (a counter for /metrics)
        self._lease_id: int | None = None
        # Until when (monotonic) the lease is sure to live: the send time of its last grant
        # or refresh plus the TTL etcd answered. A key on it is ours until then even if etcd
        # stops answering, and not one moment longer (the fast path asks, `lease_alive`).
        self._lease_alive_until = -float("inf")
        self._lease_mutex = threading.Lock()
        self._pending_deletes: list[Callable[[], Any]] = []  # releases etcd did not get
        self.request_timeout = REQUEST_TIMEOUT
        # Releases, made by a thread of their own: a lease ends on the event loop (a kept
        # request's end) and must not wait there for etcd.
        self._later: queue.SimpleQueue[Callable[[], Any] | None] = queue.SimpleQueue()
        self._releaser = threading.Thread(target=self._release_loop,
                                          name="slotkeeper-etcd-release", daemon=True)
        self._releaser.start()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep_alive, name="slotkeeper-etcd",
                                        daemon=True)
        self._thread.start()
        # A clean exit (SIGTERM: mitmproxy shuts down, then the interpreter) revokes the lease,
        # so the slots are free at once rather than after the TTL.
        atexit.register(self.close)

    @property
    def reachable(self) -> bool:
        return self.down_since is None

    @property
    def lease_alive(self) -> bool:
        """Whether this process's lease is sure to be alive now (LEASE_MARGIN to spare)."""
        return time.monotonic() < self._lease_alive_until - LEASE_MARGIN

    def _lived(self, sent: float, answer: dict) -> None:
        ttl = int(answer.get("TTL", answer.get("result", {}).get("TTL", -1)))
        self._lease_alive_until = sent + ttl if ttl > 0 else -float("inf")

    @property
    def closed(self) -> bool:
        return self._stop.is_set()

    @property
    def good(self) -> int:
        """The index of the endpoint that answered last (where the watch connects)."""
        return self._good

    def later(self, release: Callable[[], Any]) -> None:
        """Run `release` on the release thread; one etcd does not get is retried by the
        keep-alive thread (`defer`)."""
        self._later.put(release)

    def _release_loop(self) -> None:
        while True:
            release = self._later.get()
            if release is None:
                return
            try:
                release()
            except StoreUnavailable:
                self.defer(release)
            except Exception:  # the thread must outlive any one failure
                log.exception("etcd release failed")

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until the releases queued so far were made (tests; shutdown)."""
        done = threading.Event()
        self._later.put(done.set)
        return done.wait(timeout)

    def call(self, fn: Callable[[etcd3gw.client.Etcd3Client], T], probe: bool = False) -> T:
        """`fn` against the last good endpoint, then the others. While the cluster is known
        down, StoreUnavailable at once: only the keep-alive thread (`probe`) tries it, so no
        request waits on a dead cluster or a member without quorum."""
        if self.down_since is not None and not probe:
            raise StoreUnavailable(f"etcd {','.join(self.endpoints)} unreachable")
        errors = []
        start = self._good
        clients = self._probes if probe else self._clients
        for i in range(len(clients)):
            index = (start + i) % len(clients)
            try:
                result = fn(clients[index])
            except etcd_errors.Etcd3Exception as e:
                errors.append(f"{self.endpoints[index]}: {type(e).__name__}")
                continue
            self._good = index
            if self.down_since is not None:
                log.warning("etcd answers again (%s): pinning resumes", self.endpoints[index])
                self.down_since = None
            return result
        self.failures += 1
        if self.down_since is None:
            self.down_since = time.monotonic()
            log.warning("etcd unreachable (%s): requests pass through unpinned until it "
                        "answers again", "; ".join(errors))
        raise StoreUnavailable(f"etcd unreachable: {'; '.join(errors)}")

    # ---- the process's lease -----------------------------------------------------------------

    def lease_id(self) -> int:
        """The lease this process's locks hang on, granted on first use (and again if it
        expired: a blip longer than the TTL costs the locks held then, never the process,
        unlike ai-dynamo #3493 where an expired lease restarted every service)."""
        with self._lease_mutex:
            if self._lease_id is None:
                sent = time.monotonic()
                granted = self.call(lambda c: c.post(c.get_url("/lease/grant"),
                                                     json={"TTL": self.lease_ttl, "ID": 0}))
                self._lease_id = int(granted["ID"])
                self._lived(sent, granted)
            return self._lease_id

    def _refresh(self) -> None:
        with self._lease_mutex:
            lease_id = self._lease_id
        if lease_id is None:
            self.call(self.probe, probe=True)
            return
        sent = time.monotonic()
        answer = self.call(lambda c: c.post(c.get_url("/lease/keepalive"), json={"ID": lease_id}),
                           probe=True)
        self._lived(sent, answer)
        if int(answer.get("result", {}).get("TTL", -1)) <= 0:
            log.warning("etcd lease %x expired (etcd was unreachable for longer than %d s): "
                        "the slot locks held on it are gone; a new lease is taken",
                        lease_id, self.lease_ttl)
            with self._lease_mutex:
                if self._lease_id == lease_id:
                    self._lease_id = None

    @staticmethod
    def probe(client: etcd3gw.client.Etcd3Client) -> Any:
        """A linearizable read: answered only with a quorum (a member's status is not)."""
        return client.post(client.get_url("/kv/range"), json={"key": b64("/health")})

    def defer(self, delete: Callable[[], Any]) -> None:
        """A release etcd did not get: retried by the keep-alive thread, since the key would
        otherwise live as long as the (kept alive) lease and hold its slot forever."""
        with self._lease_mutex:
            self._pending_deletes.append(delete)

    def _retry_deletes(self) -> None:
        with self._lease_mutex:
            pending, self._pending_deletes = self._pending_deletes, []
        for i, delete in enumerate(pending):
            try:
                delete()  # the refresh just succeeded: etcd is marked up again
            except StoreUnavailable:
                with self._lease_mutex:
                    self._pending_deletes.extend(pending[i:])
                return

    def _keep_alive(self) -> None:
        """Refresh every third of the TTL (Patroni's rule, loop_wait + 2 * retry_timeout <=
        ttl, holds with REQUEST_TIMEOUT per member); while etcd is down, probe every second,
        so pinning resumes within about a second of its return."""
        last = -float("inf")
        while not self._stop.is_set():
            due = self.down_since is not None or self._pending_deletes or (
                time.monotonic() - last >= self.lease_ttl / 3)
            if due:
                try:
                    self._refresh()
                    self._retry_deletes()
                    last = time.monotonic()
                except StoreUnavailable:
                    pass
                except Exception:  # the keep-alive must outlive any one failure
                    log.exception("etcd keep-alive failed")
            self._stop.wait(min(DOWN_RETRY_SECONDS, self.lease_ttl / 3))

    def close(self) -> None:
        """Stop the keep-alive and revoke the lease: this process's locks go at once (on a
        SIGKILL they go when the TTL runs out)."""
        if self._stop.is_set():
            return
        atexit.unregister(self.close)
        self._stop.set()
        self.flush(REQUEST_TIMEOUT)
        self._later.put(None)
        with self._lease_mutex:
            lease_id, self._lease_id = self._lease_id, None
        if lease_id is not None:
            try:
                self.call(lambda c: c.post(c.get_url("/kv/lease/revoke"), json={"ID": lease_id}),
                          probe=True)
            except StoreUnavailable:
                pass


def _client(url: str, timeout: float) -> etcd3gw.client.Etcd3Client:
    parts = urlsplit(url)
    return etcd3gw.client(host=parts.hostname or "", port=parts.port or 2379,
                          protocol=parts.scheme, timeout=timeout, api_path="/v3/")
