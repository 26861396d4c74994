"""What a user sees of the routing in mitmweb and in saved flows: comments, markers, the
"slotkeeper" content view, the comment column, streamed bodies. Real llama-server, real
mitmweb/mitmdump processes."""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from fake_upstream import FakeFaultyLlama, Fault
from mitmproxy import http, io
from mitmproxy.contentviews import Metadata, registry
from mitmproxy.utils.emoji import emoji
from reliability import reliability  # noqa: F401
from testbed import (
    MITMDUMP,
    REPO,
    LlamaServer,
    Proxy,
    chat,
    free_port,
    long_system_prompt,
    port_open,
)

from slotkeeper.flows import MARKERS
from slotkeeper.launcher.conf import load_conf
from slotkeeper.observe import contentview

MITMWEB = MITMDUMP.with_name("mitmweb")
DEFAULT_COLUMNS = ["tls", "icon", "path", "method", "status", "size", "time"]
TIMEOUT_S = 600


class Web(Proxy):
    """mitmweb instead of mitmdump, with a known password and no browser."""

    def __init__(self, upstream: str, workdir: Path, options: dict[str, Any]) -> None:
        self.web_port = free_port()
        self.password = "pw-" + secrets.token_hex(8)
        super().__init__(upstream, workdir, options={
            "web_open_browser": False, "web_port": self.web_port,
            "web_password": self.password, **options})

    def command(self) -> list[str]:
        return [str(MITMWEB), *super().command()[1:]]

    def start(self) -> Web:
        super().start()
        # mitmweb opens its web port after the proxy port: wait for it too (under load the
        # first API call came before it).
        deadline = time.monotonic() + 30
        while not port_open(self.web_port):
            assert time.monotonic() < deadline, f"mitmweb's web port {self.web_port} not open"
            time.sleep(0.1)
        return self

    @property
    def web(self) -> str:
        return f"http://127.0.0.1:{self.web_port}"

    def api(self, path: str) -> Any:
        r = requests.get(self.web + path, timeout=30,
                         headers={"Authorization": f"Bearer {self.password}"})
        assert r.status_code == 200, f"{path}: {r.status_code} {r.text[:300]}"
        return r.json() if "json" in r.headers.get("content-type", "") else r.content


@pytest.fixture
def make_web(tmp_path: Path) -> Iterator[Callable[..., Web]]:
    webs: list[Web] = []

    def make(upstream: str | LlamaServer, **options: Any) -> Web:
        url = upstream.url if isinstance(upstream, LlamaServer) else upstream
        web = Web(url, tmp_path / f"web{len(webs)}", options)
        webs.append(web)
        return web.start()

    yield make
    for web in webs:
        web.stop()


def conf_streamed_bodies() -> bool:
    """The launcher's mitm.conf value: what `slotkeeper --web` runs with."""
    return load_conf(REPO / "mitm.conf")["store_streamed_bodies"]


def ask(url: str, session: str, messages: list[dict[str, str]]) -> requests.Response:
    r = requests.post(url + "/v1/chat/completions", timeout=TIMEOUT_S,
                      headers={"X-Session-Id": session},
                      json={"messages": messages, "temperature": 0, "max_tokens": 8})
    assert r.status_code == 200, r.text[:500]
    messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    return r


def expected_comment(r: requests.Response) -> str:
    """Session, slot and action: what fits mitmweb's 150 px comment column."""
    return (f"{r.headers['X-Slotkeeper-Session']} #{r.headers['X-Slotkeeper-Slot']} "
            f"{r.headers['X-Slotkeeper-Action']}")


