"""`slotkeeper status`, run as a user runs it (the installed command, a real proxy and
llama-server): from the proxy's API while it runs, from the files once it has stopped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import requests
from testbed import long_system_prompt

from slotkeeper.launcher.local import state_dir
from slotkeeper.settings import default_state_dir

SLOTKEEPER = Path(sys.executable).parent / "slotkeeper"
TIMEOUT_S = 600


def status(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "XDG_STATE_HOME": str(home / "state"), "HOME": str(home)}
    return subprocess.run([str(SLOTKEEPER), "status", *args], capture_output=True, text=True,
                          timeout=60, env=env)


def status_json(*args: str, home: Path) -> dict[str, Any]:
    done = status(*args, "--json", home=home)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def ask(url: str, session: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    r = requests.post(url + "/v1/chat/completions", timeout=TIMEOUT_S,
                      headers={"X-Session-Id": session},
                      json={"messages": messages, "temperature": 0, "max_tokens": 8})
    assert r.status_code == 200, r.text[:500]
    messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    return r.json()["timings"]


def slots_of(report: dict[str, Any], url: str) -> dict[int, dict[str, Any]]:
    up = next(u for u in report["upstreams"] if u["url"] == url)
    return {s["slot"]: s for s in up["slots"]}


def test_status_of_a_running_then_stopped_proxy(make_llama, make_proxy, tmp_path):
    slots = tmp_path / "slots"
    server = make_llama(np=2, ctx=8192, slot_save_path=slots)
    # slotkeeper told the server keeps no RAM cache: an evicted session is saved on its way
    # out, not left to that cache
    proxy = make_proxy(server, slotkeeper_small_request_chars=0, slotkeeper_slot_dir=str(slots),
                       slotkeeper_max_seeds=0, slotkeeper_idle_save_seconds=0,
                       slotkeeper_upstream_cache_ram_mb=0)
    chats = {name: [{"role": "system", "content": long_system_prompt(300, seed=i)},
                    {"role": "user", "content": "hi"}] for i, name in enumerate("abc")}
    last = {name: ask(proxy.url, name, chats[name]) for name in "abc"}  # c evicts a (saved)

    started = time.monotonic()
    report = status_json("--proxy", proxy.url, home=tmp_path)
    status_ms = (time.monotonic() - started) * 1000
    assert report["source"] == "proxy"
    assert report["slot_dir"] == str(slots.resolve())
    [up] = report["upstreams"]
    assert up["url"] == server.url
    assert (up["reachable"], up["slot_count"], up["owned"]) == (True, 2, 2)
    by_session = {s["session"]: s for s in up["slots"]}
    assert set(by_session) == {"b", "c"}
    state = json.loads(proxy.state_file.read_text())["upstreams"][server.url]["slots"]
    for name in "bc":
        s = by_session[name]
        assert (s["resident"], s["busy"]) == (True, False)
        assert (s["tokens"], s["last_used"]) == (state[str(s["slot"])]["tokens"],
                                                 state[str(s["slot"])]["last_used"])
        t = last[name]  # the prompt, plus what was generated (all of it, or all but the last)
        prompt = t["cache_n"] + t["prompt_n"]
        assert prompt <= s["tokens"] <= prompt + t["predicted_n"]
        assert s["last_used"] > time.time() - 300
    [saved] = report["sessions"]
    assert (saved["id"], saved["kind"], saved["resident"]) == ("a", "session", None)
    assert saved["tokens"] >= last["a"]["prompt_n"]
    assert saved["bytes"] == (slots / next(p.name for p in slots.glob("*.bin"))).stat().st_size

    text = status("--proxy", proxy.url, home=tmp_path)
    assert text.returncode == 0, text.stderr
    out = text.stdout
    assert out.startswith(f"slotkeeper status, from the proxy at {proxy.url}\n")
    assert f"Upstream {server.url}: 2 slots, 2 owned, reachable" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("  ")]
    assert ["SLOT", "SESSION", "KV", "NOW", "TOKENS", "SAVED", "LAST", "USE"] in rows
    assert any(r[1:4] == ["b", "resident", "idle"] for r in rows), out
    assert any(r[:2] == ["a", "session"] and r[-1] == "-" for r in rows), out
    assert "Saved sessions: 1," in out

    # A slot serving a request shows as busy (the server's /slots says so): b's next turn,
    # streamed, so it stays on b's slot.
    b_slot = by_session["b"]["slot"]
    chats["b"].append({"role": "user", "content": "Now write a long story about a cat."})
    busy = busy_while_streaming(proxy.url, "b", chats["b"],
                                lambda: status_json("--proxy", proxy.url, home=tmp_path))
    assert {n: s["busy"] for n, s in slots_of(busy, server.url).items()} == {
        b_slot: True, 1 - b_slot: False}, busy

    proxy.stop()  # its shutdown saves b and c
    report = status_json("--proxy", proxy.url, "--state-file", str(proxy.state_file),
                         "--slot-dir", str(slots), home=tmp_path)
    assert report["source"] == "files"
    assert "connection refused" in report["proxy_error"]
    assert {s["session"]: s["resident"] for s in slots_of(report, server.url).values()} == {
        "b": True, "c": True}
    assert {s["id"] for s in report["sessions"]} == {"a", "b", "c"}
    assert {s["id"]: s["resident"] for s in report["sessions"]}["b"]["upstream"] == server.url
    text = status("--proxy", proxy.url, "--state-file", str(proxy.state_file), "--slot-dir",
                  str(slots), home=tmp_path)
    assert text.returncode == 0
    assert text.stdout.startswith(f"slotkeeper status, read from {proxy.state_file}: no proxy "
                                  f"at {proxy.url} (connection refused)\n")
    assert "Saved sessions: 3," in text.stdout
    print(f"slotkeeper status --json against a running proxy took {status_ms:.0f} ms")


def busy_while_streaming(url: str, session: str, messages: list[dict[str, str]],
                         look: Any) -> dict[str, Any]:
    """Run `look()` while a long streamed answer for `session` is being generated."""
    first_event = threading.Event()
    stop = threading.Event()

    def stream() -> None:
        body = {"messages": messages, "max_tokens": 400, "temperature": 0, "stream": True}
        with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=120,
                           headers={"X-Session-Id": session}) as r:
            for line in r.iter_lines():
                if line.startswith(b"data: {"):
                    first_event.set()
                if stop.is_set():
                    break

    worker = threading.Thread(target=stream, daemon=True)
    worker.start()
    assert first_event.wait(120), "no streamed event"
    try:
        return look()
    finally:
        stop.set()
        worker.join(120)


def test_status_falls_back_to_files_when_the_url_is_not_a_proxy(llama, make_proxy, tmp_path):
    proxy = make_proxy(llama, slotkeeper_small_request_chars=0)
    ask(proxy.url, "f1", [{"role": "user", "content": "hi"}])
    # llama-server itself answers 404 on /api/sessions/current: not a slotkeeper proxy.
    report = status_json("--proxy", llama.url, "--state-file", str(proxy.state_file),
                         home=tmp_path)
    assert report["source"] == "files"
    assert report["proxy_error"] == (f"{llama.url} is not a slotkeeper proxy "
                                     f"(GET /api/sessions/current answered 404)")
    assert [s["session"] for s in slots_of(report, llama.url).values() if s["session"]] == ["f1"]
    assert report["sessions"] is None
    assert "no slot folder given" in report["sessions_note"]
    # Through the proxy the same slot is reported; no slot folder: said, not an error.
    report = status_json("--proxy", proxy.url, home=tmp_path)
    assert report["source"] == "proxy"
    assert [s["session"] for s in slots_of(report, llama.url).values() if s["session"]] == ["f1"]
    assert report["sessions_note"] == ("the proxy has no slot folder (slotkeeper_slot_dir is "
                                       "not set)")


def test_status_errors_are_one_line(tmp_path):
    dead = "http://127.0.0.1:9"
    done = status("--proxy", dead, home=tmp_path)
    default = tmp_path / "state" / "slotkeeper" / "state.json"
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr == (f"slotkeeper status: no proxy at {dead} (connection refused); no "
                           f"state file at {default} (slotkeeper has not run as this user, or "
                           f"give --state-file)\n")

    default.parent.mkdir(parents=True)
    default.write_text("{not json")
    done = status("--proxy", dead, home=tmp_path)
    assert done.returncode == 1
    assert done.stderr.startswith(f"slotkeeper status: no proxy at {dead} (connection "
                                  f"refused); cannot read the state file {default}: ")
    assert len(done.stderr.splitlines()) == 1
    default.write_text('{"version": 99}')
    done = status("--proxy", dead, home=tmp_path)
    assert done.returncode == 1 and "is not a slotkeeper state file" in done.stderr
    assert len(done.stderr.splitlines()) == 1

    done = status("--bogus", home=tmp_path)
    assert done.returncode == 2
    assert "unrecognized arguments: --bogus" in done.stderr
    assert "Traceback" not in done.stderr

    # An empty state (slotkeeper ran, nothing routed yet) is a report, not an error.
    default.write_text('{"version": 1, "upstreams": {}}')
    done = status("--proxy", dead, home=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "No upstream has been used yet." in done.stdout


def test_status_default_state_file_is_the_addons(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert state_dir() == default_state_dir() == tmp_path / "slotkeeper"
