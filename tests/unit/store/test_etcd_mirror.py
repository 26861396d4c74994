"""The watch-fed copy of the etcd store (issue #33): a kept request reads the state and takes
its slot's shared lease from memory, on the event loop, with no round trip; claims still go
through transactions; another process's exclusive want takes a lingering key away; the
watch comes back after members die and after quorum returns. Against a real etcd cluster."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from slotkeeper.store.backends import Store, open_store
from slotkeeper.store.etcd_locks import WANT_WAIT
from slotkeeper.store.state import SlotRecord

_prefixes = iter(range(10**6))


def _open(tmp_path, endpoints: str, prefix: str, lease_ttl: int = 15) -> Store:
    return open_store(tmp_path / "s.json", endpoints, prefix, lease_ttl)


def _count_calls(store: Store) -> list[int]:
    """Every round trip a request's code makes (the keep-alive's probes are not a request's)."""
    calls: list[int] = []
    original = store.etcd.call

    def counted(fn: Callable, probe: bool = False) -> Any:
        if not probe:
            calls.append(1)
        return original(fn, probe)

    store.etcd.call = counted  # type: ignore[method-assign]
    return calls


def _on_loop(fn: Callable[[], Any]) -> Any:
    """Run `fn` on an event loop's thread, as mitmproxy runs the kept request's hooks."""
    async def run() -> Any:
        return fn()
    return asyncio.run(run())


def _claim(store: Store, owner: str, slot: int = 0) -> None:
    store.state.update(lambda doc: doc.upstream("u").slots.__setitem__(
        slot, SlotRecord(owner=owner, claimed=1, last_used=1)))


def _until(check: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.01)
    return check()


@pytest.fixture
def pair(tmp_path, etcd_cluster):
    """Two processes' views of one prefix (each its own connection, lease and watch)."""
    prefix = f"/mirror-{next(_prefixes)}/"
    stores = (_open(tmp_path, etcd_cluster.endpoints, prefix),
              _open(tmp_path, etcd_cluster.endpoints, prefix))
    yield stores
    for store in stores:
        store.close()


def test_a_kept_request_reads_and_leases_from_memory(pair):
    a, b = pair
    _claim(a, "alice")
    # Another process's write reaches this one's copy through the watch.
    assert _until(lambda: _on_loop(b.state.read).upstreams.get("u") is not None)
    first = b.locks.try_acquire("u", 0, exclusive=False)  # a worker: one transaction
    assert first is not None
    first.release()

    def keep() -> bool:
        lease = b.locks.try_acquire("u", 0, exclusive=False)
        owner = b.state.read().upstreams["u"].slots[0].owner
        if lease is not None:
            lease.release()
        return lease is not None and owner == "alice"

    # The loop takes the key once the watch delivered its put (about a millisecond).
    assert _until(lambda: _on_loop(keep))
    calls = _count_calls(b)
    for _ in range(50):
        assert _on_loop(keep)
    assert calls == [], f"{len(calls)} round trips on 50 kept requests"
    # Without a key of its own on the slot, the loop says no (no round trip)...
    assert _on_loop(lambda: b.locks.try_acquire("u", 1, exclusive=False)) is None
    assert calls == []
    # ...and a worker's read waits for the watch to hold what this process wrote.
    _claim(b, "bob", slot=1)
    assert b.state.read().upstreams["u"].slots[1].owner == "bob"
    assert len(calls) == 1, "a claim is one transaction"


def test_a_stale_copy_fails_the_transaction_and_the_change_is_redone(pair):
    a, b = pair
    b.mirror.close()  # b's copy no longer follows etcd
    _claim(b, "b0", slot=0)
    _claim(a, "a1", slot=1)
    _claim(a, "a2", slot=2)
    seen: list[set] = []

    def change(doc) -> None:
        seen.append(set(doc.upstream("u").slots))
        doc.upstream("u").slots[3] = SlotRecord(owner="b3", claimed=1, last_used=1)

    b.state.update(change)
    assert seen[0] == {0}, "the first try works on b's stale copy"
    assert seen[-1] == {0, 1, 2}, "the retry works on the document etcd answered"
    assert _until(lambda: set(a.state.read().upstreams["u"].slots) == {0, 1, 2, 3})


