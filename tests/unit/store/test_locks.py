"""Slot locks: shared for keepers, exclusive for handovers, across processes too."""

import subprocess
import sys
import time

from store_backends import backend  # noqa: F401 - the fixture

from slotkeeper.store.locks import SlotLocks


def test_shared_leases_coexist_and_block_exclusive(backend):
    locks = backend.open().locks
    a = locks.try_acquire("u", 0, exclusive=False)
    b = locks.try_acquire("u", 0, exclusive=False)
    assert a and b
    assert locks.try_acquire("u", 0, exclusive=True) is None
    assert locks.try_acquire("u", 1, exclusive=True) is not None  # other slot: free
    a.release()
    b.release()
    b.release()  # idempotent
    assert locks.try_acquire("u", 0, exclusive=True) is not None


def test_exclusive_blocks_shared_and_times_out(backend):
    locks = backend.open().locks
    held = locks.try_acquire("u", 3, exclusive=True)
    assert held is not None
    t0 = time.monotonic()
    assert locks.acquire("u", 3, exclusive=False, timeout=0.2) is None
    assert time.monotonic() - t0 >= 0.2
    held.release()
    assert locks.acquire("u", 3, exclusive=False, timeout=0.2) is not None


def test_upstreams_have_separate_locks(tmp_path):
    locks = SlotLocks(tmp_path)
    assert locks.path("http://a:1", 0) != locks.path("http://b:1", 0)


def test_upstreams_and_slots_are_locked_apart(backend):
    locks = backend.open().locks
    assert locks.try_acquire("http://a:1", 0, True) and locks.try_acquire("http://b:1", 0, True)


def _holder(backend, hold: float, exit_how: str = "exit") -> subprocess.Popen:
    """A child process that holds slot ('u', 0) exclusive, says 'held', and after `hold`
    seconds exits cleanly ('exit') or is to be killed by the test ('kill': it sleeps on)."""
    code = (
        "import os, sys, time; sys.path.insert(0, sys.argv[1]);"
        "from pathlib import Path; from slotkeeper.store.backends import open_store;"
        "s = open_store(Path(sys.argv[2]), sys.argv[3], sys.argv[4], lease_ttl=2);"
        "l = s.locks.try_acquire('u', 0, True); print('held' if l else 'refused', flush=True);"
        "time.sleep(float(sys.argv[5])); s.close()"
    )
    import pathlib

    import slotkeeper.store.locks
    addon_dir = str(pathlib.Path(slotkeeper.store.locks.__file__).parent.parent)
    return subprocess.Popen([sys.executable, "-c", code, addon_dir, *backend.args(),
                             str(hold if exit_how == "exit" else 3600)],
                            stdout=subprocess.PIPE, text=True)


def test_lock_held_by_another_process(backend):
    child = _holder(backend, 1.0)
    assert child.stdout.readline().strip() == "held"
    locks = backend.open().locks
    assert locks.try_acquire("u", 0, exclusive=False) is None
    lease = locks.acquire("u", 0, exclusive=True, timeout=5)
    assert lease is not None  # granted once the other process exits
    child.wait(5)


def test_a_killed_holders_locks_go_with_it(backend):
    """SIGKILL: the kernel drops a flock at once; etcd deletes the keys on the holder's lease
    when its TTL (2 s here) runs out, since nobody keeps it alive any more."""
    import signal
    child = _holder(backend, 0, exit_how="kill")
    assert child.stdout.readline().strip() == "held"
    locks = backend.open().locks
    assert locks.try_acquire("u", 0, exclusive=False) is None
    child.send_signal(signal.SIGKILL)
    child.wait(5)
    t0 = time.monotonic()
    lease = locks.acquire("u", 0, exclusive=True, timeout=10)
    freed = time.monotonic() - t0
    assert lease is not None
    assert freed < (0.5 if backend.kind == "file" else 2 + 1.5), freed


def test_placement_and_snapshot_locks_exclude(backend):
    locks = backend.open().locks
    other = backend.open().locks  # another process
    held = locks.placement("session-a", timeout=0)
    assert held is not None
    assert other.placement("session-a", timeout=0.1) is None
    assert locks.placement("session-a", timeout=0) is None  # in one process too
    assert other.placement("session-b", timeout=0) is not None
    assert other.snapshot("session-a", timeout=0) is not None  # another kind of lock
    held.release()
    held.release()
    assert other.placement("session-a", timeout=0) is not None


def test_an_exclusive_lease_waits_for_another_process_shared_holder(backend):
    mine, theirs = backend.open().locks, backend.open().locks
    shared = theirs.try_acquire("u", 1, exclusive=False)
    assert shared is not None
    assert mine.try_acquire("u", 1, exclusive=True) is None
    assert mine.try_acquire("u", 1, exclusive=False) is not None  # shared with them
    shared.release()
    t0 = time.monotonic()
    assert mine.acquire("u", 1, exclusive=True, timeout=0.3) is None  # still my shared one
    assert time.monotonic() - t0 >= 0.3


def test_placement_lock_excludes_and_leaves_no_file(tmp_path):
    locks = SlotLocks(tmp_path)
    held = locks.placement("session-a", timeout=0)
    assert held is not None
    assert locks.placement("session-a", timeout=0.1) is None  # one placement at a time
    other = locks.placement("session-b", timeout=0)
    assert other is not None  # another session is not held up
    held.release()
    other.release()
    assert list(tmp_path.iterdir()) == []  # one file per session ever seen would pile up
    again = locks.placement("session-a", timeout=0)
    assert again is not None
    again.release()


def test_named_lock_waiter_does_not_lock_the_file_its_holder_removed(tmp_path, monkeypatch):
    """The holder removes the lock file on release. A waiter that opened the old file just
    before must not lock it while a third party holds the new one: the interleaving forced
    by running the holder's release and the third party's lock inside the waiter's flock."""
    import fcntl

    locks = SlotLocks(tmp_path)
    holder = locks.placement("s", timeout=0)
    third: list = []
    real_flock = fcntl.flock

    def holder_leaves_and_another_comes(fd: int, op: int) -> None:
        if not third:
            holder.release()
            third.append(None)
            third[0] = locks.placement("s", timeout=0)
        real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", holder_leaves_and_another_comes)
    waiter = locks.placement("s", timeout=0)
    monkeypatch.setattr(fcntl, "flock", real_flock)
    assert third[0] is not None
    assert waiter is None, "two holders of one placement lock"
    third[0].release()
    assert list(tmp_path.iterdir()) == []


def test_session_ids_never_name_lock_files(tmp_path):
    locks = SlotLocks(tmp_path)
    lease = locks.placement("../../etc/passwd", timeout=0)
    assert lease is not None
    names = [p.name for p in tmp_path.iterdir()]
    assert len(names) == 1 and names[0].startswith("placement-") and "passwd" not in names[0]
    lease.release()
