"""A session whose slot sat idle when a request of ours was last sent to its server is in that
server's RAM cache (llama-server copies idle slots there as each task starts, issue #31)."""

from __future__ import annotations

from slotkeeper.store.memories import Seen
from slotkeeper.upstream.client import Upstream
from slotkeeper.upstream.registry import UpstreamInfo


def test_published_only_when_a_request_sent_after_its_last_answer_ended_was_launched():
    info = UpstreamInfo(Upstream("http://127.0.0.1:9"))
    assert not info.published("a")  # never seen
    info.last_seen["a"] = Seen(100.0, 800, 3)
    assert not info.published("a")  # nothing sent since
    info.launched(99.0)
    assert not info.published("a")  # sent while a's request still ran
    info.sent_at = 101.0
    assert not info.published("a")  # sent, but the server may have deferred it: no answer yet
    info.launched(101.0)
    assert info.published("a")
    info.launched(100.5)  # an earlier request's answer beginning later changes nothing
    assert info.published("a")


def test_quiet_counts_what_was_sent_not_only_what_began():
    info = UpstreamInfo(Upstream("http://127.0.0.1:9"))
    info.sent_at = 100.0
    assert not info.quiet_for(2.0, now=101.0)  # a request in flight, no answer yet
    assert info.quiet_for(2.0, now=102.5)
