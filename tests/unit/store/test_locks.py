"""Slot locks: shared for keepers, exclusive for handovers, across processes too."""

import subprocess
import sys
import time

from slotkeeper.store.locks import SlotLocks


def test_shared_leases_coexist_and_block_exclusive(tmp_path):
    locks = SlotLocks(tmp_path)
    a = locks.try_acquire("u", 0, exclusive=False)
    b = locks.try_acquire("u", 0, exclusive=False)
    assert a and b
    assert locks.try_acquire("u", 0, exclusive=True) is None
    assert locks.try_acquire("u", 1, exclusive=True) is not None  # other slot: free
    a.release()
    b.release()
    b.release()  # idempotent
    assert locks.try_acquire("u", 0, exclusive=True) is not None


def test_exclusive_blocks_shared_and_times_out(tmp_path):
    locks = SlotLocks(tmp_path)
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
    assert locks.try_acquire("http://a:1", 0, True) and locks.try_acquire("http://b:1", 0, True)


def test_lock_held_by_another_process(tmp_path):
    code = (
        "import sys, time; sys.path.insert(0, sys.argv[1]);"
        "from pathlib import Path; from slotkeeper.store.locks import SlotLocks;"
        "l = SlotLocks(Path(sys.argv[2])).try_acquire('u', 0, True); print('held', flush=True);"
        "time.sleep(1.0)"
    )
    import pathlib

    import slotkeeper.store.locks
    addon_dir = str(pathlib.Path(slotkeeper.store.locks.__file__).parent.parent)
    child = subprocess.Popen([sys.executable, "-c", code, addon_dir, str(tmp_path)],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    locks = SlotLocks(tmp_path)
    assert locks.try_acquire("u", 0, exclusive=False) is None
    lease = locks.acquire("u", 0, exclusive=True, timeout=5)
    assert lease is not None  # granted once the other process exits
    child.wait(5)


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
