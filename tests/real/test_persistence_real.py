"""Sessions survive eviction and restarts: save/restore on handover, seeds, disk budget and the
session API, against a real llama-server (-np 4 --swa-full --slot-save-path) and mitmdump."""

from __future__ import annotations

import time
from pathlib import Path
from urllib.parse import quote

import requests
from helpers import Conversation, interleave, started_from_ram
from testbed import long_system_prompt

from slotkeeper.snapshots.paths import file_name_for

SAVE_OPTIONS = {"slotkeeper_small_request_chars": 0, "slotkeeper_idle_save_seconds": 1}


def tokens(url: str, messages: list[dict]) -> list[int]:
    prompt = requests.post(url + "/apply-template", json={"messages": messages},
                           timeout=60).json()["prompt"]
    return requests.post(url + "/tokenize", json={"content": prompt, "parse_special": True},
                         timeout=60).json()["tokens"]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def minimum_prefill(url: str, prompts: list[list[dict]]) -> list[int]:
    """For each prompt in the order sent: its tokens that no earlier prompt started with."""
    seen: list[list[int]] = []
    out = []
    for messages in prompts:
        toks = tokens(url, messages)
        out.append(len(toks) - max((common_prefix(toks, s) for s in seen), default=0))
        seen.append(toks)
    return out


