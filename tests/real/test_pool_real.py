"""Several real llama-servers behind one slotkeeper address (issue #13): stickiness, placement
under load, migration after SIGKILL, health out and back in, drain, two proxy processes sharing
the pool, and never one session on two servers. Each server: gemma-3-270m, -np 2 -c 4096
(2,048 tokens a slot), all with the same --slot-save-path. What the servers did is read from
their own answers (`timings`) and `GET /slots`, not from our headers alone."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import requests
from helpers import Conversation
from testbed import LlamaServer, long_system_prompt

from slotkeeper.launcher.status import gather, render
from slotkeeper.snapshots.paths import file_name_for

pytestmark = pytest.mark.pool

POOL_OPTIONS = {"slotkeeper_idle_save_seconds": 1, "slotkeeper_max_seeds": 0}


def start_pool(make_llama, tmp_path: Path, count: int = 2) -> tuple[list[LlamaServer], Path]:
    slot_dir = tmp_path / "slots"
    servers = [make_llama(np=2, ctx=4096, slot_save_path=slot_dir) for _ in range(count)]
    return servers, slot_dir


def pool_proxy(make_proxy, servers: list[LlamaServer], slot_dir: Path, **options):
    return make_proxy(servers[0], slotkeeper_upstreams=[s.url for s in servers],
                      slotkeeper_slot_dir=str(slot_dir), **{**POOL_OPTIONS, **options})


def server_of(turn) -> str:
    return turn.headers["X-Slotkeeper-Upstream"]


def claims(state_file: Path) -> dict[str, list[tuple[str, int]]]:
    """session -> [(upstream, slot)] from the state file every proxy process shares."""
    doc = json.loads(state_file.read_text())
    out: dict[str, list[tuple[str, int]]] = {}
    for url, up in doc["upstreams"].items():
        for slot, rec in up["slots"].items():
            out.setdefault(rec["owner"], []).append((url, int(slot)))
    return out


def live_slot(server: LlamaServer, slot: int) -> dict:
    return next(s for s in requests.get(server.url + "/slots", timeout=10).json()
                if s["id"] == slot)


def wait_saved(slot_dir: Path, conversation: Conversation, timeout: float = 30) -> int:
    """Wait until the session's snapshot holds its last turn (the idle save); its tokens."""
    want = conversation.turns[-1].prompt_tokens
    meta = (slot_dir / file_name_for(conversation.session)).with_suffix(".json")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            saved = json.loads(meta.read_text())["n_tokens"]
        except (OSError, ValueError, KeyError):
            saved = 0
        if saved >= want:
            return saved
        time.sleep(0.2)
    raise AssertionError(f"{conversation.session} not saved with {want} tokens in {timeout} s")


def pool_view(proxy) -> dict[str, dict]:
    r = requests.get(proxy.url + "/api/upstreams", timeout=10)
    assert r.status_code == 200, r.text
    return {m["url"]: m for m in r.json()["upstreams"]}


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.2)


def by_url(servers: list[LlamaServer], url: str) -> LlamaServer:
    return next(s for s in servers if s.url == url)


