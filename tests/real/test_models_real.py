"""Sessions survive model swaps (issue #22), against a real llama-server in router mode (the
test model under two names, --models-max 1, -np 2, one shared --slot-save-path) and a real
mitmdump: the session of the model that goes is saved before the swap and restored when its
model comes back. The same conversation straight to the router re-prefills from scratch."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import requests
from router_testbed import RouterServer
from testbed import BED, chat, long_system_prompt

TIMEOUT_S = 900
RECORDING_ADDON = BED / "recording_addon.py"
SLOTKEEPER = Path(sys.executable).parent / "slotkeeper"
OPTIONS = {"slotkeeper_small_request_chars": 0, "slotkeeper_idle_save_seconds": 0}


def turn(url: str, session: str, model: str, messages: list[dict], **extra: Any) -> dict:
    return chat(url, messages, {"x-session-id": session}, model=model, **extra)


def messages_turn(url: str, session: str, model: str, system: str,
                  messages: list[dict]) -> requests.Response:
    """An Anthropic `/v1/messages` turn (what Claude Code sends)."""
    r = requests.post(url + "/v1/messages", json={
        "model": model, "system": system, "messages": messages, "max_tokens": 8,
        "temperature": 0}, headers={"x-claude-code-session-id": session}, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text[:2000]
    return r


def plain_turn(url: str, session: str, model: str, messages: list[dict]) -> requests.Response:
    r = requests.post(url + "/v1/chat/completions", json={
        "model": model, "messages": messages, "max_tokens": 8, "temperature": 0},
        headers={"x-session-id": session}, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text[:2000]
    return r


def reused_share(timings: dict) -> float:
    return timings["cache_n"] / (timings["cache_n"] + timings["prompt_n"])


def conversation(seed: int) -> list[list[dict]]:
    """Three turns of one conversation: each prompt extends the previous one."""
    system = {"role": "system", "content": long_system_prompt(500, seed=seed)}
    first = [system, {"role": "user", "content": "List the rules in order."}]
    second = first + [{"role": "assistant", "content": "First, read the files."},
                      {"role": "user", "content": "And after that?"}]
    third = second + [{"role": "assistant", "content": "Keep the changes small."},
                      {"role": "user", "content": "What comes last?"}]
    return [first, second, third]


def run_two_models(url: str, seed: int) -> dict[str, Any]:
    """Session A on model-a: 2 turns (the 2nd streamed); session B on model-b: 2 turns (the
    1st through /v1/messages); A's 3rd turn. Returns A's 3rd answer."""
    a = conversation(seed)
    b = conversation(seed + 1)
    turn(url, f"a-{seed}", "model-a", a[0])
    streamed = turn(url, f"a-{seed}", "model-a", a[1], stream=True)
    assert streamed["timings"]["cache_n"] > 0  # the 2nd turn reused the 1st (streamed)
    messages_turn(url, f"b-{seed}", "model-b", b[0][0]["content"], b[0][1:])
    turn(url, f"b-{seed}", "model-b", b[1])
    return {"third": plain_turn(url, f"a-{seed}", "model-a", a[2])}


def recorded_flows(path: Path) -> list[dict[str, Any]]:
    """The flows tests/bed/recording_addon.py wrote, completion requests only, in order."""
    flows = [json.loads(line) for line in path.read_text().splitlines()]
    return [f for f in flows if f["path"] in ("/v1/chat/completions", "/v1/messages")]


def test_a_session_survives_its_model_being_swapped_out(make_router, make_proxy,
                                                        tmp_path: Path) -> None:
    slots = tmp_path / "slots"
    records = tmp_path / "flows.jsonl"
    router: RouterServer = make_router(models_max=1, np=2, ctx=8192, slot_save_path=slots)
    proxy = make_proxy(router, script=RECORDING_ADDON, flow_record_file=str(records),
                       slotkeeper_slot_dir=str(slots), **OPTIONS)

    through = run_two_models(proxy.url, seed=1)["third"]
    assert through.headers["X-Slotkeeper-Action"] == "restored", through.headers
    timings = through.json()["timings"]
    assert reused_share(timings) >= 0.9, timings
    assert router.loaded() == ["model-a"]

    # Visible: each session's model in /api/sessions and /slotkeeper/metrics; the swap-time saves.
    current = requests.get(proxy.url + "/api/sessions/current", timeout=30).json()
    models = {up.get("model"): {s["session"] for s in up["slots"].values()}
              for up in current["upstreams"].values()}
    assert "a-1" in models["model-a"] and "b-1" in models["model-b"], current
    saved = {s["id"]: s for s in requests.get(proxy.url + "/api/sessions",
                                              timeout=30).json()["sessions"]}
    assert saved["a-1"]["resident"]["model"] == "model-a", saved
    assert saved["b-1"]["resident"] is None  # saved, its model unloaded
    metrics = requests.get(proxy.url + "/slotkeeper/metrics", timeout=30).text
    swap_saves = {m: float(v) for m, v in re.findall(
        r'^slotkeeper_swap_saves_total\{model="([^"]+)"\} (\S+)$', metrics, re.M)}
    # model-a went for B (A saved), then model-b went for A's 3rd turn (B saved).
    assert swap_saves.get("model-a", 0) >= 1 and swap_saves.get("model-b", 0) >= 1, swap_saves
    assert re.search(r'^slotkeeper_session_model\{model="model-a",resident="true",'
                     r'session="a-1"\} 1\.0$', metrics, re.M), metrics

    # mitmweb's comment: the flow that made a model go says whose sessions were saved first
    # (B's first turn, through /v1/messages, saved A; A's third saved B).
    flows = recorded_flows(records)
    assert [f["slotkeeper"]["session"] for f in flows] == ["a-1", "a-1", "b-1", "b-1", "a-1"]
    b_first, a_third = flows[2], flows[4]
    assert b_first["path"] == "/v1/messages"
    assert "[model-b]" in b_first["comment"], b_first["comment"]
    assert "swap-saved model-a" in b_first["comment"], b_first["comment"]
    assert "swap-saved model-b" in a_third["comment"], a_third["comment"]
    assert a_third["comment"].startswith("a-1 #"), a_third["comment"]
    assert a_third["slotkeeper"]["model"] == "model-a"

    # `slotkeeper status` names each upstream's model.
    env = {**os.environ, "HOME": str(tmp_path), "XDG_STATE_HOME": str(tmp_path / "state")}
    done = subprocess.run([str(SLOTKEEPER), "status", "--proxy", proxy.url], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert ", model model-a" in done.stdout, done.stdout

    # The same conversation (other words, so nothing of the run above is reused) straight
    # to the router: model-a's slots went with it, A's 3rd turn prefills everything again.
    direct = run_two_models(router.url, seed=3)["third"].json()["timings"]
    assert reused_share(direct) < 0.1, direct
    assert direct["prompt_n"] > 0.9 * (timings["cache_n"] + timings["prompt_n"])


def test_an_unload_through_the_proxy_saves_first(make_router, make_proxy,
                                                 tmp_path: Path) -> None:
    """`POST /models/unload` passing through: the model's sessions are saved before it goes,
    and its next turn restores them."""
    slots = tmp_path / "slots"
    router: RouterServer = make_router(models_max=1, np=2, ctx=8192, slot_save_path=slots)
    proxy = make_proxy(router, slotkeeper_slot_dir=str(slots), **OPTIONS)
    a = conversation(5)
    turn(proxy.url, "a-5", "model-a", a[0])
    turn(proxy.url, "a-5", "model-a", a[1])
    r = requests.post(proxy.url + "/models/unload", json={"model": "model-a"}, timeout=60)
    assert r.status_code == 200, r.text
    router.wait_for("model-a", "unloaded")
    meta = json.loads(next(slots.glob("*.json")).read_text())
    assert meta["n_tokens"] > 0, meta
    third = plain_turn(proxy.url, "a-5", "model-a", a[2])
    assert third.headers["X-Slotkeeper-Action"] == "restored", third.headers
    assert reused_share(third.json()["timings"]) >= 0.9, third.json()["timings"]


def test_a_session_survives_a_swap_behind_llama_swap(make_fake_swap, make_proxy,
                                                     tmp_path: Path) -> None:
    """The same behind the FAKE llama-swap (real llama-servers, one per model, one at a
    time; slots under /upstream/<model>/slots)."""
    slots = tmp_path / "slots"
    slots.mkdir()  # the fake starts its llama-servers (which make it) on demand
    swap = make_fake_swap(np=2, ctx=8192, slot_save_path=slots)
    proxy = make_proxy(swap.url, slotkeeper_slot_dir=str(slots), **OPTIONS)
    third = run_two_models(proxy.url, seed=7)["third"]
    assert third.headers["X-Slotkeeper-Action"] == "restored", third.headers
    assert reused_share(third.json()["timings"]) >= 0.9, third.json()["timings"]
    assert swap.running() == {"model-a": "ready"}
    # Each swap stopped the running model once, after slotkeeper saved its sessions.
    assert swap.events == [("start", "model-a"), ("stop", "model-a"), ("start", "model-b"),
                           ("stop", "model-b"), ("start", "model-a")], swap.events