def test_mitmweb_shows_the_routing(llama, make_web):
    assert conf_streamed_bodies() is True
    web = make_web(llama, slotkeeper_small_request_chars=0,
                   store_streamed_bodies=conf_streamed_bodies())
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    first = ask(web.url, "web-1", messages)
    messages.append({"role": "user", "content": "and again"})
    second = ask(web.url, "web-1", messages)
    streamed = chat(web.url, [{"role": "user", "content": "Count from one to ten."}],
                    {"X-Session-Id": "web-2"}, n_predict=24, stream=True)
    assert requests.get(web.url + "/api/sessions/current", timeout=30).status_code == 200

    # The flow list, as the mitmweb UI gets it (it needs the token).
    assert requests.get(web.web + "/flows", timeout=30).status_code == 403
    flows = web.api("/flows")
    by_path = [(f["request"]["path"], f) for f in flows]
    completions = [f for path, f in by_path if path == "/v1/chat/completions"]
    assert len(completions) == 3
    one, two, three = completions
    assert one["comment"] == expected_comment(first)
    assert first.headers["X-Slotkeeper-Action"] == "assigned"
    assert one["marked"] == emoji[MARKERS["assigned"]]
    assert two["comment"] == expected_comment(second)
    assert second.headers["X-Slotkeeper-Action"] == "kept"
    assert two["marked"] == emoji[MARKERS["kept"]]
    t = streamed["timings"]
    assert re.fullmatch(r"web-2 #\d assigned", three["comment"]), three["comment"]
    api_flow = next(f for path, f in by_path if path == "/api/sessions/current")
    assert api_flow["comment"] == "slotkeeper API"

    # The addon turned the comment column on (and kept the default columns).
    assert web.api("/options")["web_columns"]["value"] == [*DEFAULT_COLUMNS, "comment"]

    # The slotkeeper view is chosen automatically for both sides of a completion flow.
    for side in ("request", "response"):
        view = web.api(f"/flows/{two['id']}/{side}/content/auto.json")
        assert view["view_name"] == "slotkeeper", view
        assert '  action: "kept"' in view["text"]
        assert f"  reused: {second.json()['timings']['cache_n']}  #" in view["text"]
        assert two["comment"] in view["text"]
    assert '"content": "and again"' in web.api(
        f"/flows/{two['id']}/request/content/auto.json")["text"]
    # A streamed answer stays in the flow: the view shows the text the client got. The body is
    # there once the stream ended (mitmproxy's copy) or the client left after [DONE] (ours,
    # test below), either a moment after the client read its last event: wait for it.
    deadline = time.monotonic() + 15
    view = web.api(f"/flows/{three['id']}/response/content/auto.json")
    while view["view_name"] != "slotkeeper" and time.monotonic() < deadline:
        time.sleep(0.1)
        view = web.api(f"/flows/{three['id']}/response/content/auto.json")
    assert view["view_name"] == "slotkeeper", view
    assert f"  text: {json.dumps(streamed['content'])}" in view["text"]
    assert f"  prefilled: {t['prompt_n']}  #" in view["text"]
    raw = web.api(f"/flows/{three['id']}/response/content.data").decode()
    assert raw.count("data: {") == len(streamed["events"])
    # Flows slotkeeper did not route keep mitmproxy's own choice.
    view = web.api(f"/flows/{api_flow['id']}/response/content/auto.json")
    assert view["view_name"] == "JSON"
    assert "slotkeeper" in web.api("/state")["contentViews"]


def test_fake_late_stream_end_the_answer_stays_in_the_flow(llama, make_web, reliability):
    """The client leaves at `data: [DONE]` while the server's end of the message is still on its
    way: the flow ends as "client disconnected", and still shows the answer the client got (it
    showed "Content is missing." once in CI). A FAKE upstream holds the chunked terminator of
    the real server's answer back for 5 s, so the client always goes first."""
    fake = FakeFaultyLlama(llama.url, faults={
        "POST /v1/chat/completions": Fault(stall_end=5.0)}).start()
    try:
        web = make_web(fake.url, slotkeeper_small_request_chars=0,
                       store_streamed_bodies=conf_streamed_bodies())
        streamed = chat(web.url, [{"role": "user", "content": "Count from one to ten."}],
                        {"X-Session-Id": "late-end"}, n_predict=16, stream=True)
        assert streamed["content"] and streamed["timings"]
        # The error hooks run after mitmproxy marked the flow: the body is there a moment later.
        deadline = time.monotonic() + 30
        while True:
            flow = next(f for f in web.api("/flows")
                        if f["request"]["path"] == "/v1/chat/completions")
            view = web.api(f"/flows/{flow['id']}/response/content/auto.json")
            if view["view_name"] == "slotkeeper" or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        flow = web.api("/flows")[-1]
        assert flow["request"]["path"] == "/v1/chat/completions"
        assert "client disconnected" in (flow.get("error") or {}).get("msg", "").lower(), flow
        assert fake.faults["POST /v1/chat/completions"].hits == 1
        assert view["view_name"] == "slotkeeper", view
        assert f"  text: {json.dumps(streamed['content'])}" in view["text"]
        raw = web.api(f"/flows/{flow['id']}/response/content.data").decode()
        assert raw.count("data: {") == len(streamed["events"])
        assert "data: [DONE]" in raw
    finally:
        fake.stop()
    reliability.row("client leaves on the final event, the stream's end still in flight (fake)",
                    area="proxy faults",
                    outcome="the flow shows 'client disconnected' and the whole answer the "
                            "client got (mitmweb's content and Raw views)")


def test_mitmweb_keeps_columns_the_user_chose(make_web):
    """No upstream needed: the columns are set when mitmweb starts."""
    web = make_web("http://127.0.0.1:9", web_columns=["path", "status"])
    assert web.api("/options")["web_columns"]["value"] == ["path", "status"]


def flows_of(path: Path) -> list[http.HTTPFlow]:
    with path.open("rb") as f:
        return [flow for flow in io.FlowReader(f).stream() if isinstance(flow, http.HTTPFlow)]


