"""llama-server's own RAM prompt cache behind slotkeeper (issue #31): a session handed over to
a dissimilar one is parked by the server in RAM and brought back from there, with no disk
restore; on a server without that cache (--cache-ram 0) the answer shows the miss and the next
handovers restore from disk. The real llama-server, default --slot-prompt-similarity."""

from __future__ import annotations

import re
import time

import pytest
import requests
from fake_upstream import Fault, FakeFaultyLlama
from helpers import Conversation
from reliability import reliability  # noqa: F401  (the fixture)
from slotkeeper.snapshots.slotfiles import SlotFolder
from testbed import long_system_prompt

RELIABILITY_AREA = "llama-server faults"
OPTIONS = {"slotkeeper_small_request_chars": 0, "slotkeeper_min_save_tokens": 0,
           "slotkeeper_idle_save_seconds": 0, "slotkeeper_max_seeds": 0}


@pytest.fixture
def slot_dir(tmp_path):
    path = tmp_path / "slots"
    path.mkdir()
    return path


def metric(url: str, name: str, labels: str = "") -> float:
    text = requests.get(url + "/slotkeeper/metrics", timeout=30).text
    pattern = rf"^{name}(?:{{[^}}]*{re.escape(labels)}[^}}]*}})? (\S+)$"
    return sum(float(v) for v in re.findall(pattern, text, re.M))


HANDED_BACK = re.compile(r"handed back( \(by the hand-back file\))? to the server's RAM cache")
BY_FILE = "(by the hand-back file)"


def folder_metas(slot_dir) -> list:
    return SlotFolder(slot_dir).list_sessions()


def line_of(log: str, session: str, nth: int) -> str:
    """The proxy's routing line of the session's nth request (1-based)."""
    lines = [line for line in log.splitlines() if f"{session} (header" in line]
    return lines[nth - 1]


def two_sessions() -> tuple[Conversation, Conversation]:
    # different system prompts: a pinned handover between them keeps < half of the slot
    return (Conversation("ram-a", long_system_prompt(700, seed=331)),
            Conversation("ram-b", long_system_prompt(700, seed=332)))


def test_a_returning_session_comes_back_from_the_servers_ram_cache(make_llama, make_proxy,
                                                                    slot_dir):
    server = make_llama(np=1, ctx=8192, slot_save_path=slot_dir)  # --cache-ram: its default
    proxy = make_proxy(server, slotkeeper_slot_dir=str(slot_dir), **OPTIONS)
    a, b = two_sessions()
    a_first = a.ask(proxy.url, "Name a colour.")
    b.ask(proxy.url, "Name a city.")  # the server parks a in RAM
    a_again = a.ask(proxy.url, "And another?")
    b_again = b.ask(proxy.url, "And another?")
    log = proxy.log_text()
    assert a_again.action == "assigned", (a_again, log[-3000:])
    assert "expected back from it" in line_of(log, "ram-a", 2), log[-3000:]
    # everything a had (its prompt and reply) came back from RAM: only the new turn prefilled
    assert a_again.cache_n >= a_first.prompt_tokens, (a_first, a_again)
    assert b_again.action == "assigned" and b_again.cache_n >= 0.9 * b.turns[0].prompt_tokens
    # the cache confirmed by a's answer: b's return saved nothing of a on the way
    assert "saved ram-a" not in line_of(log, "ram-b", 2), log[-3000:]
    assert metric(proxy.url, "slotkeeper_ram_cache_total", 'result="hit"') == 2
    assert metric(proxy.url, "slotkeeper_ram_cache_total", 'result="miss"') == 0
    assert metric(proxy.url, "slotkeeper_slot_operations_total", 'operation="restore"') == 0
    assert "restored" not in log


