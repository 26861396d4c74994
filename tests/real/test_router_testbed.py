"""The several-models test bed itself (issue #22), with real processes: llama-server in router
mode with the test model under two names, and the FAKE llama-swap whose models are real
llama-servers. Also the I/O clients of slotkeeper/upstream_models.py against both."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import requests
from fake_llama_swap import FakeLlamaSwap
from router_testbed import RouterServer
from testbed import chat, content_of, long_system_prompt

from slotkeeper.upstream.client import SlotsUnavailable, Upstream, UpstreamError
from slotkeeper.upstream.upstream_models import RouterClient, SwapClient

QUESTION = [{"role": "user", "content": "Name three colours."}]


def ask(url: str, model: str, **extra) -> dict:
    return chat(url, QUESTION, model=model, **extra)


# ---- router mode ---------------------------------------------------------------------------

def test_router_serves_two_names_and_keeps_one_loaded(make_router) -> None:
    router: RouterServer = make_router(models_max=1, np=2, ctx=4096)
    assert router.models() == {"model-a": "unloaded", "model-b": "unloaded"}
    first = ask(router.url, "model-a")
    assert router.loaded() == ["model-a"]
    second = ask(router.url, "model-b")
    assert router.loaded() == ["model-b"]  # --models-max 1: model-a was unloaded for it
    # One file under two names: the same weights answer the same at temperature 0.
    assert content_of(first) == content_of(second)
    assert second["timings"]["prompt_n"] > 0


def test_router_client_never_loads_to_read(make_router, tmp_path: Path) -> None:
    router: RouterServer = make_router(models_max=1, np=2, ctx=4096,
                                       slot_save_path=tmp_path / "slots")
    client = RouterClient(Upstream(router.url, timeout=5))
    view = client.view()
    assert view.max_instances == 1 and view.running == ()
    assert not view.load_would_unload("model-a")  # nothing to unload yet
    with pytest.raises(SlotsUnavailable):
        client.slots("model-a")
    with pytest.raises(UpstreamError):
        client.props("model-a")
    with pytest.raises(UpstreamError):
        client.save("model-a", 0, "never.bin")
    assert router.models()["model-a"] == "unloaded"  # none of those loaded it

    router.load("model-a")
    slots = client.slots("model-a")
    assert [s.id for s in slots] == [0, 1] and slots[0].n_ctx == 2048
    assert client.props("model-a")["total_slots"] == 2
    assert client.view().load_would_unload("model-b")

    ask(router.url, "model-a", id_slot=1)
    assert [s.n_tokens > 0 for s in client.slots("model-a")] == [False, True]
    saved = client.save("model-a", 1, "a.bin")
    assert saved["n_saved"] > 0 and (tmp_path / "slots" / "a.bin").is_file()
    assert client.erase("model-a", 1)["n_erased"] > 0
    assert client.restore("model-a", 1, "a.bin")["n_restored"] == saved["n_saved"]
    client.unload("model-a")
    router.wait_for("model-a", "unloaded")
    assert client.view().running == ()


# ---- the fake llama-swap -------------------------------------------------------------------

def test_fake_llama_swap_runs_one_model_at_a_time(make_fake_swap) -> None:
    swap: FakeLlamaSwap = make_fake_swap(np=2, ctx=4096)
    first = ask(swap.url, "model-a")
    assert swap.running() == {"model-a": "ready"}
    second = ask(swap.url, "model-b", stream=True)
    assert swap.running() == {"model-b": "ready"}
    assert swap.events == [("start", "model-a"), ("stop", "model-a"), ("start", "model-b")]
    assert second["content"] == content_of(first)  # streamed through it, with timings
    assert second["timings"]["prompt_n"] > 0
    listed = requests.get(swap.url + "/v1/models", timeout=10).json()["data"]
    assert {m["id"]: m["status"]["value"] for m in listed} == {"model-a": "unloaded",
                                                              "model-b": "loaded"}
    missing = requests.post(swap.url + "/v1/chat/completions", json={"messages": QUESTION},
                            timeout=10)
    assert missing.status_code == 400


def test_fake_llama_swap_upstream_paths(make_fake_swap, tmp_path: Path) -> None:
    swap: FakeLlamaSwap = make_fake_swap(np=2, ctx=4096, slot_save_path=tmp_path / "slots")
    client = SwapClient(Upstream(swap.url, timeout=30))
    with pytest.raises(SlotsUnavailable):
        client.slots("model-a")  # not running: read nothing, start nothing
    with pytest.raises(UpstreamError):
        client.save("model-a", 0, "never.bin")
    assert swap.events == []
    # ignorePaths: a .json path does not start a model
    assert requests.get(swap.url + "/upstream/model-a/x.json", timeout=10).status_code == 409
    # Any other /upstream path does, like llama-swap
    slots = requests.get(swap.url + "/upstream/model-a/slots", timeout=60).json()
    assert [s["id"] for s in slots] == [0, 1]
    assert [r.model for r in client.running()] == ["model-a"]
    ask(swap.url, "model-a", id_slot=1)
    assert [s.n_tokens > 0 for s in client.slots("model-a")] == [False, True]
    assert client.save("model-a", 1, "a.bin")["n_saved"] > 0
    client.unload("model-a")
    assert swap.running() == {} and swap.events[-1] == ("stop", "model-a")
    props = requests.get(swap.url + "/props", params={"model": "model-b"}, timeout=60).json()
    assert props["total_slots"] == 2 and swap.running() == {"model-b": "ready"}
    # The file saved by model-a's process restores into model-b's (same weights, one folder):
    # the fake, like llama-swap, does not know; slotkeeper must refuse it by fingerprint.
    assert client.restore("model-b", 1, "a.bin")["n_restored"] > 0


def test_fake_llama_swap_waits_for_the_request_in_flight(make_fake_swap) -> None:
    swap: FakeLlamaSwap = make_fake_swap(np=1, ctx=4096)
    ask(swap.url, "model-a")
    long_one: dict = {}
    system = [{"role": "system", "content": long_system_prompt(words=400)}]

    def long_request() -> None:
        long_one.update(chat(swap.url, system + QUESTION, model="model-a", n_predict=64,
                             stream=True, ignore_eos=True))

    thread = threading.Thread(target=long_request)
    thread.start()
    while not any(s.get("is_processing") for s in requests.get(
            swap.url + "/upstream/model-a/slots", timeout=10).json()):
        assert thread.is_alive()
    ask(swap.url, "model-b")  # waits until model-a's stream is done, then swaps
    thread.join(60)
    assert long_one["timings"]["predicted_n"] == 64  # not cut by the swap
    assert swap.events[-2:] == [("stop", "model-a"), ("start", "model-b")]
