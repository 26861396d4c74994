"""A request slotkeeper does not own gets what llama-server's own RAM prompt cache would give it
(issue #32, item 7b), against real llama-servers with the default `--slot-prompt-similarity`
and RAM cache: the same sequence straight and through slotkeeper, each on a fresh 1-slot
server. A pinned request never consults the RAM cache on an empty slot (b11434's
`get_available_slot`: its keep ratio is 0/0), so slotkeeper must not pin it there."""

from __future__ import annotations

import requests
from testbed import long_system_prompt

PROMPT = long_system_prompt(220, seed=71)  # ~1.5k characters: a side request, no session
OTHER = long_system_prompt(220, seed=72)


def ask(url: str, text: str) -> dict:
    r = requests.post(url + "/v1/chat/completions", timeout=600, json={
        "messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text[:500]
    return {"timings": r.json()["timings"], "action": r.headers.get("X-Slotkeeper-Action", ""),
            "detail": r.headers.get("X-Slotkeeper-Detail", "")}


def erase_slot(server_url: str) -> None:
    r = requests.post(server_url + "/slots/0?action=erase", timeout=60)
    assert r.status_code == 200, r.text


def run(server_url: str, url: str) -> dict:
    """P; another prompt on the same slot (the server parks P in its RAM cache); the slot
    erased; P with a few more words: what the last one reuses."""
    ask(url, PROMPT)
    ask(url, OTHER)
    erase_slot(server_url)
    slots = requests.get(server_url + "/slots", timeout=30).json()
    assert all(s.get("n_past", 0) == 0 or not s.get("prompt") for s in slots), slots
    return ask(url, PROMPT + " And one more thing.")


def test_a_side_request_on_an_empty_slot_reuses_the_servers_ram_cache(make_llama, make_proxy,
                                                                      tmp_path):
    straight_server = make_llama(np=1, ctx=4096, slot_save_path=tmp_path / "straight")
    straight = run(straight_server.url, straight_server.url)
    assert straight["timings"]["cache_n"] > 200, straight  # the server's RAM cache gave P back

    server = make_llama(np=1, ctx=4096, slot_save_path=tmp_path / "slots")
    proxy = make_proxy(server, slotkeeper_slot_dir=str(tmp_path / "slots"))
    through = run(server.url, proxy.url)
    assert through["timings"]["cache_n"] >= straight["timings"]["cache_n"], (through, straight)
    assert through["timings"]["prompt_n"] <= straight["timings"]["prompt_n"], (through, straight)
