"""Test-only mitmproxy entry script: slotkeeper's own addons, with a recorder on each side.

`mitmdump -s tests/bed/recording_addon.py --set flow_record_file=PATH` runs slotkeeper exactly as
`addon/slotkeeper_addon.py` does, and appends one JSON line per finished HTTP flow to PATH:
the request as the client sent it (headers and body, before slotkeeper pins it), the response
status and headers (slotkeeper's X-Slotkeeper-* among them) and slotkeeper's routing summary
(session, rule, slot, action, and the server's reused/prefilled tokens when it reported them).

The client conformance suite needs this because the CLIs never show response headers; it is
loaded only by the tests, never by users.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from mitmproxy import ctx, http

from slotkeeper.addon import make_addons
from slotkeeper.flows import SUMMARY_KEY

SNAPSHOT_KEY = "recorded_request"


class RequestSnapshot:
    """First in the chain: keeps the request as it came, before slotkeeper rewrites it."""

    def request(self, flow: http.HTTPFlow) -> None:
        request = flow.request
        flow.metadata[SNAPSHOT_KEY] = {
            "method": request.method,
            "path": request.path,
            "headers": [[k, v] for k, v in request.headers.items(multi=True)],
            "body": request.get_text(strict=False) if request.raw_content else "",
            "started": time.time(),
        }


class FlowRecorder:
    """Last in the chain: runs after slotkeeper's response hook has added the timings."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def load(self, loader: Any) -> None:
        loader.add_option("flow_record_file", str, "",
                          "append one JSON line per finished flow to this file (tests only)")

    def response(self, flow: http.HTTPFlow) -> None:
        self._write(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._write(flow)

    def _write(self, flow: http.HTTPFlow) -> None:
        path = ctx.options.flow_record_file
        snapshot = flow.metadata.get(SNAPSHOT_KEY)
        if not path or snapshot is None:
            return
        response = flow.response
        record = {
            **snapshot,
            "ended": time.time(),
            "status": response.status_code if response is not None else None,
            "response_headers": ({k: v for k, v in response.headers.items()}
                                 if response is not None else {}),
            "slotkeeper": flow.metadata.get(SUMMARY_KEY),
            "comment": flow.comment,
            "error": str(flow.error) if flow.error else None,
        }
        with self._lock, open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(record, ensure_ascii=False) + "\n")


addons = [RequestSnapshot(), *make_addons(), FlowRecorder()]
