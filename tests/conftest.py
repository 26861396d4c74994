"""Fixtures for the real-process tests. A missing llama-server binary or model makes those
tests fail (never skip): CI must not count a skipped integration test as a pass."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from fake_llama_swap import FakeLlamaSwap, llama_factory
from router_testbed import MODEL_NAMES, RouterServer
from testbed import LlamaServer, Proxy, llama_server_binary, model_file

# Tests using any of these need the real binary and model: they get the `real` marker, so
# `-m "not real"` runs the fast tests alone.
REAL_FIXTURES = {"llama_bin", "bed_llama_bin", "model_path", "llama", "make_llama",
                 "make_proxy"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if REAL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real)


def _required(path: Path, what: str) -> Path:
    if not path.is_file():
        pytest.fail(f"{what} not found at {path}: run scripts/test (it builds and fetches both) "
                    f"or set SLOTKEEPER_LLAMA_SERVER / SLOTKEEPER_MODEL", pytrace=False)
    return path


@pytest.fixture(scope="session")
def llama_bin() -> Path:
    return _required(llama_server_binary(), "llama-server")


@pytest.fixture(scope="session")
def bed_llama_bin() -> Path:
    """The benchmarks' build of llama-server (scripts/build-llama-server --bed, which
    scripts/test runs): upstream's source with scripts/bed/*.patch."""
    path = Path(os.environ.get("SLOTKEEPER_BED_LLAMA_SERVER") or "/nonexistent")
    if not path.is_file():
        pytest.fail(f"the bed's llama-server not found at {path}: run scripts/test (it builds "
                    f"it) or set SLOTKEEPER_BED_LLAMA_SERVER", pytrace=False)
    return path


@pytest.fixture(scope="session")
def model_path() -> Path:
    return _required(model_file(), "the model")


@pytest.fixture(scope="session")
def llama(llama_bin: Path, model_path: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    """One llama-server (-np 4, 4096 tokens per slot, slot files under tmp) for the whole run:
    starting one takes about a second, but tests that kill or restart it must use make_llama."""
    workdir = tmp_path_factory.mktemp("llama")
    server = LlamaServer(workdir, slot_save_path=workdir / "slots", binary=llama_bin,
                         model=model_path).start()
    yield server
    server.stop()


@pytest.fixture
def make_llama(llama_bin: Path, model_path: Path,
               tmp_path: Path) -> Iterator[Callable[..., LlamaServer]]:
    """make_llama(**LlamaServer kwargs) -> a started server of this test, stopped at its end."""
    yield from _started_servers(LlamaServer, tmp_path / "llama", llama_bin, model_path)


@pytest.fixture
def make_proxy(tmp_path: Path) -> Iterator[Callable[..., Proxy]]:
    """make_proxy(upstream, *, script=None, port=None, host=None, **options) -> a started
    mitmdump with the addon in front of `upstream` (a URL or a LlamaServer), each option as
    `--set`; stopped at the end of the test. Each proxy has its own folder, so its own state
    file. `host`: a netns.Host to run it on (its namespace and address)."""
    proxies: list[Proxy] = []

    def make(upstream: str | LlamaServer, *, script: Path | None = None,
             port: int | None = None, host: Any = None, **options: Any) -> Proxy:
        url = upstream.url if isinstance(upstream, LlamaServer) else upstream
        where = {"netns": host.netns, "host": host.address} if host is not None else {}
        proxy = Proxy(url, tmp_path / f"proxy{len(proxies)}", options=options, script=script,
                      port=port, **where)
        proxies.append(proxy)
        return proxy.start()

    yield make
    for proxy in proxies:
        proxy.stop()


# ---- several models (issue #22): a router, and a fake llama-swap of real llama-servers ----

@pytest.fixture
def make_router(llama_bin: Path, model_path: Path,
                tmp_path: Path) -> Iterator[Callable[..., RouterServer]]:
    """make_router(**RouterServer kwargs) -> a started llama-server in router mode with the
    test model under MODEL_NAMES (default --models-max 1), stopped at the end of the test."""
    yield from _started_servers(RouterServer, tmp_path / "router", llama_bin, model_path)


@pytest.fixture
def make_fake_swap(llama_bin: Path, model_path: Path,
                   tmp_path: Path) -> Iterator[Callable[..., FakeLlamaSwap]]:
    """make_fake_swap(names=MODEL_NAMES, **LlamaServer kwargs) -> a started FAKE llama-swap
    whose models are real llama-servers (test model) made with those kwargs, one at a time;
    stopped with its servers at the end of the test."""
    swaps: list[FakeLlamaSwap] = []

    def make(names: Sequence[str] = MODEL_NAMES, **kwargs: Any) -> FakeLlamaSwap:
        kwargs.setdefault("binary", llama_bin)
        kwargs.setdefault("model", model_path)
        folder = tmp_path / f"swap{len(swaps)}"
        swap = FakeLlamaSwap({name: llama_factory(folder / name, **kwargs) for name in names})
        swaps.append(swap)
        return swap.start()

    yield make
    for swap in swaps:
        swap.stop()


def _started_servers(kind: Any, folder: Path, llama_bin: Path,
                     model_path: Path) -> Iterator[Callable[..., Any]]:
    """A factory fixture's body: make(**kwargs) starts a `kind` server (llama-server, or one
    in router mode) with the test binary and model in `folder`N; all are stopped at the end."""
    servers: list[Any] = []

    def make(**kwargs: Any) -> Any:
        kwargs.setdefault("binary", llama_bin)
        kwargs.setdefault("model", model_path)
        server = kind(folder.with_name(f"{folder.name}{len(servers)}"), **kwargs)
        servers.append(server)
        return server.start()

    yield make
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def etcd_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real 3-member etcd cluster on loopback for the whole run (issue #33). A missing etcd
    binary fails the test (never skips), as a missing llama-server does. Tests that kill
    members must use make_etcd."""
    yield from _etcd(tmp_path_factory.mktemp("etcd"), 3)


@pytest.fixture
def proxy_hosts() -> Iterator[Callable[..., Any]]:
    """proxy_hosts(count) -> netns.Hosts: hosts for proxies, each in a network namespace of its
    own where the machine allows it, else on loopback ports (its describe() says which);
    whatever was made is removed at the end of the test, pass or fail."""
    from netns import Hosts
    made: list = []

    def make(count: int) -> Any:
        hosts = Hosts(count)
        made.append(hosts)
        print(hosts.describe())
        if not hosts.isolated:  # in the run's summary too, not only in captured output
            warnings.warn(hosts.describe(), stacklevel=2)
        return hosts

    yield make
    for hosts in made:
        hosts.close()


@pytest.fixture
def make_etcd(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """make_etcd(size=3, also_on="") -> a started cluster of this test, stopped at its end
    (`also_on`: an address served besides loopback, EtcdCluster's)."""
    clusters: list = []

    def make(size: int = 3, also_on: str = "") -> Any:
        cluster = _etcd_cluster(tmp_path / f"etcd{len(clusters)}", size, also_on)
        clusters.append(cluster)
        return cluster.start()

    yield make
    for cluster in clusters:
        cluster.stop()


def _etcd_cluster(folder: Path, size: int, also_on: str = "") -> Any:
    from etcd_cluster import EtcdCluster
    try:
        return EtcdCluster(folder, size, also_on=also_on)
    except FileNotFoundError as e:
        pytest.fail(str(e), pytrace=False)


def _etcd(folder: Path, size: int) -> Iterator[Any]:
    cluster = _etcd_cluster(folder, size)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
