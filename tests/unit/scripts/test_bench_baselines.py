"""The pure parts of scripts/bench-baselines: the emulated clients' requests
(scripts/workloads.py), the targets' server flags and the sums and comparisons
(scripts/baselinebench.py). No processes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
from baselinebench import TARGETS, compare, headers_delta, markdown, pick_targets, summarize, table  # noqa: E402
from emulated import WORKLOADS, Options, body_of  # noqa: E402
from workloads import (  # noqa: E402
    OLLAMA_CHAT,
    ChatClient,
    ChatUI,
    RebuiltPromptAgent,
    SdkAgent,
    SessionAgent,
    sized,
    text,
)

# ---- the emulated clients ---------------------------------------------------------------------

def test_texts_are_the_same_in_every_run_and_differ_by_seed() -> None:
    assert text(50, "a") == text(50, "a")
    assert text(50, "a") != text(50, "b")
    assert len(text(50, "a").split()) == 50
    assert len(sized(3900, "head", "x")) == 3900 and sized(3900, "head", "x").startswith("head")


def prompt(req) -> str:
    return "\n".join(m["content"] for m in req.messages)


def test_rebuilt_prompt_shares_a_growing_prefix_but_never_extends_the_last_turn() -> None:
    agent = RebuiltPromptAgent("a")
    first = agent.request(1)
    agent.record(first, "reply one")
    second = agent.request(2)
    assert not prompt(second).startswith(prompt(first))  # no turn extends the previous one
    # system prompt and both example exchanges come first, unchanged
    assert second.messages[:5] == first.messages[:5]
    assert [m["role"] for m in first.messages] == ["system", "user", "assistant", "user",
                                                   "assistant", "user"]
    # history holds the bare question, then the file, question and reminder close the prompt
    assert second.messages[5] == {"role": "user", "content": first.question}
    assert second.messages[6] == {"role": "assistant", "content": "reply one"}
    last = second.messages[-1]["content"]
    assert last.startswith("File src/main.py:") and "<reminder>" in last
    assert len(agent.system().split()) > 600 and not second.headers


def test_chat_client_extends_its_conversation() -> None:
    chat = ChatClient("c", "system text", OLLAMA_CHAT)
    first = chat.request(1)
    chat.record(first, "answer")
    second = chat.request(2)
    assert second.messages[:2] == first.messages
    assert second.messages[2] == {"role": "assistant", "content": "answer"}
    body = body_of(second)
    assert body["options"] == {"temperature": 0, "num_predict": 32} and body["stream"] is True


def test_six_agents_take_turns_round_robin_under_their_own_ids() -> None:
    """#19 item 4's workload: six `x-session-id` agents, one shared system prompt, each turn
    extending that agent's own conversation."""
    class Recorder:
        def __init__(self) -> None:
            self.sent: list = []

        def send(self, req):
            self.sent.append(req)
            return type("R", (), {"content": f"reply {len(self.sent)}"})()
    sender = Recorder()
    WORKLOADS["six-agents"](sender, Options(turns=3))
    assert [r.headers["x-session-id"] for r in sender.sent[:7]] == [
        *(f"agent{k}" for k in range(1, 7)), "agent1"]
    assert len(sender.sent) == 18 and len({r.messages[0]["content"] for r in sender.sent}) == 1
    first, second = sender.sent[0], sender.sent[6]
    assert second.messages[:len(first.messages)] == first.messages
    assert second.messages[len(first.messages)] == {"role": "assistant", "content": "reply 1"}


def test_chat_ui_title_request_carries_the_chat_id_and_its_size() -> None:
    ui = ChatUI("u", "chat-7")
    first = ui.request(1)
    ui.record(first, "answer")
    title = ui.title_request(2)
    assert title.kind == "title" and title.chars() == 3900
    assert title.headers == {"X-OpenWebUI-Chat-Id": "chat-7"} == first.headers
    assert body_of(title)["chat_id"] == "chat-7" == body_of(first)["chat_id"]
    assert "USER: Please read this document" in title.messages[0]["content"]
    assert first.chars() > 2000  # the chat is long enough to be a session


def test_sdk_agent_memory_request_is_a_one_off_with_tools_and_the_transcript() -> None:
    agent = SdkAgent("s", system_tokens=1300, memory_chars=5000)
    first = agent.request(1)
    assert 900 <= len(agent.system().split()) <= 1100  # ~1.3 tokens a word
    assert "x-session-id" not in {k.lower() for k in first.headers}
    assert first.headers["X-Stainless-Retry-Count"] == "0"
    agent.record(first, "done")
    memory = agent.memory_request(1)
    assert memory.kind == "memory" and len(memory.extra["tools"]) == 4
    assert len(memory.messages[0]["content"]) == 5000
    assert "assistant: done" in memory.messages[1]["content"]
    assert "tools" not in SdkAgent("t", tools=False).memory_request(1).extra


def test_session_agent_title_is_abandoned_under_its_own_title_session() -> None:
    agent = SessionAgent("o", "sess-1", system_tokens=130)
    title = agent.title_request(1)
    assert title.abandon and title.headers == {"x-session-id": "title-sess-1"}
    assert 2500 <= title.chars() <= 2700
    assert agent.request(1).headers == {"x-session-id": "sess-1"}


def test_chat_body_generates_the_same_number_of_tokens_everywhere() -> None:
    body = body_of(ChatClient("c", "s").request(1))
    assert body["ignore_eos"] is True and body["temperature"] == 0 and body["max_tokens"] == 32


# ---- targets ----------------------------------------------------------------------------------

