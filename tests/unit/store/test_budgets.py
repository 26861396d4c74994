"""The budgets' accounting against both backends (issue #33): with etcd every proxy charges
one write budget and sees the others' saves in flight; with the file backend each process
keeps its own count, as before."""

from __future__ import annotations

import pathlib
import signal
import subprocess
import sys
import time

from store_backends import backend  # noqa: F401 - the fixture

import slotkeeper.store.budgets
from slotkeeper.store.backends import open_store
from slotkeeper.store.budgets import HOUR, LocalLedger
from slotkeeper.store.etcd_budgets import PRUNE_EVERY, EtcdLedger

ADDON = str(pathlib.Path(slotkeeper.store.budgets.__file__).parent.parent)
# A child process: opens the store (a 2 s lease), writes, reserves, says so, then holds
# until killed or for argv[5] seconds.
CHILD = (
    "import sys, time; sys.path.insert(0, sys.argv[1]); from pathlib import Path; "
    "from slotkeeper.store.backends import open_store; "
    "s = open_store(Path(sys.argv[2]), sys.argv[3], sys.argv[4], 2); "
    "s.ledger.wrote(1000); r = s.ledger.reserve('c.saving-0000abcd.bin', 500); r.__enter__(); "
    "print('ready', flush=True); time.sleep(float(sys.argv[5])); r.__exit__(None, None, None); "
    "s.close()"
)


def child(backend, hold: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, ADDON, *backend.args(), str(hold)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_writes_within_the_hour_are_counted(backend):
    ledger = backend.open().ledger
    assert ledger.last_hour() == 0
    ledger.wrote(10)
    ledger.wrote(20)
    assert ledger.last_hour() == 30


def test_two_proxies_charge_one_write_budget(backend):
    a, b = backend.open().ledger, backend.open().ledger
    a.wrote(100)
    b.wrote(50)
    proc = child(backend, 0)
    proc.wait(10)
    shared = backend.kind == "etcd"
    print(f"{backend.kind}: A counts {a.last_hour()}, B {b.last_hour()}")
    assert a.last_hour() == (1150 if shared else 100)
    assert b.last_hour() == (1150 if shared else 50)


def test_writes_older_than_an_hour_drop_out(backend):
    now = [1_000_000.0]
    store = backend.open()
    ledger = (EtcdLedger(store.etcd, backend.prefix, clock=lambda: now[0])
              if backend.kind == "etcd" else LocalLedger(clock=lambda: now[0]))
    ledger.wrote(7)
    now[0] += HOUR / 2
    ledger.wrote(5)
    now[0] += HOUR / 2 + 1
    if backend.kind == "etcd":
        ledger.local = LocalLedger(clock=lambda: now[0])  # the cluster's count alone
    assert ledger.last_hour() == 5
    if backend.kind == "etcd":  # the old key is gone from etcd, not only skipped
        assert len(ledger._range(ledger.writes_key)) == 1


def test_a_proxy_that_never_asks_still_prunes_old_writes(backend):
    if backend.kind != "etcd":
        assert backend.open().ledger.last_hour() == 0  # nothing kept outside the process
        return
    now = [1_000_000.0]
    ledger = EtcdLedger(backend.open().etcd, backend.prefix, clock=lambda: now[0])
    ledger.wrote(1)
    now[0] += HOUR + 1
    for _ in range(PRUNE_EVERY - 1):
        ledger.wrote(1)
    assert len(ledger._range(ledger.writes_key)) == PRUNE_EVERY - 1


def test_saves_in_flight_are_seen_by_every_proxy(backend):
    a, b = backend.open().ledger, backend.open().ledger
    sizes = {"x.saving-00000001.bin": 30}
    with a.reserve("x.saving-00000001.bin", 100):
        # B must make room for the 70 bytes A has still to write; A not for its own.
        seen = b.pending(lambda name: sizes.get(name, 0), exclude="y.saving-00000002.bin")
        assert seen == (70 if backend.kind == "etcd" else 0)
        assert a.pending(lambda name: 0, exclude="x.saving-00000001.bin") == 0
        # Another save of the same process (another thread) sees it with either backend.
        assert a.pending(lambda name: sizes.get(name, 0), exclude="z.saving-00000003.bin") == 70
    assert b.pending(lambda name: 0, exclude="") == 0


def test_a_killed_proxys_reservation_dies_with_its_lease(backend):
    proc = child(backend, 3600)
    ledger = backend.open().ledger
    assert ledger.pending(lambda name: 0, exclude="") == (500 if backend.kind == "etcd" else 0)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    killed = time.monotonic()
    while ledger.pending(lambda name: 0, exclude="") and time.monotonic() - killed < 10:
        time.sleep(0.2)
    gone = time.monotonic() - killed
    print(f"{backend.kind}: the killed proxy's reservation was gone {gone:.1f} s after the kill")
    assert ledger.pending(lambda name: 0, exclude="") == 0
    assert gone < 2 + 3, gone  # the child's lease TTL is 2 s
    assert ledger.last_hour() == (1000 if backend.kind == "etcd" else 0)


def test_with_etcd_unreachable_the_proxy_counts_its_own(tmp_path):
    store = open_store(tmp_path / "state.json", "127.0.0.1:9", "/down/")
    try:
        ledger = store.ledger
        ledger.wrote(40)  # no error: counted here
        assert ledger.last_hour() == 40
        with ledger.reserve("x.saving-00000001.bin", 10):
            assert ledger.pending(lambda name: 0, exclude="") == 10
        assert ledger.pending(lambda name: 0, exclude="") == 0
    finally:
        store.close()
