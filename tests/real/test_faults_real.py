"""Faults, with real processes: llama-server killed mid-stream and restarted, /slots disabled,
save/restore refused, a read-only or full slot folder, corrupt state and slot files, the proxy
SIGKILLed while it writes the state file or waits for a save, and four proxies sharing one
server. A FAKE llama-server front (tests/bed/fake_upstream.py) is used only where a real server
cannot show the fault on demand (/slots failing with 500, or taking 3 s); those tests say
"fake" in their names.

What every test checks: the client gets an answer or a clean error (never a hang), answers are
the same as llama-server gives directly at temperature 0, no saved session is destroyed or
handed to another, the proxy logs no traceback and llama-server never aborts."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
from fake_upstream import FakeFaultyLlama, Fault
from helpers import eventually
from reliability import problems_in, reliability  # noqa: F401  (reliability: the fixture)
from testbed import LlamaServer, Proxy, long_system_prompt
from throttlefs import ThrottledFolder

from slotkeeper.snapshots.paths import FILE_NAME_RE, file_name_for

RELIABILITY_AREA = "llama-server faults"
# Every session is saved a second after its request, whatever its size (min_save_tokens 0),
# so short prompts are enough to exercise saves and restores.
SAVE_FAST = {"slotkeeper_small_request_chars": 0, "slotkeeper_min_save_tokens": 0,
             "slotkeeper_idle_save_seconds": 1, "slotkeeper_max_seeds": 0}
SYSTEM = long_system_prompt(30, seed=99)  # ~60 tokens: half a second of prefill here


# ---- helpers ---------------------------------------------------------------------------------

@dataclass
class Answer:
    status: int
    content: str | None
    timings: dict[str, Any] | None
    headers: dict[str, str]
    messages: list[dict[str, str]]  # what was sent
    tokens: list[tuple[str, float, dict[str, float]]] = field(default_factory=list)

    @property
    def action(self) -> str | None:
        return self.headers.get("x-slotkeeper-action")

    @property
    def cache_n(self) -> int:
        return (self.timings or {}).get("cache_n", 0)

    @property
    def prompt_tokens(self) -> int:
        t = self.timings or {}
        return t.get("cache_n", 0) + t.get("prompt_n", 0)


@dataclass
class Session:
    """One conversation: every turn sends the system prompt and the whole history."""

    sid: str
    system: str = SYSTEM
    history: list[dict[str, str]] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)

    def ask(self, url: str, question: str, n_predict: int = 6, timeout: float = 300,
            **extra: Any) -> Answer:
        messages = [{"role": "system", "content": self.system}, *self.history,
                    {"role": "user", "content": f"({self.sid}) {question}"}]
        r = requests.post(url + "/v1/chat/completions", timeout=timeout,
                          headers={"X-Session-Id": self.sid},
                          json={"messages": messages, "temperature": 0,
                                "max_tokens": n_predict, **LOGPROBS, **extra})
        headers = {k.lower(): v for k, v in r.headers.items()}
        if r.status_code != 200:
            answer = Answer(r.status_code, None, None, headers, messages)
        else:
            data = r.json()
            content = data["choices"][0]["message"]["content"]
            answer = Answer(200, content, data.get("timings"), headers, messages,
                            tokens_of(data))
            self.history = [*messages[1:], {"role": "assistant", "content": content}]
        self.answers.append(answer)
        return answer


LOGPROBS = {"logprobs": True, "top_logprobs": 5}
# Measured: the same prompt prefilled cold or on top of a reused prefix gives log-probabilities
# that differ by up to ~0.35 nats here (other batch shapes, other rounding in the quantized
# matmuls), so where two candidate tokens are that close, greedy decoding may pick either.
NEAR_TIE = 1.0


def tokens_of(data: dict) -> list[tuple[str, float, dict[str, float]]]:
    content = (data["choices"][0].get("logprobs") or {}).get("content") or []
    return [(t["token"], t["logprob"], {x["token"]: x["logprob"] for x in t["top_logprobs"]})
            for t in content]


def direct(llama: LlamaServer, messages: list[dict[str, str]], n_predict: int = 6
           ) -> list[tuple[str, float, dict[str, float]]]:
    """What llama-server answers the same messages directly, from a cold prompt."""
    r = requests.post(llama.url + "/v1/chat/completions", timeout=300, json={
        "messages": messages, "temperature": 0, "max_tokens": n_predict,
        "cache_prompt": False, **LOGPROBS})
    assert r.status_code == 200, r.text
    return tokens_of(r.json())


NEAR_TIES: list[str] = []  # answers that left the direct one at a near tie (for the table)


def same_as_direct(answer: Answer, cold: list[tuple[str, float, dict[str, float]]]) -> bool:
    """The answer's tokens equal the direct answer's, or equal them up to a token where the
    direct answer had the answer's token as a near tie (and from there the texts differ
    legitimately). An answer from someone else's KV leaves at a clear choice."""
    for (token, _, _), (cold_token, cold_lp, cold_top) in zip(answer.tokens, cold):
        if token != cold_token:
            if token in cold_top and cold_lp - cold_top[token] <= NEAR_TIE:
                NEAR_TIES.append(f"{token!r} for {cold_token!r}")
                return True
            return False
    return len(answer.tokens) == len(cold)