def test_sessions_stick_and_new_ones_avoid_a_loaded_server(make_llama, make_proxy, tmp_path):
    servers, slot_dir = start_pool(make_llama, tmp_path)
    proxy = pool_proxy(make_proxy, servers, slot_dir)
    a, b = servers
    first = Conversation("stick-1", long_system_prompt(350, seed=21))
    t1 = first.ask(proxy.url, "Name one prime number.")
    home = by_url(servers, server_of(t1))
    for question in ("And another one?", "And a third?"):
        t = first.ask(proxy.url, question)
        assert (server_of(t), t.action) == (home.url, "kept"), t
        # The server's own count: everything but the new message came from the slot's KV.
        assert t.cache_n >= 0.9 * first.turns[-2].prompt_tokens, t
        assert live_slot(home, int(t.slot))["n_prompt_tokens"] >= t.prompt_tokens - 1
    # Load the home server with two long generations sent to it directly (both its slots
    # busy); a new session must go to the idle one. The generations are streamed and cut
    # off once the new session was answered (llama-server stops a task whose client left).
    other = b if home is a else a
    body = {"messages": [{"role": "user", "content": "Count from one to a thousand."}],
            "max_tokens": 2000, "ignore_eos": True, "temperature": 0, "stream": True}
    stop = threading.Event()

    def generate() -> None:
        with requests.post(home.url + "/v1/chat/completions", json=body, stream=True,
                           timeout=600) as r:
            for _line in r.iter_lines():
                if stop.is_set():
                    break

    busy = [threading.Thread(target=generate) for _ in range(2)]
    for thread in busy:
        thread.start()
    wait_for(lambda: sum(s["is_processing"] for s in
                         requests.get(home.url + "/slots", timeout=10).json()) == 2,
             30, "both slots of the home server busy")
    newcomer = Conversation("stick-2", long_system_prompt(350, seed=22))
    t = newcomer.ask(proxy.url, "Name one prime number.")
    assert server_of(t) == other.url, t
    slot = live_slot(other, int(t.slot))
    assert slot["n_prompt_tokens"] >= t.prompt_tokens - 1, slot  # it ran there
    stop.set()
    for thread in busy:
        thread.join()
    # The state names one server per session.
    assert {s: len(c) for s, c in claims(proxy.state_file).items()} == {
        "stick-1": 1, "stick-2": 1}


def test_killed_server_costs_its_sessions_one_restore_and_comes_back(make_llama, make_proxy,
                                                                    tmp_path):
    servers, slot_dir = start_pool(make_llama, tmp_path)
    proxy = pool_proxy(make_proxy, servers, slot_dir)
    sessions = [Conversation(f"mig-{i}", long_system_prompt(350, seed=30 + i)) for i in range(2)]
    for c in sessions:
        c.ask(proxy.url, "Name one prime number.")
    for c in sessions:
        c.ask(proxy.url, "And another one?")
    victim = by_url(servers, server_of(sessions[0].turns[-1]))
    survivor = next(s for s in servers if s is not victim)
    on_victim = [c for c in sessions if server_of(c.turns[-1]) == victim.url]
    for c in on_victim:
        wait_saved(slot_dir, c)
    victim.kill()  # SIGKILL: no warning, no save
    # Health: taken out of the pool by the /health poll (every 0.5 s). A request sent in
    # between gets mitmproxy's 502, like the one in flight when the server died.
    wait_for(lambda: pool_view(proxy)[victim.url]["up"] is False, 5, "taken out of the pool")
    for c in on_victim:
        before = c.turns[-1].prompt_tokens
        t = c.ask(proxy.url, "After the crash: one more prime please?")
        assert (server_of(t), t.action) == (survivor.url, "restored"), t
        assert t.cache_n >= 0.9 * before, (c.session, t.cache_n, before)
        # The survivor's own view: the slot holds the whole conversation now.
        assert live_slot(survivor, int(t.slot))["n_prompt_tokens"] >= t.prompt_tokens - 1
    for session, held in claims(proxy.state_file).items():
        assert len(held) == 1, (session, held)
    # Health: the server comes back (same port) and is probed back into the pool.
    victim.start()
    wait_for(lambda: pool_view(proxy)[victim.url]["up"], 15, "back in the pool")
    # The survivor now holds every session (2 of its 2 slots): a new one goes to the server
    # that came back, where it displaces nobody.
    fresh = Conversation("mig-new", long_system_prompt(350, seed=39))
    t = fresh.ask(proxy.url, "Name one prime number.")
    assert server_of(t) == victim.url, t
    assert live_slot(by_url(servers, server_of(t)), int(t.slot))["n_prompt_tokens"] >= \
        t.prompt_tokens - 1


