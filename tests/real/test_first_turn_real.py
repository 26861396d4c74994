"""First turns and one-off requests (issue #23), against the real llama-server (-np N
--swa-full) through a real mitmdump: seeds are taken after the answer, never before it; a
retry goes where the original went; a title request leaves the conversations as they were."""

from __future__ import annotations

import http.client
import json
import os
import re
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import requests
from helpers import Conversation
from testbed import long_system_prompt

SYSTEM = long_system_prompt(1100, seed=231)  # ~1.1k tokens: ~2.7 s of prefill, quiet
HEADER_TIMEOUT_S = 5.0


def render_prefix(url: str, system: str) -> str:
    """The system part as every session with it starts (seeds.py renders it the same way)."""
    renders = [requests.post(url + "/apply-template", timeout=60, json={"messages": [
        {"role": "system", "content": system}, {"role": "user", "content": probe}]}).json()[
        "prompt"] for probe in ("A", "B")]
    return os.path.commonprefix(renders)


def completion(url: str, body: dict) -> dict:
    r = requests.post(url + "/completion", json={"cache_prompt": True, "temperature": 0, **body},
                      timeout=600)
    assert r.status_code == 200, r.text[:300]
    return r.json()["timings"]


def slot_action(url: str, slot: int, action: str, name: str = "") -> dict:
    r = requests.post(f"{url}/slots/{slot}?action={action}", timeout=120,
                      json={"filename": name} if name else {})
    assert r.status_code == 200, r.text[:300]
    return r.json()


def test_the_server_cuts_a_slot_to_its_system_prefix_without_prefilling(make_llama, tmp_path):
    """What taking a seed afterwards rests on (b11434, --swa-full): a /completion of the
    system prefix with cache_prompt, on a slot holding a conversation that starts with it,
    keeps the common prefix and evaluates one token; on a never-restored slot and on a
    restored one (a restore clears the server's checkpoints)."""
    server = make_llama(np=2, ctx=16384, slot_save_path=tmp_path / "slots")
    prefix = render_prefix(server.url, SYSTEM)
    chat = prefix + "Explain what a unit test is.<end_of_turn>\n<start_of_turn>model\n"
    first = completion(server.url, {"prompt": chat, "n_predict": 4, "id_slot": 0})
    conversation_tokens = first["prompt_n"] + first["cache_n"]
    started = time.monotonic()
    cut = completion(server.url, {"prompt": prefix, "n_predict": 0, "id_slot": 0})
    cut_s = time.monotonic() - started
    prefix_tokens = cut["prompt_n"] + cut["cache_n"]
    assert cut["prompt_n"] <= 2 and cut["cache_n"] >= prefix_tokens - 2, cut
    assert cut_s < 0.1 * first["prompt_ms"] / 1000 + 1, (cut_s, first)

    # A restored slot: the conversation saved, restored into the other slot, cut there.
    slot_action(server.url, 0, "erase")
    completion(server.url, {"prompt": chat, "n_predict": 4, "id_slot": 0})
    saved = slot_action(server.url, 0, "save", "conv.bin")["n_saved"]
    assert saved >= conversation_tokens - 1
    assert slot_action(server.url, 1, "restore", "conv.bin")["n_restored"] == saved
    cut_restored = completion(server.url, {"prompt": prefix, "n_predict": 0, "id_slot": 1})
    assert cut_restored["prompt_n"] <= 2, cut_restored
    assert cut_restored["cache_n"] >= prefix_tokens - 2, cut_restored
    # The cut slot, saved, is a seed: another conversation restoring it reuses the prefix.
    slot_action(server.url, 1, "save", "seed.bin")
    slot_action(server.url, 0, "restore", "seed.bin")
    other = completion(server.url, {"prompt": prefix + "Another question entirely."
                                     "<end_of_turn>\n<start_of_turn>model\n",
                                     "n_predict": 2, "id_slot": 0})
    assert other["cache_n"] >= prefix_tokens - 2, other
    print(f"\nconversation {conversation_tokens} tokens prefilled in {first['prompt_ms']:.0f} "
          f"ms; cut to the {prefix_tokens}-token prefix in {cut_s * 1000:.0f} ms "
          f"(evaluated {cut['prompt_n']}); on a restored slot evaluated "
          f"{cut_restored['prompt_n']}")


def prefill_seconds(url: str, system: str) -> float:
    """Seconds the server takes to prefill `system` from nothing (cache_prompt: false), asked
    directly: the yardstick for timeouts that must fall mid-prefill on any machine."""
    r = requests.post(url + "/v1/chat/completions", timeout=600, json={
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}],
        "max_tokens": 1, "temperature": 0, "cache_prompt": False})
    assert r.status_code == 200, r.text[:300]
    return r.json()["timings"]["prompt_ms"] / 1000