def assert_same_as_direct(llama: LlamaServer, answers: list[Answer]) -> None:
    """Each answer against llama-server's direct one (asked four at a time: the server batches
    its slots, which is faster than one after another)."""
    assert all(a.status == 200 for a in answers), [a.status for a in answers]
    with ThreadPoolExecutor(4) as pool:
        colds = list(pool.map(lambda a: direct(llama, a.messages), answers))
    for answer, cold in zip(answers, colds):
        assert same_as_direct(answer, cold), (answer.action, answer.tokens, cold)


def snapshot_digests(slot_dir: Path, sid: str) -> tuple[str, dict]:
    """The KV file's digest and the meta but for when it was last used (restoring the
    snapshot as another session's prefix counts as a use)."""
    state_path, meta_path = snapshot_files(slot_dir, sid)
    meta = json.loads(meta_path.read_text())
    meta.pop("last_used", None)
    return file_digest(state_path), meta


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot_files(slot_dir: Path, sid: str) -> tuple[Path, Path]:
    state = slot_dir / file_name_for(sid)
    return state, state.with_suffix(".json")


def wait_saved(slot_dir: Path, sid: str, newer_than: float = 0.0, timeout: float = 20) -> dict:
    """The session's meta once a save newer than `newer_than` (a time.time()) is written."""
    _, meta_path = snapshot_files(slot_dir, sid)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if meta_path.stat().st_mtime > newer_than:
                return json.loads(meta_path.read_text())
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"{sid} not saved within {timeout} s")


def state_owners(path: Path) -> list[str]:
    doc = json.loads(path.read_text())  # raises if the file is not whole
    return [s["owner"] for up in doc["upstreams"].values() for s in up["slots"].values()]


def clean(*processes: Proxy | LlamaServer) -> None:
    for p in processes:
        found = problems_in(p.log_text())
        assert not found, (p.log, found[:5])


@pytest.fixture
def slot_dir(tmp_path: Path) -> Path:
    path = tmp_path / "slots"
    path.mkdir()
    return path


# ---- llama-server killed mid-stream, restarted ---------------------------------------------

def test_llama_server_killed_mid_stream_then_restarted(make_llama, make_proxy, slot_dir, llama,
                                                       reliability):
    server = make_llama(np=2, ctx=4096, slot_save_path=slot_dir)
    proxy = make_proxy(server, slotkeeper_slot_dir=str(slot_dir), **SAVE_FAST)
    keep = Session("kept-safe")
    before = time.time()
    keep.ask(proxy.url, "Name a prime number.")
    meta = wait_saved(slot_dir, keep.sid, newer_than=before)
    digests = snapshot_digests(slot_dir, keep.sid)

    victim = Session("victim")
    body = {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": "Count from one to two hundred in words."}],
            "temperature": 0, "max_tokens": 400, "stream": True}
    # A second, non-streamed request generating in the other slot when the server dies.
    plain: dict[str, Any] = {}

    def plain_request() -> None:
        started = time.monotonic()
        r = requests.post(proxy.url + "/v1/chat/completions", timeout=120,
                          headers={"X-Session-Id": "victim-plain"},
                          json={**body, "stream": False})
        plain.update(status=r.status_code, ended=time.monotonic(), took=time.monotonic()
                     - started)

    plain_thread = threading.Thread(target=plain_request)
    plain_thread.start()
    time.sleep(0.5)
    events, error, killed_at = 0, None, None
    with requests.post(proxy.url + "/v1/chat/completions", json=body, stream=True, timeout=60,
                       headers={"X-Session-Id": victim.sid}) as r:
        assert r.status_code == 200
        try:
            for line in r.iter_lines():
                if line.startswith(b"data: {"):
                    events += 1
                if line == b"data: [DONE]":
                    break
                if events == 5 and killed_at is None:
                    server.kill()  # SIGKILL, mid-generation
                    killed_at = time.monotonic()
        except requests.RequestException as e:
            error = e
    cut_after = time.monotonic() - killed_at
    assert killed_at is not None and cut_after < 10, cut_after
    assert error is not None, "the stream ended as if complete"  # truncated, not [DONE]
    plain_thread.join(60)
    assert plain.get("status") == 502, plain  # mitmproxy's answer: the server went away
    plain_after = plain["ended"] - killed_at
    assert plain_after < 10, plain
    # The sentinel held no connection while these were in flight: their ends said it.
    assert "the answer broke off: slots will be verified" in proxy.log_text()

    started = time.monotonic()
    down = victim.ask(proxy.url, "Are you there?", timeout=60)
    assert down.status == 502 and time.monotonic() - started < 10, down
    assert proxy.alive

    server.start()  # same port, empty slots
    assert digests == snapshot_digests(slot_dir, keep.sid)
    after_victim = victim.ask(proxy.url, "Are you there now?")
    after_keep = keep.ask(proxy.url, "And one more prime?")
    assert after_keep.action == "restored", after_keep.headers
    assert after_keep.cache_n >= 0.9 * meta["n_tokens"], (after_keep.cache_n, meta)
    assert_same_as_direct(llama, [after_victim, after_keep])
    clean(proxy, server)
    reliability.row(
        "llama-server SIGKILLed mid-stream (after 5 SSE events), then restarted on its port",
        outcome=f"the client's stream broke off {cut_after:.1f} s after the kill (a "
                f"connection error, no [DONE], no hang); a non-streamed request generating in "
                f"the other slot got 502 {max(plain_after, 0):.1f} s after the kill; a request "
                f"while it was down got 502 "
                f"at once; after the restart both sessions answered as llama-server does "
                f"directly, and the saved one was restored (reused {after_keep.cache_n} of "
                f"{meta['n_tokens']} saved tokens) from a file left untouched",
        lost="the answer in flight (the client sees the error)")


