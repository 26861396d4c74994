"""Parsing the router's and llama-swap's answers (issue #22), on the shapes measured with
llama-server b11434 in router mode (scripts/measure-router) and read from llama-swap's source."""

from __future__ import annotations

import pytest

from slotkeeper.decisions.choice import SlotView
from slotkeeper.upstream.client import SlotsUnavailable, UpstreamError
from slotkeeper.upstream.upstream_models import (
    ModelEntry,
    RouterView,
    SwapRunning,
    model_query,
    parse_models,
    parse_router_props,
    parse_running,
    parse_slots,
)

# GET /models of b11434 with --models-dir (two symlinks), model-a loaded (trimmed: the real
# entries also carry "args", "architecture", "created", and a loaded one the child's info).
MODELS = {"object": "list", "data": [
    {"id": "model-a", "aliases": [], "tags": [], "object": "model", "owned_by": "llamacpp",
     "status": {"value": "loaded", "args": ["llama-server", "--port", "41000"]},
     "source": "models_dir", "can_remove": False},
    {"id": "model-b", "aliases": ["b"], "tags": [], "object": "model", "owned_by": "llamacpp",
     "status": {"value": "unloaded", "args": []}, "source": "models_dir"},
    {"id": "model-c", "aliases": [], "object": "model",
     "status": {"value": "unloaded", "exit_code": 1, "failed": True}},
]}
ROUTER_PROPS = {"role": "router", "max_instances": 1, "models_autoload": True,
                "model_alias": "llama-server", "model_path": "none",
                "default_generation_settings": {"params": {}, "n_ctx": 0},
                "build_info": "b0-unknown"}


def test_models_are_parsed_with_status_aliases_and_failure() -> None:
    models = parse_models(MODELS)
    assert models == (ModelEntry("model-a", "loaded"),
                      ModelEntry("model-b", "unloaded", aliases=("b",)),
                      ModelEntry("model-c", "unloaded", failed=True))
    assert [m.loaded for m in models] == [True, False, False]


@pytest.mark.parametrize("status, running", [
    ("loaded", True), ("loading", True), ("sleeping", True), ("unloaded", False),
    ("downloading", False)])
def test_running_counts_what_holds_a_place_under_models_max(status: str, running: bool) -> None:
    assert ModelEntry("m", status).running is running


def test_models_entries_without_id_or_status_are_tolerated() -> None:
    data = {"data": [{"id": ""}, "x", {"id": "m"}, {"id": "n", "status": "loaded"}]}
    assert parse_models(data) == (ModelEntry("m", "unknown"), ModelEntry("n", "unknown"))


@pytest.mark.parametrize("data", [None, [], {"data": {}}, {"object": "list"}])
def test_models_not_a_list_raises(data: object) -> None:
    with pytest.raises(UpstreamError):
        parse_models(data)


def test_router_props_give_the_limit() -> None:
    props = parse_router_props(ROUTER_PROPS)
    assert props is not None
    assert (props.max_instances, props.autoload, props.build_info) == (1, True, "b0-unknown")


def test_props_of_a_single_model_server_are_not_a_router() -> None:
    assert parse_router_props({"total_slots": 4, "model_path": "/m.gguf"}) is None
    assert parse_router_props([]) is None


def test_router_props_with_odd_types_fall_back() -> None:
    props = parse_router_props({"role": "router", "max_instances": "2",
                                "models_autoload": "yes"})
    assert props is not None and (props.max_instances, props.autoload) == (0, True)


def test_view_says_when_a_load_unloads_another() -> None:
    view = RouterView(parse_models(MODELS), max_instances=1)
    assert view.running == ("model-a",)
    assert view.load_would_unload("model-b")
    assert view.load_would_unload("b")  # an alias
    assert not view.load_would_unload("model-a")  # already running
    assert not view.load_would_unload("nope")  # unknown: the router refuses it
    assert not RouterView(view.models, max_instances=2).load_would_unload("model-b")
    assert not RouterView(view.models, max_instances=0).load_would_unload("model-b")


def test_slots_parse_like_the_single_server_ones() -> None:
    data = [{"id": 0, "n_ctx": 4096, "is_processing": False, "n_prompt_tokens": 321},
            {"id": 1, "n_ctx": 4096, "speculative": False, "is_processing": True}]
    assert parse_slots(data) == [SlotView(0, False, 321, 4096), SlotView(1, True, 0, 4096)]


@pytest.mark.parametrize("data", [{"error": {"code": 400}}, [{"id": "0"}], ["x"]])
def test_slots_malformed_raise_slots_unavailable(data: object) -> None:
    with pytest.raises(SlotsUnavailable):
        parse_slots(data)


def test_llama_swap_running() -> None:
    data = {"running": [{"model": "a", "state": "ready", "cmd": "x", "proxy": "y", "ttl": 0},
                        {"model": "b", "state": "starting"}, {"state": "ready"}]}
    running = parse_running(data)
    assert running == (SwapRunning("a", "ready"), SwapRunning("b", "starting"))
    assert [r.ready for r in running] == [True, False]
    with pytest.raises(UpstreamError):
        parse_running({"data": []})


def test_model_query_escapes_the_name() -> None:
    assert model_query("model-a", autoload="false") == "?model=model-a&autoload=false"
    assert model_query("org/m:q4 x&y") == "?model=org%2Fm%3Aq4%20x%26y"
