"""A fresh proxy verifies its server at start (Router.warm_up), off every request's path: the
first request found no server verified and read /props, the model file's digest and /slots
itself (0.2-0.3 s measured, docs/DESIGN.md, "Verified at start"). Real llama-server."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import requests
from slotkeeper.identity.identity import Identity
from slotkeeper.routing.router import Router
from slotkeeper.routing.routes import Route, RouterConfig
from slotkeeper.store.locks import SlotLocks
from slotkeeper.store.state import SlotRecord, StateDoc, StateFile


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
    assert router.warm_up([llama.url]) == [llama.url]  # the addon's `ready:` line names it
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
    # nothing listens on the discard port
    assert router.warm_up(["http://127.0.0.1:9"]) == []
    assert router.upstreams.peek("http://127.0.0.1:9") is None
    assert not router.state.read().upstreams


def test_no_request_keeps_a_slot_before_the_verification_has_marked_it_lost(llama, tmp_path):
    """A restarted server's slot is empty while the state file still says a session owns it.
    The verification marks that claim stale; until it has, the server must still count as
    suspect, or a request arriving in between takes the fast path and is "kept" on an empty
    slot (seen in CI: a proxy and its server both restarted, the first turn kept with
    cache_n=0 while the start-up verification was between its /slots read and its write)."""
    slot = 3
    requests.post(f"{llama.url}/slots/{slot}?action=erase", timeout=10).raise_for_status()
    router = make_router(tmp_path)
    now = time.time()

    def claim(doc: StateDoc) -> None:
        doc.upstream(llama.url).slots[slot] = SlotRecord(
            owner="returning", claimed=now, last_used=now, tokens=500)

    router.state.update(claim)
    routes_meanwhile: list[Route | None] = []
    update = router.state.update

    def update_after_a_request(change):
        routes_meanwhile.append(router.try_keep(llama.url, ident("returning")))
        return update(change)

    router.state.update = update_after_a_request  # type: ignore[method-assign]
    router.warm_up([llama.url])
    for route in routes_meanwhile:
        if route is not None:
            route.release()
    assert routes_meanwhile and all(r is None for r in routes_meanwhile), routes_meanwhile
    assert router.state.read().upstreams[llama.url].slots[slot].stale
    assert router.try_keep(llama.url, ident("returning")) is None