# ---- a save queued behind another slot's long prefill ------------------------------------------

WAITED = re.compile(r"saved busy-b from slot \d+: \d+ tokens, \d+ bytes in \d+ ms \((\d+) ms with")


def test_a_save_behind_another_slots_long_prefill_waits_and_the_server_stays_trusted(
        make_llama, make_proxy, slot_dir, reliability):
    """llama-server runs a save on its main loop between two batches: behind another slot's
    4,000-token prefill it waits seconds. The fixed 5 s bound gave up and marked the healthy
    server suspect, and the session was never saved (issue #31, #32 item 3). The bound now
    counts a batch at the measured prefill speed, and a timeout while a slot computes never
    marks the server suspect."""
    server = make_llama(np=2, ctx=16384, slot_save_path=slot_dir)
    proxy = make_proxy(server, slotkeeper_slot_dir=str(slot_dir), **SAVE_FAST)
    b = Session("busy-b", system=long_system_prompt(250, seed=3))
    assert b.ask(proxy.url, "Name a prime.").status == 200  # measures the prefill speed too
    # b's first idle save, on a quiet server, measures the save speed: a save of unmeasured
    # cost never runs while another slot computes (it may take seconds)
    wait_saved(slot_dir, b.sid, timeout=60)
    assert b.ask(proxy.url, "And another?").status == 200
    a = Session("busy-a", system=long_system_prompt(3000, seed=4))  # ~4,000 tokens
    answers: list[Answer] = []
    started = time.time()
    long_turn = threading.Thread(target=lambda: answers.append(a.ask(proxy.url, "Summarize.")))
    long_turn.start()  # b's idle save comes a second later, behind a's first batch
    meta = wait_saved(slot_dir, b.sid, newer_than=started, timeout=120)
    long_turn.join(600)
    assert answers and answers[0].status == 200 and answers[0].timings["prompt_n"] > 3000
    log = proxy.log_text()
    waited = [int(ms) for ms in WAITED.findall(log)]
    # Queued behind the prefill's batch (how long depends on when in the batch it came: 9 s
    # and 2.6 s seen here; the old fixed 5 s bound lost the save when it was longer).
    assert waited and max(waited) > 1000, (waited, log[-3000:])
    assert "no answer in" not in log and "marked suspect" not in log, log[-3000:]
    assert meta["n_tokens"] >= b.answers[0].prompt_tokens
    clean(proxy, server)
    reliability.row("a save queued behind another slot's 4,000-token prefill (real server)",
                    outcome=f"the save waited {max(waited) / 1000:.1f} s and was kept; the "
                            f"server was not marked suspect",
                    lost="none")


# ---- a save that can wait, on a folder as slow as a real model's slot ----------------------------

def stream_gaps(url: str, session: Session, question: str, max_tokens: int) -> tuple[float, int]:
    """Stream an answer; (the longest gap between two of its events after the first, events)."""
    messages = [{"role": "system", "content": session.system},
                {"role": "user", "content": f"({session.sid}) {question}"}]
    r = requests.post(url + "/v1/chat/completions", stream=True, timeout=600,
                      headers={"X-Session-Id": session.sid},
                      json={"messages": messages, "temperature": 0, "max_tokens": max_tokens,
                            "stream": True, "ignore_eos": True})
    assert r.status_code == 200, r.text[:300]
    arrivals = [time.monotonic() for line in r.iter_lines() if line.startswith(b"data: {")]
    return max(b - a for a, b in zip(arrivals, arrivals[1:])), len(arrivals)


def test_an_idle_save_waits_while_another_slot_streams_on_a_slow_folder(
        make_llama, make_proxy, tmp_path, reliability):
    """The slot folder capped at 5 MB/s (a FUSE passthrough: a multi-GiB slot on a GPU host
    saves this slowly): session b's idle save would stop session a's stream for ~2 s, since the
    server writes on its main loop (issue #31). It waits until a's stream ends; a's longest gap
    stays within the stall budget."""
    folder = ThrottledFolder(tmp_path / "fuse", 5_000_000).start()
    try:
        server = make_llama(np=2, ctx=8192, slot_save_path=folder.path)
        proxy = make_proxy(server, slotkeeper_slot_dir=str(folder.path), **SAVE_FAST)
        b = Session("stall-b", system=long_system_prompt(800, seed=5))  # ~1,100 tokens
        assert b.ask(proxy.url, "Name a prime.").status == 200
        first = wait_saved(folder.backing, b.sid, timeout=60)  # measures the save speed
        assert b.ask(proxy.url, "And another one?").status == 200  # idle-saved a second later
        gap, events = stream_gaps(proxy.url, Session("stall-a"), "Count slowly.", 150)
        ended = time.time()
        second = wait_saved(folder.backing, b.sid, newer_than=ended - 0.5, timeout=60)
        log = proxy.log_text()
    finally:
        folder.stop()
    assert events >= 100
    assert gap < 1.0, (gap, log[-3000:])  # the budget (0.5 s) and the stream's own jitter
    assert "save of stall-b deferred" in log, log[-3000:]
    assert second["n_tokens"] > first["n_tokens"]
    reliability.row("an idle save due while another slot streams, slot folder at 5 MB/s "
                    "(FUSE; the save would take ~2 s)",
                    outcome=f"deferred until the stream ended (its longest gap {gap:.2f} s), "
                            f"then saved",
                    lost="none")


