"""A /slots read that fails while one of our own slot calls runs (llama-server answers /slots
from the main loop a save or restore holds) gives the last view read, not the hash fallback;
with no slot call of ours in flight the failure stands (issue #31)."""

from __future__ import annotations

import pytest

from slotkeeper.upstream.client import SlotsUnavailable, Upstream, UpstreamError

SLOTS = [{"id": 0, "is_processing": False, "n_prompt_tokens": 812, "n_ctx": 4096},
         {"id": 1, "is_processing": True, "n_prompt_tokens": 40, "n_ctx": 4096}]


class FlakySlots:
    """FAKE /slots: answers until told to time out."""

    def __init__(self) -> None:
        self.fail = False

    def __call__(self, path: str):
        assert path == "/slots"
        if self.fail:
            raise UpstreamError("GET /slots: ReadTimeout")
        return SLOTS


@pytest.fixture
def client(monkeypatch):
    upstream = Upstream("http://127.0.0.1:9")
    fake = FlakySlots()
    monkeypatch.setattr(upstream, "_get", fake)
    return upstream, fake


def test_a_timeout_during_our_save_gives_the_last_view(client):
    upstream, fake = client
    first = upstream.slots()
    fake.fail = True
    with upstream.calls.running():
        assert upstream.slots() == first
        assert [v.n_tokens for v in upstream.slots()] == [812, 40]


def test_a_timeout_with_no_slot_call_of_ours_is_a_failure(client):
    upstream, fake = client
    upstream.slots()
    fake.fail = True
    with pytest.raises(SlotsUnavailable):
        upstream.slots()
    with upstream.calls.running(slot_call=False), pytest.raises(SlotsUnavailable):
        upstream.slots()  # a prefill or a template read is not a slot call


def test_nothing_read_yet_is_a_failure_even_during_a_save(client):
    upstream, fake = client
    fake.fail = True
    with upstream.calls.running(), pytest.raises(SlotsUnavailable):
        upstream.slots()


def test_the_count_goes_back_down_when_the_call_raises(client):
    upstream, fake = client
    upstream.slots()
    with pytest.raises(RuntimeError), upstream.calls.running():
        raise RuntimeError("save failed")
    fake.fail = True
    with pytest.raises(SlotsUnavailable):
        upstream.slots()