def test_without_the_ram_cache_the_miss_sends_the_next_returns_to_the_disk(make_llama,
                                                                           make_proxy, slot_dir):
    """A server run with --cache-ram 0 behind the default option: the first return costs a
    prefill (the option said the cache is there, so the handover saved nothing), its answer
    shows the miss, and from then on the handovers save and restore through the disk."""
    server = make_llama(np=1, ctx=8192, slot_save_path=slot_dir, extra=["--cache-ram", "0"])
    proxy = make_proxy(server, slotkeeper_slot_dir=str(slot_dir), **OPTIONS)
    a, b = two_sessions()
    a.ask(proxy.url, "Name a colour.")
    b.ask(proxy.url, "Name a city.")  # a left to the RAM cache the option says is there
    a_again = a.ask(proxy.url, "And another?")  # predicted from RAM: the server prefilled it
    b.ask(proxy.url, "And another?")  # after the miss: a saved on the way out
    a_third = a.ask(proxy.url, "One more?")  # from the disk
    log = proxy.log_text()
    assert a_again.action == "assigned" and a_again.prompt_n >= 0.8 * a_again.prompt_tokens
    assert metric(proxy.url, "slotkeeper_ram_cache_total", 'result="miss"') == 1
    assert "reused" in log and "restore from disk" in log, log[-3000:]
    assert "saved ram-a" in line_of(log, "ram-b", 2), log[-3000:]
    assert a_third.action == "restored", (a_third, log[-3000:])
    assert a_third.cache_n >= a_again.prompt_tokens, (a_again, a_third)


def three_sharing_one_system_prompt(tag: str) -> list[Conversation]:
    system = long_system_prompt(700, seed=333)
    return [Conversation(f"{tag}-{name}", system) for name in ("a", "b", "c")]


def test_sessions_of_one_system_prompt_are_handed_back_through_the_ram_cache(
        make_llama, make_proxy, slot_dir):
    """Three sessions of one system prompt on two slots: a pinned request keeps the slot's
    shared prompt, so the server alone never looks in its cache. Second turns: each session's
    snapshot (taken for the next one's prefix) holds all the cache does, and reading it is
    ~free here, so it is restored; the session it displaces is left to the cache, unsaved.
    Third turns: the cache holds more than the snapshots, slotkeeper hands the slot back first
    and the returning session loads its whole conversation from RAM, as much as llama-server's
    best own setting here (`-np 1 -sps 0`, which swaps on every request) gets on the same
    turns, with no file written or read on the way."""
    baseline = make_llama(np=1, ctx=8192, extra=["--slot-prompt-similarity", "0"])
    server = make_llama(np=2, ctx=8192, slot_save_path=slot_dir)  # --cache-ram: its default
    proxy = make_proxy(server, slotkeeper_slot_dir=str(slot_dir), **OPTIONS)
    straight, through = three_sharing_one_system_prompt("s"), three_sharing_one_system_prompt("p")
    for url, sessions in ((baseline.url, straight), (proxy.url, through)):
        ask_three_turns(url, sessions)
    log = proxy.log_text()
    for (mine, theirs) in zip(through, straight):
        for turn in (1, 2):  # everything of the turn before (prompt and reply) came back
            assert mine.turns[turn].cache_n >= mine.turns[turn - 1].prompt_tokens, (
                mine.session, mine.turns, log[-3000:])
        assert mine.turns[2].cache_n >= theirs.turns[2].cache_n - 8, (mine.turns, theirs.turns)
    by_file = 0
    for mine in through:  # every third turn: handed back, nothing saved or restored
        returning = line_of(log, mine.session, 3)
        assert HANDED_BACK.search(returning), log[-3000:]
        assert "saved" not in returning and "restored" not in returning, returning
        by_file += BY_FILE in returning
    # The first hand-back call left its slot holding only the call's prompt: kept as the
    # model's hand-back file, which then clears a slot whose session the server had copied
    # into its cache while it sat idle, without a prompt evaluation.
    assert [m.kind for m in folder_metas(slot_dir)].count("hand-back") == 1, log[-3000:]
    assert by_file >= 1, log[-3000:]
    assert metric(proxy.url, "slotkeeper_ram_cache_total", 'result="hit"') >= 3, log[-3000:]
    assert metric(proxy.url, "slotkeeper_ram_cache_total", 'result="miss"') == 0, log[-3000:]


def ask_three_turns(url: str, sessions: list[Conversation]) -> None:
    for question in ("Name a colour.", "And another?", "One more, with a reason?"):
        for conversation in sessions:  # each its own words: no two prompts alike
            conversation.ask(url, f"({conversation.session[2:]}) {question}")


