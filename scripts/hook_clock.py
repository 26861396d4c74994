"""Bench-only mitmproxy entry script: slotkeeper's addons between two clocks.

`mitmdump -s scripts/hook_clock.py --set hook_clock_file=PATH` runs slotkeeper as
`addon/slotkeeper_addon.py` does, with an addon before and one after it. mitmproxy runs a
hook's addons one after the other and awaits each (an async hook's thread hops included),
so the time from the first to the last is what slotkeeper's own hooks took for that request:
its overhead, apart from llama-server's time and the client's. One JSON line per finished
flow: the milliseconds of `request`, `responseheaders` and `response` (or `error`), and the
route's action. Loaded by scripts/bench-etcd only, never by users."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

from mitmproxy import ctx, http

# This checkout's addon, not an installed one.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "addon"))
from slotkeeper.addon import make_addons  # noqa: E402
from slotkeeper.flows import SUMMARY_KEY  # noqa: E402

STARTED = "hook_clock_started"
SPENT = "hook_clock_ms"


class ClockStart:
    def load(self, loader: Any) -> None:
        loader.add_option("hook_clock_file", str, "", "append one JSON line per flow here")

    def _start(self, flow: http.HTTPFlow) -> None:
        flow.metadata[STARTED] = time.perf_counter()

    request = responseheaders = response = error = _start


class ClockStop:
    def __init__(self) -> None:
        self._mutex = threading.Lock()

    def _stop(self, flow: http.HTTPFlow, hook: str) -> None:
        started = flow.metadata.get(STARTED)
        if started is not None:
            spent = flow.metadata.setdefault(SPENT, {})
            spent[hook] = (time.perf_counter() - started) * 1000

    def request(self, flow: http.HTTPFlow) -> None:
        self._stop(flow, "request")

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        self._stop(flow, "responseheaders")

    def response(self, flow: http.HTTPFlow) -> None:
        self._stop(flow, "response")
        self._write(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._stop(flow, "error")
        self._write(flow)

    def _write(self, flow: http.HTTPFlow) -> None:
        path = ctx.options.hook_clock_file
        if not path or not flow.request.path.startswith("/v1/chat"):
            return
        summary = flow.metadata.get(SUMMARY_KEY) or {}
        line = {"session": flow.request.headers.get("x-session-id", ""),
                "action": summary.get("action", ""), "ms": flow.metadata.get(SPENT, {}),
                "at": time.time()}
        with self._mutex, open(path, "a") as out:
            out.write(json.dumps(line) + "\n")


addons = [ClockStart(), *make_addons(), ClockStop()]
