"""Models as a dimension (issue #22), the pure parts: upstream keys, which model goes, which
requests are unloads, and how a session's model shows (flow comment, status, metrics)."""

from __future__ import annotations

import json

from slotkeeper.launcher import status
from slotkeeper.manage.scrape import session_models
from slotkeeper.observe.contentview import flow_comment
from slotkeeper.store.state import SlotRecord, StateDoc
from slotkeeper.upstream.models import (
    KEY_MARK,
    model_key,
    model_of_body,
    pick_victims,
    split_key,
    unload_targets,
)

BASE = "http://127.0.0.1:8080"


def test_keys_round_trip_hostile_names() -> None:
    for name in ("model-a", "org/model:q4", "a#model=b", "../x", "ü b"):
        key = model_key(BASE, name)
        assert key.count(KEY_MARK) == 1 and "/" not in key.partition(KEY_MARK)[2]
        assert split_key(key) == (BASE, name)
    assert split_key(BASE) == (BASE, "")  # a plain server's key is its URL
    assert model_of_body({"model": "m"}) == "m"
    assert model_of_body({"model": 3}) == model_of_body(None) == ""


def test_the_model_that_goes_is_the_router_s_choice() -> None:
    last = {"a": 10.0, "b": 5.0, "c": 7.0}
    # Idle before busy, then the oldest last POST; the wanted model never goes.
    assert pick_victims(["a", "b", "c"], "d", last, {}, 1) == ["b"]
    assert pick_victims(["a", "b", "c"], "d", last, {"b": 1}, 1) == ["c"]
    assert pick_victims(["a", "b", "c"], "d", last, {}, 2) == ["b", "c"]
    assert pick_victims(["a", "x"], "d", last, {}, 1) == ["x"]  # never used here: oldest
    assert pick_victims(["a"], "a", last, {}, 1) == []


def test_unloads_passing_through() -> None:
    assert unload_targets("POST", "/models/unload", b'{"model": "m"}') == ["m"]
    assert unload_targets("POST", "/models/unload", b"not json") is None
    assert unload_targets("POST", "/models/unload", b"{}") is None
    assert unload_targets("POST", "/api/models/unload/org%2Fm", b"") == ["org/m"]
    assert unload_targets("GET", "/unload", None) == []  # llama-swap: every model
    assert unload_targets("GET", "/models/unload", None) is None
    assert unload_targets("POST", "/v1/chat/completions", b'{"model": "m"}') is None


def test_the_model_shows_in_the_comment_status_and_metrics() -> None:
    comment = flow_comment({"session": "s1", "slot": 0, "action": "restored",
                            "model": "model-a", "swap_saved": "model-b: 1 session(s)"})
    assert comment == "s1 #0 restored [model-a] · swap-saved model-b: 1 session(s)"
    assert flow_comment({"session": "s1", "slot": 0, "action": "kept"}) == "s1 #0 kept"

    key = model_key(BASE, "model-a")
    current = {"upstreams": {key: {"model": "model-a", "slots": {"0": {
        "session": "s1", "resident": True, "tokens": 900, "saved_tokens": 900,
        "last_used": 0.0, "claimed": 0.0, "file": None}}}}}
    ups = status.merge(current, check_upstreams=False)
    assert ups[0]["url"] == BASE and ups[0]["model"] == "model-a"
    report = status.Report(source="files", proxy="p", upstreams=ups, sessions=[{
        "id": "s1", "kind": "session", "tokens": 900, "bytes": 1, "last_used": 0.0,
        "created": 0.0, "resident": {"upstream": key, "slot": 0, "model": "model-a"}}])
    text = status.render(report)
    assert f"Upstream {BASE}, model model-a:" in text
    assert f"slot 0 of {BASE} (model-a)" in text
    json.dumps(report.to_json())

    doc = StateDoc()
    doc.upstream(key).slots[0] = SlotRecord(owner="s1", claimed=0, last_used=0)
    doc.upstream(BASE).slots[0] = SlotRecord(owner="plain", claimed=0, last_used=0)

    class FakeRouter:  # only what session_models reads
        class state:
            @staticmethod
            def read() -> StateDoc:
                return doc

    samples = [(s.labels, s.value) for s in session_models(FakeRouter()).samples]
    assert samples == [({"session": "s1", "model": "model-a", "resident": "true"}, 1)]
