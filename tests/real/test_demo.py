"""`slotkeeper demo` and the demo model's answers, with the real llama-server and model."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from testbed import chat, content_of, free_port

from slotkeeper.launcher.local import LocalServer, start_local_server, stop

SLOTKEEPER = Path(sys.executable).parent / "slotkeeper"
# A sentence: words of letters (digits and light punctuation allowed), no template markers.
SENTENCE = re.compile(r"[A-Za-z][A-Za-z0-9_ ,.'!?-]*")
TURN = re.compile(r"(demo-\d) +(\d+)  slot +(\d+|-) (\w+) +([\d,]+) +([\d,]+) +[\d.]+ s"
                  r"  \| *([\d,]+) +([\d,]+) +[\d.]+ s")
ANSWER = re.compile(r" {14}('.*'|\".*\") -> ('.*'|\".*\")")
TOTALS = re.compile(r"prefilled in all: ([\d,]+) tokens through slotkeeper \(with ([\d,]+) .*\), "
                    r"([\d,]+) direct\.")


def number(text: str) -> int:
    return int(text.replace(",", ""))


def assert_sentence(answer: str, min_words: int = 1) -> None:
    assert "<|im_" not in answer and "<start_of_turn>" not in answer, answer
    assert "User:" not in answer and "Assistant:" not in answer, answer
    assert SENTENCE.fullmatch(answer.strip()), answer
    assert len(answer.split()) >= min_words, answer


@pytest.fixture(scope="module")
def launcher_server(llama_bin: Path, model_path: Path,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    """The llama-server the launcher starts for the quick start (its code, its flags)."""
    folder = tmp_path_factory.mktemp("launcher-server")
    server = LocalServer("127.0.0.1", free_port(), folder / "slots", folder / "log")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SLOTKEEPER_LLAMA_SERVER", str(llama_bin))
        env.setenv("SLOTKEEPER_MODEL", str(model_path))
        proc = start_local_server(server)
    yield server
    stop(proc)


@pytest.mark.parametrize("question", ["What is the capital of France?",
                                      "Name a colour of the sky.",
                                      "Say hello to the team."])
def test_the_demo_model_answers_a_chat_with_a_sentence(launcher_server: LocalServer,
                                                       question: str) -> None:
    """Without a chat template the demo model answered "<|im_end|>\\n<|im" (ChatML debris)."""
    answer = content_of(chat(launcher_server.url, [{"role": "user", "content": question}],
                             n_predict=24))
    assert_sentence(answer, min_words=2)


def test_demo_runs_sessions_through_slotkeeper_beside_direct(llama_bin: Path, model_path: Path
                                                             ) -> None:
    env = {**os.environ, "SLOTKEEPER_LLAMA_SERVER": str(llama_bin),
           "SLOTKEEPER_MODEL": str(model_path)}
    done = subprocess.run([str(SLOTKEEPER), "demo", "--sessions", "3", "--turns", "2"],
                          capture_output=True, text=True, timeout=1800, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    turns = [(TURN.fullmatch(line), lines[i + 1]) for i, line in enumerate(lines)
             if TURN.fullmatch(line)]
    assert len(turns) == 6, done.stdout
    rows = {}
    for match, answer_line in turns:
        session, turn, slot, action, reused, prefilled, d_reused, d_prefilled = match.groups()
        rows[session, int(turn)] = dict(slot=slot, action=action, reused=number(reused),
                                        prefilled=number(prefilled), d_reused=number(d_reused),
                                        d_prefilled=number(d_prefilled))
        answer = ANSWER.fullmatch(answer_line)
        assert answer, answer_line
        assert_sentence(ast.literal_eval(answer[2]))
    assert sorted(rows) == [(f"demo-{s}", t) for s in (1, 2, 3) for t in (1, 2)]
    # Two slots for three sessions: at least two second turns found their slot taken.
    assert sum(rows[f"demo-{s}", 2]["action"] != "kept" for s in (1, 2, 3)) >= 2, rows
    for s in ("demo-1", "demo-2", "demo-3"):
        first, second = rows[s, 1], rows[s, 2]
        # demo-1 starts cold; the others from the seed, or demo-1's prefix (its KV saved and
        # restored while it is young: "The second conversation of a system prompt").
        assert first["action"] in ({"assigned"} if s == "demo-1" else
                                   {"assigned", "seeded", "restored"}), first
        assert first["slot"] in {"0", "1"}, first
        # Three sessions on two slots: each came back to its own slot (kept: the slot
        # another session needed was one whose owner lost nothing, DESIGN "Which slot") or
        # after another had its slot, its whole previous prompt brought back from disk or
        # from the server's RAM cache (the slot handed back): the server reused all of it.
        assert second["action"] in ("kept", "restored", "assigned"), second
        assert second["reused"] >= first["reused"] + first["prefilled"], (first, second)
        # Sent direct, the session's own file is computed again: 300+ tokens.
        assert second["d_prefilled"] > second["prefilled"] + 200, second
    totals = TOTALS.search(done.stdout)
    assert totals, done.stdout
    through, seeds, direct = (number(g) for g in totals.groups())
    assert through == seeds + sum(r["prefilled"] for r in rows.values())
    assert direct == sum(r["d_prefilled"] for r in rows.values())
    assert through < direct
    # Every process it started is gone.
    for pid in re.findall(r"started llama-server \(pid (\d+)\)", done.stderr):
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid), 0)
    assert len(re.findall(r"started llama-server", done.stderr)) == 2, done.stderr
