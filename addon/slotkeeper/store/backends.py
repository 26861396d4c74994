"""Which store a process uses: the JSON state file and flock locks on one machine (the
default), or etcd for proxies on several hosts (issue #33). Both give the same three objects,
the state (read, last_read, update), the locks (try_acquire, acquire, snapshot, placement)
and the budgets' ledger (budgets.Ledger), so nothing above the store knows which it has."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlsplit

from .budgets import Ledger, LocalLedger
from .locks import SlotLease, SlotLocks
from .state import StateDoc, StateFile, StoreUnavailable

if TYPE_CHECKING:  # the etcd modules need the `etcd` extra: imported only when chosen
    from .etcd_conn import EtcdConnection
    from .etcd_mirror import EtcdMirror

log = logging.getLogger("slotkeeper.state")

DEFAULT_PREFIX = "/slotkeeper/"
# Patroni's rule, loop_wait + 2 * retry_timeout <= ttl (10 + 2 * 10 <= 30 s there): ours is a
# keep-alive every ttl/3 (5 s) + 2 * the 2 s request timeout = 9 s <= 15 s. A SIGKILLed
# proxy's slots are free again within 15 s; an etcd blip shorter than that costs nothing held.
DEFAULT_LEASE_TTL = 15


class State(Protocol):
    def read(self) -> StateDoc: ...
    def last_read(self) -> StateDoc: ...
    def update(self, change): ...


class Locks(Protocol):
    def try_acquire(self, upstream: str, slot: int, exclusive: bool) -> SlotLease | None: ...
    def acquire(self, upstream: str, slot: int, exclusive: bool,
                timeout: float) -> SlotLease | None: ...
    def snapshot(self, snapshot_id: str, timeout: float) -> SlotLease | None: ...
    def placement(self, session: str, timeout: float) -> SlotLease | None: ...


@dataclass
class Store:
    state: State
    locks: Locks
    etcd: EtcdConnection | None = None  # None: the file backend
    mirror: EtcdMirror | None = None
    settings: tuple = ()  # what it was opened with: the same options reuse it
    # The disk and write budgets' accounting: this process's own, or the cluster's in etcd.
    ledger: Ledger = field(default_factory=LocalLedger)

    def describe(self) -> str:
        """For `slotkeeper status` and the log: which store, and whether it answers."""
        return describe(store_of(self.state))

    def close(self) -> None:
        if self.mirror is not None:
            self.mirror.close()
        if self.etcd is not None:
            self.etcd.close()


def parse_endpoints(text: str) -> tuple[str, ...]:
    """`host:port` or `http(s)://host:port`, comma-separated; ValueError says which is bad."""
    endpoints = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        url = item if "://" in item else f"http://{item}"
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as e:
            raise ValueError(f"{item!r}: {e}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname or port is None \
                or parts.path not in ("", "/") or parts.query or parts.username:
            raise ValueError(f"{item!r} is not host:port or http(s)://host:port")
        endpoints.append(f"{parts.scheme}://{parts.netloc}")
    if not endpoints:
        raise ValueError("no endpoint given")
    return tuple(endpoints)


def store_of(state: State) -> dict:
    """Which store holds `state`, and whether it answers (the session API's "store")."""
    conn = getattr(state, "conn", None)  # EtcdState's; the file has none
    if conn is None:
        return {"kind": "file", "where": str(getattr(state, "path", "")), "reachable": True}
    return {"kind": "etcd", "where": ",".join(conn.endpoints), "reachable": conn.reachable}


def describe(store: dict) -> str:
    if store.get("kind") != "etcd":
        return f"state file {store.get('where', '')}"
    answer = ("reachable" if store.get("reachable")
              else "UNREACHABLE: requests pass through unpinned until it answers")
    return f"etcd {store.get('where', '')}, {answer}"


def check_prefix(prefix: str) -> str:
    """Printable ASCII without spaces, ending in '/': it is the start of every key."""
    if not prefix or not all("!" <= c <= "~" for c in prefix):
        raise ValueError("must be printable ASCII without spaces")
    return prefix if prefix.endswith("/") else prefix + "/"


def open_store(state_path: Path, etcd: str = "", prefix: str = DEFAULT_PREFIX,
               lease_ttl: int = DEFAULT_LEASE_TTL, previous: Store | None = None) -> Store:
    """The file backend when `etcd` is empty, else etcd at those comma-separated endpoints.
    ValueError on a bad endpoint or prefix; OSError from the files. etcd being unreachable
    is no error: the proxy starts, says so, and pins once it answers. `previous`: the store
    in use (an option changed): reused as it is when opened with the same etcd options (its
    connection, lease, watch and the locks held on them), else the caller closes it."""
    if not etcd.strip():
        return Store(StateFile(state_path), SlotLocks(state_path.parent / "locks"))
    endpoints = parse_endpoints(etcd)
    prefix = check_prefix(prefix)
    settings = (endpoints, prefix, lease_ttl)
    if previous is not None and previous.etcd is not None and previous.settings == settings:
        return previous
    try:
        from .etcd_budgets import EtcdLedger
        from .etcd_conn import EtcdConnection
        from .etcd_locks import EtcdLocks
        from .etcd_mirror import EtcdMirror
        from .etcd_state import EtcdState
    except ImportError as e:
        raise ValueError(f"{e}: install slotkeeper[etcd] (etcd3gw) to use etcd") from None
    conn = EtcdConnection(endpoints, lease_ttl)
    mirror = EtcdMirror(conn, prefix)
    state = EtcdState(conn, mirror, prefix)
    store = Store(state, EtcdLocks(conn, mirror, prefix, need=state.need), conn, mirror,
                  settings, EtcdLedger(conn, prefix))
    mirror.start()
    try:
        conn.call(conn.probe, probe=True)
        log.info("state in etcd %s under %s (lease TTL %d s)", ",".join(endpoints), prefix,
                 lease_ttl)
    except StoreUnavailable as e:
        log.warning("etcd is unreachable at start (%s): every request passes through unpinned "
                    "until it answers", e)
    return store
