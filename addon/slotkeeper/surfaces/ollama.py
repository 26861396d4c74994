"""Ollama's API (`/api/chat`, `/api/generate`, `/api/embed`, ...) in terms of llama-server's
own routes: what the pure Ollama modules share. Pure: no mitmproxy, no I/O.

- ollama_requests.py: Ollama requests -> llama-server requests (`Mapped`).
- ollama_answers.py: llama-server's answers and streams -> Ollama's objects and NDJSON.
- ollama_models.py: the model listings and `/api/show`, from llama-server's model facts.
- ollama_surface.py: the mitmproxy glue. Why each route maps where it does is in
  docs/DESIGN.md, "Ollama surface".

Errors come out as `{"error": "..."}` with the status llama-server (or we) chose.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

# What /api/version reports. OpenWebUI compares versions numerically (it keeps the lowest of
# its backends), so this must be plain dotted numbers; it names the Ollama API level whose
# request and response fields this surface follows, not a slotkeeper release.
OLLAMA_VERSION = "0.13.0"
RUNNING_TEXT = "Ollama is running"
NDJSON = "application/x-ndjson"

CHAT = "chat"  # /v1/chat/completions, answered as /api/chat
GENERATE_CHAT = "generate-chat"  # /v1/chat/completions, answered as /api/generate
GENERATE_RAW = "generate-raw"  # /completion (raw or context), answered as /api/generate
GENERATE_INFILL = "generate-infill"  # /infill (suffix), answered as /api/generate

# Model management has no counterpart in llama-server: one model, loaded at its start.
UNSUPPORTED_ROUTES = frozenset({"/api/pull", "/api/push", "/api/create", "/api/delete",
                                "/api/copy"})


class OllamaError(Exception):
    """A request we answer ourselves with `{"error": message}` and `status`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def error_body(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def tagged(name: str) -> str:
    """Ollama clients expect `name:tag`; llama-server's model ids have no tag."""
    return name if ":" in name else f"{name}:latest"


def untagged(name: str) -> str:
    return name[:-len(":latest")] if name.endswith(":latest") else name




@dataclass
class Mapped:
    """An upstream request: where it goes, its JSON body, and what was left out (for the log)."""
    path: str
    body: dict[str, Any]
    kind: str
    model: str  # as the client named it, echoed in every answer
    stream: bool
    ignored: list[str] = field(default_factory=list)
    context: list[int] | None = None  # /api/generate: the prompt tokens (context + new)


def ignored_settings(body: Any, ignored: list[str]) -> list[str]:
    """Each ignored name with the value the request gave it, as the log says it
    (`num_ctx=8192`, `weird=1 (unknown)`): from the body's `options`, else the body itself."""
    options = body.get("options") if isinstance(body, dict) else None
    said = []
    for entry in ignored:
        name, _, note = entry.partition(" ")
        source = (options if isinstance(options, dict) and name in options
                  else body if isinstance(body, dict) else {})
        value = json.dumps(source.get(name), ensure_ascii=False, default=str)[:40]
        said.append(f"{name}={value}" + (f" {note}" if note else ""))
    return said


def upstream_error(status: int, raw: bytes) -> str:
    """The message of a llama-server error body (`{"error": {"message": ...}}`), or the body."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        text = raw.decode("utf-8", "replace").strip()
        return text[:500] or f"upstream answered {status}"
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
    return json.dumps(data)[:500]

