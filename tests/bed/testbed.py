"""Real processes for the integration tests: llama-server with the small test model, mitmdump
running the slotkeeper addon, and request helpers. No mocks: a test sees what a user would."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import requests

from slotkeeper.launcher.conf import set_args
from slotkeeper.launcher.local import (
    cached_llama_server,
    cached_model,
    die_with_parent,
    model_flags,
)

REPO = Path(__file__).resolve().parents[2]
# The test bed's own folder (fakes, templates, the corpus, the JS client)
BED = Path(__file__).resolve().parent
# Overridable so the test bed can be checked with a stand-in addon while the real one is
# being written.
ADDON_SCRIPT = Path(os.environ.get("SLOTKEEPER_ADDON_SCRIPT")
                    or REPO / "addon" / "slotkeeper_addon.py")
# The mitmdump of the venv running the tests, which has the slotkeeper package installed.
MITMDUMP = Path(sys.executable).parent / "mitmdump"
LLAMA_HEALTH_TIMEOUT_S = 120.0
PROXY_START_TIMEOUT_S = 30.0
STARTUP_ERROR_GRACE_S = 0.5
STOP_TIMEOUT_S = 10.0
CHAT_TIMEOUT_S = 600.0  # a long prompt prefills at ~150 tokens/s on 2 cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_server_binary() -> Path:
    """$SLOTKEEPER_LLAMA_SERVER (scripts/test sets it), else the cached build."""
    return Path(os.environ.get("SLOTKEEPER_LLAMA_SERVER") or cached_llama_server())


def model_file() -> Path:
    """$SLOTKEEPER_MODEL (scripts/test sets it), else the cached model."""
    return Path(os.environ.get("SLOTKEEPER_MODEL") or cached_model())


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, port)) == 0


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_for_mitmproxy(proc: subprocess.Popen[bytes], port: int, log: Path,
                       timeout: float, host: str = "127.0.0.1") -> None:
    """Wait until a starting mitmdump (or the launcher running it) serves on `port`.
    mitmdump exits when an error was logged during startup (a script that failed to load, a
    bad option), but only just after it started listening: a port that opened is not proof
    enough, the process must outlive that moment too."""
    deadline = time.monotonic() + timeout
    while not port_open(port, host):
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode} before listening on {port}:\n"
                               f"{log_tail(log)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"not listening on {port} after {timeout} s:\n{log_tail(log)}")
        time.sleep(0.1)
    time.sleep(STARTUP_ERROR_GRACE_S)
    # The port is checked again for the launcher, which outlives a failed mitmdump child.
    if proc.poll() is not None or not port_open(port, host):
        how = "its port closed" if proc.poll() is None else f"exit {proc.returncode}"
        raise RuntimeError(f"mitmdump failed at startup ({how}):\n{log_tail(log)}")


def end_process(proc: subprocess.Popen[bytes] | None, first: signal.Signals) -> None:
    """Send `first`, wait, then SIGKILL; always reap so no zombie keeps the port."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(first)
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class _LocalProcess:
    """What LlamaServer and Proxy share: one child process on a loopback port, with a log."""

    port: int
    log: Path
    proc: subprocess.Popen[bytes] | None
    host = "127.0.0.1"  # where it listens (a proxy in a network namespace: its address)
    prefix: tuple[str, ...] = ()  # what runs the command (`ip netns exec NAME`)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def command(self) -> list[str]:
        raise NotImplementedError

    def _spawn(self) -> None:
        """Start command(), its output appended to the log after a line naming the command."""
        with self.log.open("ab") as log:
            log.write(f"\n==== {' '.join(self.command())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen([*self.prefix, *self.command()],
                                         stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, preexec_fn=die_with_parent())

    def kill(self) -> None:
        end_process(self.proc, signal.SIGKILL)

    def restart(self) -> Self:
        """Same port, same arguments."""
        self.stop()
        return self.start()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class LlamaServer(_LocalProcess):
    """A real llama-server on 127.0.0.1. `ctx` is the total context (-c); with an explicit
    -np the KV cache is split, so each slot gets ctx // np tokens."""

    def __init__(self, workdir: Path, *, np: int = 4, ctx: int = 16384,
                 slot_save_path: Path | None = None, extra: Sequence[str] = (),
                 port: int | None = None, binary: Path | None = None,
                 model: Path | None = None, host: str = "127.0.0.1") -> None:
        self.workdir = workdir
        self.host = host  # a bridge's address, for proxies in network namespaces (netns.py)
        self.np = np
        self.ctx = ctx
        self.slot_save_path = slot_save_path
        self.extra = list(extra)
        self.port = port or free_port()
        self.binary = binary or llama_server_binary()
        self.model = model or model_file()
        self.log = workdir / f"llama-server-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def ctx_per_slot(self) -> int:
        return self.ctx // self.np

    def command(self) -> list[str]:
        # --swa-full: Gemma 3 uses sliding-window attention; without it a restored slot is not
        # reused. -t 2: the test machines have 2 cores. --no-repack and the model's chat
        # template: as the launcher's local server (slotkeeper/local.py), without its default
        # stop strings, which end an answer after one line (tests stream long answers).
        cmd = [str(self.binary), "-m", str(self.model), "--host", self.host,
               "--port", str(self.port), "-np", str(self.np), "--swa-full", "-c", str(self.ctx),
               "-t", "2", "--no-repack", *model_flags(self.model, stops=False)]
        if self.slot_save_path is not None:
            cmd += ["--slot-save-path", str(self.slot_save_path)]
        return cmd + self.extra

    def start(self) -> Self:
        for what, path in (("llama-server", self.binary), ("model", self.model)):
            if not path.is_file():
                raise FileNotFoundError(
                    f"{what} not found at {path}: run scripts/test (it builds and fetches "
                    f"both), or set SLOTKEEPER_LLAMA_SERVER / SLOTKEEPER_MODEL")
        if self.slot_save_path is not None:
            self.slot_save_path.mkdir(parents=True, exist_ok=True)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._spawn()
        deadline = time.monotonic() + LLAMA_HEALTH_TIMEOUT_S
        while not self._healthy():
            if not self.alive:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}:\n"
                                   f"{log_tail(self.log)}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"llama-server not healthy after {LLAMA_HEALTH_TIMEOUT_S} s:"
                                   f"\n{log_tail(self.log)}")
            time.sleep(0.1)
        return self

    def _healthy(self) -> bool:
        try:
            return requests.get(self.url + "/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def stop(self) -> None:
        end_process(self.proc, signal.SIGTERM)


class Proxy(_LocalProcess):
    """A real mitmdump running the addon in reverse mode in front of `upstream`, with its own
    confdir (so ~/.mitmproxy is never touched) and its own state file."""

    def __init__(self, upstream: str, workdir: Path, *,
                 options: Mapping[str, Any] | None = None, script: Path | None = None,
                 port: int | None = None, netns: str = "", host: str = "127.0.0.1") -> None:
        self.upstream = upstream
        # In a network namespace (tests/bed/netns.py): run inside it, listen on its address.
        self.prefix = ("ip", "netns", "exec", netns) if netns else ()
        self.host = host
        self.workdir = workdir
        self.options = dict(options or {})
        self.script = script or ADDON_SCRIPT
        self.port = port or free_port()
        self.state_file = Path(self.options.get("slotkeeper_state_file") or workdir / "state.json")
        self.log = workdir / f"mitmdump-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        # Given options replace these defaults: mitmproxy rejects two `--set` of one option.
        options = {"listen_host": self.host, "connection_strategy": "lazy",
                   "confdir": str(self.workdir / "confdir"),
                   "slotkeeper_state_file": str(self.state_file), **self.options}
        cmd = [str(MITMDUMP), "-s", str(self.script),
               "--mode", f"reverse:{self.upstream}@{self.port}"]
        for name, value in options.items():
            cmd += set_args(name, value)
        return cmd

    def start(self) -> Self:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._spawn()
        try:
            wait_for_mitmproxy(self.proc, self.port, self.log, PROXY_START_TIMEOUT_S, self.host)
        except TimeoutError:
            self.kill()
            raise
        return self

    def stop(self) -> None:
        """SIGINT is mitmdump's clean shutdown (addons' `done` hooks run)."""
        end_process(self.proc, signal.SIGINT)


def chat(url: str, messages: list[dict[str, Any]], session_headers: Mapping[str, str] | None = None,
         n_predict: int = 8, stream: bool = False, **extra: Any) -> dict[str, Any]:
    """POST /v1/chat/completions at temperature 0 (greedy, so the same prompt gives the same
    text). Returns the JSON body; with stream=True, {"events": [...], "timings": the last
    event's timings, "content": the joined deltas}. A non-200 answer raises with its body."""
    body = {"messages": messages, "temperature": 0, "max_tokens": n_predict, "stream": stream,
            **extra}
    with requests.post(url + "/v1/chat/completions", json=body, headers=dict(session_headers or {}),
                       stream=stream, timeout=CHAT_TIMEOUT_S) as response:
        if response.status_code != 200:
            raise AssertionError(f"{url} answered {response.status_code}: {response.text[:2000]}")
        if not stream:
            return response.json()
        events: list[dict[str, Any]] = []
        for raw in response.iter_lines():  # bytes: SSE is UTF-8 whatever the headers say
            line = raw.decode()
            if not line.startswith("data: "):
                continue  # blank separators and SSE comments (pings)
            if line == "data: [DONE]":
                break
            events.append(json.loads(line.removeprefix("data: ")))
    timings = next((e["timings"] for e in reversed(events) if "timings" in e), None)
    content = "".join(choice.get("delta", {}).get("content") or ""
                      for e in events for choice in e.get("choices", []))
    return {"events": events, "timings": timings, "content": content}


def content_of(response: Mapping[str, Any]) -> str:
    """The assistant text of a non-streamed chat response."""
    return response["choices"][0]["message"]["content"]


_WORDS = ("the", "agent", "reads", "files", "before", "editing", "them", "and", "keeps",
          "changes", "small", "tests", "must", "pass", "every", "commit", "explains", "why",
          "never", "guess", "paths", "ask", "when", "unsure", "prefer", "clear", "names",
          "over", "comments", "log", "errors", "with", "context", "retry", "only", "safe",
          "operations", "report", "results", "plainly", "cache", "slot", "session", "proxy",
          "server", "request", "response", "token", "prompt", "system", "user", "tool")


def long_system_prompt(words: int = 600, seed: int = 0) -> str:
    """A short header and `words` filler words (~1.3 tokens each with Gemma 3). The same seed
    gives the same text in every run; a different seed starts differently from the header on."""
    rng = random.Random(seed)
    body = " ".join(rng.choice(_WORDS) for _ in range(words))
    return f"You are a coding agent. Rules ({seed}): {body}."
