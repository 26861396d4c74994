"""What only the etcd backend has (issue #33): endpoints to parse, a cluster that goes down
and comes back, a member lost, keys that never hold a client's id."""

from __future__ import annotations

import time

import pytest

from slotkeeper.store.backends import check_prefix, open_store
from slotkeeper.store.backends import parse_endpoints
from slotkeeper.store.state import StoreUnavailable
from slotkeeper.store.state import SlotRecord


def test_endpoints_are_parsed_or_refused_plainly():
    assert parse_endpoints("127.0.0.1:2379, https://etcd-b:2379,") == (
        "http://127.0.0.1:2379", "https://etcd-b:2379")
    for bad in ("", " , ", "127.0.0.1", "ftp://a:1", "http://a:99999", "http://a:1/path",
                "http://u:p@a:1", "a:b"):
        with pytest.raises(ValueError):
            parse_endpoints(bad)
    assert check_prefix("/team-a") == "/team-a/"
    for bad in ("", "/with space/", "/é/"):
        with pytest.raises(ValueError):
            check_prefix(bad)


def _claim(state, owner: str) -> None:
    state.update(lambda doc: doc.upstream("u").slots.__setitem__(
        0, SlotRecord(owner=owner, claimed=1, last_used=1)))


def test_keys_stay_under_the_prefix_and_never_name_a_session(tmp_path, etcd_cluster):
    import etcd3gw
    store = open_store(tmp_path / "s.json", etcd_cluster.endpoints, "/keys-test/")
    hostile = "../../\x00/etc/passwd"
    try:
        _claim(store.state, hostile)
        held = [store.locks.placement(hostile, 0), store.locks.snapshot(hostile, 0),
                store.locks.try_acquire(hostile, 0, True), store.locks.try_acquire("v", 1, False)]
        assert all(held)
        client = etcd3gw.client(port=int(etcd_cluster.endpoints.split(",")[0].rsplit(":", 1)[1]))
        keys = [meta["key"].decode() for _, meta in client.get_all()]
        assert keys and all(k.startswith("/keys-test/") for k in keys), keys
        assert not any("passwd" in k or ".." in k for k in keys), keys
        for lease in held:
            lease.release()
        assert store.etcd.flush()  # releases are made by the release thread
        left = sorted(meta["key"].decode() for _, meta in client.get_all())
        # The shared key lingers (the next kept request takes it from memory): it alone
        assert len(left) == 2 and left[1] == "/keys-test/state", left
        assert left[0].startswith("/keys-test/slots/") and "/1/sh/" in left[0], left
    finally:
        store.close()


def test_a_cluster_down_fails_fast_and_pinning_comes_back(tmp_path, make_etcd):
    cluster = make_etcd(1)
    store = open_store(tmp_path / "s.json", cluster.endpoints, "/down/", lease_ttl=5)
    try:
        _claim(store.state, "a")
        held = store.locks.try_acquire("u", 0, exclusive=True)
        assert held is not None
        cluster.kill(0)
        # Reads come from the watch-fed copy until the watch sees its stream end: a read in
        # that instant rightly answers from the copy (CI caught one), so wait for the watch.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and store.mirror.synced:
            time.sleep(0.05)
        assert not store.mirror.synced, "the watch did not notice etcd's end within 5 s"
        with pytest.raises(StoreUnavailable):
            store.state.read()
        assert not store.etcd.reachable and "UNREACHABLE" in store.describe()
        t0 = time.monotonic()
        assert store.locks.try_acquire("u", 1, exclusive=False) is None  # no wait: known down
        with pytest.raises(StoreUnavailable):
            store.locks.acquire("u", 1, exclusive=True, timeout=30)
        with pytest.raises(StoreUnavailable):
            store.locks.placement("s", timeout=30)
        assert time.monotonic() - t0 < 1.0
        assert store.state.last_read().upstreams["u"].slot_of("a") == 0  # the last known doc
        held.release()  # etcd does not get it: retried when it is back
        cluster.restart(0)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not store.etcd.reachable:
            time.sleep(0.1)
        assert store.etcd.reachable, "pinning did not resume within 5 s of etcd's return"
        assert store.state.read().upstreams["u"].slot_of("a") == 0  # nothing lost
        again = store.locks.acquire("u", 0, exclusive=True, timeout=3)
        assert again is not None, "the release made while etcd was down was never delivered"
    finally:
        store.close()


def test_a_lingering_key_is_used_only_while_its_lease_is_sure_to_live(
        tmp_path, etcd_cluster, monkeypatch):
    """A shared key kept from an earlier request is reused with no round trip, but only while
    the lease it hangs on is sure to be alive: past the TTL since its last refresh, another
    process may have taken the slot, even if this one has not yet seen etcd fail."""
    store = open_store(tmp_path / "s.json", etcd_cluster.endpoints, "/linger/", lease_ttl=2)
    try:
        first = store.locks.try_acquire("u", 0, exclusive=False)
        assert first is not None
        first.release()
        assert store.etcd.flush()
        again = store.locks.try_acquire("u", 0, exclusive=False)
        assert again is not None, "the lingering key was not reused"
        again.release()
        # The keep-alive silenced, as when every call to a cut-off cluster hangs: nothing has
        # failed yet, so etcd still counts as reachable.
        monkeypatch.setattr(store.etcd, "_refresh", lambda: None)
        time.sleep(2.1)
        assert store.etcd.reachable and not store.etcd.lease_alive
        assert store.locks.try_acquire("u", 0, exclusive=False) is None
    finally:
        monkeypatch.undo()
        store.close()


