"""Emulated clients for the baseline benchmark (scripts/bench-baselines) and for tests: what each
kind of client puts in its requests, turn by turn. Pure: no processes, no sockets, no clock.
scripts/emulated.py sends these requests and drives the clients' timing (early next turns,
abandoned titles, header timeouts).

Every text is deterministic (seeded pseudo-random words), so every target of a benchmark run
gets the same prompts, and two runs on two days too. Sizes are in words (~1.3 tokens each with
gemma-3) or, where the issue that describes the client gives characters, in characters.

The clients (issues #19 and #23):
- RebuiltPromptAgent: header-less coding agent that rebuilds its prompt every turn (system
  prompt, two example exchanges, the history, the file it was given, the new message with a
  reminder appended). No turn extends the previous one.
- ChatClient: a plain chat (Ollama-style or OpenAI-style), system prompt + history + message.
  The early-next-turn timing is the sender's business (emulated.py).
- ChatUI: an OpenWebUI-like chat with its own id (header X-OpenWebUI-Chat-Id and body chat_id),
  whose title request (~3,900 characters, the same id) arrives before the chat's next turn.
- SdkAgent: an OpenAI-SDK agent with a long system prompt, no session id, and a one-off
  "memory" request after each turn (its own long system prompt, 4 tools, the transcript).
- SessionAgent: an agent that sends its own `x-session-id`, and a title request
  (`x-session-id: title-<session>`) at each start, which it leaves before the answer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

CHAT = "/v1/chat/completions"
OLLAMA_CHAT = "/api/chat"
# The estimate sizes are made from. Measured on gemma-3 with this vocabulary: ~1.07 tokens a
# word (a 15k-token target gives ~12.3k). Kept at 1.3 so that runs stay comparable with the
# "before" run of 2026-12-03; use --mixed-scale 1.22 for the 15k/12k.
TOKENS_PER_WORD = 1.3

_VOCAB = ("the", "agent", "reads", "files", "before", "editing", "them", "and", "keeps",
          "changes", "small", "tests", "must", "pass", "every", "commit", "explains", "why",
          "never", "guess", "paths", "ask", "when", "unsure", "prefer", "clear", "names",
          "function", "returns", "parser", "config", "module", "error", "handler", "retry",
          "timeout", "buffer", "stream", "index", "branch", "merge", "build", "schema",
          "query", "cache", "token", "worker", "thread", "socket", "client", "server")


def text(words: int, seed: str) -> str:
    """`words` pseudo-random words, the same for the same seed in every run."""
    rng = random.Random(seed)
    return " ".join(rng.choice(_VOCAB) for _ in range(max(0, words)))


def sized(chars: int, head: str, seed: str) -> str:
    """`head` followed by filler words, cut to exactly `chars` characters (at least the head)."""
    filler = text(chars // 3 + 8, seed)
    return (head + " " + filler)[:max(chars, len(head))]


def words_for_tokens(tokens: float) -> int:
    return max(1, round(tokens / TOKENS_PER_WORD))


@dataclass
class Req:
    """One request a client sends. `messages` are OpenAI-style; the sender turns them into
    the body of `path` (an Ollama /api/chat body or a chat completion)."""
    client: str  # which emulated client
    session: str  # the conversation it belongs to (a label of the bench, not a header)
    turn: int  # from 1
    kind: str  # "main" (a conversation's turn) or a one-off: "title", "memory"
    messages: list[dict[str, str]]
    headers: dict[str, str] = field(default_factory=dict)
    path: str = CHAT
    max_tokens: int = 32
    abandon: bool = False  # the client leaves once it has the response headers
    extra: dict[str, Any] = field(default_factory=dict)  # more body fields (tools, chat_id)
    question: str = ""  # the bare new message, for a client that keeps it in its history

    @property
    def key(self) -> tuple[str, int, str]:
        """The same request in every target's run."""
        return (self.session, self.turn, self.kind)

    def chars(self) -> int:
        return sum(len(m["content"]) for m in self.messages)


def question(client: str, turn: int, words: int = 60) -> str:
    return f"[{client} turn {turn}] " + text(words, f"{client}:q{turn}")


# ---- a header-less agent that rebuilds its prompt ------------------------------------------

def agent_system(name: str, tokens: int) -> str:
    """An agent's own system prompt of about `tokens` tokens."""
    return f"You are {name}, an agent. " + text(words_for_tokens(tokens), f"{name}:system")


def agent_turn(system: str, history: list[dict[str, str]], name: str, turn: int,
               question_words: int) -> list[dict[str, str]]:
    """An agent's main request: its system prompt, the history, the turn's question."""
    return [{"role": "system", "content": system}, *history,
            {"role": "user", "content": question(name, turn, question_words)}]


