"""What mitmweb shows of the routing: the "slotkeeper" content view and the comment column.

The content view is chosen automatically (render_priority above the JSON view's 1) for the
request and the response of every flow slotkeeper routed. It shows the routing decision (the
`flow.metadata["slotkeeper"]` dict), the response's timings (llama-server's `timings`, and the
flow's own timestamps), then the body: pretty JSON, or for a streamed (SSE) answer the
assembled text and the final event. So choosing it costs nothing: the body is still there."""

from __future__ import annotations

import json
import logging
from typing import Any

from mitmproxy import contentviews, ctx, http
from mitmproxy.contentviews import Contentview, Metadata

log = logging.getLogger("slotkeeper.contentview")

NAME = "slotkeeper"
SUMMARY_KEY = "slotkeeper"  # the same key as addon.SUMMARY_KEY
PRIORITY = 2.0  # the JSON view says 1 for application/json
COLUMN = "comment"
TIMING_KEYS = ("cache_n", "prompt_n", "prompt_ms", "prompt_per_second", "predicted_n",
               "predicted_ms", "predicted_per_second")


# mitmweb's Comment column is 150 px wide, 8 px of it padding, and cuts what does not fit with
# an ellipsis that takes 14 px more: about 16 characters of its 14 px sans-serif font when more
# text follows, 18 when nothing does (measured in Chromium with DejaVu Sans: "web-1 #1
# assigned" is 134 px, "…5c6d #1 assigned" 140 px). So the comment is only what tells flows
# apart, whole: session, slot, action. The rest (token counts, the router's notes, the rule, a
# long session id in full) is in the slotkeeper content view of the flow and its metadata.
SESSION_HEAD_CHARS = 5


def short_session(session: str) -> str:
    """A long id by its end: what tells `content-<hash>` and `parent/child` ids apart."""
    if len(session) <= SESSION_HEAD_CHARS:
        return session
    return "\N{HORIZONTAL ELLIPSIS}" + session[-(SESSION_HEAD_CHARS - 1):]


def flow_comment(summary: dict[str, Any]) -> str:
    """The flow comment from the routing summary (flow.metadata["slotkeeper"]):
    "web-1 #2 kept" is session web-1, slot 2, kept."""
    session = short_session(str(summary.get("session") or "?"))
    slot = summary.get("slot")
    action = str(summary.get("action") or "?")
    comment = f"{session} {action}" if slot is None else f"{session} #{slot} {action}"
    server = summary.get("server")
    if server:  # a pool (issue #13): which server, by its port (or host when ports repeat)
        comment += f" @{server_tag(str(server))}"
    if summary.get("model"):  # a router's or llama-swap's model (issue #22)
        comment += f" [{summary['model']}]"
    if summary.get("swap_saved"):  # sessions of the model that went, saved before the swap
        comment += f" · swap-saved {summary['swap_saved']}"
    return comment


def server_tag(url: str) -> str:
    """A pool server's short name for the flow comment: its port ("http://127.0.0.1:8081"
    -> "8081"); servers on other hosts are told apart by host then ("gpu2:8080")."""
    rest = url.partition("://")[2]
    host, _, port = rest.rpartition(":")
    return port if host in ("127.0.0.1", "localhost", "[::1]") else rest


def summary_of(flow: object) -> dict[str, Any] | None:
    if not isinstance(flow, http.HTTPFlow):
        return None
    found = flow.metadata.get(SUMMARY_KEY)
    return found if isinstance(found, dict) else None


def sse_events(data: bytes) -> list[Any]:
    """The JSON payloads of `data:` lines of a server-sent-event stream ([DONE] skipped)."""
    events = []
    for line in data.decode("utf-8", "replace").splitlines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if not payload or payload == "[DONE]":
            continue
        try:
            events.append(json.loads(payload))
        except json.JSONDecodeError:
            events.append(payload)
    return events


def event_text(event: Any) -> str:
    """The generated text one SSE event carries, in the shapes llama-server b11434 streams:
    OpenAI chat (choices[].delta.content) and completions (choices[].text), Anthropic
    (content_block_delta: delta.text), Responses (response.output_text.delta: delta), and
    its own /completion (content)."""
    if not isinstance(event, dict):
        return ""
    kind = event.get("type")
    delta = event.get("delta")
    if kind == "content_block_delta" and isinstance(delta, dict):
        return str(delta.get("text") or "")
    if kind == "response.output_text.delta" and isinstance(delta, str):
        return delta
    if isinstance(event.get("choices"), list):
        out = []
        for choice in event["choices"]:
            if isinstance(choice, dict):
                part = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
                out.append(str(part.get("content") or choice.get("text") or ""))
        return "".join(out)
    content = event.get("content")
    return content if isinstance(content, str) else ""


def timings_of(response: http.Response | None) -> dict[str, Any] | None:
    """llama-server's `timings` of a response: in the JSON body, or in the last SSE event that
    carries them."""
    if response is None:
        return None
    try:
        data = response.get_content(strict=False) or b""
    except ValueError:
        return None
    if "text/event-stream" in response.headers.get("content-type", ""):
        candidates = list(reversed(sse_events(data)))
    else:
        try:
            candidates = [json.loads(data)]
        except (UnicodeDecodeError, json.JSONDecodeError):
            return None
    for item in candidates:
        if isinstance(item, dict) and isinstance(item.get("timings"), dict):
            return item["timings"]
    return None