# ---- a restart faster than the health poll (fake) ---------------------------------------------

def test_fake_restart_between_two_health_polls_is_noticed_before_the_next_turn(
        make_llama, make_proxy, slot_dir, reliability):
    """A FAKE front (its /health never fails) 'restarts' in no time: every connection to it
    closes at once, as a dying server's do, and a fresh real llama-server with empty slots
    answers from then on. The health poll cannot see it; the sentinel's connection does
    (issue #32: the next turn went out `kept` and was prefilled in full). Deterministic: no
    timing decides it."""
    first = make_llama(np=2, ctx=4096, slot_save_path=slot_dir)
    fake = FakeFaultyLlama(first.url).start()
    try:
        proxy = make_proxy(fake.url, slotkeeper_slot_dir=str(slot_dir), **SAVE_FAST)
        a = Session("fastrestart")
        assert a.ask(proxy.url, "Name a prime.").action == "assigned"
        saved = wait_saved(slot_dir, a.sid)
        fresh = make_llama(np=2, ctx=4096, slot_save_path=slot_dir)  # a new server, empty
        fake.restart_as(fresh.url)
        time.sleep(0.3)  # the proxy is told in milliseconds; no poll is waited for
        turn = a.ask(proxy.url, "And another?")
        assert turn.action == "restored", (turn.action, turn.headers)
        assert turn.cache_n >= 0.9 * saved["n_tokens"], (turn.cache_n, saved)
        assert "its connection closed: slots will be verified" in proxy.log_text()
        clean(proxy)
    finally:
        fake.stop()
    reliability.row("llama-server restarted between two health polls (fake: connections "
                    "closed, a fresh server behind the same address, /health never failing)",
                    outcome="the closed sentinel connection marks the server suspect; the "
                            "next turn verifies /slots and is restored from its snapshot",
                    lost="none")


# ---- /slots disabled, failing (fake), slow (fake) --------------------------------------------

def test_slots_disabled_with_no_slots(make_llama, make_proxy, llama, reliability):
    server = make_llama(np=2, ctx=4096, extra=["--no-slots"])
    proxy = make_proxy(server, **SAVE_FAST)
    a, b = Session("noslots-a"), Session("noslots-b")
    answers = [a.ask(proxy.url, "Hello?"), b.ask(proxy.url, "Hello?"),
               a.ask(proxy.url, "And again?")]
    assert {x.action for x in answers} == {"fallback"}
    # stable: a session keeps its hashed slot
    assert answers[0].headers["x-slotkeeper-slot"] == answers[2].headers["x-slotkeeper-slot"]
    assert_same_as_direct(llama, answers)
    assert "GET /slots is disabled or failing" in proxy.log_text()
    clean(proxy, server)
    reliability.row("llama-server started with --no-slots",
                    outcome="every request pinned by a stable hash of its session over the "
                            "slot count from /props (action fallback), a warning logged once; "
                            "answers as direct",
                    lost="none (sessions that hash alike share a slot and re-prefill)")


@pytest.mark.parametrize("fault,case", [
    (Fault(status=500), "GET /slots answering 500 (fake)"),
    (Fault(delay=3.0), "GET /slots answering after 3 s (fake)"),
])
def test_fake_slots_failing_or_slow(fault, case, llama, make_proxy, reliability):
    fake = FakeFaultyLlama(llama.url, faults={"GET /slots": fault}).start()
    try:
        proxy = make_proxy(fake.url, **SAVE_FAST)
        a, b = Session("fakeslots-a"), Session("fakeslots-b")
        answers, slowest = [], 0.0
        for s, question in ((a, "Hello?"), (b, "Hello?"), (a, "And again?")):
            started = time.monotonic()
            answers.append(s.ask(proxy.url, question))
            slowest = max(slowest, time.monotonic() - started)
        assert {x.action for x in answers} == {"fallback"}, [x.action for x in answers]
        assert answers[0].headers["x-slotkeeper-slot"] == answers[2].headers["x-slotkeeper-slot"]
        assert_same_as_direct(llama, answers)
        assert fake.seen.count("GET /slots") >= 3  # asked every time, never trusted stale
        clean(proxy)
    finally:
        fake.stop()
    reliability.row(case, outcome=f"pinned by the stable hash (fallback), answers as direct; "
                                  f"the slowest request took {slowest:.1f} s (/slots is given "
                                  f"up after slotkeeper_slots_timeout_ms, 1 s)",
                    lost="none")


# ---- save/restore refused ---------------------------------------------------------------------

