"""Proxies as hosts (issue #33): each proxy of a test in a network namespace of its own, with
its own address on a bridge, so that nothing but the network reaches from one to another, as
with proxies on several machines. Where the machine does not allow it (not root, no `ip`, no
veth or bridge in the kernel, a sandbox), the proxies run on loopback with ports of their own,
and the bed says so: `Hosts.describe()` is printed by the tests that use it.

Layout: a bridge `skb<tag>` on the host with address 10.A.B.1/24 (the "gateway": services the
proxies use, llama-server and etcd, listen there too), and for proxy i a namespace `skn<tag>i`
joined to the bridge by a veth pair (`skv<tag>i` on the host, `skp<tag>i` inside at
10.A.B.(10+i)). <tag> is this process's pid in hex and a letter, so two test runs on one
machine never share a name; a subnet already in use on the machine is skipped.

Everything made is undone by `close()`, which the `proxy_hosts` fixture calls whatever the
test did (and an atexit hook, should the fixture not run); leftovers of a run that was killed
(its pid gone, more than an hour old) are swept when the next bed is made."""

from __future__ import annotations

import atexit
import ipaddress
import itertools
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

IP_TIMEOUT_S = 10.0
STALE_AFTER_S = 3600.0
_NAME = re.compile(r"sk[nbvp]([0-9a-f]+)([a-z])\d*")
_letters = itertools.cycle("abcdefghijklmnopqrstuvwxyz")


class NamespacesUnavailable(Exception):
    """The machine does not let this process make network namespaces; the message says why."""


@dataclass(frozen=True)
class Host:
    netns: str  # "" on loopback
    address: str  # where the proxy listens


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(["ip", *args], capture_output=True, text=True,
                              timeout=IP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NamespacesUnavailable(f"ip {' '.join(args)}: {e}") from None
    if check and done.returncode != 0:
        raise NamespacesUnavailable(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


class Hosts:
    """`Hosts(count)`: `count` hosts for proxies, in namespaces when the machine allows it.
    `.gateway` is the address services must serve on (127.0.0.1 on loopback)."""

    def __init__(self, count: int) -> None:
        self.tag = f"{os.getpid():x}{next(_letters)}"
        self.bridge = f"skb{self.tag}"
        self.namespaces: list[str] = []
        self.made_bridge = False
        self.gateway = "127.0.0.1"
        self.hosts = [Host("", "127.0.0.1") for _ in range(count)]
        self.reason = ""
        atexit.register(self.close)
        try:
            self._make(count)
        except NamespacesUnavailable as e:
            self.close()
            self.hosts = [Host("", "127.0.0.1") for _ in range(count)]
            self.gateway = "127.0.0.1"
            self.reason = str(e)

    @property
    def isolated(self) -> bool:
        return not self.reason

    def describe(self) -> str:
        if self.isolated:
            return ("proxies as hosts: network namespaces " + ", ".join(
                f"{h.netns} at {h.address}" for h in self.hosts) + f", services at {self.gateway}")
        return (f"network namespaces unavailable ({self.reason}): the proxies run on loopback, "
                f"each on its own port")

    def _make(self, count: int) -> None:
        if os.environ.get("SLOTKEEPER_TEST_NO_NETNS"):
            raise NamespacesUnavailable("SLOTKEEPER_TEST_NO_NETNS is set")
        if sys.platform != "linux" or shutil.which("ip") is None:
            raise NamespacesUnavailable("no Linux `ip` command")
        if os.geteuid() != 0:
            raise NamespacesUnavailable("not root")
        sweep_stale()
        net = free_subnet()
        gateway = str(net.network_address + 1)
        _ip("link", "add", self.bridge, "type", "bridge")
        self.made_bridge = True
        _ip("addr", "add", f"{gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        hosts = []
        for i in range(count):
            netns, outside, inside = (f"skn{self.tag}{i}", f"skv{self.tag}{i}",
                                      f"skp{self.tag}{i}")
            _ip("netns", "add", netns)
            self.namespaces.append(netns)
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", netns)  # deleted with the namespace
            _ip("link", "set", outside, "master", self.bridge)
            _ip("link", "set", outside, "up")
            address = str(net.network_address + 10 + i)
            _ip("-n", netns, "addr", "add", f"{address}/24", "dev", inside)
            _ip("-n", netns, "link", "set", inside, "up")
            _ip("-n", netns, "link", "set", "lo", "up")
            hosts.append(Host(netns, address))
        self.gateway = gateway
        for host in hosts:
            reaches(host.netns, gateway)
        self.hosts = hosts

    def close(self) -> None:
        """Undo everything made (idempotent, never raises): the namespaces take their veth
        ends with them; the bridge goes last."""
        namespaces, self.namespaces = self.namespaces, []
        bridge, self.made_bridge = self.made_bridge, False
        for name in namespaces:
            # The pair goes with either end; deleted here, not left to the namespace's
            # teardown, which the kernel finishes later (seen: veths alive after `netns del`).
            _quietly("link", "del", "skv" + name.removeprefix("skn"))
            _quietly("netns", "del", name)
        if bridge:
            _quietly("link", "del", self.bridge)


def _quietly(*args: str) -> None:
    """An `ip` call of a cleanup: its failure (already gone) is no error."""
    try:
        _ip(*args, check=False)
    except NamespacesUnavailable:
        pass


def reaches(netns: str, gateway: str) -> None:
    """A process in `netns` connects to a socket this process listens on at the gateway."""
    with socket.socket() as server:
        server.bind((gateway, 0))
        server.listen(1)
        server.settimeout(IP_TIMEOUT_S)
        port = server.getsockname()[1]
        code = (f"import socket; socket.create_connection(({gateway!r}, {port}), "
                f"timeout={IP_TIMEOUT_S}).close()")
        try:
            child = subprocess.Popen(["ip", "netns", "exec", netns, sys.executable, "-c", code],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        except OSError as e:
            raise NamespacesUnavailable(f"ip netns exec: {e}") from None
        try:
            server.accept()[0].close()
        except OSError as e:
            child.kill()
            raise NamespacesUnavailable(f"{netns} cannot reach {gateway}: {e}") from None
        finally:
            try:
                child.wait(IP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def free_subnet() -> ipaddress.IPv4Network:
    """A /24 under 10.213-10.222 that no interface of this machine has an address in."""
    used = _ip("-o", "-4", "addr", "show").stdout + _ip("-4", "route", "show").stdout
    start = os.getpid() % 2500
    for k in range(2500):
        n = (start + k) % 2500
        net = ipaddress.IPv4Network(f"10.{213 + n // 250}.{n % 250}.0/24")
        if f"10.{213 + n // 250}.{n % 250}." not in used:
            return net
    raise NamespacesUnavailable("no free 10.x subnet")


def sweep_stale() -> None:
    """Namespaces of ours (and their bridge) whose test run is gone: its pid is not alive
    and the namespace is over an hour old (a pid of another pid namespace looks gone)."""
    for name in _ip("netns", "list", check=False).stdout.split():
        match = _NAME.fullmatch(name)
        if match is None or not name.startswith("skn") or _alive(int(match.group(1), 16)):
            continue
        try:
            age = time.time() - (Path("/run/netns") / name).stat().st_mtime
        except OSError:
            continue
        if age > STALE_AFTER_S:
            _quietly("netns", "del", name)
            _quietly("link", "del", f"skb{match.group(1)}{match.group(2)}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
