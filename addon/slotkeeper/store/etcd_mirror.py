"""This process's copy of every key under the prefix, kept current by an etcd watch (issue
#33): what lets a kept request decide from memory, with no network round trip and nothing
blocking the event loop.

The loop: read every key under the prefix at one revision R (one range call), then watch the
prefix from R + 1; on any end of the stream (a member killed, a member that lost its leader:
the watch asks for one with the `hasleader` metadata, so etcd cancels it rather than leave it
silent; a compaction; etcd unreachable) mark the copy out of date and start again with a
fresh read. `revision` is the newest revision whose events under the prefix the copy holds:
every put and delete under the prefix up to it has been applied (a watch response's header
revision is that of the store when it was sent, after the events it carries)."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import requests

from .etcd_conn import EtcdConnection, b64, range_end, unb64
from .state import StoreUnavailable

log = logging.getLogger("slotkeeper.etcd")

# (key, value or None for a delete, the event's revision); key None: the copy was reset
# (read whole again), every key must be looked up afresh.
Listener = Callable[[str | None, bytes | None, int], None]

# How long a worker waits for the watch to deliver a revision this process already knows of
# (its own write, or a key it read): on loopback the watch is ~1 ms behind a write; past this
# bound the watch is taken as stuck and read again.
CATCH_UP_SECONDS = 1.0
RETRY_SECONDS = 0.2  # between two attempts to read and watch again


class EtcdMirror:
    """The copy (key -> (value, create_revision, mod_revision)), its revision, and a
    condition every change notifies. Thread-safe; one watch thread."""

    def __init__(self, conn: EtcdConnection, prefix: str) -> None:
        self.conn = conn
        self.prefix = prefix
        self.keys: dict[str, tuple[bytes, int, int]] = {}
        self.revision = 0
        self.synced = False  # the watch runs and the copy is whole
        self.resyncs = 0  # how many times the copy was read whole (a counter for tests)
        self.changed = threading.Condition()
        self._listeners: list[Listener] = []
        self._response: requests.Response | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slotkeeper-etcd-watch",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def listen(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def current(self, revision: int) -> bool:
        """The copy holds every event under the prefix up to `revision` (no wait)."""
        return self.synced and self.revision >= revision

    def catch_up(self, revision: int, timeout: float = CATCH_UP_SECONDS) -> bool:
        """Wait (workers only) until the copy holds `revision`. False: not synced, or the
        watch did not deliver it in time (then it is restarted: a stream that stopped
        delivering without ending, e.g. a member frozen, must not keep the copy old)."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while not self.current(revision):
                left = deadline - time.monotonic()
                if left <= 0 or not self.synced:
                    break
                self.changed.wait(left)
            if self.current(revision):
                return True
        if self.synced:
            log.warning("etcd watch %d revisions behind for %.1f s: reading again",
                        revision - self.revision, timeout)
            self._restart()
        return False

    def wait_change(self, timeout: float) -> None:
        """Until the next change of the copy (or `timeout`): what a lock waiter sleeps on."""
        with self.changed:
            self.changed.wait(timeout)

    # ---- the watch thread --------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._sync_and_watch()
            except (StoreUnavailable, requests.RequestException, ValueError, KeyError) as e:
                if not self._stop.is_set():
                    log.debug("etcd watch ended: %s", e)
            except Exception:  # the watch must outlive any one failure
                log.exception("etcd watch failed")
            self._set_synced(False)
            self._stop.wait(RETRY_SECONDS)

    def _sync_and_watch(self) -> None:
        answer = self.conn.call(lambda c: c.post(c.get_url("/kv/range"), json={
            "key": b64(self.prefix), "range_end": b64(range_end(self.prefix))}))
        revision = int(answer["header"]["revision"])
        keys = {unb64(kv["key"]).decode(): (unb64(kv.get("value", "")),
                                           int(kv.get("create_revision", 0)),
                                           int(kv.get("mod_revision", 0)))
                for kv in answer.get("kvs") or []}
        with self.changed:
            self.keys = keys
            self.revision = revision
        self.resyncs += 1
        self._tell(None, None, revision)
        self._watch(revision + 1)

    def _watch(self, start: int) -> None:
        create = {"create_request": {"key": b64(self.prefix),
                                     "range_end": b64(range_end(self.prefix)),
                                     "start_revision": str(start)}}
        endpoint = self.conn.endpoints[self.conn.good]
        # No read timeout: a watch is silent while nothing changes. A member that loses its
        # leader cancels it (hasleader); a frozen one is caught by `catch_up`.
        response = requests.post(f"{endpoint}/v3/watch", json=create, stream=True,
                                 timeout=(self.conn.request_timeout, None),
                                 headers={"Grpc-Metadata-hasleader": "true"})
        self._response = response
        try:
            response.raise_for_status()
            for line in response.iter_lines():
                if self._stop.is_set():
                    return
                if line.strip():
                    self._answer(json.loads(line))
        finally:
            self._response = None
            response.close()

    def _answer(self, message: dict[str, Any]) -> None:
        result = message.get("result")
        if result is None:
            raise ValueError(f"watch error: {message.get('error', message)}")
        if result.get("canceled") or result.get("compact_revision"):
            raise ValueError(f"watch canceled: {result.get('cancel_reason', '')} "
                             f"(compacted at {result.get('compact_revision', '-')})")
        revision = int(result.get("header", {}).get("revision", 0))
        if result.get("created"):
            self._set_synced(True)
            return
        for event in result.get("events") or []:
            kv = event["kv"]
            key = unb64(kv["key"]).decode()
            mod = int(kv.get("mod_revision", 0))
            value = None
            with self.changed:
                if event.get("type") == "DELETE":
                    self.keys.pop(key, None)
                else:
                    value = unb64(kv.get("value", ""))
                    self.keys[key] = (value, int(kv.get("create_revision", 0)), mod)
            self._tell(key, value, mod)
        with self.changed:
            self.revision = max(self.revision, revision)
            self.changed.notify_all()

    def _tell(self, key: str | None, value: bytes | None, revision: int) -> None:
        for listener in self._listeners:
            try:
                listener(key, value, revision)
            except Exception:  # one listener's bug must not stop the watch
                log.exception("etcd watch listener failed on %s", key)

    def _set_synced(self, synced: bool) -> None:
        with self.changed:
            self.synced = synced
            self.changed.notify_all()

    def _restart(self) -> None:
        response = self._response
        if response is not None:
            try:
                response.raw._fp.fp.raw._sock.shutdown(2)  # unblocks the reading thread
            except (AttributeError, OSError):
                pass
            response.close()

    def close(self) -> None:
        self._stop.set()
        self._set_synced(False)
        self._restart()