def _scalar(value: Any) -> str:
    """A value as YAML would write it (JSON scalars are valid YAML)."""
    return json.dumps(value, ensure_ascii=False)


def _rate(tokens: Any, ms: Any) -> str:
    try:
        return f" ({float(tokens) / (float(ms) / 1000):,.1f} tokens/s)" if float(ms) > 0 else ""
    except (TypeError, ValueError):
        return ""


def describe_timings(flow: http.HTTPFlow) -> list[str]:
    lines = []
    t = timings_of(flow.response)
    if t is not None:
        lines.append("timings:  # llama-server's, from the response")
        lines.append(f"  reused: {_scalar(t.get('cache_n'))}  # prompt tokens from the slot's "
                     f"KV (cache_n)")
        lines.append(f"  prefilled: {_scalar(t.get('prompt_n'))}  # prompt tokens computed "
                     f"(prompt_n)")
        lines.append(f"  prefill_ms: {_scalar(t.get('prompt_ms'))}  #"
                     f"{_rate(t.get('prompt_n'), t.get('prompt_ms')) or ' -'}")
        lines.append(f"  generated: {_scalar(t.get('predicted_n'))}")
        lines.append(f"  generation_ms: {_scalar(t.get('predicted_ms'))}  #"
                     f"{_rate(t.get('predicted_n'), t.get('predicted_ms')) or ' -'}")
    elif flow.response is not None:
        lines.append("timings: null  # the response carries none")
    req, resp = flow.request, flow.response
    if resp is not None and req.timestamp_start:
        lines.append("flow:")
        if resp.timestamp_start:
            lines.append(f"  response_headers_after_s: "
                         f"{resp.timestamp_start - req.timestamp_start:.3f}")
        if resp.timestamp_end:
            lines.append(f"  response_complete_after_s: "
                         f"{resp.timestamp_end - req.timestamp_start:.3f}")
    return lines


def describe_body(data: bytes, message: http.Message | None) -> list[str]:
    if not data:
        return ["body: null  # empty"]
    content_type = message.headers.get("content-type", "") if message is not None else ""
    if "text/event-stream" in content_type:
        events = sse_events(data)
        text = "".join(event_text(event) for event in events)
        lines = [f"stream:  # {len(events)} events; the Raw view shows them all",
                 f"  text: {_scalar(text)}"]
        if events:
            last = json.dumps(events[-1], indent=4, ensure_ascii=False)
            lines.append("  last_event: " + last.replace("\n", "\n  "))
        return lines
    try:
        parsed = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return ["body: |", *("  " + line for line in
                             data.decode("utf-8", "replace").splitlines()[:200])]
    return ["body: " + json.dumps(parsed, indent=4, ensure_ascii=False)]


class SlotkeeperContentview(Contentview):
    """The routing decision, the timings and the body of a flow slotkeeper routed."""

    syntax_highlight = "yaml"

    @property
    def name(self) -> str:
        return NAME

    def render_priority(self, data: bytes, metadata: Metadata) -> float:
        flow = metadata.flow
        if summary_of(flow) is None or metadata.http_message is None:
            return 0
        assert isinstance(flow, http.HTTPFlow)
        if metadata.http_message is not flow.request and metadata.http_message is not \
                flow.response:
            return 0
        return PRIORITY

    def prettify(self, data: bytes, metadata: Metadata) -> str:
        flow = metadata.flow
        summary = summary_of(flow)
        if summary is None:
            raise ValueError("not a flow slotkeeper routed")
        assert isinstance(flow, http.HTTPFlow)
        lines = ["slotkeeper:  # the routing decision (flow.metadata)"]
        lines += [f"  {key}: {_scalar(value)}" for key, value in summary.items()]
        if flow.comment:
            lines.append(f"comment: {_scalar(flow.comment)}")
        lines += describe_timings(flow)
        lines.append("")
        lines += describe_body(data, metadata.http_message)
        return "\n".join(lines) + "\n"


view = SlotkeeperContentview()


def register() -> None:
    """Add the view to mitmproxy's registry (idempotent: a reload registers the same one)."""
    if contentviews.registry.get(NAME) is not view:
        contentviews.add(view)


def show_comment_column() -> bool:
    """Under mitmweb, add the comment column to the flow list, unless the user chose the
    columns. True when the columns were changed."""
    if "web_columns" not in ctx.options:
        return False
    columns = list(ctx.options.web_columns)
    if COLUMN in columns or columns != list(ctx.options.default("web_columns")):
        return False
    ctx.options.update(web_columns=[*columns, COLUMN])
    return True


class MitmwebView:
    """Registers the content view, and shows the comment column in mitmweb."""

    def load(self, loader) -> None:
        register()

    def running(self) -> None:
        if show_comment_column():
            log.info("mitmweb: added the comment column (web_columns) to show the routing")