def test_an_exclusive_want_takes_an_idle_lingering_key(pair):
    a, b = pair
    kept = a.locks.try_acquire("u", 0, exclusive=False)
    assert kept is not None
    # While a's request holds it, b's try waits WANT_WAIT and gives up: never both.
    t0 = time.monotonic()
    assert b.locks.try_acquire("u", 0, exclusive=True) is None
    assert time.monotonic() - t0 >= WANT_WAIT * 0.9
    kept.release()  # idle and wanted: a deletes its key
    assert a.etcd.flush()
    handover = b.locks.acquire("u", 0, exclusive=True, timeout=5)
    assert handover is not None
    # a's lingering key is gone: its loop refuses, a worker waits for b.
    assert _on_loop(lambda: a.locks.try_acquire("u", 0, exclusive=False)) is None
    assert a.locks.try_acquire("u", 0, exclusive=False) is None
    handover.release()
    again = a.locks.acquire("u", 0, exclusive=False, timeout=5)
    assert again is not None
    again.release()
    # An idle lingering key goes within the try's wait when asked.
    t0 = time.monotonic()
    taken = b.locks.try_acquire("u", 0, exclusive=True)
    assert taken is not None, "an idle lingering key was not given up"
    assert time.monotonic() - t0 < WANT_WAIT
    taken.release()


def test_the_watch_comes_back_after_a_member_dies_and_after_quorum(tmp_path, make_etcd):
    cluster = make_etcd(3)
    prefix = "/mirror-faults/"
    a = _open(tmp_path, cluster.endpoints, prefix, lease_ttl=10)
    b = _open(tmp_path, cluster.endpoints, prefix, lease_ttl=10)
    try:
        assert _until(lambda: b.mirror.synced)
        resyncs = b.mirror.resyncs
        watched = b.etcd.good
        cluster.kill(watched)  # the member b's watch reads from
        _claim(a, "after-kill")
        assert _until(lambda: _on_loop(b.state.read).upstreams.get("u") is not None
                      and _on_loop(b.state.read).upstreams["u"].slots[0].owner == "after-kill"
                      ), "b's copy missed a change made while its watch moved to another member"
        assert b.mirror.resyncs > resyncs
        cluster.restart(watched)
        # Quorum lost: the watch is cancelled (hasleader), the copy is out of date and the
        # loop's fast path refuses rather than trust it.
        lease = b.locks.try_acquire("u", 0, exclusive=False)
        assert lease is not None
        lease.release()
        cluster.kill(0)
        cluster.kill(1)
        assert _until(lambda: not b.mirror.synced, 10), "the watch went on without a quorum"
        assert _on_loop(lambda: b.locks.try_acquire("u", 0, exclusive=False)) is None
        cluster.restart(0)
        cluster.restart(1)
        assert _until(lambda: b.mirror.synced and b.etcd.reachable, 10)
        _claim(a, "after-quorum")
        assert _until(lambda: _on_loop(b.state.read).upstreams["u"].slots[0].owner
                      == "after-quorum")
    finally:
        a.close()
        b.close()


def test_a_watch_that_stops_delivering_is_read_again(tmp_path, etcd_cluster):
    """A stream that delivers nothing without ending (a frozen member) must not keep the copy
    old: a worker's bounded wait gives up and restarts the watch, which reads the prefix whole
    again."""
    store = _open(tmp_path, etcd_cluster.endpoints, f"/mirror-{next(_prefixes)}/")
    try:
        assert _until(lambda: store.mirror.synced)
        resyncs = store.mirror.resyncs
        assert not store.mirror.catch_up(store.mirror.revision + 10**6, timeout=0.2)
        assert _until(lambda: store.mirror.resyncs > resyncs and store.mirror.synced)
        _claim(store, "after")
        assert store.state.read().upstreams["u"].slots[0].owner == "after"
    finally:
        store.close()
