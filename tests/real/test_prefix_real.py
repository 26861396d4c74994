"""Issue #19 against the real llama-server through a real mitmdump: clients that do not fit
slotkeeper's old rules must do at least as well as llama-server alone.

- A header-less agent that rebuilds its prompt every turn reuses at least what a direct
  llama-server reuses on the same turns (`--slot-prompt-similarity 0`, and the default), and
  leaves no fork snapshots behind.
- A client that sends its next turn the moment it reads the final event (the previous
  response still open) has every later turn `kept`.
- A chat UI's title request that arrives before its chat's next turn does not take the chat's
  slot: the turn keeps its KV.
- A forked conversation starts from its parent's prefix."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import requests
from agents import RebuiltPromptAgent, words
from helpers import started_from_ram
from testbed import long_system_prompt

TIMEOUT = 600


def post(url: str, messages: list[dict], headers: dict | None = None, n_predict: int = 8,
         **extra) -> dict:
    r = requests.post(url + "/v1/chat/completions", headers=headers or {}, timeout=TIMEOUT,
                      json={"messages": messages, "max_tokens": n_predict, "temperature": 0,
                            **extra})
    assert r.status_code == 200, r.text[:500]
    data = r.json()
    return {"session": r.headers.get("X-Slotkeeper-Session"),
            "slot": r.headers.get("X-Slotkeeper-Slot"),
            "action": r.headers.get("X-Slotkeeper-Action"), "timings": data["timings"],
            "reply": data["choices"][0]["message"]["content"]}


def snapshots_in(folder: Path) -> list[str]:
    """Session snapshots (seeds, named `seed~<hex>`, are files `seed_...`)."""
    return sorted(p.name for p in folder.glob("*.bin") if not p.name.startswith("seed_"))


# ---- the rebuilt-prompt agent --------------------------------------------------------------

def test_rebuilt_prompt_agent_reuses_what_llama_server_alone_reuses(make_llama, make_proxy,
                                                                   tmp_path):
    """Against llama-server alone with both of its own settings: `--slot-prompt-similarity 0`
    (its RAM cache handles every slot change) and the default (it picks the most similar
    slot); per turn, the better of the two."""
    slots = tmp_path / "slots"
    direct = make_llama(np=2, ctx=8192, extra=["--slot-prompt-similarity", "0"])
    default = make_llama(np=2, ctx=8192)
    server = make_llama(np=2, ctx=8192, slot_save_path=slots)
    proxy = make_proxy(server, slotkeeper_slot_dir=str(slots), slotkeeper_idle_save_seconds=1)
    agent = RebuiltPromptAgent()
    through, alone = [], []
    for turn in range(1, 5):
        messages = agent.messages(turn)
        through.append(post(proxy.url, messages))
        best = max((post(direct.url, messages), post(default.url, messages)),
                   key=lambda t: t["timings"]["cache_n"])
        alone.append(best)
        agent.record(turn, through[-1]["reply"])
    sessions = {t["session"] for t in through}
    assert len(sessions) == 1, through  # one conversation, not a fork per turn
    assert [t["action"] for t in through[1:]] == ["kept"] * 3, through
    for mine, theirs in zip(through[1:], alone[1:]):
        # The same tokens reused, give or take the one token the server always evaluates.
        assert mine["timings"]["cache_n"] >= theirs["timings"]["cache_n"] - 1, (mine, theirs)
        assert mine["timings"]["cache_n"] > 0, mine
    later = sum(t["timings"]["prompt_n"] for t in through[1:])
    direct_later = sum(t["timings"]["prompt_n"] for t in alone[1:])
    print("rebuilt agent prefill per turn, slotkeeper:",
          [t["timings"]["prompt_n"] for t in through], "llama-server alone (best setting):",
          [t["timings"]["prompt_n"] for t in alone])
    assert later <= direct_later + 3, (later, direct_later)
    # Forks leave nothing: one snapshot at most (the conversation's own, by its idle save).
    time.sleep(3)
    assert len(snapshots_in(slots)) <= 1, snapshots_in(slots)


# ---- the next turn on the final event --------------------------------------------------------

def _open_until_final(url: str, path: str, body: dict, headers: dict) -> tuple[dict, str,
                                                                                 requests.Response]:
    """POST a streamed request and read it until its final event (Ollama's `done: true`, the
    SSE event with a finish reason); the response stays open. (headers, content, response)"""
    response = requests.post(url + path, json=body, headers=headers, stream=True,
                             timeout=TIMEOUT)
    assert response.status_code == 200, response.text[:500]
    parts = []
    for raw in response.iter_lines():
        line = raw.decode()
        if path == "/api/chat":
            if not line.strip():
                continue
            event = json.loads(line)
            parts.append((event.get("message") or {}).get("content") or "")
            if event.get("done"):
                break
        elif line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line.removeprefix("data: "))
            for choice in event.get("choices", []):
                parts.append((choice.get("delta") or {}).get("content") or "")
            if any(c.get("finish_reason") for c in event.get("choices", [])):
                break
    return dict(response.headers), "".join(parts), response


def _early_chat(url: str, path: str, name: str, system: str, turns: int,
                headers: dict) -> list[dict]:
    """A chat that sends each next turn on the previous answer's final event."""
    history, seen, still_open = [{"role": "system", "content": system}], [], []
    for turn in range(1, turns + 1):
        history.append({"role": "user", "content": f"[{name} {turn}] " + words(40, name + str(turn))})
        body = ({"model": "m", "messages": history, "stream": True,
                 "options": {"temperature": 0, "num_predict": 6}} if path == "/api/chat" else
                {"messages": history, "stream": True, "temperature": 0, "max_tokens": 6})
        got, content, response = _open_until_final(url, path, body, headers)
        seen.append(got)
        still_open.append(response)
        history.append({"role": "assistant", "content": content})
    for response in still_open:
        response.close()
    return seen