def test_one_member_of_three_down_changes_nothing(tmp_path, make_etcd):
    cluster = make_etcd(3)
    store = open_store(tmp_path / "s.json", cluster.endpoints, "/member/")
    try:
        _claim(store.state, "a")
        for index in range(3):  # whichever member it is, the leader included
            cluster.kill(index)
            _claim(store.state, f"b{index}")
            lease = store.locks.acquire("u", 0, exclusive=True, timeout=10)
            assert lease is not None
            lease.release()
            assert store.state.read().upstreams["u"].slot_of(f"b{index}") == 0
            cluster.restart(index)
        assert store.etcd.failures == 0
    finally:
        store.close()


def test_a_proxy_started_while_etcd_is_down_says_so(tmp_path, caplog):
    store = open_store(tmp_path / "s.json", "127.0.0.1:1", "/nothing/")
    try:
        assert "etcd is unreachable at start" in caplog.text
        assert store.locks.try_acquire("u", 0, exclusive=False) is None
    finally:
        store.close()


def test_bad_etcd_options_are_refused_plainly(tmp_path):
    from mitmproxy import exceptions
    from mitmproxy.test import taddons

    from slotkeeper.addon import SlotKeeper

    keeper = SlotKeeper()
    with taddons.context(keeper) as tctx:
        for option, value, says in (("slotkeeper_etcd", "http://a:1/x", "slotkeeper_etcd"),
                                    ("slotkeeper_etcd", "a:99999", "slotkeeper_etcd"),
                                    ("slotkeeper_etcd_prefix", "/a b/", "slotkeeper_etcd_prefix"),
                                    ("slotkeeper_etcd_lease_ttl", 1, "lease_ttl")):
            options = {"slotkeeper_state_file": str(tmp_path / "state.json"),
                       "slotkeeper_etcd": "127.0.0.1:2379", option: value}
            with pytest.raises(exceptions.OptionsError, match=says):
                tctx.configure(keeper, **options)
        assert not (tmp_path / "state.json.lock").exists()  # refused before any file is made


def test_the_addon_runs_on_etcd(tmp_path, etcd_cluster):
    from mitmproxy.test import taddons

    from slotkeeper.addon import SlotKeeper
    from slotkeeper.store.etcd_state import EtcdState

    keeper = SlotKeeper()
    with taddons.context(keeper) as tctx:
        tctx.configure(keeper, slotkeeper_state_file=str(tmp_path / "state.json"),
                       slotkeeper_etcd=etcd_cluster.endpoints, slotkeeper_etcd_prefix="/addon")
        assert isinstance(keeper.router.state, EtcdState)
        assert keeper.router.state.key == "/addon/state"
        keeper.pool.shutdown()
        keeper.release_pool.shutdown()


def test_status_and_metrics_say_which_store_and_whether_it_answers(tmp_path):
    from types import SimpleNamespace

    from slotkeeper.launcher.status import Report, render
    from slotkeeper.manage.scrape import StoreHealth
    from slotkeeper.store.backends import store_of

    store = open_store(tmp_path / "s.json", "127.0.0.1:1", "/nothing/")  # nothing listens
    try:
        assert store_of(store.state) == {"kind": "etcd", "where": "http://127.0.0.1:1",
                                         "reachable": False}
        text = render(Report("proxy", "http://127.0.0.1:8000", store=store_of(store.state)))
        assert "Store: etcd http://127.0.0.1:1, UNREACHABLE" in text, text
        health = StoreHealth()
        health.keeper = SimpleNamespace(router=SimpleNamespace(state=store.state))
        values = {s.name: s.value for family in health.collect() for s in family.samples}
        assert values["slotkeeper_store_reachable"] == 0
        assert values["slotkeeper_store_unreachable_total"] >= 1
    finally:
        store.close()
    file_store = open_store(tmp_path / "s.json")
    assert "Store: state file" in render(Report("proxy", "x", store=store_of(file_store.state)))


def test_reconfiguring_keeps_the_etcd_store_or_closes_it(tmp_path, etcd_cluster):
    """Any slotkeeper_ option change rebuilds the router: the same etcd options keep the
    connection (its lease, its watch, the leases of requests in flight); others close it."""
    from mitmproxy.test import taddons

    from slotkeeper.addon import SlotKeeper

    keeper = SlotKeeper()
    with taddons.context(keeper) as tctx:
        tctx.configure(keeper, slotkeeper_state_file=str(tmp_path / "state.json"),
                       slotkeeper_etcd=etcd_cluster.endpoints, slotkeeper_etcd_prefix="/re/")
        first = keeper.store
        assert first is not None and first.etcd is not None
        tctx.configure(keeper, slotkeeper_ttl=77)
        assert keeper.store is first and keeper.router.state is first.state
        tctx.configure(keeper, slotkeeper_etcd_prefix="/re-other/")
        assert keeper.store is not first and keeper.router.state.key == "/re-other/state"
        assert first.etcd.closed and not first.mirror.synced  # closed, not leaked
        keeper.store.close()
        keeper.pool.shutdown()
        keeper.release_pool.shutdown()
