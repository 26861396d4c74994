"""The pure parts of scripts/bench-pool: the choice rule of the plain load balancers it compares
slotkeeper's pool against (scripts/pool_baselines.py), the order of its requests and its sums
(scripts/poolbench.py), without processes; and the balancer addon itself in front of two
real llama-servers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import requests
from testbed import MITMDUMP, Proxy

from slotkeeper.launcher.conf import set_args

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
from pool_baselines import busy_slots, choose_upstream  # noqa: E402
from poolbench import Step, compare, phases, plan, totals  # noqa: E402


def test_round_robin_takes_turns() -> None:
    picks = [choose_upstream("round-robin", [0, 0, 0], turn) for turn in range(6)]
    assert picks == [0, 1, 2, 0, 1, 2]


def test_round_robin_skips_a_dead_server() -> None:
    picks = [choose_upstream("round-robin", [0, None, 0], turn) for turn in range(4)]
    assert picks == [0, 2, 2, 0]


def test_least_busy_takes_the_idlest() -> None:
    assert choose_upstream("least-busy", [2, 1, 3], 0) == 1
    assert choose_upstream("least-busy", [2, 1, 3], 5) == 1


def test_least_busy_ties_take_turns() -> None:
    picks = [choose_upstream("least-busy", [1, 0, 0], turn) for turn in range(4)]
    assert picks == [1, 1, 2, 1]


def test_least_busy_skips_a_dead_server_even_if_it_looks_idle() -> None:
    assert choose_upstream("least-busy", [None, 2], 0) == 1


def test_every_server_down_gives_none() -> None:
    assert choose_upstream("round-robin", [None, None], 3) is None
    assert choose_upstream("least-busy", [None, None], 3) is None


def test_unknown_placement_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown placement"):
        choose_upstream("random", [0, 0], 0)


def test_busy_slots_counts_processing_slots() -> None:
    slots = [{"id": 0, "is_processing": True}, {"id": 1, "is_processing": False},
             {"id": 2}, {"id": 3, "is_processing": True}]
    assert busy_slots(slots) == 2


def test_busy_slots_refuses_what_is_not_a_slot_list() -> None:
    with pytest.raises(ValueError):
        busy_slots({"error": "slots disabled"})


# ---- the bench's plan and sums ---------------------------------------------------------------

def test_plan_batches_stay_within_a_turn() -> None:
    batches = plan(sessions=3, turns=2, concurrency=2)
    assert batches == [[Step(0, 1), Step(1, 1)], [Step(2, 1)],
                       [Step(0, 2), Step(1, 2)], [Step(2, 2)]]


def test_plan_refuses_nothing_to_do() -> None:
    with pytest.raises(ValueError):
        plan(sessions=0, turns=2, concurrency=1)


def row(turn: int, prefilled: int, minimum: int, ttft: float, **extra: object) -> dict:
    return {"turn": turn, "prefilled": prefilled, "reused": 10, "minimum": minimum,
            "ttft_ms": ttft, "prompt_ms": ttft / 2, **extra}


def test_totals_prefer_the_servers_count_and_leave_failures_out() -> None:
    rows = [row(1, 100, 50, 300.0), row(1, 40, 40, 100.0),
            {"turn": 1, "error": "RemoteDisconnected", "retries": 2}]
    got = totals(rows, server_prefilled=180)
    assert got["prompt_n"] == 140
    assert got["prefilled"] == 180  # the logs also count the proxy's own seed builds
    assert got["minimum"] == 90
    assert got["over_minimum"] == 2.0
    assert got["errors"] == 1 and got["retries"] == 2
    assert got["ttft_ms_median"] == 200.0


def test_phases_split_at_the_kill() -> None:
    rows = [row(t, 10 * t, 10, 100.0 * t) for t in (1, 2, 3, 4)]
    logged = {1: 10, 2: 20, 3: 30, 4: 40}
    got = phases(rows, logged, turns=4, kill_after=2)
    assert got["before_kill"]["turns"] == [1, 2]
    assert got["later_before_kill"]["prefilled"] == 20
    assert got["after_kill"]["prefilled"] == 70
    assert got["after_kill"]["over_minimum"] == 3.5
    assert "after_kill" not in phases(rows, logged, turns=4, kill_after=0)


def test_phase_without_every_turn_logged_falls_back_to_timings() -> None:
    rows = [row(1, 10, 10, 1.0), row(2, 30, 10, 1.0)]
    got = phases(rows, {1: 15}, turns=2, kill_after=0)
    assert got["all"]["prefilled"] == 40  # turn 2's log is missing: timings for both


def test_compare_says_who_prefills_less_and_answers_sooner() -> None:
    def result(prefilled: int, ttft: float) -> dict:
        return {"phases": phases([row(1, prefilled, 100, ttft)], {}, turns=1, kill_after=0)}
    got = compare({"slotkeeper": result(110, 200.0), "round-robin": result(300, 150.0)},
                  "slotkeeper")
    part = got["round-robin"]["all"]
    assert part["slotkeeper_prefills_less"] is True
    assert part["slotkeeper_faster"] is False
    assert part["prefilled_ratio"] == round(110 / 300, 3)


# ---- the balancer addon with real llama-servers ----------------------------------------------

BALANCER = Path(__file__).resolve().parents[3] / "scripts" / "pool_baselines.py"


class BalancerProxy(Proxy):
    """mitmdump with the baseline balancer addon (it has none of slotkeeper's options)."""

    def command(self) -> list[str]:
        cmd = [str(MITMDUMP), "-s", str(self.script), "--mode",
               f"reverse:{self.upstream}@{self.port}", "--set", "listen_host=127.0.0.1",
               "--set", f"confdir={self.workdir / 'confdir'}"]
        for name, value in self.options.items():
            cmd += set_args(name, value)
        return cmd


def ask(url: str) -> tuple[str, dict]:
    """One small streamed chat turn; the server it went to, and the answer."""
    with requests.post(url + "/v1/chat/completions", timeout=120, stream=True,
                       json={"messages": [{"role": "user", "content": "Say hi."}],
                             "max_tokens": 4, "temperature": 0, "stream": True}) as response:
        assert response.status_code == 200, response.text[:500]
        events = [line for line in response.iter_lines() if line.startswith(b"data: {")]
        return response.headers["X-Pool-Upstream"], {"events": len(events)}


@pytest.mark.parametrize("placement", ["round-robin", "least-busy"])
def test_balancer_spreads_requests_and_skips_a_killed_server(make_llama, tmp_path: Path,
                                                             placement: str) -> None:
    servers = [make_llama(np=1, ctx=2048) for _ in range(2)]
    urls = [s.url for s in servers]
    proxy = BalancerProxy(urls[0], tmp_path / "balancer", script=BALANCER,
                          options={"pool_upstreams": urls, "pool_placement": placement})
    try:
        proxy.start()
        went = [ask(proxy.url) for _ in range(4)]
        # One request at a time: both servers idle each time, so least-busy takes turns too.
        assert [url for url, _ in went] == [urls[0], urls[1], urls[0], urls[1]]
        assert all(answer["events"] >= 2 for _, answer in went)  # streamed, event by event
        servers[1].kill()
        assert [ask(proxy.url)[0] for _ in range(3)] == [urls[0]] * 3
    finally:
        proxy.stop()