@pytest.mark.parametrize("path", ["/api/chat", "/v1/chat/completions"])
def test_next_turn_sent_on_the_final_event_keeps_its_slot(make_llama, make_proxy, tmp_path,
                                                         path):
    """The Ollama JavaScript client (header-less) and an SSE client with its own session id:
    two chats at once, each sending its next turn the moment it reads the final event."""
    slots = tmp_path / "slots"
    server = make_llama(np=4, ctx=16384, slot_save_path=slots)
    proxy = make_proxy(server, slotkeeper_slot_dir=str(slots))
    system = "You are a helpful assistant in a chat app. " + words(500, "chat-app")
    results: dict[str, list[dict]] = {}

    def chat(name: str) -> None:
        headers = {} if path == "/api/chat" else {"x-session-id": name}
        results[name] = _early_chat(proxy.url, path, name, system, 4, headers)

    threads = [threading.Thread(target=chat, args=(name,)) for name in ("one", "two")]
    for thread in threads:
        thread.start()
        time.sleep(0.3)
    for thread in threads:
        thread.join(TIMEOUT)
    for name, seen in results.items():
        actions = [h.get("X-Slotkeeper-Action") for h in seen]
        slots_used = {h.get("X-Slotkeeper-Slot") for h in seen}
        assert actions[1:] == ["kept"] * 3, (name, seen)
        assert len(slots_used) == 1, (name, seen)
    assert len(results) == 2


# ---- a title request before its chat's turn ----------------------------------------------------

TITLE_TASK = ("### Task:\nGenerate a concise, 3-5 word title with an emoji summarizing the chat "
              "history.\n### Chat History:\n<chat_history>\n")


def test_title_request_before_its_chats_turn_leaves_the_chat_its_kv(make_llama, make_proxy,
                                                                     tmp_path):
    """OpenWebUI-like: the chat's id in a header and in the body, no system prompt; its title
    request (the same id, ~3,900 characters: the task and a transcript) is sent first, and
    the chat's next turn right after the title's response headers."""
    slots = tmp_path / "slots"
    server = make_llama(np=4, ctx=16384, slot_save_path=slots)
    proxy = make_proxy(server, slotkeeper_slot_dir=str(slots))
    headers = {"X-OpenWebUI-Chat-Id": "chat-1"}
    chat = [{"role": "user", "content": "Please read this document:\n" + words(450, "doc")
             + "\n\nWhat does it say about caches?"}]
    first = post(proxy.url, chat, headers, chat_id="chat-1")
    chat.append({"role": "assistant", "content": first["reply"]})
    transcript = "\n".join(f"{m['role'].upper()}: {m['content']}" for m in chat)
    title = [{"role": "user", "content": (TITLE_TASK + transcript)[:3880] + "\n</chat_history>"}]
    opened = threading.Event()
    title_seen: dict = {}

    def send_title() -> None:
        with requests.post(proxy.url + "/v1/chat/completions", headers=headers, stream=True,
                           timeout=TIMEOUT, json={"messages": title, "max_tokens": 16,
                                                  "stream": True, "chat_id": "chat-1"}) as r:
            title_seen.update(r.headers)
            opened.set()
            for _ in r.iter_lines():
                pass

    sender = threading.Thread(target=send_title)
    sender.start()
    assert opened.wait(TIMEOUT)
    chat.append({"role": "user", "content": "And about tokens?"})
    second = post(proxy.url, chat, headers, chat_id="chat-1")
    sender.join(TIMEOUT)
    assert title_seen.get("X-Slotkeeper-Action") == "side", title_seen
    assert title_seen.get("X-Slotkeeper-Slot") != first["slot"], title_seen
    assert second["slot"] == first["slot"] and second["action"] == "kept", second
    previous = first["timings"]["cache_n"] + first["timings"]["prompt_n"]
    assert second["timings"]["cache_n"] >= 0.9 * previous, (second, previous)