def wait_for_saves(slot_dir: Path, sessions: list[Conversation], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    want = {slot_dir / file_name_for(c.session) for c in sessions}
    while time.monotonic() < deadline:
        if all(p.exists() and p.with_suffix(".json").exists() for p in want):
            return
        time.sleep(0.2)
    missing = [p.name for p in want if not p.with_suffix(".json").exists()]
    raise AssertionError(f"sessions not saved in {timeout} s: {missing}")


def test_six_sessions_on_four_slots(make_llama, make_proxy, tmp_path):
    """More sessions than slots, turns interleaved: every handover keeps the outgoing
    session (on disk or in the server's RAM cache) and brings the incoming one back, so
    prefilled tokens stay within 1.1x of the tokens no earlier prompt started with."""
    server = make_llama(slot_save_path=tmp_path / "slots")
    proxy = make_proxy(server, slotkeeper_slot_dir=str(tmp_path / "slots"),
                       slotkeeper_small_request_chars=0, slotkeeper_idle_save_seconds=0)
    system = long_system_prompt(500, seed=3)
    sessions = [Conversation(f"six{i}", system) for i in range(6)]
    prompts: list[list[dict]] = []
    order: list[tuple[Conversation, int]] = []
    for k in range(3):
        for c in sessions:
            c.ask(proxy.url, f"(session {c.session}) question {k}: name one prime number.")
            prompts.append([{"role": "system", "content": system}, *c.messages[:-1]])
            order.append((c, k))
    minimum = minimum_prefill(server.url, prompts)
    # The seed of a system prompt is taken after the answer of the second conversation that
    # uses it (issue #23: never on the request path, never for a prompt seen once); that
    # conversation's first turn starts from the first's prefix instead (restored from its
    # slot), which the minimum counts as reusable: the bound is the minimum.
    allowed = list(minimum)
    prefilled = [c.turns[k].prompt_n for c, k in order]
    actions = [c.turns[k].action for c, k in order]
    # Sessions 2-6 start from the shared system prompt: from its seed, from a slot or
    # snapshot that holds it already where that costs less (issue #31's pricing: measured
    # 14 prefilled where the seed's restore gave 17), or from an idle parent's copy in the
    # server's RAM cache (its default --cache-ram), or the KV of the slot's session, which
    # holds the same system block.
    first = sessions[0].turns[0]
    log = proxy.log_text()
    for c in sessions[1:]:
        opening = next(line for line in log.splitlines() if f"{c.session} (header" in line)
        assert (c.turns[0].action in ("seeded", "restored") or started_from_ram(log, c.session)
                or "KV left in the slot as its prefix" in opening), (actions, opening)
        assert c.turns[0].cache_n >= 0.9 * (first.prompt_n + first.cache_n), (c.turns[0], first)
    assert sum(prefilled) <= 1.1 * sum(allowed), (prefilled, allowed, actions)
    later = [(p, m) for (c, k), p, m in zip(order, prefilled, minimum) if k > 0]
    assert all(p <= 1.1 * m + 2 for p, m in later), (later, actions)
    # with idle saves off no quiet period takes a seed: it is taken after the answer
    assert any(p.name.startswith("seed_") for p in (tmp_path / "slots").iterdir()), log[-3000:]


def test_llama_server_killed_and_restarted_sessions_come_back_warm(make_llama, make_proxy,
                                                                      tmp_path):
    slot_dir = tmp_path / "slots"
    server = make_llama(slot_save_path=slot_dir)
    proxy = make_proxy(server, slotkeeper_slot_dir=str(slot_dir), **SAVE_OPTIONS)
    system = long_system_prompt(300, seed=11)
    sessions = [Conversation(f"crash{i}", system) for i in range(3)]
    interleave(sessions, proxy.url, turns=2)
    wait_for_saves(slot_dir, sessions)  # idle for a second: saved
    time.sleep(1.5)  # the second turn's idle save too
    server.kill()  # no warning
    server.start()
    for c in sessions:
        before = c.turns[-1].prompt_tokens
        turn = c.ask(proxy.url, "And after the restart, one more prime please?")
        assert turn.action == "restored", (c.session, turn)
        assert turn.cache_n >= 0.95 * before, (c.session, turn.cache_n, before)


def test_proxy_restart_loses_nothing(make_llama, make_proxy, tmp_path):
    slot_dir = tmp_path / "slots"
    server = make_llama(slot_save_path=slot_dir)
    proxy = make_proxy(server, slotkeeper_slot_dir=str(slot_dir),
                       slotkeeper_small_request_chars=0, slotkeeper_idle_save_seconds=0)
    c = Conversation("proxyrestart", long_system_prompt(300, seed=5))
    c.ask(proxy.url, "First question: what is a prime number?")
    proxy.stop()  # SIGINT: graceful, saves resident sessions
    assert (slot_dir / file_name_for(c.session)).with_suffix(".json").exists()
    proxy.start()
    turn = c.ask(proxy.url, "Second question: is nine prime?")
    assert turn.action == "kept" and turn.cache_n >= c.turns[0].prompt_tokens
    # And both restarted: the snapshot written at shutdown brings it back.
    proxy.stop()
    server.stop()
    server.start()
    proxy.start()
    before = c.turns[-1].prompt_tokens
    turn = c.ask(proxy.url, "Third question: is eleven prime?")
    assert turn.action == "restored" and turn.cache_n >= 0.95 * before, turn


def test_new_session_with_known_system_prompt_starts_from_the_seed(make_llama, make_proxy,
                                                                     tmp_path):
    slot_dir = tmp_path / "slots"
    # the disk's way: a server whose RAM cache cannot hold its slots (a large model's)
    server = make_llama(slot_save_path=slot_dir, extra=["--cache-ram", "0"])
    proxy = make_proxy(server, slotkeeper_slot_dir=str(slot_dir),
                       slotkeeper_small_request_chars=0, slotkeeper_idle_save_seconds=0,
                       slotkeeper_upstream_cache_ram_mb=0)
    system = long_system_prompt(400, seed=21)
    first = Conversation("seed-a", system)
    t1 = first.ask(proxy.url, "Hello, who are you?")
    assert t1.action == "assigned", t1  # no seed on a request's path (issue #23)
    first.ask(proxy.url, "And what can you do?")
    system_tokens = len(tokens(server.url, [{"role": "system", "content": system}]))
    # A second conversation uses the system prompt: it starts from the first's prefix (the
    # first's KV saved and restored into its slot), and its seed is taken after its answer.
    second = Conversation("seed-b", system).ask(proxy.url, "Another question.")
    assert second.action == "restored" and second.cache_n >= 0.9 * system_tokens, second
    third = Conversation("seed-c", system)
    t3 = third.ask(proxy.url, "A different first question about testing.")
    assert t3.action == "seeded"
    assert t3.cache_n >= 0.9 * system_tokens, (t3.cache_n, system_tokens)


def test_disk_budget_holds(make_llama, make_proxy, tmp_path):
    slot_dir = tmp_path / "slots"
    server = make_llama(slot_save_path=slot_dir, np=2)
    budget_mb = 25  # about two sessions of ~500 tokens (9.5 MB each, measured)
    proxy = make_proxy(server, slotkeeper_slot_dir=str(slot_dir), slotkeeper_max_seeds=0,
                       slotkeeper_disk_max_mb=budget_mb, **SAVE_OPTIONS)
    sessions = [Conversation(f"budget{i}", long_system_prompt(350, seed=30 + i))
                for i in range(5)]
    for c in sessions:
        c.ask(proxy.url, "Tell me one fact about budgets.")
    time.sleep(2.5)  # idle saves
    total = sum(p.stat().st_size for p in slot_dir.iterdir() if p.is_file())
    assert total <= budget_mb * 1024 * 1024, total
    saved = [c.session for c in sessions
             if (slot_dir / file_name_for(c.session)).exists()]
    assert 1 <= len(saved) < len(sessions)


def test_session_api_lists_deletes_and_refuses_hostile_ids(make_llama, make_proxy, tmp_path):
    slot_dir = tmp_path / "slots"
    server = make_llama(slot_save_path=slot_dir)
    proxy = make_proxy(server, slotkeeper_slot_dir=str(slot_dir), slotkeeper_max_seeds=0,
                       **SAVE_OPTIONS)
    c = Conversation("api-one", long_system_prompt(300, seed=41))
    c.ask(proxy.url, "Hello there.")
    wait_for_saves(slot_dir, [c])
    listed = requests.get(proxy.url + "/api/sessions", timeout=10).json()["sessions"]
    entry = next(s for s in listed if s["id"] == "api-one")
    assert entry["tokens"] > 256 and entry["bytes"] > 0 and entry["resident"]["slot"] >= 0
    current = requests.get(proxy.url + "/api/sessions/current", timeout=10).json()
    slots = next(iter(current["upstreams"].values()))["slots"]
    assert any(s["session"] == "api-one" for s in slots.values())

    for hostile in ("../../etc/passwd", "/etc/passwd", "a\x00b", "x" * 10_000, "\u00e9\u4e2d"):
        r = requests.delete(proxy.url + "/api/sessions/" + quote(hostile, safe=""), timeout=10)
        assert r.status_code in (400, 404), (hostile[:20], r.status_code)
        assert "error" in r.json()
    assert requests.delete(proxy.url + "/api/sessions/nobody", timeout=10).status_code == 404

    r = requests.delete(proxy.url + "/api/sessions/api-one", timeout=30)
    assert r.status_code == 200 and r.json()["files_deleted"]
    assert not (slot_dir / file_name_for("api-one")).exists()
    assert requests.get(proxy.url + "/api/sessions", timeout=10).json()["sessions"] == []
    turn = c.ask(proxy.url, "Still there?")  # forgotten: starts clean, still answered
    assert turn.action == "assigned"

    r = requests.post(proxy.url + "/api/sessions/clear", json={}, timeout=30)
    assert r.status_code == 200 and r.json()["erased"]
    assert next(iter(requests.get(proxy.url + "/api/sessions/current", timeout=10).json()
                     ["upstreams"].values()))["slots"] == {}


def test_slot_dir_out_of_reach_pins_anyway_and_the_api_says_why(llama, make_proxy, tmp_path):
    missing = tmp_path / "not-there"
    proxy = make_proxy(llama, slotkeeper_slot_dir=str(missing), slotkeeper_small_request_chars=0)
    turn = Conversation("no-dir", "Be brief.").ask(proxy.url, "hello")
    assert turn.slot in {"0", "1", "2", "3"}
    r = requests.get(proxy.url + "/api/sessions", timeout=10)
    assert r.status_code == 409
    assert str(missing) in r.json()["error"]["message"]
    assert "pinned but not saved" in proxy.log_text()


def test_ctrl_c_with_open_keep_alive_connections_saves_and_prints_no_traceback(
        make_llama, make_proxy, tmp_path):
    """Ctrl-C (SIGINT) while three clients hold keep-alive connections open (as agents and
    chat UIs do): every session is saved, the connections are closed, and the log has no
    traceback (issue #32: one CancelledError traceback per connection before)."""
    slot_dir = tmp_path / "slots"
    server = make_llama(slot_save_path=slot_dir)
    proxy = make_proxy(server, slotkeeper_slot_dir=str(slot_dir),
                       slotkeeper_small_request_chars=0, slotkeeper_idle_save_seconds=0)
    system = long_system_prompt(300, seed=31)
    clients = []
    for i in range(3):
        http = requests.Session()  # one connection, kept alive after the answer
        body = {"messages": [{"role": "system", "content": system},
                             {"role": "user", "content": f"Client {i}: name a prime."}],
                "max_tokens": 4, "temperature": 0}
        r = http.post(proxy.url + "/v1/chat/completions", json=body,
                      headers={"X-Session-Id": f"keepalive{i}"}, timeout=300)
        assert r.status_code == 200 and r.headers.get("Connection", "").lower() != "close"
        clients.append(http)
    proxy.stop()  # SIGINT, the connections still open
    log = proxy.log_text()
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
    assert "shutdown: saved" in log, log[-3000:]
    for i in range(3):
        assert (slot_dir / file_name_for(f"keepalive{i}")).with_suffix(".json").exists()
    for http in clients:
        http.close()
