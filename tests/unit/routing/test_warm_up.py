"""A fresh proxy verifies its server at start (Router.warm_up), off every request's path: the
first request found no server verified and read /props, the model file's digest and /slots
itself (0.2-0.3 s measured, docs/DESIGN.md, "Verified at start"). Real llama-server."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from slotkeeper.identity.identity import Identity
from slotkeeper.routing.router import Router
from slotkeeper.routing.routes import RouterConfig
from slotkeeper.store.locks import SlotLocks
from slotkeeper.store.state import StateFile


def make_router(tmp_path: Path) -> Router:
    return Router(RouterConfig(lock_timeout=1.0), StateFile(tmp_path / "state.json"),
                  SlotLocks(tmp_path / "locks"), None)


def ident(session: str) -> Identity:
    return Identity(session_id=session, rule="header x-session-id", parent_id=None,
                    prompt_chars=5000, message_count=1, seed_key=None, system_chars=0)


def count_props(router: Router, url: str, delay: float = 0.0) -> list[float]:
    """The times /props was read through the server's client (each read waits `delay`)."""
    client = router.upstreams.get(url).client
    reads: list[float] = []
    props = client.props

    def counted():
        reads.append(time.monotonic())
        time.sleep(delay)
        return props()

    client.props = counted  # type: ignore[method-assign]
    return reads


def test_warm_up_verifies_the_server_and_the_first_request_does_not_again(llama, tmp_path):
    router = make_router(tmp_path)
    reads = count_props(router, llama.url)
    router.warm_up([llama.url])
    info = router.upstreams.peek(llama.url)
    assert info is not None and info.checked and not info.suspect
    fingerprint = router.state.read().upstreams[llama.url].fingerprint
    assert fingerprint and fingerprint == info.props.fingerprint
    route = router.route(llama.url, ident("warm-first"))
    router.finish(route, None)
    assert route.action == "assigned", route
    assert len(reads) == 1, reads


def test_a_request_during_the_start_up_verification_waits_for_it(llama, tmp_path):
    router = make_router(tmp_path)
    reads = count_props(router, llama.url, delay=0.5)
    warming = threading.Thread(target=router.warm_up, args=([llama.url],))
    warming.start()
    deadline = time.monotonic() + 10
    while not reads and time.monotonic() < deadline:
        time.sleep(0.01)
    route = router.route(llama.url, ident("warm-during"))  # while /props is being read
    router.finish(route, None)
    warming.join()
    assert route.action == "assigned", route
    assert len(reads) == 1, reads  # one verification, not one each


def test_warm_up_leaves_a_server_that_is_not_up_to_the_first_request(tmp_path):
    router = make_router(tmp_path)
    router.warm_up(["http://127.0.0.1:9"])  # nothing listens on the discard port
    assert router.upstreams.peek("http://127.0.0.1:9") is None
    assert not router.state.read().upstreams