def render(flow: http.HTTPFlow, message: http.Message) -> tuple[str, str]:
    """(chosen view name, text) as mitmproxy renders the message in auto mode."""
    contentview.register()
    metadata = Metadata(flow=flow, http_message=message,
                        content_type=message.headers.get("content-type", "").split(";")[0])
    data = message.get_content(strict=False) or b""
    view = registry.get_view(data, metadata)
    return view.name, view.prettify(data, metadata)


def test_saved_flows_carry_comment_marker_metadata_and_view(make_llama, make_proxy, tmp_path):
    """A handover run written with `-w` (save_stream_file): every flow read back says how it
    was routed, in the comment, the marker, the metadata and the content view."""
    slots = tmp_path / "slots"
    server = make_llama(np=1, ctx=4096, slot_save_path=slots)
    flows_file = tmp_path / "run.flows"
    # The disk's handover (saved, restored) is what the flows must show: slotkeeper is told
    # the server keeps no RAM cache, which it would otherwise leave these two sessions to.
    proxy = make_proxy(server, slotkeeper_small_request_chars=0, slotkeeper_slot_dir=str(slots),
                       slotkeeper_max_seeds=0, slotkeeper_idle_save_seconds=0,
                       slotkeeper_upstream_cache_ram_mb=0, save_stream_file=str(flows_file))
    a = [{"role": "system", "content": long_system_prompt(300, seed=1)},
         {"role": "user", "content": "hi"}]
    b = [{"role": "system", "content": long_system_prompt(300, seed=2)},
         {"role": "user", "content": "hi"}]
    answers = [ask(proxy.url, "a", a)]
    answers.append(ask(proxy.url, "b", b))
    a.append({"role": "user", "content": "more"})
    answers.append(ask(proxy.url, "a", a))
    a.append({"role": "user", "content": "again"})
    answers.append(ask(proxy.url, "a", a))
    requests.post(proxy.url + "/v1/chat/completions", data=b"[1, 2]", timeout=60,
                  headers={"Content-Type": "application/json"})
    proxy.stop()  # flushes the flow file

    flows = flows_of(flows_file)
    assert len(flows) == 5
    restored_words = r"saved b; restored ([\d,]+) tokens in \d+ ms"
    patterns = ["", "saved a", restored_words, ""]
    for flow, r, words in zip(flows, answers, patterns):
        action = r.headers["X-Slotkeeper-Action"]
        t = r.json()["timings"]
        assert flow.comment == expected_comment(r)
        assert re.fullmatch(words, flow.metadata["slotkeeper"]["detail"]), flow.metadata
        assert flow.marked == MARKERS[action]
        summary = flow.metadata["slotkeeper"]
        assert summary["session"] == r.headers["X-Slotkeeper-Session"]
        assert summary["slot"] == 0
        assert summary["action"] == action
        assert (summary["reused"], summary["prefilled"]) == (t["cache_n"], t["prompt_n"])
        assert set(flow.metadata) == {"slotkeeper"}  # nothing internal left in saved flows

        name, text = render(flow, flow.response)
        assert name == "slotkeeper"
        assert f'  action: "{action}"' in text
        assert f"  reused: {t['cache_n']}  #" in text
        assert f"  prefilled: {t['prompt_n']}  #" in text
        assert '"timings": {' in text  # the body follows the summary
        assert render(flow, flow.request)[0] == "slotkeeper"
    restored = int(re.search(restored_words, flows[2].metadata["slotkeeper"]["detail"])[1]
                   .replace(",", ""))
    # a's whole first turn came back, and the server reused all of it.
    assert answers[0].json()["timings"]["prompt_n"] <= restored
    assert restored <= answers[2].json()["timings"]["cache_n"]

    passed = flows[4]
    assert passed.comment.startswith("passed through unchanged: body is JSON list")
    assert passed.marked == MARKERS["unpinned"]
    name, text = render(passed, passed.request)
    assert name == "slotkeeper"
    assert '  why: "body is JSON list, not an object"' in text


def test_one_log_line_per_routing_decision_not_per_chunk(llama, make_proxy):
    proxy = make_proxy(llama, slotkeeper_small_request_chars=0)
    streamed = chat(proxy.url, [{"role": "user", "content": "Count from one to forty."}],
                    {"X-Session-Id": "log-once"}, n_predict=48, stream=True)
    assert len(streamed["events"]) >= 20
    proxy.stop()
    log = proxy.log_text()
    lines = [line for line in log.splitlines() if "log-once" in line]
    assert len(lines) == 1, lines
    assert re.search(r"log-once \(header x-session-id\) -> slot \d, assigned in [\d.]+ ms$",
                     lines[0])
    # mitmdump's own lines for the flow: connect, the request, the status, disconnects.
    assert len(log.splitlines()) < 25, log
