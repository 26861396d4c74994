"""The proxies-as-hosts bed (tests/bed/netns.py): namespaces made, reachable and removed, or
a plain fallback that says why."""

from __future__ import annotations

import subprocess

from netns import Hosts


def ours(tag: str) -> list[str]:
    """Namespaces and links of this bed still on the machine."""
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [word for word in (netns + links).replace(":", " ").replace("@", " ").split()
            if word.startswith(("skn", "skb", "skv")) and tag in word]


def test_hosts_are_namespaces_or_say_why_not():
    hosts = Hosts(2)
    print(hosts.describe())
    try:
        if hosts.isolated:
            assert len({h.netns for h in hosts.hosts}) == 2 and all(h.netns for h in hosts.hosts)
            assert len({h.address for h in hosts.hosts}) == 2
            assert hosts.gateway != "127.0.0.1"
            assert ours(hosts.tag)
        else:
            assert hosts.reason and "unavailable" in hosts.describe()
            assert all(h.address == "127.0.0.1" and not h.netns for h in hosts.hosts)
    finally:
        hosts.close()
    assert ours(hosts.tag) == []
    hosts.close()  # twice: nothing left to do, no error


def test_the_fallback_runs_on_loopback(monkeypatch):
    monkeypatch.setenv("SLOTKEEPER_TEST_NO_NETNS", "1")
    hosts = Hosts(3)
    assert not hosts.isolated and hosts.gateway == "127.0.0.1"
    assert "SLOTKEEPER_TEST_NO_NETNS" in hosts.describe()
    assert ours(hosts.tag) == []
