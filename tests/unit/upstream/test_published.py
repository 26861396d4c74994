"""A session whose slot sat idle when a request of ours was last sent to its server is in that
server's RAM cache (llama-server copies idle slots there as each task starts, issue #31)."""

from __future__ import annotations

from slotkeeper.store.memories import Seen
from slotkeeper.upstream.client import Upstream
from slotkeeper.upstream.registry import UpstreamInfo


def test_published_only_when_a_request_was_sent_after_its_last_answer_ended():
    info = UpstreamInfo(Upstream("http://127.0.0.1:9"))
    assert not info.published("a")  # never seen
    info.last_seen["a"] = Seen(100.0, 800, 3)
    assert not info.published("a")  # nothing sent since
    info.launched_at = 99.0
    assert not info.published("a")  # sent while a's request still ran
    info.launched_at = 101.0
    assert info.published("a")