def stream_headers_at(url: str, session: str, messages: list[dict], max_tokens: int = 4
                      ) -> tuple[float, dict[str, str], dict, str]:
    """A streaming client with a 5 s header timeout (no retry): seconds to the response
    headers, the headers, the final timings and the answer's text."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=HEADER_TIMEOUT_S)
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "timings_per_token": False})
    started = time.monotonic()
    conn.request("POST", "/v1/chat/completions", body=body,
                 headers={"Content-Type": "application/json", "x-session-id": session})
    response = conn.getresponse()  # raises TimeoutError after 5 s without headers
    headers_s = time.monotonic() - started
    conn.sock.settimeout(600)
    timings: dict = {}
    text = ""
    for line in response.read().decode().splitlines():
        if not line.startswith("data: {"):
            continue
        event = json.loads(line[6:])
        timings = event.get("timings") or timings
        for choice in event.get("choices") or ():
            text += (choice.get("delta") or {}).get("content") or ""
    conn.close()
    assert response.status == 200
    return headers_s, dict(response.getheaders()), timings, text


def test_a_first_turn_gets_its_headers_at_once_and_the_seed_comes_afterwards(
        make_llama, make_proxy, tmp_path):
    """A second conversation with a ~1.1k-token system prompt used to build the seed (~10 s
    on a slow machine) before its request was forwarded: a client with a 5 s header timeout
    gave up. Now every first turn is forwarded at once: the first cold, the second from the
    first's prefix (its young KV saved and restored, where llama-server alone on one slot
    reuses it in place); the seed is taken after the second conversation's answer, and a
    third conversation starts from it."""
    slots = tmp_path / "slots"
    # the disk's way: a server whose RAM cache cannot hold its slots (a large model's); with
    # one, b starts from a's copy there (test_ram_cache_real.py)
    server = make_llama(np=3, ctx=3 * 4096, slot_save_path=slots, extra=["--cache-ram", "0"])
    proxy = make_proxy(server, slotkeeper_slot_dir=str(slots), slotkeeper_idle_save_seconds=0,
                       slotkeeper_upstream_cache_ram_mb=0)
    system_tokens = len(requests.post(server.url + "/tokenize", timeout=60, json={
        "content": render_prefix(server.url, SYSTEM), "parse_special": True}).json()["tokens"])
    chats = {name: Conversation(f"first-{name}", SYSTEM) for name in "ab"}
    firsts, prompt_s = {}, {}
    for name, chat in chats.items():
        chat.messages.append({"role": "user", "content": f"Conversation {name}: a fixture?"})
        headers_s, headers, timings, text = stream_headers_at(
            proxy.url, chat.session, [{"role": "system", "content": SYSTEM}, *chat.messages])
        chat.messages.append({"role": "assistant", "content": text})
        print(f"\n{name}: headers after {headers_s * 1000:.0f} ms, prefill "
              f"{timings['prompt_ms']:.0f} ms, reused {timings['cache_n']}")
        prompt_s[name] = timings["prompt_ms"] / 1000
        # Building a seed first would hold the headers for at least the system prompt's
        # prefill: the headers come in under half of it (and under 1.5 s), on a fast machine
        # (~2.7 s of prefill on a quiet machine) as on a loaded one (~10 s).
        assert headers_s < 1.5, (name, headers_s)
        assert headers_s < prompt_s["a"] / 2, (headers_s, timings, prompt_s)
        firsts[name] = timings["prompt_n"] + timings["cache_n"]
        if name == "a":  # a conversation, not a one-off: it comes back
            assert headers["X-Slotkeeper-Action"] == "assigned", headers
            assert timings["cache_n"] < 0.5 * system_tokens, timings
            turn = chat.ask(proxy.url, "And a mock?")
            assert turn.action == "kept" and turn.cache_n >= 0.95 * firsts["a"], turn
        else:  # a's KV, saved from a's slot and restored into b's: the system prompt reused
            assert headers["X-Slotkeeper-Action"] == "restored", headers
            assert timings["cache_n"] >= 0.9 * system_tokens, (timings, system_tokens)
    # a kept its own slot and its whole conversation.
    turn = chats["a"].ask(proxy.url, "And a stub?")
    assert turn.action == "kept" and turn.cache_n >= 0.95 * firsts["a"], turn
    # The seed was taken after b's answer: c starts from it.
    third = Conversation("first-c", SYSTEM).ask(proxy.url, "Conversation c: and a mock?")
    assert third.action == "seeded", third
    assert third.cache_n >= 0.9 * system_tokens, (third, system_tokens)
    # b's own slot was given back its conversation after the seed was cut from it.
    again = chats["b"].ask(proxy.url, "Thanks. One more?")
    assert again.action == "kept" and again.cache_n >= 0.95 * firsts["b"], again
    log = proxy.log_text()
    print("\n".join(line for line in log.splitlines() if "seed" in line or "first-b" in line))
    assert re.search(r"took seed seed~\w+ from first-b's slot", log), log[-3000:]
    assert re.search(r"saved first-a from slot \d to start from its prefix", log), log[-3000:]
    assert "Traceback" not in log


def test_a_second_conversation_never_waits_for_its_busy_parent(make_llama, make_proxy,
                                                               tmp_path):
    """The second conversation's start from the first's prefix saves the first from its
    slot only when that slot is idle: with the first generating, the second starts at once
    and cold (as llama-server alone on a free slot), and the first is not disturbed."""
    slots = tmp_path / "slots"
    server = make_llama(np=2, ctx=2 * 4096, slot_save_path=slots)
    proxy = make_proxy(server, slotkeeper_slot_dir=str(slots), slotkeeper_idle_save_seconds=0)
    first = Conversation("busy-a", SYSTEM)
    first.ask(proxy.url, "Conversation a: a fixture?")
    messages = [{"role": "system", "content": SYSTEM}, *first.messages,
                {"role": "user", "content": "Count from one to fifty in words."}]
    outcome: dict = {}

    def long_turn() -> None:
        outcome["a"] = stream_headers_at(proxy.url, first.session, messages, max_tokens=96)

    runner = threading.Thread(target=long_turn)
    runner.start()
    deadline = time.monotonic() + 60
    while not any(s.get("is_processing") for s in requests.get(
            server.url + "/slots", timeout=30).json()):
        assert time.monotonic() < deadline, "a's turn never started"
        time.sleep(0.05)
    headers_s, headers, timings, _text = stream_headers_at(
        proxy.url, "busy-b", [{"role": "system", "content": SYSTEM},
                              {"role": "user", "content": "Conversation b: a mock?"}])
    runner.join(120)
    a_headers_s, a_headers, a_timings, _ = outcome["a"]
    assert a_headers["X-Slotkeeper-Action"] == "kept", a_headers
    assert a_timings["cache_n"] >= first.turns[-1].prompt_tokens - 1, a_timings
    assert headers["X-Slotkeeper-Action"] == "assigned", headers
    assert headers_s < 1.5, headers_s
    log = proxy.log_text()
    assert "to start from its prefix" not in log, log[-3000:]
    assert "Traceback" not in log


def test_a_retry_lands_on_the_original_slot_and_is_prefilled_once(make_llama, make_proxy,
                                                                  tmp_path):
    """An SDK gives up waiting (a third of the way into the prefill) and sends the same request again
    with X-Stainless-Retry-Count: the server stops the original task (its client left, through
    the proxy), and the retry runs on the original's slot, reusing what it had prefilled."""
    slots = tmp_path / "slots"
    server = make_llama(np=2, ctx=2 * 4096, slot_save_path=slots)
    proxy = make_proxy(server, slotkeeper_slot_dir=str(slots), slotkeeper_idle_save_seconds=0)
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Write a long explanation of test doubles."}]
    body = {"messages": messages, "max_tokens": 16, "temperature": 0}
    headers = {"x-session-id": "retry-1"}
    # Give up a third of the way into the prefill, whatever this machine's speed (~2.7 s of
    # prefill quiet, ~10 s loaded): measured on a same-length prompt the slots never see.
    give_up_s = prefill_seconds(server.url, long_system_prompt(1100, seed=232)) / 3
    try:
        requests.post(proxy.url + "/v1/chat/completions", json=body, headers=headers,
                      timeout=give_up_s)
        raise AssertionError(f"the original answered within {give_up_s:.1f} s")
    except requests.exceptions.ReadTimeout:
        pass
    started = time.monotonic()
    r = requests.post(proxy.url + "/v1/chat/completions", json=body, timeout=600,
                      headers={**headers, "X-Stainless-Retry-Count": "1"})
    print(f"\nretry answered in {time.monotonic() - started:.1f} s")
    assert r.status_code == 200, r.text[:300]
    timings = r.json()["timings"]
    total = timings["prompt_n"] + timings["cache_n"]
    log = server.log_text()
    print("\n".join(line for line in log.splitlines()
                    if "cancel" in line or "release" in line or "stop processing" in line))
    assert "cancel task" in log, log[-3000:]  # the original stopped when its client left
    # Prefilled once: the retry reuses what the original evaluated on the same slot.
    assert timings["cache_n"] >= total - 4, timings
    original = next(line for line in proxy.log_text().splitlines() if "retry-1" in line)
    retry_slot = r.headers["X-Slotkeeper-Slot"]
    assert f"slot {retry_slot}," in original, (original, retry_slot)
    assert r.headers["X-Slotkeeper-Action"] == "kept", dict(r.headers)
    print(f"\nretry: {timings['cache_n']} of {total} prompt tokens reused on slot {retry_slot}")


