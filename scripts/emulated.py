"""Sends the emulated clients' requests (scripts/workloads.py) to a loopback URL, with the
timing of the real clients they stand for, and measures each request: time to the response
headers, to the first content token, to the final event, the end; llama-server's own
`timings` (prompt_n, cache_n) from the final event.

- Early next turn: a chat sends its next turn the moment it reads the final event (`done:
  true` on /api/chat NDJSON, the event with `timings` on /v1/chat/completions SSE), while the
  previous response is still open (its `[DONE]` and the end of the body unread).
- Abandon: a client that leaves once it has the response headers (a title request of an
  agent that exits).
- Header timeout: an OpenAI-style SDK gives up when the response headers take longer than
  `header_timeout` seconds, and sends the same request again with `X-Stainless-Retry-Count: N`.

Only stdlib: usable from the benchmark scripts and from tests (tests add scripts/ to sys.path).
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from workloads import (CHAT, OLLAMA_CHAT, ChatClient, ChatUI, RebuiltPromptAgent, Req, SdkAgent,
                       SessionAgent, ShortPromptAgent, text)

LOOPBACK = ("127.0.0.1", "localhost", "::1")
READ_TIMEOUT_S = 900.0  # a long prompt on a loaded 2-core machine


@dataclass
class Result:
    """What one request got. Times in seconds from the moment it was sent (the last attempt's
    send for a retried request); `sent_at` from the start of the workload."""
    req: Req
    sent_at: float = 0.0
    status: int = 0
    headers_s: float | None = None
    ttft_s: float | None = None
    final_s: float | None = None
    wall_s: float | None = None
    content: str = ""
    timings: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    header_waits_s: list[float] = field(default_factory=list)  # attempts that timed out
    error: str | None = None
    # time.perf_counter() (CLOCK_MONOTONIC, shared by every process) of each content event:
    # the inter-token gaps (scripts/bench-profiles: other slots' saves stall a stream)
    token_at: list[float] = field(default_factory=list)

    @property
    def retries(self) -> int:
        return len(self.header_waits_s)

    @property
    def prompt_n(self) -> int | None:
        return int(self.timings["prompt_n"]) if "prompt_n" in self.timings else None

    @property
    def cache_n(self) -> int | None:
        return int(self.timings["cache_n"]) if "cache_n" in self.timings else None

    def row(self) -> dict[str, Any]:
        """The JSON row of the benchmark (no message texts)."""
        r = self.req
        return {
            "client": r.client, "session": r.session, "turn": r.turn, "kind": r.kind,
            "path": r.path, "chars": r.chars(), "abandon": r.abandon,
            "sent_at_s": _r(self.sent_at), "status": self.status,
            "headers_s": _r(self.headers_s), "ttft_s": _r(self.ttft_s),
            "final_s": _r(self.final_s), "wall_s": _r(self.wall_s),
            "retries": self.retries, "header_waits_s": [_r(w) for w in self.header_waits_s],
            "prompt_n": self.prompt_n, "cache_n": self.cache_n,
            "prompt_ms": self.timings.get("prompt_ms"),
            "action": self.headers.get("x-slotkeeper-action"),
            "slot": self.headers.get("x-slotkeeper-slot"),
            "sk_session": self.headers.get("x-slotkeeper-session"),
            "error": self.error,
        }


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def body_of(req: Req, stream: bool = True, reply_tokens: int | None = None) -> dict[str, Any]:
    """The request body for req.path. Chat completions: temperature 0 and `ignore_eos`, so
    every target generates the same number of tokens. Ollama: the same as options.
    `reply_tokens` replaces the clients' own limit: that many for a conversation's turn, half
    for a one-off (at least 1)."""
    limit = req.max_tokens
    if reply_tokens:
        limit = reply_tokens if req.kind == "main" else max(1, reply_tokens // 2)
    if req.path == OLLAMA_CHAT:
        return {"model": "gemma-3-270m", "messages": req.messages, "stream": stream,
                "options": {"temperature": 0, "num_predict": limit}, **req.extra}
    return {"messages": req.messages, "max_tokens": limit, "temperature": 0,
            "stream": stream, "ignore_eos": True, **req.extra}


class Sender:
    """Sends requests to one loopback URL, each on a connection of its own (as SDKs with a
    pool do when a request is still open), and times them from `origin`."""

    def __init__(self, url: str, header_timeout: float | None = None, max_retries: int = 2,
                 origin: float | None = None, reply_tokens: int | None = None) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname not in LOOPBACK or parts.port is None:
            raise ValueError(f"not a loopback http URL with a port: {url}")
        self.host, self.port = parts.hostname, parts.port
        self.header_timeout = header_timeout or None
        self.max_retries = max_retries
        self.reply_tokens = reply_tokens
        self.origin = time.perf_counter() if origin is None else origin
        self.lock = threading.Lock()
        self.results: list[Result] = []  # in the order sent

    def send(self, req: Req, on_final: Callable[[Result], None] | None = None) -> Result:
        """Send, read the answer as the client would; `on_final` is called when the final
        event is read, before the rest of the body. Never raises for a bad answer: the error
        is in the result."""
        result = Result(req)
        with self.lock:
            self.results.append(result)
        payload = json.dumps(body_of(req, reply_tokens=self.reply_tokens)).encode()
        conn = None
        try:
            for attempt in range(self.max_retries + 1):
                headers = {"Content-Type": "application/json", **req.headers}
                if "X-Stainless-Retry-Count" in req.headers or attempt:
                    headers["X-Stainless-Retry-Count"] = str(attempt)
                conn = http.client.HTTPConnection(self.host, self.port, timeout=READ_TIMEOUT_S)
                t0 = time.perf_counter()
                result.sent_at = t0 - self.origin
                conn.request("POST", req.path, payload, headers)
                if self.header_timeout and attempt < self.max_retries:
                    conn.sock.settimeout(self.header_timeout)
                try:
                    resp = conn.getresponse()
                except (TimeoutError, socket.timeout):
                    result.header_waits_s.append(time.perf_counter() - t0)
                    conn.close()  # the SDK gives up on this attempt and sends it again
                    continue
                conn.sock.settimeout(READ_TIMEOUT_S)
                result.headers_s = time.perf_counter() - t0
                result.status = resp.status
                result.headers = {k.lower(): v for k, v in resp.getheaders()}
                if req.abandon:
                    break  # leaves before the answer: the connection closes below
                if resp.status != 200:
                    result.error = f"{resp.status}: {resp.read()[:300]!r}"
                    break
                read = _read_ndjson if req.path == OLLAMA_CHAT else _read_sse
                read(resp, t0, result, on_final)
                result.wall_s = time.perf_counter() - t0
                break
            else:
                result.error = f"no response headers after {self.max_retries + 1} attempts"
        except (OSError, http.client.HTTPException, ValueError) as e:
            result.error = f"{type(e).__name__}: {e}"
        finally:
            if conn is not None:
                conn.close()
            if on_final is not None and result.final_s is None:
                on_final(result)  # never leave a waiting client hanging
        return result


def _final(result: Result, t0: float, on_final: Callable[[Result], None] | None) -> None:
    result.final_s = time.perf_counter() - t0
    if on_final is not None:
        on_final(result)


def _read_sse(resp: http.client.HTTPResponse, t0: float, result: Result,
              on_final: Callable[[Result], None] | None) -> None:
    parts: list[str] = []
    while line := resp.readline():
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        event = json.loads(data)
        for choice in event.get("choices", []):
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                parts.append(piece)
                result.token_at.append(time.perf_counter())
                if result.ttft_s is None:
                    result.ttft_s = time.perf_counter() - t0
        if isinstance(event.get("timings"), dict):  # llama-server's last event
            result.timings = event["timings"]
            result.content = "".join(parts)
            _final(result, t0, on_final)
    result.content = "".join(parts)
    resp.read()


def _read_ndjson(resp: http.client.HTTPResponse, t0: float, result: Result,
                 on_final: Callable[[Result], None] | None) -> None:
    parts: list[str] = []
    while line := resp.readline():
        if not line.strip():
            continue
        event = json.loads(line)
        if "error" in event:
            result.error = str(event["error"])[:300]
            break
        piece = (event.get("message") or {}).get("content")
        if piece:
            parts.append(piece)
            result.token_at.append(time.perf_counter())
            if result.ttft_s is None:
                result.ttft_s = time.perf_counter() - t0
        if event.get("done"):
            # Ollama's prompt_eval_count is the whole prompt (reused + prefilled, as Ollama
            # counts it), and Ollama has no field for the reused part: how much the server
            # prefilled is not in the answer (prompt_n stays unknown; the server's log total,
            # server_prefilled, still counts it).
            result.timings = {"prompt_ms": event.get("prompt_eval_duration", 0) / 1e6,
                              "prompt_eval_count": event.get("prompt_eval_count", 0)}
            result.content = "".join(parts)
            _final(result, t0, on_final)
    result.content = "".join(parts)
    resp.read()


# ---- the workloads: who sends what, when ----------------------------------------------------

def run_turns(sender: Sender, client: Any, turns: int) -> None:
    """One client's turns one after the other, each after the previous answer's end."""
    for turn in range(1, turns + 1):
        req = client.request(turn)
        client.record(req, sender.send(req).content)


def run_early(sender: Sender, client: Any, turns: int) -> None:
    """Each next turn is sent the moment the previous answer's final event is read, while
    that response is still open (read to its end in a thread of its own)."""
    readers = []
    for turn in range(1, turns + 1):
        req = client.request(turn)
        done = threading.Event()
        got: list[Result] = []

        def final(result: Result, got: list[Result] = got, done: threading.Event = done) -> None:
            got.append(result)
            done.set()

        reader = threading.Thread(target=sender.send, args=(req, final), daemon=True)
        reader.start()
        readers.append(reader)
        done.wait(READ_TIMEOUT_S)
        client.record(req, got[0].content if got else "")
    for reader in readers:
        reader.join(READ_TIMEOUT_S)


def together(*jobs: Callable[[], None], stagger_s: float = 0.0) -> None:
    """Run jobs at once (each in a thread), started `stagger_s` apart in the order given."""
    threads = [threading.Thread(target=job, daemon=True) for job in jobs]
    for k, thread in enumerate(threads):
        if k and stagger_s:
            time.sleep(stagger_s)
        thread.start()
    for thread in threads:
        thread.join(READ_TIMEOUT_S * 4)


def send_after_headers(sender: Sender, first: Req, then: Req) -> Result:
    """`first` is sent; `then` as soon as `first` has its response headers (while `first`
    still runs). Returns then's result; both are in sender.results."""
    started = threading.Thread(target=sender.send, args=(first,), daemon=True)
    started.start()
    deadline = time.monotonic() + READ_TIMEOUT_S
    while time.monotonic() < deadline:
        mine = next((r for r in sender.results if r.req is first), None)
        if mine is not None and (mine.headers_s is not None or mine.error or mine.retries):
            break
        time.sleep(0.005)
    result = sender.send(then)
    started.join(READ_TIMEOUT_S)
    return result