# ---- a fork starts from its parent's prefix ---------------------------------------------------

def test_forked_conversation_starts_from_its_parents_prefix(make_llama, make_proxy, tmp_path):
    """A header-less conversation, then a fork of it (its last question edited, as a chat UI's
    "edit" sends): a new session on another slot, started from the parent's snapshot; the
    parent's next turn still keeps its own slot and KV."""
    slots = tmp_path / "slots"
    server = make_llama(np=4, ctx=16384, slot_save_path=slots)
    proxy = make_proxy(server, slotkeeper_slot_dir=str(slots), slotkeeper_idle_save_seconds=1)
    system = long_system_prompt(200, seed=81)
    parent = [{"role": "system", "content": system},
              {"role": "user", "content": "Read this:\n" + words(700, "fork-doc")}]
    first = post(proxy.url, parent)
    parent += [{"role": "assistant", "content": first["reply"]},
               {"role": "user", "content": "Summarise it."}]
    second = post(proxy.url, parent)
    assert second["action"] == "kept", second
    time.sleep(3)  # the idle save writes the parent's snapshot
    assert snapshots_in(slots), "the parent was not saved"
    fork = [*parent[:-1], {"role": "user", "content": "List its three main points."}]
    forked = post(proxy.url, fork)
    assert forked["session"] != second["session"] and forked["slot"] != second["slot"], forked
    # from the parent's snapshot, or from its copy in the server's RAM cache (the parent sits
    # idle in its slot)
    assert (forked["action"] == "restored"
            or started_from_ram(proxy.log_text(), forked["session"])), forked
    shared = first["timings"]["cache_n"] + first["timings"]["prompt_n"]  # system + document
    assert forked["timings"]["cache_n"] >= 0.9 * shared, (forked, shared)
    parent += [{"role": "assistant", "content": second["reply"]},
               {"role": "user", "content": "Thanks."}]
    third = post(proxy.url, parent)
    assert third["session"] == second["session"] and third["action"] == "kept", third
    before = second["timings"]["cache_n"] + second["timings"]["prompt_n"]
    assert third["timings"]["cache_n"] >= 0.9 * before, third


# ---- new conversations of a short system prompt (issue #32) -----------------------------------

def short_prompt_conversations() -> list[list[dict]]:
    """Three header-less conversations of one coding agent: a ~1,150-character system prompt
    and two example exchanges, shared, then each its own task."""
    system = ("You are a careful coding agent. " + words(150, "short-system"))[:1150]
    examples = []
    for k in (1, 2):
        examples += [{"role": "user", "content": "Example task: " + words(30, f"ex{k}")},
                     {"role": "assistant", "content": "Example answer: " + words(20, f"exa{k}")}]
    return [[{"role": "system", "content": system}, *examples] for _ in range(3)]


def run_short_prompt_conversations(url: str) -> list[dict]:
    conversations = short_prompt_conversations()
    answers = []
    for turn in range(1, 5):
        for n, messages in enumerate(conversations):
            # A first task of ~1,000 characters: the prompt is over slotkeeper_small_request_chars
            # (2,000), a conversation and not a side request.
            size = 150 if turn == 1 else 40
            messages.append({"role": "user", "content": f"Task {n}, step {turn}: "
                             + words(size, f"task{n}.{turn}")})
            answers.append(post(url, messages))
            messages.append({"role": "assistant", "content": answers[-1]["reply"]})
    return answers


def test_new_conversations_of_a_short_system_prompt_start_from_the_shared_prefix(
        make_llama, make_proxy, tmp_path):
    """Three conversations sharing a short system prompt and examples on 2 slots, turns
    interleaved: each new conversation's first turn reuses the shared prefix, as llama-server
    alone does; in total slotkeeper prefills no more than the better of llama-server's
    default and `-sps 0` on the same requests (issue #32: 643 tokens against 120 before)."""
    slots = tmp_path / "slots"
    default = make_llama(np=2, ctx=8192)
    sps0 = make_llama(np=2, ctx=8192, extra=["--slot-prompt-similarity", "0"])
    server = make_llama(np=2, ctx=8192, slot_save_path=slots)
    proxy = make_proxy(server, slotkeeper_slot_dir=str(slots))
    through = run_short_prompt_conversations(proxy.url)
    alone = {name: run_short_prompt_conversations(s.url)
             for name, s in (("default", default), ("sps0", sps0))}
    prefilled = sum(t["timings"]["prompt_n"] for t in through)
    best = min(sum(t["timings"]["prompt_n"] for t in run) for run in alone.values())
    print("prefilled, slotkeeper:", [t["timings"]["prompt_n"] for t in through],
          {name: [t["timings"]["prompt_n"] for t in run] for name, run in alone.items()})
    for first in through[1:3]:  # the first turns of conversations 2 and 3
        assert first["timings"]["cache_n"] > 100, (first, through)
    assert prefilled <= best + len(through), (prefilled, best)