def test_targets_flags() -> None:
    flags = {t.name: t.describe(2, 4096) for t in TARGETS}
    assert flags["llama-default"].startswith("-np 2 -c 8192 ")
    assert flags["llama-sps0-ram16"].endswith("--slot-prompt-similarity 0 --cache-ram 16")
    assert flags["llama-np1-sps0"].startswith("-np 1 -c 4096 ")
    assert "--slot-save-path" in flags["slotkeeper"]
    assert [t.name for t in pick_targets(["slotkeeper"])] == ["slotkeeper"]
    with pytest.raises(ValueError, match="unknown target"):
        pick_targets(["llama-fastest"])


# ---- sums and comparisons ---------------------------------------------------------------------

def row(session: str, turn: int, kind: str, prompt_n: int | None, minimum: int,
        headers_s: float | None = 0.01, **extra: object) -> dict:
    return {"session": session, "turn": turn, "kind": kind, "prompt_n": prompt_n,
            "cache_n": 5, "minimum": minimum, "headers_s": headers_s, "ttft_s": 0.5,
            "retries": 0, "header_waits_s": [], "error": None, **extra}


def test_summarize_counts_later_turns_of_conversations_only() -> None:
    rows = [row("a", 1, "main", 800, 800), row("a", 1, "title", 300, 300),
            row("a", 2, "main", 150, 100), row("a", 3, "main", 250, 100),
            row("b", 2, "title", None, 300, error=None)]  # abandoned: no timings
    got = summarize(rows, server_prefilled=1900)
    assert got["later_prompt_n"] == 400 and got["later_minimum"] == 200
    assert got["later_over_minimum"] == 2.0
    assert got["prompt_n"] == 1500 and got["one_off_prompt_n"] == 300
    assert got["server_prefilled"] == 1900 and got["minimum"] == 1600
    assert got["headers_s_max"] == 0.01


def test_later_turns_whose_answer_hides_the_prefill_are_unknown_not_zero() -> None:
    """/api/chat answers carry Ollama's prompt_eval_count (the whole prompt), not what the
    server prefilled: such later turns make the sum unknown; their minimum still counts."""
    rows = [row("a", 1, "main", None, 800), row("a", 2, "main", None, 100),
            row("a", 3, "main", None, 120)]
    got = summarize(rows, server_prefilled=1100)
    assert got["later_prompt_n"] is None and got["later_over_minimum"] is None
    assert got["later_minimum"] == 220 and got["server_prefilled"] == 1100


def test_headers_delta_matches_the_same_request_and_counts_timed_out_attempts() -> None:
    mine = [row("a", 1, "main", 1, 1, headers_s=0.5, header_waits_s=[5.0], retries=1),
            row("a", 2, "main", 1, 1, headers_s=0.2)]
    theirs = [row("a", 2, "main", 1, 1, headers_s=0.1), row("a", 1, "main", 1, 1, headers_s=0.02)]
    got = headers_delta(mine, theirs)
    assert got == {"delta_s": 5.48, "request": ["a", 1, "main"]}
    assert headers_delta(mine, []) is None


def test_compare_names_the_best_baseline_and_slotkeepers_ratios() -> None:
    def run(later: int, total: int, hdr: float) -> dict:
        rows = [row("a", 1, "main", total - later, 10, headers_s=hdr),
                row("a", 2, "main", later, 10, headers_s=hdr)]
        return {"summary": summarize(rows, total), "requests": rows}
    got = compare({"llama-default": run(400, 1000, 0.02), "llama-sps0": run(100, 700, 0.02),
                   "slotkeeper": run(200, 900, 1.52)})
    assert got["best_baseline_later"] == "llama-sps0"
    assert got["slotkeeper_later_at_most_best"] is False
    assert (got["best_baseline_later_excess"], got["slotkeeper_later_excess"]) == (90, 190)
    assert got["slotkeeper_excess_at_most_best"] is False
    # One token more in the conversation (a reply one token longer) is not one token worse:
    # judged over each run's own minimum.
    longer = [row("a", 1, "main", 500, 500), row("a", 2, "main", 101, 11)]
    equal = compare({"llama-sps0": run(100, 700, 0.02),
                     "slotkeeper": {"summary": summarize(longer, 601), "requests": longer}})
    assert equal["slotkeeper_later_at_most_best"] is False
    assert equal["slotkeeper_excess_at_most_best"] is True
    assert got["llama-default"]["later_prompt_n_ratio"] == 0.5
    assert got["llama-sps0"]["server_prefilled_ratio"] == round(900 / 700, 3)
    assert got["llama-sps0"]["headers_max_delta"]["delta_s"] == 1.5
    rows = table({"w": {"llama-sps0": {**run(100, 700, 0.02), "slot_dir": None},
                        "slotkeeper": {**run(200, 900, 1.52),
                                       "slot_dir": {"files": 3, "bytes": 3 * 2 ** 20}},
                        "comparison": got}})
    assert rows[0][:3] == ["workload", "target", "later pre"]
    assert rows[2][-2:] == ["3", "3.00"] and rows[1][-2:] == ["-", "-"]
    assert rows[1][5] == "2.00"  # slotkeeper prefilled twice what llama-sps0 did


def test_reply_tokens_override_halves_for_one_offs() -> None:
    ui = ChatUI("u", "c")
    assert body_of(ui.request(1), reply_tokens=8)["max_tokens"] == 8
    assert body_of(ui.title_request(2), reply_tokens=8)["max_tokens"] == 4
    assert body_of(ui.title_request(2))["max_tokens"] == 16


def test_markdown_table() -> None:
    assert markdown([["a", "b"], ["1", "2"]]) == "| a | b |\n|---|---|\n| 1 | 2 |"
