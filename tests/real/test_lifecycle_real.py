"""One request lifecycle (issue #18, item 2): a routed flow's lease and its session's running
count end in one place that always runs. Each hook of the addon between routing and the end
is made to raise in turn (as a bug, or a RecursionError from a translation, would); mitmproxy
logs an addon's exception and carries on with the flow, so the test does the same. Afterwards
no slot lease may be held and the session's next request must keep its slot (a leaked running
count would class it `side` for good). Real llama-server; the raising pieces are monkeypatched
parts of the addon, named per case."""

from __future__ import annotations

import asyncio
import json

import pytest
import requests
from mitmproxy import http
from mitmproxy.test import taddons, tflow

from slotkeeper import addon as addon_module
from slotkeeper.addon import SlotKeeper
from slotkeeper.flows import SUMMARY_KEY
from slotkeeper.observe import metrics

SYSTEM = "You are a careful assistant who answers briefly. " * 60  # > small_request_chars


class Boom(Exception):
    pass


def boom(*_args, **_kwargs):
    raise Boom("a hook failed")


class DeepTranslation:
    """A translation whose answer conversion fails like issue #18's Ollama example."""

    def whole(self, _response):
        raise RecursionError("maximum recursion depth exceeded")


# (module, attribute, replacement): every piece of the addon's hooks that runs after routing.
FAULTS = {
    "request: write_body": (addon_module, "write_body", boom),
    "request: describe": (addon_module, "describe", boom),
    "request: metrics.routed": (metrics, "routed", boom),
    "responseheaders: set_headers": (addon_module, "set_headers", boom),
    "response: timings_of": (addon_module, "timings_of", boom),
    "response: translation.whole RecursionError": (
        addon_module, "translation_of", lambda _flow: DeepTranslation()),
    "response: metrics.timings": (metrics, "timings", boom),
    "error: no answer handling": (addon_module, "suspect_after_error", boom),
}


def completion_flow(url: str, session: str, question: str) -> http.HTTPFlow:
    """A flow as reverse mode gives it: pointed at the llama-server at `url`."""
    flow = tflow.tflow()
    host, _, port = url.removeprefix("http://").rpartition(":")
    flow.request.scheme, flow.request.host, flow.request.port = "http", host, int(port)
    flow.request.method, flow.request.path = "POST", "/v1/chat/completions"
    flow.request.headers["x-session-id"] = session
    flow.request.content = json.dumps({
        "messages": [{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": question}],
        "max_tokens": 4, "temperature": 0}).encode()
    return flow


async def hook(coro_or_none) -> None:
    """Await a hook as mitmproxy does: an exception is logged (safecall), the flow goes on."""
    try:
        if asyncio.iscoroutine(coro_or_none):
            await coro_or_none
    except Exception:
        pass


async def run_flow(keeper: SlotKeeper, flow: http.HTTPFlow, llama_url: str,
                   fail_upstream: bool = False) -> None:
    await hook(_call(keeper.on_request, flow))
    if fail_upstream:
        flow.error = flow.error or tflow.terr()
        flow.response = None
        await hook(_call(keeper.error, flow))
        return
    answer = requests.post(llama_url + flow.request.path, data=flow.request.raw_content,
                           headers={"content-type": "application/json"}, timeout=120)
    flow.response = http.Response.make(answer.status_code, answer.content,
                                       {"content-type": "application/json"})
    await hook(_call(keeper.responseheaders, flow))
    await hook(_call(keeper.response, flow))


def _call(func, flow):
    try:
        return func(flow)
    except Exception:  # a sync hook (responseheaders) that raised: mitmproxy logs it
        return None


def held_slots(keeper: SlotKeeper, url: str, n_slots: int) -> list[int]:
    held = []
    for slot in range(n_slots):
        lease = keeper.router.locks.try_acquire(url, slot, exclusive=True)
        if lease is None:
            held.append(slot)
        else:
            lease.release()
    return held


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_failing_hook_never_leaks_the_lease_or_the_running_count(fault, llama, tmp_path,
                                                                    monkeypatch):
    keeper = SlotKeeper()
    session = f"lifecycle-{list(FAULTS).index(fault)}"
    with taddons.context(keeper) as tctx:
        tctx.configure(keeper, slotkeeper_state_file=str(tmp_path / "state.json"),
                       slotkeeper_idle_save_seconds=0)

        async def scenario() -> str:
            # The session's first request claims a slot, with nothing failing.
            first = completion_flow(llama.url, session, "Name a colour.")
            await run_flow(keeper, first, llama.url)
            target, name, replacement = FAULTS[fault]
            with monkeypatch.context() as patch:
                patch.setattr(target, name, replacement)
                second = completion_flow(llama.url, session, "Name a fruit.")
                await run_flow(keeper, second, llama.url, fail_upstream=fault.startswith("error"))
            assert held_slots(keeper, llama.url, 4) == [], "a lease leaked"
            assert keeper.router.sessions.running_on(session) == [], "running count leaked"
            assert keeper.in_flight == 0
            third = completion_flow(llama.url, session, "Name an animal.")
            await run_flow(keeper, third, llama.url)
            return third.metadata[SUMMARY_KEY]["action"]

        action = asyncio.run(scenario())
    # A failed write_body forwards the request unpinned; the slot may then hold another
    # prompt, so the session is handed over again (restored or assigned), never side.
    assert action in (("kept",) if fault != "request: write_body" else ("kept", "assigned"))
    assert held_slots(keeper, llama.url, 4) == []
    keeper._close()