@dataclass
class Options:
    """Sizes of the workloads (defaults: the issues' numbers)."""
    turns: int = 4
    mixed_turns: int = 3
    mixed_scale: float = 1.0  # the 15k/12k-token system prompts and the memory prompt
    memory_tools: bool = True


def rebuilt_prompt(sender: Sender, opts: Options) -> None:
    """#19 (1): one header-less agent that rebuilds its prompt, `turns` turns."""
    agent = RebuiltPromptAgent("rebuilt")
    run_turns(sender, agent, opts.turns)


def early_next_turn(sender: Sender, opts: Options, path: str = CHAT) -> None:
    """#19 (2): two header-less chats (one app: the same system prompt, different first
    messages) at once, each sending its next turn on the previous answer's final event."""
    system = "You are a helpful assistant in a chat app. " + text(500, "chat-app")
    chats = [ChatClient(f"chat{k}", system, path) for k in (1, 2)]
    together(*(lambda c=c: run_early(sender, c, opts.turns) for c in chats), stagger_s=0.3)


def title_first(sender: Sender, opts: Options) -> None:
    """#19 (3): two chats of a chat UI, turns taken in turn; after each chat's first turn its
    title request (the chat's id, ~3,900 characters) is sent, and the chat's next turn right
    after the title's response headers."""
    chats = [ChatUI(f"ui{k}", f"chat-id-{k}") for k in (1, 2)]
    for turn in range(1, opts.turns + 1):
        for chat in chats:
            req = chat.request(turn)
            if turn == 2:
                result = send_after_headers(sender, chat.title_request(turn), req)
            else:
                result = sender.send(req)
            chat.record(req, result.content)


