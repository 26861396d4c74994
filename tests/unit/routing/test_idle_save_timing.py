"""An idle save is for a session that stayed away (Router.when_idle): its timer fires an idle
period after the session's request ended, and when the session is back with a request
running by then, nothing is saved. A save decided then ran right after that request, on the
server's main loop, and held up the next session's turn for its whole length (six-agents at
the bench's cap: two turns kept on their slots waited 1.9-2.1 s for their first token).
Real llama-server."""

from __future__ import annotations

import time
from pathlib import Path

from slotkeeper.identity.identity import Identity
from slotkeeper.routing.router import Router
from slotkeeper.routing.routes import RouterConfig
from slotkeeper.snapshots.slotfiles import SlotFolder
from slotkeeper.store.locks import SlotLocks
from slotkeeper.store.state import StateFile


def ident(session: str) -> Identity:
    return Identity(session_id=session, rule="header x-session-id", parent_id=None,
                    prompt_chars=5000, message_count=1, seed_key=None, system_chars=0)


def test_no_idle_save_while_the_session_is_back(llama, tmp_path: Path):
    saves: list[str] = []
    router = Router(RouterConfig(lock_timeout=5.0), StateFile(tmp_path / "state.json"),
                    SlotLocks(tmp_path / "locks"), SlotFolder(llama.slot_save_path))
    router.accounting.save_if_idle = (  # type: ignore[method-assign]
        lambda url, session, ended: saves.append(session) or True)
    ended = time.time() - 10
    back = router.route(llama.url, ident("returning"))  # its next request, running
    try:
        assert router.when_idle(llama.url, "returning", ended) is False
        assert saves == []
    finally:
        router.finish(back, None)
    router.when_idle(llama.url, "returning", ended)  # away again: asked
    assert saves == ["returning"]
