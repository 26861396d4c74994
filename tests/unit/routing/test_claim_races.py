"""A request that loses the race for a slot's claim tries again until the lock timeout is
spent (walk.Walk._session). A claim is refused when the slot's owner used it while we waited
for its lease; with more busy sessions than slots that is every other try, and a fixed five
tries ran out in ~6 s in CI (4 sessions on 2 slots through 3 proxies): the request went out
without its lease, over another session's KV. Real llama-server; the refusals stand in for
other sessions' turns (a patched `claim`, named as such: their timing cannot be forced)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from slotkeeper.identity.identity import Identity
from slotkeeper.routing import walk
from slotkeeper.routing.router import Router
from slotkeeper.routing.routes import RouterConfig
from slotkeeper.store.locks import SlotLocks
from slotkeeper.store.state import StateFile


def make_router(tmp_path: Path, lock_timeout: float) -> Router:
    return Router(RouterConfig(lock_timeout=lock_timeout), StateFile(tmp_path / "state.json"),
                  SlotLocks(tmp_path / "locks"), None)


def ident(session: str) -> Identity:
    return Identity(session_id=session, rule="header x-session-id", parent_id=None,
                    prompt_chars=5000, message_count=1, seed_key=None, system_chars=0)


def refused_first(monkeypatch: pytest.MonkeyPatch, times: int | None) -> list[float]:
    """`claim` refuses its first `times` calls (None: every call), as when another session
    used the slot meanwhile; returns the times it was called."""
    calls: list[float] = []
    real = walk.claim

    def racing(*args, **kwargs):
        calls.append(time.monotonic())
        if times is None or len(calls) <= times:
            time.sleep(0.02)  # the other session's turn
            return None
        return real(*args, **kwargs)

    monkeypatch.setattr(walk, "claim", racing)
    return calls


def test_a_request_that_keeps_losing_the_claim_race_still_gets_a_slot(llama, tmp_path,
                                                                       monkeypatch):
    router = make_router(tmp_path, lock_timeout=30)
    calls = refused_first(monkeypatch, times=12)
    route = router.route(llama.url, ident("patient"))
    router.finish(route, None)
    assert route.action == "assigned", route
    assert len(calls) == 13, len(calls)


def test_the_retries_end_with_the_lock_timeout(llama, tmp_path, monkeypatch):
    router = make_router(tmp_path, lock_timeout=0.5)
    calls = refused_first(monkeypatch, times=None)
    started = time.monotonic()
    route = router.route(llama.url, ident("never"))
    took = time.monotonic() - started
    router.finish(route, None)
    assert route.action == "fallback", route
    assert "no slot could be locked in time" in route.detail, route.detail
    assert len(calls) > 5 and took < 5, (len(calls), took)
