"""The store tests run against both backends (issue #33): the JSON file and flock, and a real
3-member etcd cluster (each test under a prefix of its own). A test module takes the fixture
with `from store_backends import backend` (a conftest.py under tests/unit would do too, but
pytest then hashes every plugin for the tests outside it, and the reliability recorder's
plugin is an unhashable dataclass)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from slotkeeper.store.backends import Store, open_store

_prefixes = itertools.count()


class Backend:
    """`open()` is one process's view of the store: call it twice for two processes."""

    def __init__(self, kind: str, folder: Path, endpoints: str = "") -> None:
        self.kind = kind
        self.folder = folder
        self.endpoints = endpoints
        self.prefix = f"/test-{next(_prefixes)}-{folder.name}/"
        self.opened: list[Store] = []

    def open(self, lease_ttl: int = 15) -> Store:
        store = open_store(self.folder / "state.json", self.endpoints, self.prefix, lease_ttl)
        self.opened.append(store)
        return store

    def args(self) -> list[str]:
        """How a child process opens the same store: open_store(Path(a[0]), a[1], a[2])."""
        return [str(self.folder / "state.json"), self.endpoints, self.prefix]


@pytest.fixture(params=["file", "etcd"])
def backend(request: pytest.FixtureRequest, tmp_path: Path):
    endpoints = ""
    if request.param == "etcd":
        endpoints = request.getfixturevalue("etcd_cluster").endpoints
    b = Backend(request.param, tmp_path, endpoints)
    yield b
    for store in b.opened:
        store.close()
    if endpoints:  # the cluster is the run's: leave no key (a test reads every key there is)
        import etcd3gw
        port = int(endpoints.split(",")[0].rsplit(":", 1)[1])
        etcd3gw.client(port=port).delete_prefix(b.prefix)