def test_server_without_slot_save_path(make_llama, make_proxy, slot_dir, llama, reliability):
    server = make_llama(np=2, ctx=4096)  # no --slot-save-path: save/restore/erase answer 501
    proxy = make_proxy(server, slotkeeper_slot_dir=str(slot_dir), **SAVE_FAST)
    sessions = [Session(f"nosave-{i}") for i in range(3)]  # 3 sessions, 2 slots: handovers
    answers = [s.ask(proxy.url, "Hello?") for s in sessions]
    answers.append(sessions[0].ask(proxy.url, "Once more?"))  # its slot went to nosave-2
    # idle saves run once the server has been quiet for 2 s (the first save's length is not
    # known yet): the refused ones are logged then
    eventually(lambda: "without --slot-save-path" in proxy.log_text(), timeout=15)
    assert all(a.status == 200 for a in answers)
    assert {a.action for a in answers} <= {"assigned", "kept"}, [a.action for a in answers]
    assert not list(slot_dir.iterdir())
    assert "without --slot-save-path" in proxy.log_text()
    assert_same_as_direct(llama, answers)
    clean(proxy, server)
    reliability.row("save/restore refused: llama-server without --slot-save-path while "
                    "slotkeeper_slot_dir is set (3 sessions on 2 slots)",
                    outcome="pinned as usual (assigned, kept); the refused saves were logged "
                            "with how to fix it, no file was written, every request answered "
                            "as direct",
                    lost="none saved to lose (sessions re-prefill after a handover)")


# ---- the slot folder read-only or full (a small tmpfs) --------------------------------------

@pytest.fixture
def tmpfs_slots(tmp_path: Path) -> Iterator[Path]:
    """A 20 MB tmpfs as the slot folder (root only: the test machines run as root). Listed
    before make_llama/make_proxy in a test's arguments, so it is unmounted after they stop."""
    path = tmp_path / "tmpfs-slots"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m,mode=0700", "tmpfs", str(path)],
                   check=True, capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def remount(path: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], check=True,
                   capture_output=True)


def test_slot_folder_read_only_then_full(tmpfs_slots, make_llama, make_proxy, llama,
                                         reliability):
    slot_dir = tmpfs_slots
    server = make_llama(np=2, ctx=4096, slot_save_path=slot_dir)
    proxy = make_proxy(server, slotkeeper_slot_dir=str(slot_dir), **SAVE_FAST)
    ro, full = Session("readonly"), Session("diskfull")
    for s in (ro, full):
        before = time.time()
        s.ask(proxy.url, "Name a colour.")
        wait_saved(slot_dir, s.sid, newer_than=before)
    saved = {s.sid: [file_digest(p) for p in snapshot_files(slot_dir, s.sid)] for s in (ro, full)}
    tokens = {s.sid: json.loads(snapshot_files(slot_dir, s.sid)[1].read_text())["n_tokens"]
              for s in (ro, full)}

    # Read-only: the next save of `ro` fails; its snapshot stays as it was.
    remount(slot_dir, "ro")
    ro.ask(proxy.url, "Name another colour.")
    time.sleep(2)  # its idle save is tried and refused
    assert "save of readonly" in proxy.log_text()
    remount(slot_dir, "rw")
    # Full: fill the tmpfs to the last 64 KB; the next save of `full` is cut short.
    stat = os.statvfs(slot_dir)
    filler = slot_dir / "filler.dat"
    filler.write_bytes(b"\0" * (stat.f_bavail * stat.f_frsize - 64 * 1024))
    full.ask(proxy.url, "Name another colour.")
    time.sleep(2)
    assert "save of diskfull" in proxy.log_text()
    for s in (ro, full):
        assert [file_digest(p) for p in snapshot_files(slot_dir, s.sid)] == saved[s.sid], s.sid
    assert not [p for p in slot_dir.iterdir() if ".saving-" in p.name]  # partials removed
    filler.unlink()

    server.kill()
    server.start()  # empty slots: both come back from their (older) snapshots
    answers = [s.ask(proxy.url, "And a third colour?") for s in (ro, full)]
    for s, a in zip((ro, full), answers):
        assert a.action == "restored", (s.sid, a.headers)
        assert a.cache_n >= 0.9 * tokens[s.sid], (s.sid, a.cache_n, tokens[s.sid])
    assert_same_as_direct(llama, answers)
    clean(proxy, server)
    reliability.row("slot folder remounted read-only, then full (20 MB tmpfs filled to its "
                    "last 64 KB), while sessions grow",
                    outcome="each failed save was logged and its partial file removed; the "
                            "previous snapshots stayed byte for byte (the server now writes "
                            "under a temporary name, renamed only after the check); after a "
                            "server restart both sessions were restored from them and answered "
                            "as direct",
                    lost="none saved; the turn the disk refused is re-prefilled",
                    area="slot folder and files")


# ---- corrupt slot files and state file -------------------------------------------------------

def corruptions(state: bytes) -> dict[str, bytes | None]:
    """Damaged versions of a real state file (None: the file is deleted)."""
    n_tokens = struct.unpack_from("<I", state, 20)[0]
    middle = len(state) // 2
    return {
        "1 byte short": state[:-1],  # aborts llama-server b11434 if restored
        "2 bytes short": state[:-2],  # aborts llama-server b11434 if restored
        "100 bytes short": state[:-100],
        "empty": b"",
        "100 bytes appended": state + b"\0" * 100,
        "magic zeroed": b"\0\0\0\0" + state[4:],
        "version 3": state[:4] + struct.pack("<I", 3) + state[8:],
        "token count +1 in the header": state[:20] + struct.pack("<I", n_tokens + 1)
        + state[24:],
        "4 KB of KV bytes changed, same size": state[:middle] + bytes(
            b ^ 0x55 for b in state[middle:middle + 4096]) + state[middle + 4096:],
        "deleted": None,
    }