@dataclass
class RebuiltPromptAgent:
    """System prompt and two example exchanges (fixed), then the history (questions without
    the file or the reminder, and the replies), then the file, then the new question with a
    reminder appended, all in the last user message. Sends no session header."""
    name: str
    system_words: int = 600
    file_words: int = 300
    question_words: int = 60
    headers: dict[str, str] = field(default_factory=dict)
    history: list[dict[str, str]] = field(default_factory=list)

    def system(self) -> str:
        return (f"You are {self.name}, a careful coding agent. "
                + text(self.system_words, f"{self.name}:system"))

    def examples(self) -> list[dict[str, str]]:
        out = []
        for k in (1, 2):
            out += [{"role": "user", "content": "Example task: " + text(40, f"{self.name}:ex{k}")},
                    {"role": "assistant", "content": "Example answer: "
                     + text(30, f"{self.name}:exa{k}")}]
        return out

    def file(self) -> str:
        return "File src/main.py:\n" + text(self.file_words, f"{self.name}:file")

    def request(self, turn: int) -> Req:
        ask = question(self.name, turn, self.question_words)
        last = (f"{self.file()}\n\n{ask}\n\n<reminder>Answer briefly; do not edit files you "
                f"were not given.</reminder>")
        messages = [{"role": "system", "content": self.system()}, *self.examples(),
                    *self.history, {"role": "user", "content": last}]
        return Req(self.name, self.name, turn, "main", messages, dict(self.headers),
                   question=ask)

    def record(self, req: Req, reply: str) -> None:
        self.history += [{"role": "user", "content": req.question},
                         {"role": "assistant", "content": reply}]


# ---- a plain chat ----------------------------------------------------------------------------

@dataclass
class ChatClient:
    """System prompt, the history, the new message. Header-less unless `headers` say so."""
    name: str
    system: str
    path: str = CHAT
    question_words: int = 60
    headers: dict[str, str] = field(default_factory=dict)
    history: list[dict[str, str]] = field(default_factory=list)

    def request(self, turn: int) -> Req:
        messages = [{"role": "system", "content": self.system}, *self.history,
                    {"role": "user", "content": question(self.name, turn, self.question_words)}]
        return Req(self.name, self.name, turn, "main", messages, dict(self.headers), self.path)

    def record(self, req: Req, reply: str) -> None:
        self.history += [req.messages[-1], {"role": "assistant", "content": reply}]


# ---- a coding agent with a short system prompt (#32) ----------------------------------------

SHORT_SYSTEM = sized(1150, "You are a careful coding agent working in the user's repository.",
                     "short-prompt:system")


@dataclass
class ShortPromptAgent:
    """One conversation of a header-less coding agent whose system prompt is ~1,150 characters
    (under slotkeeper_seed_min_chars: no seed), then two example exchanges, shared by all its
    conversations; each conversation opens with its own ~1,000-character task."""
    name: str
    history: list[dict[str, str]] = field(default_factory=list)

    @staticmethod
    def opening() -> list[dict[str, str]]:
        out: list[dict[str, str]] = [{"role": "system", "content": SHORT_SYSTEM}]
        for k in (1, 2):
            out += [{"role": "user", "content": "Example task: " + text(30, f"short:ex{k}")},
                    {"role": "assistant", "content": "Example answer: " + text(20, f"short:a{k}")}]
        return out

    def request(self, turn: int) -> Req:
        ask = question(self.name, turn, 150 if turn == 1 else 40)
        messages = [*self.opening(), *self.history, {"role": "user", "content": ask}]
        return Req(self.name, self.name, turn, "main", messages, {})

    def record(self, req: Req, reply: str) -> None:
        self.history += [req.messages[-1], {"role": "assistant", "content": reply}]


# ---- a chat UI with a title request ----------------------------------------------------------

TITLE_TASK = ("### Task:\nGenerate a concise, 3-5 word title with an emoji summarizing the chat "
              "history.\n### Guidelines:\n- The title should clearly represent the main theme "
              "of the conversation.\n- Write the title in the chat's primary language.\n"
              "### Output:\nJSON format: { \"title\": \"your concise title here\" }\n"
              "### Chat History:\n<chat_history>\n")


