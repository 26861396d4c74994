"""`slotkeeper demo`: what slotkeeper does, on this machine, in a few minutes at most.

Two llama-servers with the demo model and the same flags (2 slots each), one behind a
slotkeeper proxy (mitmdump with the addon and mitm.conf's options, as `slotkeeper` runs it), one
used directly. A few sessions that share one long system prompt, as agent sessions do, take
turns; every turn goes through the proxy and then, with the same messages, straight to the
other server. Each line shows what the server reports for both (`timings.cache_n` = prompt
tokens reused from the slot's KV cache, `prompt_n` = tokens computed), and for the proxy the
slot and the action from its X-Slotkeeper headers. Everything runs on loopback in a temporary
folder that is removed at the end."""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from .conf import default_conf, load_conf, mitmproxy_command, user_options
from .local import DEMO_STOPS, LocalServer, UsageError, die_with_parent, start_local_server, stop

SLOTS = 2  # fewer than the sessions, so that sessions must take turns on the slots
CONTEXT = 8192  # 4,096 tokens per slot
ANSWER_TOKENS = 24
# One line per answer: the small base model otherwise goes on with lists or the next turns.
ANSWER_STOPS = ("\n", *DEMO_STOPS)
PROXY_START_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 600.0

# The shared system prompt: long enough (over slotkeeper_small_request_chars, 2,000 characters)
# that its requests are sessions rather than side requests, and that a seed is built for it.
RULES = [
    "Read a file before you change it, and keep every change small.",
    "Run the tests after each change and report what they say.",
    "Explain in one sentence why a change is needed before making it.",
    "Never guess a path: list the folder when you are not sure.",
    "Prefer clear names over comments, and comments that say why over ones that say what.",
    "Ask the user when a request is ambiguous instead of choosing for them.",
    "Keep answers short: one or two sentences unless more is asked for.",
    "Do not change files outside the project folder.",
]
SYSTEM_PROMPT = "You are a careful coding assistant working in a user's project.\n" + "\n".join(
    f"Rule {n}: {RULES[(n - 1) % len(RULES)]}" for n in range(1, 33))
# Each session then works on a file of its own, the part of its conversation that no other
# session shares: what llama-server computes again when another session had the slot.
FILE_LINES = 40