def test_drain_moves_sessions_out_and_takes_no_new_ones(make_llama, make_proxy, tmp_path):
    servers, slot_dir = start_pool(make_llama, tmp_path)
    proxy = pool_proxy(make_proxy, servers, slot_dir)
    c = Conversation("drain-1", long_system_prompt(350, seed=41))
    c.ask(proxy.url, "Name one prime number.")
    c.ask(proxy.url, "And another one?")
    home = by_url(servers, server_of(c.turns[-1]))
    other = next(s for s in servers if s is not home)
    r = requests.post(proxy.url + "/api/upstreams/drain", json={"upstream": home.url},
                      timeout=60)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["moved"] == [{"session": "drain-1",
                                "saved_tokens": answer["moved"][0]["saved_tokens"]}]
    assert answer["moved"][0]["saved_tokens"] >= c.turns[-1].prompt_tokens
    assert "drain-1" not in claims(proxy.state_file)  # no longer on the drained server
    before = c.turns[-1].prompt_tokens
    t = c.ask(proxy.url, "After the drain: one more prime please?")
    assert (server_of(t), t.action) == (other.url, "restored"), t
    assert t.cache_n >= 0.9 * before, (t.cache_n, before)
    newcomer = Conversation("drain-2", long_system_prompt(350, seed=42))
    assert server_of(newcomer.ask(proxy.url, "Name one prime number.")) == other.url
    # `slotkeeper status` shows every pool member, which one drains, and each session's server.
    report = gather(proxy.url, proxy.state_file, slot_dir)
    text = render(report)
    assert f"Upstream {home.url} (pool member, draining)" in text, text
    assert f"Upstream {other.url} (pool member)" in text, text
    on_other = next(up for up in report.upstreams if up["url"] == other.url)
    assert {s["session"] for s in on_other["slots"]} >= {"drain-1", "drain-2"}, on_other
    metrics = requests.get(proxy.url + "/slotkeeper/metrics", timeout=10).text
    assert f'slotkeeper_upstream_draining{{upstream="{home.url}"}} 1.0' in metrics
    assert (f'slotkeeper_session_upstream{{resident="true",session="drain-1",'
            f'upstream="{other.url}"}} 1.0') in metrics
    # Bad calls are clear errors.
    assert requests.post(proxy.url + "/api/upstreams/drain", json={"upstream": "http://x:1"},
                         timeout=10).status_code == 404
    assert requests.post(proxy.url + "/api/upstreams/drain", data="{", timeout=10,
                         headers={"Content-Type": "application/json"}).status_code == 400
    # Every server drained: a request gets a clear 503, not a traceback or a hang.
    r = requests.post(proxy.url + "/api/upstreams/drain", json={"upstream": other.url},
                      timeout=60)
    assert r.status_code == 200 and {m["session"] for m in r.json()["moved"]} == {
        "drain-1", "drain-2"}, r.text
    r = requests.post(proxy.url + "/v1/chat/completions", headers={"X-Session-Id": "drain-3"},
                      json={"messages": [{"role": "user", "content": "x" * 3000}],
                            "max_tokens": 4}, timeout=60)
    assert r.status_code == 503 and "down or draining" in r.text, (r.status_code, r.text)
    for server in servers:
        r = requests.post(proxy.url + "/api/upstreams/undrain", json={"upstream": server.url},
                          timeout=10)
        assert r.status_code == 200 and pool_view(proxy)[server.url]["draining"] is False


def two_proxies_and_a_shared_session(make_llama, make_proxy, tmp_path: Path):
    """Two proxy processes sharing one pool and one state file, and one session whose first
    turn went through the first proxy and second through the other."""
    servers, slot_dir = start_pool(make_llama, tmp_path)
    state = tmp_path / "shared-state.json"
    proxies = [pool_proxy(make_proxy, servers, slot_dir, slotkeeper_state_file=str(state))
               for _ in range(2)]
    c = Conversation("shared-1", long_system_prompt(350, seed=51))
    t1 = c.ask(proxies[0].url, "Name one prime number.")
    t2 = c.ask(proxies[1].url, "And another one?")
    return proxies, state, c, t1, t2


