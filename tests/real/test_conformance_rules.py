"""The conformance run's rules for a request a client left (tests/real/test_clients_real.py), on
made-up records: which leaving is the client's own habit and which is a symptom."""

from __future__ import annotations

import json

from agents import Run
from test_clients_real import Conformance, Flow, answered, left_when_done

RUN_ENDED = 1000.0


def record(tools: bool, status: int | None, error: str | None, ended: float) -> dict:
    body = {"messages": [{"role": "user", "content": "hi"}]}
    if tools:
        body["tools"] = [{"type": "function", "function": {"name": "read"}}]
    return {"body": json.dumps(body), "path": "/v1/chat/completions", "started": 980.0,
            "ended": ended, "status": status, "error": error, "slotkeeper": {}}


def conformance(*records: dict, returncode: int = 0) -> Conformance:
    run = Run(["opencode", "run"], returncode, "", "", 970.0, RUN_ENDED)
    flows = [Flow("opencode", "new", r) for r in records]
    return Conformance({}, {("opencode", "new"): run}, flows, [], "", "", {})


def test_a_title_left_as_the_client_exits_after_its_turn_is_its_habit() -> None:
    main = record(True, 200, None, ended=RUN_ENDED - 0.3)
    title = record(False, None, "client disconnected", ended=RUN_ENDED + 0.1)
    run = conformance(main, title)
    assert not answered(run.flows[1])
    assert left_when_done(run, run.flows[1])


def test_a_title_left_while_the_client_still_ran_is_a_symptom() -> None:
    main = record(True, 200, None, ended=RUN_ENDED - 0.3)
    title = record(False, None, "client disconnected", ended=RUN_ENDED - 30)
    run = conformance(main, title)
    assert not left_when_done(run, run.flows[1])


def test_a_title_left_before_the_turn_had_its_answer_is_a_symptom() -> None:
    main = record(True, 200, None, ended=RUN_ENDED)
    title = record(False, None, "client disconnected", ended=RUN_ENDED - 0.5)
    run = conformance(main, title)
    assert not left_when_done(run, run.flows[1])


def test_a_main_request_left_is_always_a_symptom() -> None:
    main = record(True, None, "client disconnected", ended=RUN_ENDED)
    run = conformance(main)
    assert not left_when_done(run, run.flows[0])


def test_a_title_left_by_a_run_that_failed_or_whose_turn_failed_is_a_symptom() -> None:
    title = record(False, None, "client disconnected", ended=RUN_ENDED + 0.1)
    failed_run = conformance(record(True, 200, None, ended=RUN_ENDED - 1), title, returncode=1)
    assert not left_when_done(failed_run, failed_run.flows[1])
    failed_turn = conformance(record(True, 500, None, ended=RUN_ENDED - 1), title)
    assert not left_when_done(failed_turn, failed_turn.flows[1])