def test_corrupt_slot_files_are_never_restored(make_llama, make_proxy, slot_dir, llama,
                                               reliability):
    server = make_llama(np=4, ctx=8192, slot_save_path=slot_dir)
    # every session saved on its way out (not left to the server's RAM cache): the files are
    # what this test damages
    proxy = make_proxy(server, slotkeeper_slot_dir=str(slot_dir), **SAVE_FAST,
                       slotkeeper_upstream_cache_ram_mb=0)
    file_cases = list(corruptions(b"\0" * 64))
    meta_cases = ["meta not JSON", "meta deleted", "meta of another session"]
    sessions = {case: Session(f"corrupt-{i}") for i, case in enumerate(file_cases + meta_cases)}
    control = Session("corrupt-control")

    def first_turn(s: Session) -> None:
        before = time.time()
        s.ask(proxy.url, "Name a fruit.")
        # Nine sessions on four slots, four at a time: a save may wait behind the others'
        # prefills (seen once over 20 s in a full run on two busy cores).
        wait_saved(slot_dir, s.sid, newer_than=before, timeout=60)

    with ThreadPoolExecutor(4) as pool:  # four at a time: the server batches its slots
        list(pool.map(first_turn, [*sessions.values(), control]))
    pid = server.proc.pid
    r = requests.post(proxy.url + "/api/sessions/clear", json={}, timeout=60)  # every slot emptied
    assert r.status_code == 200
    for case, s in sessions.items():
        state_path, meta_path = snapshot_files(slot_dir, s.sid)
        if case in file_cases:
            damaged = corruptions(state_path.read_bytes())[case]
            if damaged is None:
                state_path.unlink()
            else:
                state_path.write_bytes(damaged)
        elif case == "meta not JSON":
            meta_path.write_bytes(b"{not json")
        elif case == "meta deleted":
            meta_path.unlink()
        else:
            meta_path.write_bytes(snapshot_files(slot_dir, control.sid)[1].read_bytes())
    with ThreadPoolExecutor(4) as pool:
        asked = dict(zip(sessions, pool.map(lambda s: s.ask(proxy.url, "Another fruit?"),
                                            sessions.values())))
    answers = asked
    control_answer = control.ask(proxy.url, "Another fruit?")
    assert control_answer.action == "restored", control_answer.headers
    assert server.alive and server.proc.pid == pid  # never aborted
    assert "GGML_ASSERT" not in server.log_text()
    log = proxy.log_text()
    assert "restore failed" not in log  # refused before a restore was sent, not by the server
    for case, answer in answers.items():
        line = next(line for line in log.splitlines()[::-1]
                    if f"{sessions[case].sid} (header" in line)
        # Its own snapshot is never used; a sound snapshot of another session with the same
        # system prompt may be, as a prefix ("The second conversation of a system prompt").
        assert f"started from {sessions[case].sid}'s" not in line, (case, line)
        if answer.action == "restored":
            assert re.search(r"started from corrupt-[\w-]+'s prefix", line), (case, line)
        else:
            assert answer.action == "assigned", (case, answer.headers, line)
        if case in file_cases:
            assert "snapshot not used" in line, (case, line)
    assert_same_as_direct(llama, [*answers.values(), control_answer])
    clean(proxy, server)
    reliability.row("slot file " + "; ".join(file_cases) + "; " + "; ".join(meta_cases),
                    outcome="none restored (each refused by the size, header, meta or crc32 "
                            "check before any restore was sent), the session re-prefilled and "
                            "answered as direct; an intact control session restored; "
                            "llama-server never aborted (1-2 bytes short would abort it)",
                    lost="only the damaged snapshot itself (it cannot be used)",
                    area="slot folder and files")


def test_corrupt_state_file_while_running(make_llama, make_proxy, slot_dir, llama, reliability):
    server = make_llama(np=2, ctx=4096, slot_save_path=slot_dir)
    proxy = make_proxy(server, slotkeeper_slot_dir=str(slot_dir), **SAVE_FAST)
    sessions = [Session("statefile-a"), Session("statefile-b")]
    for s in sessions:
        before = time.time()
        s.ask(proxy.url, "Name a tree.")
        wait_saved(slot_dir, s.sid, newer_than=before)
    damage = {"truncated": proxy.state_file.read_bytes()[:-7], "garbage": b"\x00\xffgarbage",
              "wrong shape": b'{"version": 1, "upstreams": []}'}
    answers = []
    for case, data in damage.items():
        proxy.state_file.write_bytes(data)
        answers += [s.ask(proxy.url, f"Another tree ({case})?") for s in sessions]
        owners = state_owners(proxy.state_file)  # whole again
        assert len(owners) == len(set(owners)), owners
    assert "unreadable" in proxy.log_text()
    assert_same_as_direct(llama, answers)
    clean(proxy, server)
    reliability.row("state file truncated, overwritten with garbage, or of the wrong shape "
                    "while the proxy runs",
                    outcome="read as empty with a warning and rewritten whole at the next "
                            "change; every request answered as direct; no owner twice",
                    lost="who owned which slot (sessions are restored or re-prefilled)",
                    area="slot folder and files")


# ---- the proxy killed ------------------------------------------------------------------------

STATE_HAMMER = """
import sys, time
from pathlib import Path
from slotkeeper.store.state import SlotRecord, StateFile
state = StateFile(Path(sys.argv[1]))
n = 0
while True:
    n += 1
    def change(doc, n=n):
        up = doc.upstream("http://u")
        up.slots[n % 8] = SlotRecord(owner=f"s{n}", claimed=n, last_used=n, tokens=n)
        up.fingerprint = "x" * (n % 5000)  # documents of varying size
    state.update(change)
    if n == 1:  # the parent times its kill from here, not from a start slowed by imports
        print("writing", flush=True)
"""


