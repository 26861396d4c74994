"""Verification against the real llama-server: after each routed request slotkeeper reads back
which slot ran it, and what it reports (X-Slotkeeper-Verified, the metric, the session's
claim) agrees with what the server itself shows in /slots (issue #9)."""

from __future__ import annotations

import requests
from testbed import long_system_prompt


def slot_tasks(url: str) -> dict[int, int]:
    return {s["id"]: s.get("id_task", -1) for s in requests.get(url + "/slots", timeout=30).json()}


def test_verification_reports_the_slot_the_server_really_used(make_llama, make_proxy):
    """/v1/messages on llama-server b11434 ignores id_slot and picks a slot by prompt
    similarity. Slot 2 is made to hold the request's system prompt (sent straight to the
    server), so the server prefers it while slotkeeper pins the request to an empty slot.
    Whatever the server does (a surface that translates /v1/messages gets it pinned), the
    verification must say what /slots says."""
    server = make_llama()
    system = long_system_prompt(120, seed=70)
    r = requests.post(server.url + "/v1/chat/completions", timeout=600, json={
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
        "max_tokens": 2, "temperature": 0, "id_slot": 2})
    assert r.status_code == 200
    proxy = make_proxy(server, slotkeeper_small_request_chars=0, slotkeeper_max_seeds=0,
                       slotkeeper_idle_save_seconds=0)
    before = slot_tasks(server.url)
    r = requests.post(proxy.url + "/v1/messages", timeout=600, headers={
        "x-session-id": "verify-1", "anthropic-version": "2023-06-01"}, json={
        "model": "gemma", "system": system, "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": "Hello there, answer briefly."}]})
    assert r.status_code == 200, r.text[:500]
    after = slot_tasks(server.url)
    ran = [slot for slot in after if after[slot] != before.get(slot)]
    assert len(ran) == 1, (before, after)
    truth, pinned = ran[0], int(r.headers["X-Slotkeeper-Slot"])
    verified = r.headers.get("X-Slotkeeper-Verified")
    metrics = requests.get(proxy.url + "/slotkeeper/metrics", timeout=30).text
    mismatches = next(float(line.split()[-1]) for line in metrics.splitlines()
                      if line.startswith("slotkeeper_slot_mismatches_total"))
    print(f"pinned slot {pinned}, ran on slot {truth}, X-Slotkeeper-Verified: {verified}")
    current = requests.get(proxy.url + "/api/sessions/current", timeout=30).json()
    slots = next(iter(current["upstreams"].values()))["slots"]
    if truth == pinned:
        assert verified in ("yes", "reuse"), verified
        assert mismatches == 0
        assert slots[str(pinned)]["resident"] is True
    else:
        assert verified == f"no: ran on slot {truth}", (verified, truth, pinned)
        assert mismatches == 1
        # The state no longer claims the session's KV is in the pinned slot.
        assert slots[str(pinned)]["session"] == "verify-1"
        assert slots[str(pinned)]["resident"] is False, slots