def mixed_agents(sender: Sender, opts: Options) -> None:
    """#23: three agents, `mixed_turns` turns each, taken in turn: the SDK agent (15k-token
    system prompt, no session id) then its memory one-off; the session agent (12k) with its
    title at each start, sent at the same moment and abandoned; the rebuilt-prompt agent
    (1k-token system prompt, header-less)."""
    sdk = SdkAgent("sdk", system_tokens=round(15000 * opts.mixed_scale),
                   memory_chars=round(24000 * opts.mixed_scale), tools=opts.memory_tools)
    own = SessionAgent("own", "own-session-1", system_tokens=round(12000 * opts.mixed_scale))
    rebuilt = RebuiltPromptAgent("rebuilt", system_words=770)  # ~1k tokens
    for turn in range(1, opts.mixed_turns + 1):
        req = sdk.request(turn)
        sdk.record(req, sender.send(req).content)
        sender.send(sdk.memory_request(turn))
        req = own.request(turn)
        together(lambda: sender.send(own.title_request(turn)),
                 lambda: own.record(req, sender.send(req).content), stagger_s=0.05)
        req = rebuilt.request(turn)
        rebuilt.record(req, sender.send(req).content)


def six_agents(sender: Sender, opts: Options) -> None:
    """#19 (4): six agent sessions (`x-session-id`) sharing a 600-word system prompt, each
    turn an 80-word message, turns taken round-robin: bench-agents' workload, where
    llama-server's `-sps 0` RAM cache matches slotkeeper (run it with --slots 4)."""
    system = "You are a coding agent. " + text(600, "six-agents:system")
    agents = [ChatClient(f"agent{k}", system, question_words=80,
                         headers={"x-session-id": f"agent{k}"}) for k in range(1, 7)]
    for turn in range(1, opts.turns + 1):
        for agent in agents:
            req = agent.request(turn)
            agent.record(req, sender.send(req).content)


def short_prompt_agents(sender: Sender, opts: Options) -> None:
    """#32 (1): three header-less conversations of one coding agent sharing a ~1,150-character
    system prompt and two examples, `turns` turns each, taken in turn (run it with --slots 2):
    each new conversation's first turn can reuse the shared opening another slot holds."""
    agents = [ShortPromptAgent(f"short{k}") for k in (1, 2, 3)]
    for turn in range(1, opts.turns + 1):
        for agent in agents:
            req = agent.request(turn)
            agent.record(req, sender.send(req).content)


WORKLOADS: dict[str, Callable[[Sender, Options], None]] = {
    "six-agents": six_agents,
    "rebuilt-prompt": rebuilt_prompt,
    "early-next-turn": early_next_turn,
    "early-next-turn-ollama": lambda s, o: early_next_turn(s, o, OLLAMA_CHAT),
    "title-first": title_first,
    "mixed-agents": mixed_agents,
    "short-prompt-agents": short_prompt_agents,
}
SLOTKEEPER_ONLY = {"early-next-turn-ollama"}  # llama-server answers no /api/* route


def results_in_order(results: Sequence[Result]) -> list[Result]:
    return sorted(results, key=lambda r: r.sent_at)