def test_proxy_killed_during_state_writes(tmp_path, reliability):
    """A process doing nothing but state updates, SIGKILLed at random moments: the file is
    whole after every kill, and holds the last update or the one before."""
    path = tmp_path / "state.json"
    rng = random.Random(7)
    kills = 25
    for _ in range(kills):
        proc = subprocess.Popen([sys.executable, "-c", STATE_HAMMER, str(path)],
                                stdout=subprocess.PIPE, text=True)
        # Killed mid-writing, not mid-import: on a loaded machine the import alone took longer
        # than the old fixed delay, so no write had happened yet and the file was missing.
        assert proc.stdout is not None and proc.stdout.readline() == "writing\n"
        time.sleep(rng.random() * 0.3)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        doc = json.loads(path.read_text())  # never half a file
        owners = [s["owner"] for s in doc["upstreams"]["http://u"]["slots"].values()]
        assert len(owners) == len(set(owners))
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".state-")]
    reliability.row(f"a process writing the state file SIGKILLed {kills} times at random",
                    outcome=f"the file parsed whole after every kill; {len(leftovers)} temp "
                            f"files left by kills mid-write (removed by the next start after "
                            f"a minute)",
                    area="proxy faults")


def test_proxy_killed_while_a_save_is_in_flight(make_llama, make_proxy, slot_dir, llama,
                                                reliability):
    """The server is stopped (SIGSTOP) just after a turn, so the proxy's idle save waits on it;
    the proxy is SIGKILLed; the server resumes and writes the file the dead proxy asked for."""
    server = make_llama(np=2, ctx=4096, slot_save_path=slot_dir)
    proxy = make_proxy(server, slotkeeper_slot_dir=str(slot_dir), **SAVE_FAST)
    a, b = Session("inflight-a"), Session("inflight-b")
    for s in (a, b):
        before = time.time()
        s.ask(proxy.url, "Name a river.")
        wait_saved(slot_dir, s.sid, newer_than=before)
    old = [file_digest(p) for p in snapshot_files(slot_dir, a.sid)]
    old_tokens = json.loads(snapshot_files(slot_dir, a.sid)[1].read_text())["n_tokens"]
    a.ask(proxy.url, "Name another river.")
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(2.5)  # the idle save (after 1 s) is now waiting for the stopped server
        proxy.kill()
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 20
    while not [p for p in slot_dir.iterdir() if ".saving-" in p.name]:
        assert time.monotonic() < deadline, "the server never wrote the save"
        time.sleep(0.1)
    # The dead proxy's save was written under a temporary name and never committed.
    assert [file_digest(p) for p in snapshot_files(slot_dir, a.sid)] == old
    owners = state_owners(proxy.state_file)
    assert sorted(owners) == sorted({a.sid, b.sid})
    proxy.start()
    answers = [a.ask(proxy.url, "A third river?"), b.ask(proxy.url, "Another river?")]
    for s, answer in zip((a, b), answers):
        assert answer.action == "kept", (s.sid, answer.headers)  # still resident, its own KV
        assert answer.cache_n >= s.answers[-2].prompt_tokens, (s.sid, answer.timings)
    server.kill()
    server.start()
    restored = b.ask(proxy.url, "After a restart?")
    assert restored.action == "restored"
    time.sleep(0.1)
    after = a.ask(proxy.url, "After a restart?")
    assert after.action == "restored" and after.cache_n >= 0.9 * old_tokens, after.timings
    assert_same_as_direct(llama, [*answers, restored, after])
    clean(proxy, server)
    reliability.row("the proxy SIGKILLed while its save waits on the server (stopped with "
                    "SIGSTOP), then the server resumes and writes the file",
                    outcome="the orphaned save stayed under its temporary name (swept after a "
                            "minute); the previous snapshot and the state file were whole; "
                            "after a proxy restart both sessions kept their own slots (full "
                            "reuse), and after a server restart were restored and answered as "
                            "direct",
                    lost="none", area="proxy faults")


def test_proxy_killed_under_load(make_llama, make_proxy, slot_dir, llama, reliability):
    """SIGKILL in the middle of concurrent handovers: the state file stays whole, no session
    owns two slots or a slot that holds another's KV, and every later answer is correct."""
    server = make_llama(np=2, ctx=4096, slot_save_path=slot_dir)
    options = {"slotkeeper_slot_dir": str(slot_dir), **SAVE_FAST}
    proxy = make_proxy(server, **options)
    sessions = [Session(f"load-{i}") for i in range(4)]  # 4 sessions on 2 slots
    results: list[Answer | Exception] = []

    def run(s: Session) -> None:
        for k in range(3):
            try:
                results.append(s.ask(proxy.url, f"Question {k}: name a city.", timeout=60))
            except requests.RequestException as e:
                results.append(e)

    threads = [threading.Thread(target=run, args=(s,)) for s in sessions]
    for t in threads:
        t.start()
    time.sleep(2.5)
    proxy.kill()
    for t in threads:
        t.join(120)
    owners = state_owners(proxy.state_file)
    assert len(owners) == len(set(owners)) and len(owners) <= 2
    proxy.start()
    for s in sessions:
        s.history = []  # a fresh turn from a known state
    answers = [s.ask(proxy.url, "Start over: name a city.") for s in sessions]
    answers += [s.ask(proxy.url, "Name another city.") for s in sessions]
    for s in sessions:
        last = s.answers[-1]
        if last.action == "kept":
            assert last.cache_n >= s.answers[-2].prompt_tokens, (s.sid, last.timings)
    owners = state_owners(proxy.state_file)
    assert len(owners) == len(set(owners))
    assert_same_as_direct(llama, answers)
    clean(proxy, server)
    failed = sum(1 for r in results if isinstance(r, Exception) or r.status != 200)
    reliability.row("the proxy SIGKILLed during concurrent handovers (4 sessions on 2 slots)",
                    outcome=f"{failed} requests in flight failed with a connection error; the "
                            f"state file was whole with no owner twice; after a restart every "
                            f"session answered as direct, kept slots reused their whole prefix",
                    lost="the answers in flight", area="proxy faults")