def folder_state(slots: Path) -> dict[str, float]:
    return {p.name: p.stat().st_mtime for p in slots.iterdir() if not p.name.startswith(".")}


def claims(url: str) -> dict:
    """Who holds which slot (the session API), without the measured costs: every answer moves
    those, a one-off's too."""
    current = requests.get(url + "/api/sessions/current", timeout=30).json()
    for upstream in current["upstreams"].values():
        upstream.pop("costs", None)
    return current


def test_a_title_one_off_leaves_the_conversations_and_the_folder_as_they_were(
        make_llama, make_proxy, tmp_path):
    """A title request (`x-session-id: title-<session>`, its own ~2.5 KB system prompt, one
    turn) is never a session: it claims no slot, builds no seed, leaves no snapshot, and runs
    on the free slot while two conversations hold theirs."""
    slots = tmp_path / "slots"
    server = make_llama(np=3, ctx=3 * 4096, slot_save_path=slots)
    proxy = make_proxy(server, slotkeeper_slot_dir=str(slots), slotkeeper_idle_save_seconds=1)
    chats = [Conversation(f"chat-{i}", long_system_prompt(500, seed=240 + i)) for i in (1, 2)]
    firsts = [c.ask(proxy.url, "Start: what does pytest's -x flag do?") for c in chats]
    time.sleep(3)  # the idle saves
    claims_before = claims(proxy.url)
    files_before = folder_state(slots)
    title_system = ("You are a title generator. Output ONLY a short title. "
                    + long_system_prompt(330, seed=249))
    for chat in chats:
        r = requests.post(proxy.url + "/v1/chat/completions", timeout=600,
                          headers={"x-session-id": f"title-{chat.session}"}, json={
                              "messages": [{"role": "system", "content": title_system},
                                           {"role": "user", "content": chat.messages[0][
                                               "content"]}],
                              "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text[:300]
        assert r.headers["X-Slotkeeper-Action"] == "side", dict(r.headers)
        assert r.headers["X-Slotkeeper-Slot"] not in {t.slot for t in firsts}, dict(r.headers)
    time.sleep(3)  # an idle save of a one-off would have happened by now
    assert claims(proxy.url) == claims_before
    assert folder_state(slots) == files_before
    for chat, first in zip(chats, firsts):
        turn = chat.ask(proxy.url, "Next: and -k?")
        assert turn.action == "kept" and turn.slot == first.slot, turn
        assert turn.cache_n >= first.prompt_tokens - 4, (turn, first)


def turns_with_memory_requests(url: str, agent: Conversation, memory_system: str,
                               turns: int = 3) -> list[requests.Response]:
    """The agent's turns, each followed by its header-less memory request (the memory system
    prompt, then the transcript so far in one message); the memory requests' answers."""
    answers = []
    for turn in range(turns):
        agent.ask(url, f"Step {turn}: what does pytest -x do?")
        transcript = " ".join(m["content"] for m in agent.messages)
        r = requests.post(url + "/v1/chat/completions", timeout=600, json={
            "messages": [{"role": "system", "content": memory_system},
                         {"role": "user", "content": f"Update the memory from: {transcript}"}],
            "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text[:300]
        answers.append(r)
        time.sleep(2.5)  # idle saves of whatever owns a slot
    return answers


def test_memory_requests_after_each_turn_become_one_offs_and_leave_no_files(
        make_llama, make_proxy, tmp_path):
    """An agent sends a header-less "memory" request after each of its turns (its own system
    prompt, the transcript; a new content session each time). Once two of them ended without
    a second request while the agent came back, the third is a one-off (no claim), and what
    the first two left (snapshots, claims) is removed: the folder holds the agent's files
    only."""
    slots = tmp_path / "slots"
    server = make_llama(np=3, ctx=3 * 4096, slot_save_path=slots)
    proxy = make_proxy(server, slotkeeper_slot_dir=str(slots), slotkeeper_idle_save_seconds=1)
    agent = Conversation("agent-7", long_system_prompt(400, seed=250))
    memory_system = "You keep the user's memory file. " + long_system_prompt(400, seed=251)
    # The memory system block's tokens: what the second request must at least reuse.
    reused_min = len(requests.post(server.url + "/tokenize", timeout=60, json={
        "content": memory_system}).json()["tokens"])
    answers = turns_with_memory_requests(proxy.url, agent, memory_system)
    actions = [r.headers["X-Slotkeeper-Action"] for r in answers]
    reused = [r.json()["timings"]["cache_n"] for r in answers]
    # The second starts from the first one's long system block (its parent's snapshot, or
    # the slot the first left), as llama-server's own cache would; the third is a one-off.
    assert actions[0] == "assigned" and actions[2] == "side", actions
    assert actions[1] in ("assigned", "restored") and reused[1] > 0.9 * reused_min, (
        actions, reused, reused_min)
    current = requests.get(proxy.url + "/api/sessions/current", timeout=30).json()
    owners = {info["session"] for up in current["upstreams"].values()
              for info in up["slots"].values()}
    assert owners == {"agent-7"}, current
    metas = [json.loads(p.read_text()) for p in slots.glob("*.json")]
    # the model's hand-back file (one per model, made by the first hand-back) is nobody's
    assert {m["session_id"] for m in metas if m["kind"] != "hand-back"} == {"agent-7"}, metas
    assert sum(m["kind"] == "hand-back" for m in metas) <= 1, metas


def test_a_memory_one_off_starts_from_the_previous_memory_request(make_llama, make_proxy,
                                                                    tmp_path):
    """An agent's memory request grows by a turn each time (its transcript), so the third one
    shares all of the second's prompt. When the third is a one-off (no claim), it still starts
    from the second's snapshot, restored onto its side slot before that snapshot is removed
    as a leftover: what llama-server's own RAM cache gives it. Here the cache is off
    (--cache-ram 0) and there is one slot, which the agent's own turns take back by restores
    in between, so nothing else holds those tokens (the final mixed-agents bench prefilled 105
    tokens more than -sps 0 without this)."""
    slots = tmp_path / "slots"
    server = make_llama(np=1, ctx=4096, slot_save_path=slots, extra=["--cache-ram", "0"])
    proxy = make_proxy(server, slotkeeper_slot_dir=str(slots), slotkeeper_idle_save_seconds=1)
    agent = Conversation("agent-7", long_system_prompt(400, seed=260))
    memory_system = "You keep the user's memory file. " + long_system_prompt(400, seed=261)
    answers = turns_with_memory_requests(proxy.url, agent, memory_system)
    actions = [r.headers["X-Slotkeeper-Action"] for r in answers]
    timings = [r.json()["timings"] for r in answers]
    assert actions[2] == "side", actions
    second_prompt = timings[1]["cache_n"] + timings[1]["prompt_n"]
    assert timings[2]["cache_n"] >= 0.9 * second_prompt, (actions, timings)
    metas = [json.loads(p.read_text()) for p in slots.glob("*.json")]
    # the leftovers are gone; the model's hand-back file (one per model) is nobody's
    assert {m["session_id"] for m in metas if m["kind"] != "hand-back"} == {"agent-7"}, metas
    assert sum(m["kind"] == "hand-back" for m in metas) <= 1, metas


def test_a_fresh_proxy_verifies_its_server_before_the_first_request(llama, make_proxy):
    """mitmdump's `running` hook verifies the reverse target in the background: the state file
    holds the server's fingerprint before any request is sent, so the first request does not
    read /props, the model file's digest and /slots on its own path (0.2-0.3 s, measured)."""
    proxy = make_proxy(llama, slotkeeper_small_request_chars=0)
    deadline = time.monotonic() + 30
    fingerprint = ""
    while not fingerprint and time.monotonic() < deadline:
        if proxy.state_file.exists():
            upstreams = json.loads(proxy.state_file.read_text()).get("upstreams", {})
            fingerprint = upstreams.get(llama.url, {}).get("fingerprint", "")
        time.sleep(0.1)
    assert fingerprint, proxy.log_text()[-2000:]
    first = Conversation("verified-at-start", SYSTEM).ask(proxy.url, "Name a colour.")
    assert first.action == "assigned", first
    after = json.loads(proxy.state_file.read_text())["upstreams"][llama.url]["fingerprint"]
    assert after == fingerprint