def session_file(number: int) -> list[dict[str, str]]:
    """The opening of session `number`: a file it was given, and its acknowledgement."""
    lines = [f"def step_{number}_{i}(value):\n    return value * {i} + {number}"
             for i in range(FILE_LINES // 2)]
    return [{"role": "user",
             "content": f"Here is the file module_{number}.py:\n\n" + "\n\n".join(lines)},
            {"role": "assistant", "content": f"I have read module_{number}.py."}]


QUESTIONS = [
    "What is the capital of France?",
    "Name a colour of the sky.",
    "What is two plus two?",
    "Say hello to the team.",
]


@dataclass
class Turn:
    """One answer and what the server reported for it."""
    answer: str
    reused: int
    prefilled: int
    prefill_ms: float
    slot: str = ""
    action: str = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ask(url: str, messages: list[dict[str, str]], session: str | None) -> Turn:
    headers = {"X-Session-Id": session} if session else {}
    body = {"messages": messages, "temperature": 0, "max_tokens": ANSWER_TOKENS,
            "stop": list(ANSWER_STOPS)}
    try:
        r = requests.post(url + "/v1/chat/completions", json=body, headers=headers,
                          timeout=REQUEST_TIMEOUT_S)
    except requests.RequestException as e:
        raise UsageError(f"no answer from {url}: {e}") from None
    if r.status_code != 200:
        raise UsageError(f"{url} answered {r.status_code}: {r.text[:300]}")
    data = r.json()
    t = data.get("timings") or {}
    return Turn(answer=str(data["choices"][0]["message"].get("content") or "").strip(),
                reused=int(t.get("cache_n", 0)), prefilled=int(t.get("prompt_n", 0)),
                prefill_ms=float(t.get("prompt_ms", 0.0)),
                slot=r.headers.get("X-Slotkeeper-Slot", ""),
                action=r.headers.get("X-Slotkeeper-Action", ""))


def start_proxy(upstream: str, port: int, work: Path) -> subprocess.Popen[bytes]:
    """mitmdump with mitm.conf's options, as `slotkeeper` runs it, in front of `upstream`."""
    conf_path = default_conf()
    conf = load_conf(conf_path)
    args = ["--mode", f"reverse:{upstream}@{port}", "--set", "listen_host=127.0.0.1",
            "--set", f"confdir={work / 'confdir'}",
            "--set", f"slotkeeper_state_file={work / 'state.json'}",
            "--set", f"slotkeeper_slot_dir={work / 'slots-proxied'}"]
    cmd = mitmproxy_command(False, conf, conf_path.resolve().parent,
                            user_options(args, web=False), args, {})
    log = work / "mitmdump.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=die_with_parent())
    deadline = time.monotonic() + PROXY_START_TIMEOUT_S
    while not listening(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            tail = log.read_text(errors="replace").splitlines()[-5:]
            raise UsageError("the proxy did not start: " + " | ".join(tail))
        time.sleep(0.1)
    return proc


def seed_tokens(proxy: str) -> int:
    """Tokens the proxy prefilled to build seeds: its own requests, not in any answer's
    timings (slotkeeper_slot_operation_tokens_total{operation="seed_build"})."""
    text = requests.get(proxy + "/slotkeeper/metrics", timeout=30).text
    prefix = 'slotkeeper_slot_operation_tokens_total{operation="seed_build"}'
    return sum(int(float(row.split()[-1])) for row in text.splitlines()
               if row.startswith(prefix))


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def line(session: str, turn: int, proxied: Turn, direct: Turn) -> str:
    return (f"{session:<7} {turn:>4}  slot {proxied.slot or '-':>2} {proxied.action:<9}"
            f"{proxied.reused:>7,} {proxied.prefilled:>9,} {proxied.prefill_ms / 1000:>6.1f} s"
            f"  |{direct.reused:>7,} {direct.prefilled:>9,} {direct.prefill_ms / 1000:>6.1f} s")


def run(sessions: int, turns: int, out: Any) -> dict[str, int]:
    """The demo; returns the prefilled-token totals, {"slotkeeper": n, "direct": n}."""
    processes: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="slotkeeper-demo-") as tmp:
        work = Path(tmp)
        flags = ("-np", str(SLOTS), "-c", str(CONTEXT))
        try:
            servers = []
            for name in ("proxied", "direct"):
                server = LocalServer("127.0.0.1", free_port(), work / f"slots-{name}",
                                     work / f"llama-server-{name}.log", extra=flags)
                processes.append(start_local_server(server))
                servers.append(server)
            port = free_port()
            processes.append(start_proxy(servers[0].url, port, work))
            proxy = f"http://127.0.0.1:{port}"
            print(f"\n{sessions} sessions share one system prompt ({len(SYSTEM_PROMPT):,} "
                  f"characters) and take turns on {SLOTS} slots. Each turn goes through "
                  f"slotkeeper ({proxy}), then the same messages straight to a second "
                  f"llama-server with the same flags. Token counts are the servers' own "
                  f"(timings.cache_n, timings.prompt_n).\n", file=out)
            print(f"{'':14}{'through slotkeeper':<43}  | direct to llama-server", file=out)
            print(f"{'session':<7} {'turn':>4}  {'slot':<7} {'action':<9}{'reused':>7} "
                  f"{'prefilled':>9} {'prefill':>8}  |{'reused':>7} {'prefilled':>9} "
                  f"{'prefill':>8}", file=out)
            totals = {"slotkeeper": 0, "direct": 0}
            names = [f"demo-{i}" for i in range(1, sessions + 1)]
            history = {name: [{"role": "system", "content": SYSTEM_PROMPT}] for name in names}
            for turn in range(1, turns + 1):
                for name in names:
                    messages = history[name]
                    number = names.index(name) + 1
                    question = QUESTIONS[(turn - 2 + number) % len(QUESTIONS)]
                    if turn == 1:
                        messages += session_file(number)
                    messages.append({"role": "user", "content": question})
                    proxied = ask(proxy, messages, name)
                    direct = ask(servers[1].url, messages, None)
                    totals["slotkeeper"] += proxied.prefilled
                    totals["direct"] += direct.prefilled
                    print(line(name, turn, proxied, direct), file=out)
                    print(f"{'':14}{question!r} -> {proxied.answer!r}", file=out)
                    out.flush()
                    # Both servers continue the same conversation: the proxied answer.
                    messages.append({"role": "assistant", "content": proxied.answer})
            seeds = seed_tokens(proxy)
            totals["slotkeeper"] += seeds
            print(f"\nprefilled in all: {totals['slotkeeper']:,} tokens through slotkeeper "
                  f"(with {seeds:,} to build the system prompt's seed, a request of the "
                  f"proxy's own), {totals['direct']:,} direct.", file=out)
            print("assigned: a free slot; kept: still in its slot; seeded: started from the "
                  "saved system prompt; restored: its KV came back from disk after another "
                  "session had the slot (on a first turn: another session's, with the same "
                  "system prompt).", file=out)
            return totals
        finally:
            for proc in reversed(processes):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)  # mitmdump's clean shutdown
                stop(proc)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="slotkeeper demo", allow_abbrev=False,
        description="slotkeeper in a few minutes: a few sessions through the proxy, the same turns "
                    "sent straight to llama-server, side by side.")
    parser.add_argument("--sessions", type=int, default=3, choices=range(1, 9),
                        metavar="N", help="sessions (1-8, default 3)")
    parser.add_argument("--turns", type=int, default=3, choices=range(1, 9),
                        metavar="N", help="turns per session (1-8, default 3)")
    args = parser.parse_args(list(argv))
    run(args.sessions, args.turns, sys.stdout)
    return 0