# ---- four proxies, one server --------------------------------------------------------------

def tokens_of_file(path: Path) -> list[int]:
    data = path.read_bytes()
    n = struct.unpack_from("<I", data, 20)[0]
    return list(struct.unpack_from(f"<{n}i", data, 24))


def test_four_proxies_one_server_never_mix_sessions(make_llama, make_proxy, slot_dir, tmp_path,
                                                   reliability):
    server = make_llama(np=4, ctx=8192, slot_save_path=slot_dir)
    state = tmp_path / "shared-state.json"
    # every session saved on its way out (not left to the server's RAM cache): the saved
    # files are what this test checks
    options = {"slotkeeper_state_file": str(state), "slotkeeper_slot_dir": str(slot_dir),
               **SAVE_FAST, "slotkeeper_upstream_cache_ram_mb": 0}
    proxies = [make_proxy(server, **options) for _ in range(4)]
    sessions = [Session(f"mix-{i}", system=long_system_prompt(60, seed=200 + i))
                for i in range(8)]  # 8 sessions on 4 slots, each with its own system prompt
    errors: list[str] = []
    stop = threading.Event()
    samples = [0]

    def sample_state() -> None:
        while not stop.is_set():
            try:
                owners = state_owners(state)
            except FileNotFoundError:
                owners = []
            except ValueError as e:
                errors.append(f"state file not whole: {e}")
                owners = []
            if len(owners) != len(set(owners)):
                errors.append(f"one session owns two slots: {owners}")
            samples[0] += 1
            time.sleep(0.02)

    def run(index: int, s: Session) -> None:
        rng = random.Random(index)
        try:
            for k in range(3):
                proxy = proxies[rng.randrange(4)]
                answer = s.ask(proxy.url, f"Turn {k}: name an animal and a colour.")
                if answer.status != 200:
                    errors.append(f"{s.sid} turn {k}: {answer.status}")
                elif answer.action == "kept" and k > 0 and \
                        answer.cache_n < s.answers[-2].prompt_tokens:
                    errors.append(f"{s.sid} turn {k} kept slot "
                                  f"{answer.headers['x-slotkeeper-slot']} but reused "
                                  f"{answer.cache_n} of {s.answers[-2].prompt_tokens}")
                elif answer.action == "restored" and answer.cache_n < 0.5 * \
                        s.answers[-2].prompt_tokens:
                    errors.append(f"{s.sid} turn {k} restored a snapshot the server could not "
                                  f"reuse ({answer.cache_n})")
        except Exception as e:  # surfaced below
            errors.append(f"{s.sid}: {e!r}")

    sampler = threading.Thread(target=sample_state)
    sampler.start()
    threads = [threading.Thread(target=run, args=(i, s)) for i, s in enumerate(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    time.sleep(2.5)  # the last idle saves
    stop.set()
    sampler.join()
    assert not errors, errors
    # Each saved file holds its own session's tokens: it starts with the session's own first
    # prompt (system prompt and first question, both unique to the session).
    checked = 0
    for s in sessions:
        state_path, meta_path = snapshot_files(slot_dir, s.sid)
        if not meta_path.exists():
            continue
        first = s.answers[0].messages
        prompt = requests.post(server.url + "/apply-template", json={"messages": first},
                               timeout=60).json()["prompt"]
        own = requests.post(server.url + "/tokenize", json={
            "content": prompt, "parse_special": True, "add_special": True},  # with BOS
            timeout=60).json()["tokens"]
        saved = tokens_of_file(state_path)
        assert saved[:len(own)] == own, f"{s.sid}'s file does not start with its own prompt"
        assert json.loads(meta_path.read_text())["session_id"] == s.sid
        checked += 1
    assert checked >= 6, checked
    assert all(FILE_NAME_RE.fullmatch(p.name) or p.suffix == ".json"
               for p in slot_dir.iterdir()), list(slot_dir.iterdir())
    clean(*proxies, server)
    kept = sum(a.action == "kept" for s in sessions for a in s.answers)
    restored = sum(a.action == "restored" for s in sessions for a in s.answers)
    reliability.row("four mitmdump processes sharing one state file and slot folder in front "
                    "of one server; 8 concurrent sessions on 4 slots, each turn through a "
                    "random proxy",
                    outcome=f"the state file, sampled {samples[0]} times, was always whole "
                            f"and never named one session twice; {kept} turns kept their slot "
                            f"and reused their whole previous conversation, {restored} were "
                            f"restored and reused; each of {checked} saved files starts with "
                            f"its own session's first prompt (tokens read from the file)",
                    area="concurrency")