@dataclass
class ChatUI:
    """A chat with its own id in a header and in the body (as OpenWebUI sends them). Its first
    message carries a pasted document, so the chat is long enough to be a session. Its title
    request repeats the chat so far in one user message of `title_chars` characters."""
    name: str
    chat_id: str
    doc_words: int = 450
    title_chars: int = 3900
    question_words: int = 60
    history: list[dict[str, str]] = field(default_factory=list)

    @property
    def headers(self) -> dict[str, str]:
        return {"X-OpenWebUI-Chat-Id": self.chat_id}

    def request(self, turn: int) -> Req:
        ask = question(self.name, turn, self.question_words)
        if turn == 1:
            ask = "Please read this document:\n" + text(self.doc_words, f"{self.name}:doc") \
                + "\n\n" + ask
        messages = [*self.history, {"role": "user", "content": ask}]
        return Req(self.name, self.name, turn, "main", messages, self.headers,
                   extra={"chat_id": self.chat_id})

    def title_request(self, turn: int) -> Req:
        chat = "\n".join(f"{m['role'].upper()}: {m['content']}" for m in self.history)
        body = sized(self.title_chars - len("\n</chat_history>"), TITLE_TASK + chat,
                     f"{self.name}:title{turn}") + "\n</chat_history>"
        return Req(self.name, self.name, turn, "title", [{"role": "user", "content": body}],
                   self.headers, max_tokens=16, extra={"chat_id": self.chat_id})

    def record(self, req: Req, reply: str) -> None:
        self.history += [req.messages[-1], {"role": "assistant", "content": reply}]


# ---- #23's mixed agents ----------------------------------------------------------------------

SDK_HEADERS = {"User-Agent": "OpenAI/Python 1.99.0", "X-Stainless-Lang": "python",
               "X-Stainless-Package-Version": "1.99.0", "X-Stainless-Retry-Count": "0"}

MEMORY_TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"{name.replace('_', ' ')} in the long-term memory",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"},
                                                    "value": {"type": "string"}},
                   "required": ["key"]}}}
    for name in ("remember_fact", "forget_fact", "update_fact", "list_facts")]


@dataclass
class SdkAgent:
    """An OpenAI-SDK agent without a session id (SDK headers only), with a one-off memory
    request after each turn: its own system prompt (`memory_chars`), 4 tools, and the
    transcript of the conversation so far."""
    name: str
    system_tokens: int = 15000
    memory_chars: int = 24000
    question_words: int = 60
    tools: bool = True
    history: list[dict[str, str]] = field(default_factory=list)

    def system(self) -> str:
        return agent_system(self.name, self.system_tokens)

    def request(self, turn: int) -> Req:
        messages = agent_turn(self.system(), self.history, self.name, turn, self.question_words)
        return Req(self.name, self.name, turn, "main", messages, dict(SDK_HEADERS))

    def memory_request(self, turn: int) -> Req:
        system = sized(self.memory_chars, "You maintain the user's long-term memory. Decide "
                       "which facts of the transcript to remember.", f"{self.name}:memory")
        transcript = "\n".join(f"{m['role']}: {m['content']}" for m in self.history)
        extra = {"tools": MEMORY_TOOLS} if self.tools else {}
        return Req(self.name, self.name, turn, "memory",
                   [{"role": "system", "content": system},
                    {"role": "user", "content": "Transcript:\n" + transcript}],
                   dict(SDK_HEADERS), max_tokens=16, extra=extra)

    def record(self, req: Req, reply: str) -> None:
        self.history += [req.messages[-1], {"role": "assistant", "content": reply}]


@dataclass
class SessionAgent:
    """An agent that sends its own `x-session-id` and, at each start (every turn is a new run
    of the CLI), a title request with `x-session-id: title-<session>` that it leaves before
    the answer comes."""
    name: str
    session_id: str
    system_tokens: int = 12000
    title_chars: int = 2600
    question_words: int = 60
    history: list[dict[str, str]] = field(default_factory=list)

    def system(self) -> str:
        return agent_system(self.name, self.system_tokens)

    def request(self, turn: int) -> Req:
        messages = agent_turn(self.system(), self.history, self.name, turn, self.question_words)
        return Req(self.name, self.name, turn, "main", messages,
                   {"x-session-id": self.session_id})

    def title_request(self, turn: int) -> Req:
        system = "You write a short title for a coding session. Reply with the title only."
        user = sized(self.title_chars - len(system), "Title this session. First message: "
                     + question(self.name, turn, self.question_words), f"{self.name}:t{turn}")
        return Req(self.name, self.name, turn, "title",
                   [{"role": "system", "content": system}, {"role": "user", "content": user}],
                   {"x-session-id": f"title-{self.session_id}"}, max_tokens=16, abandon=True)

    def record(self, req: Req, reply: str) -> None:
        self.history += [req.messages[-1], {"role": "assistant", "content": reply}]