def test_fake_server_refusing_the_hand_back_still_answers_right(make_llama, make_proxy,
                                                                 slot_dir, reliability):
    """A FAKE llama-server front (the real one behind it) answers the hand-back's /completion
    with 500 (the first hand-back: a new conversation's, for its parent's prefix): the session
    is served by the real server all the same, with no claim of a restore, and the next
    returns still hand back (a failed call is not a miss)."""
    server = make_llama(np=2, ctx=8192, slot_save_path=slot_dir)
    fake = FakeFaultyLlama(server.url, faults={
        "POST /completion": Fault(status=500, count=1)}).start()
    try:
        proxy = make_proxy(fake.url, slotkeeper_slot_dir=str(slot_dir), **OPTIONS)
        sessions = three_sharing_one_system_prompt("f")
        ask_three_turns(proxy.url, sessions)
    finally:
        fake.stop()
    log = proxy.log_text()
    routes = [line for line in log.splitlines() if " (header x-session-id) -> slot" in line]
    refused = [line for line in routes if "hand-back to the server's RAM cache failed" in line]
    handed = [line for line in routes if HANDED_BACK.search(line)]
    assert len(refused) == 1 and " assigned " in refused[0], log[-3000:]
    by_call = [line for line in handed if BY_FILE not in line]
    assert sum(1 for line in fake.seen if "/completion" in line and "chat" not in line) == (
        1 + len(by_call)), (fake.seen, log[-3000:])
    assert handed and all(routes.index(line) > routes.index(refused[0]) for line in handed)
    failed = next(c for c in sessions if f"{c.session} (header" in refused[0])
    # a first turn's hand-back (its parent's prefix from RAM) or a return's
    failed_turn = failed.turns[[line for line in routes
                                if f"{failed.session} (header" in line].index(refused[0])]
    for conversation in sessions:  # every later turn got back all of the turn before
        for before, after in zip(conversation.turns, conversation.turns[1:]):
            if after is not failed_turn:
                assert after.cache_n >= before.prompt_tokens, conversation.turns
    assert metric(proxy.url, "slotkeeper_ram_cache_total", 'result="miss"') == 0, log[-3000:]
    reliability.row("FAKE llama-server answering the hand-back to its RAM cache (a one-token "
                    "/completion pinned to the slot) with 500",
                    outcome=f"the session is served by the server with no restore "
                            f"claimed (reused {failed_turn.cache_n} of "
                            f"{failed_turn.prompt_tokens} tokens); the next returns "
                            f"hand back and come back whole from RAM",
                    lost="none (at most a prefill of the session)")


def seed_files(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("seed_"))


def test_a_new_conversation_starts_from_its_idle_parents_copy_in_ram(make_llama, make_proxy,
                                                                     slot_dir):
    """The second conversation of a system prompt, on an empty slot while the first sits idle
    in the other: slotkeeper hands the empty slot back, the call's start makes the server copy
    the idle parent into its RAM cache, and the request loads that copy and keeps the shared
    opening: as much as llama-server's best own setting here (`-np 1 -sps 0`) reuses on the
    same turns, with no slot file written or read (no seeds, no idle saves here). The parent
    keeps its slot and its whole conversation."""
    baseline = make_llama(np=1, ctx=8192, extra=["--slot-prompt-similarity", "0"])
    server = make_llama(np=2, ctx=8192, slot_save_path=slot_dir)  # --cache-ram: its default
    proxy = make_proxy(server, slotkeeper_slot_dir=str(slot_dir), **OPTIONS)
    straight, through = three_sharing_one_system_prompt("s"), three_sharing_one_system_prompt("q")
    for url, (a, b, _c) in ((baseline.url, straight), (proxy.url, through)):
        a.ask(url, f"({a.session}) Name a colour.")
        b.ask(url, f"({b.session}) Name a city.")
    a, b, _c = through
    log = proxy.log_text()
    line = line_of(log, b.session, 1)
    assert "prefix expected from it" in line and a.session in line, log[-3000:]
    assert b.turns[0].slot != a.turns[0].slot, (a.turns, b.turns)
    assert b.turns[0].cache_n >= straight[1].turns[0].cache_n - 8, (b.turns, straight[1].turns)
    assert b.turns[0].cache_n >= 0.5 * b.turns[0].prompt_tokens, b.turns
    # nothing written on the answers' paths but the model's hand-back file, once (2 tokens)
    assert [m.kind for m in folder_metas(slot_dir)] == ["hand-back"], log[-3000:]
    assert len(list(slot_dir.iterdir())) == 2, (list(slot_dir.iterdir()), log[-3000:])
    a_again = a.ask(proxy.url, f"({a.session}) And another?")
    assert a_again.action == "kept" and a_again.cache_n >= a.turns[0].prompt_tokens, a.turns
    assert metric(proxy.url, "slotkeeper_ram_cache_total", 'result="hit"') >= 1, log[-3000:]
    assert metric(proxy.url, "slotkeeper_ram_cache_total", 'result="miss"') == 0, log[-3000:]


