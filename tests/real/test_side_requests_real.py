"""Side requests told by what they are (issue #9), against the real llama-server through a real
mitmdump: OpenCode's title request and its main request, sent at the same moment with one
session id, never queue on one slot, and the main conversation keeps its slot."""

from __future__ import annotations

import threading
import time

import requests
from testbed import long_system_prompt

SESSION = {"x-session-id": "ses_opencode1", "x-session-affinity": "ses_opencode1"}
TITLE_SYSTEM = ("You are a title generator. You output ONLY a thread title, nothing else. "
                + long_system_prompt(330, seed=61))  # ~2.5 KB, like OpenCode's
MAIN_SYSTEM = long_system_prompt(1000, seed=62)


def post(url: str, messages: list[dict], n_predict: int = 6) -> dict:
    started = time.monotonic()
    r = requests.post(url + "/v1/chat/completions", headers=SESSION, timeout=600, json={
        "messages": messages, "max_tokens": n_predict, "temperature": 0})
    assert r.status_code == 200, r.text[:500]
    data = r.json()
    return {"slot": r.headers["X-Slotkeeper-Slot"], "action": r.headers["X-Slotkeeper-Action"],
            "detail": r.headers.get("X-Slotkeeper-Action"), "timings": data["timings"],
            "reply": data["choices"][0]["message"]["content"],
            "seconds": time.monotonic() - started}


def title_messages() -> list[dict]:
    return [{"role": "system", "content": TITLE_SYSTEM},
            {"role": "user", "content": "Generate a title for: fix the failing unit test"}]


def test_opencode_title_and_main_request_at_once_never_share_a_slot(make_llama, make_proxy,
                                                                   tmp_path):
    slots = tmp_path / "slots"
    server = make_llama(np=4, ctx=16384, slot_save_path=slots)
    proxy = make_proxy(server, slotkeeper_slot_dir=str(slots), slotkeeper_idle_save_seconds=0)
    main = [{"role": "system", "content": MAIN_SYSTEM},
            {"role": "user", "content": "Fix the failing unit test in tests/test_app.py."}]
    results: dict[str, dict] = {}
    title = threading.Thread(target=lambda: results.setdefault(
        "title", post(proxy.url, title_messages())))
    title.start()  # the title request first: it takes the session's slot
    time.sleep(0.3)
    results["main"] = post(proxy.url, main)
    title.join(600)
    first_title, first_main = results["title"], results["main"]
    assert first_title["slot"] != first_main["slot"], results
    assert first_main["action"] in ("assigned", "seeded", "restored"), first_main

    # The session's claim is the main conversation's slot, holding the main conversation.
    current = requests.get(proxy.url + "/api/sessions/current", timeout=30).json()
    claims = {slot: info["session"]
              for up in current["upstreams"].values() for slot, info in up["slots"].items()}
    assert claims.get(first_main["slot"]) == "ses_opencode1", current
    assert list(claims.values()).count("ses_opencode1") == 1, current

    # Its next turn keeps the slot and reuses the whole previous prompt (the server says so).
    main += [{"role": "assistant", "content": first_main["reply"]},
             {"role": "user", "content": "Now run the tests again."}]
    second = post(proxy.url, main)
    previous = first_main["timings"]["cache_n"] + first_main["timings"]["prompt_n"]
    assert second["slot"] == first_main["slot"] and second["action"] == "kept", second
    assert second["timings"]["cache_n"] >= 0.9 * previous, (second, previous)

    # A title request now (main resident) is a side request on another slot, and the main
    # conversation's next turn still finds its KV.
    late_title = post(proxy.url, title_messages())
    assert late_title["action"] == "side" and late_title["slot"] != first_main["slot"], late_title
    main += [{"role": "assistant", "content": second["reply"]},
             {"role": "user", "content": "Thanks."}]
    third = post(proxy.url, main)
    before = second["timings"]["cache_n"] + second["timings"]["prompt_n"]
    assert third["action"] == "kept" and third["timings"]["cache_n"] >= 0.9 * before, third