def test_two_proxies_share_the_pool_and_a_session_is_on_one_server(make_llama, make_proxy,
                                                                   tmp_path):
    _proxies, _state, _c, t1, t2 = two_proxies_and_a_shared_session(make_llama, make_proxy,
                                                                    tmp_path)
    assert (server_of(t2), t2.action) == (server_of(t1), "kept"), t2
    assert t2.cache_n >= 0.9 * t1.prompt_tokens, t2


def test_one_new_session_placed_by_two_proxies_at_once_stays_on_one_server(
        make_llama, make_proxy, tmp_path):
    proxies, state, c, t1, t2 = two_proxies_and_a_shared_session(make_llama, make_proxy,
                                                                  tmp_path)
    # The same new sessions sent through both proxies at the same moment: each ends on one
    # server, whichever proxy placed it first.
    pairs = [(Conversation(f"race-{i}", long_system_prompt(350, seed=60 + i)),
              Conversation(f"race-{i}", long_system_prompt(350, seed=60 + i))) for i in range(2)]
    results: dict[tuple[int, int], object] = {}

    def ask(i: int, k: int) -> None:
        results[(i, k)] = pairs[i][k].ask(proxies[k].url, "Name one prime number.")

    threads = [threading.Thread(target=ask, args=(i, k)) for i in range(2) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4
    for i in range(2):
        assert server_of(results[(i, 0)]) == server_of(results[(i, 1)]), (
            results[(i, 0)], results[(i, 1)])
    held = claims(state)
    for session, where in held.items():
        assert len(where) == 1, (session, where)
    assert {"race-0", "race-1"} <= set(held)
    # Four slots, three sessions: nobody had to leave.
    t3 = c.ask(proxies[0].url, "And a third one?")
    assert (server_of(t3), t3.action) == (server_of(t1), "kept"), t3
    assert t3.cache_n >= 0.9 * t2.prompt_tokens, t3


def test_baseline_placements_for_the_benchmark(make_llama, make_proxy, tmp_path):
    """round-robin and least-busy (slotkeeper_placement) place each request without looking at
    the KV: what scripts/bench-pool compares the cost policy with."""
    servers, slot_dir = start_pool(make_llama, tmp_path)
    urls = [s.url for s in servers]
    rr = pool_proxy(make_proxy, servers, slot_dir, slotkeeper_placement="round-robin")
    c = Conversation("rr-1", long_system_prompt(350, seed=71))
    placed = [server_of(c.ask(rr.url, q)) for q in ("One prime?", "Another?", "A third?")]
    assert placed == [urls[0], urls[1], urls[0]], placed
    # It moved every turn: the server it left no longer holds its claim.
    assert claims(rr.state_file)["rr-1"] == [(urls[0], int(c.turns[-1].slot))]
    least = pool_proxy(make_proxy, servers, slot_dir, slotkeeper_placement="least-busy",
                       slotkeeper_state_file=str(tmp_path / "least.json"))
    body = {"messages": [{"role": "user", "content": "Count from one to a thousand."}],
            "max_tokens": 2000, "ignore_eos": True, "temperature": 0, "stream": True}
    stop = threading.Event()

    def generate() -> None:
        with requests.post(urls[0] + "/v1/chat/completions", json=body, stream=True,
                           timeout=600) as r:
            for _line in r.iter_lines():
                if stop.is_set():
                    break

    busy = threading.Thread(target=generate)
    busy.start()
    try:
        wait_for(lambda: any(s["is_processing"] for s in
                             requests.get(urls[0] + "/slots", timeout=10).json()),
                 30, "a slot of the first server busy")
        t = Conversation("lb-1", long_system_prompt(350, seed=72)).ask(least.url, "One prime?")
        assert server_of(t) == urls[1], t
    finally:
        stop.set()
        busy.join()