def test_a_third_conversation_starts_from_an_idle_twins_copy_by_the_file(make_llama, make_proxy,
                                                                         slot_dir):
    """Three conversations of one system prompt, one after the other, on three slots. The
    second's parent (the first) has not sat idle at a launch yet: its empty slot is handed back
    by the call. The third's parent (the second) spoke last and is not in the cache either, but
    the first is, copied at the second's start: the third's slot is handed back by the 2-token
    file and loads the first's copy, keeping the opening as `-np 1 -sps 0` does on the same
    turns."""
    baseline = make_llama(np=1, ctx=8192, extra=["--slot-prompt-similarity", "0"])
    server = make_llama(np=3, ctx=12288, slot_save_path=slot_dir)  # --cache-ram: its default
    proxy = make_proxy(server, slotkeeper_slot_dir=str(slot_dir), **OPTIONS)
    straight, through = three_sharing_one_system_prompt("t"), three_sharing_one_system_prompt("u")
    for url, conversations in ((baseline.url, straight), (proxy.url, through)):
        for conv, ask in zip(conversations, ("Name a colour.", "Name a city.", "Name a river.")):
            conv.ask(url, f"({conv.session}) {ask}")
    a, b, c = through
    log = proxy.log_text()
    assert BY_FILE not in line_of(log, b.session, 1), log[-3000:]
    third = line_of(log, c.session, 1)
    assert BY_FILE in third and f"from {a.session}'s copy" in third, log[-3000:]
    assert len({a.turns[0].slot, b.turns[0].slot, c.turns[0].slot}) == 3, through
    assert c.turns[0].cache_n >= straight[2].turns[0].cache_n - 8, (c.turns, straight[2].turns)
    assert c.turns[0].cache_n >= 0.5 * c.turns[0].prompt_tokens, c.turns
    assert metric(proxy.url, "slotkeeper_ram_cache_total", 'result="miss"') == 0, log[-3000:]


def test_the_seed_waits_for_a_quiet_server_when_the_ram_cache_serves_new_conversations(
        make_llama, make_proxy, slot_dir):
    """With idle saves on: the second conversation's answer ends with no seed taken (it held
    the answer's end 1.36 s at the bench's cap, and the RAM cache serves the next
    conversations from an idle parent); a second of quiet later the seed is there, and the
    session whose slot it was cut from still answers its next turn whole."""
    server = make_llama(np=2, ctx=8192, slot_save_path=slot_dir)
    options = OPTIONS | {"slotkeeper_max_seeds": 4, "slotkeeper_seed_min_chars": 100,
                         "slotkeeper_idle_save_seconds": 1}
    proxy = make_proxy(server, slotkeeper_slot_dir=str(slot_dir), **options)
    a, b, _c = three_sharing_one_system_prompt("w")
    a.ask(proxy.url, f"({a.session}) Name a colour.")
    b.ask(proxy.url, f"({b.session}) Name a city.")
    assert seed_files(slot_dir) == [], proxy.log_text()[-3000:]
    deadline = time.monotonic() + 30
    while not seed_files(slot_dir) and time.monotonic() < deadline:
        time.sleep(0.25)
    log = proxy.log_text()
    assert seed_files(slot_dir), log[-3000:]
    assert "took seed" in log, log[-3000:]
    for conversation in (a, b):
        again = conversation.ask(proxy.url, f"({conversation.session}) And another?")
        assert again.cache_n >= conversation.turns[0].prompt_tokens, (conversation.turns,
                                                                      log[-3000:])
