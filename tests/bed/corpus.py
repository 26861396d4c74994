"""The corpus of real client requests under tests/bed/corpus/<client>/: written from a client
conformance run (SLOTKEEPER_CORPUS_OUT=tests/bed/corpus), read by tests/unit/identity/test_corpus_identity.py.

Each file is one request as the client sent it: {"client", "phase", "kind", "method", "path",
"headers": [[name, value], ...], "body": <the JSON body>}. `phase` is "first" (a new
conversation), "next" (the same conversation continued) or "new" (another new conversation);
`kind` is "main" (the conversation itself: it carries tools) or "side" (a title or similar).
Removed on writing: credentials (replaced by "<removed>"), and the run's temporary paths and
ports (replaced by fixed placeholders), so the files are the same on every machine.

Of Claude Code's requests only the first and last of the first turn, the first of the
continued turn and the first of the new conversation are kept: the others are its "resume
after the output limit" requests, each the previous one plus ~80 tokens. The Anthropic tests
read every file in tests/bed/corpus/claude/ too (same method/path/headers/body keys).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from slotkeeper.surfaces.anthropic import is_messages_route

CORPUS = Path(__file__).resolve().parent / "corpus"
SECRET_HEADERS = frozenset({"authorization", "x-api-key", "cookie", "proxy-authorization"})
HOME = "/home/user"
PROJECT = "/home/user/project"
PROXY = "http://127.0.0.1:8000"
HOST = "127.0.0.1:8000"
CLIENTS_CACHE = "/home/user/.cache/slotkeeper/clients"


# What the exact replacements cannot catch: the upstream's port (mitmproxy's reverse mode
# sends the upstream's Host), paths the model echoed cut off mid-way, and machine ids.
PATTERNS = ((re.compile(r"127\.0\.0\.1:\d+"), HOST),
            (re.compile(r"/tmp/pytest-of-[\w.-]*(/[\w.-]*)*"), "/tmp/slotkeeper-test"),
            # Claude Code's machine id, inside the JSON string metadata.user_id
            (re.compile(r'(device_id\\?"\s*:\s*\\?")[0-9a-f]+'), r"\g<1>" + "0" * 64))


def scrub(text: str, replacements: list[tuple[str, str]]) -> str:
    for old, new in replacements:
        text = text.replace(old, new)
    for pattern, new in PATTERNS:
        text = pattern.sub(new, text)
    return text


def write_corpus(out: Path, conformance: Any, work: Path) -> None:
    """Write every recorded request of a conformance run, one file each."""
    counters: dict[str, int] = {}
    for flow in conformance.flows:
        agent = conformance.agents[flow.client]
        host = agent.proxy_url.removeprefix("http://")
        clients_cache = agent.executable.parents[3]  # <cache>/clients/<name>-<version>/...
        replacements = [(str(agent.project), PROJECT), (str(agent.home), HOME),
                        # Claude Code names its project folder after the path
                        (str(agent.project).replace("/", "-"), PROJECT.replace("/", "-")),
                        (str(agent.root), HOME), (str(work), "/tmp/slotkeeper-test"),
                        (str(clients_cache), CLIENTS_CACHE),
                        (agent.proxy_url, PROXY), (host, HOST)]
        headers = [[name, "<removed>" if name.lower() in SECRET_HEADERS
                    else scrub(value, replacements)]
                   for name, value in flow.record["headers"]]
        body = json.loads(scrub(flow.record["body"], _json_escaped(replacements)))
        kind = "main" if flow.main else "side"
        number = counters.get(flow.client, 0) + 1
        counters[flow.client] = number
        entry = {"client": flow.client, "phase": flow.phase, "kind": kind,
                 "method": flow.record["method"], "path": flow.record["path"],
                 "headers": headers, "body": body}
        folder = out / flow.client
        folder.mkdir(parents=True, exist_ok=True)
        name = f"{flow.client}-{number:02d}-{flow.phase}-{kind}.json"
        (folder / name).write_text(json.dumps(entry, indent=1, ensure_ascii=False) + "\n")


def _json_escaped(replacements: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The replacements as they appear inside JSON strings ("/" may be escaped as "\\/")."""
    escaped = []
    for old, new in replacements:
        escaped.append((old, new))
        escaped.append((json.dumps(old)[1:-1], json.dumps(new)[1:-1]))
        escaped.append((old.replace("/", "\\/"), new))
    return escaped


def load(client: str) -> list[dict[str, Any]]:
    """The client's corpus entries in capture order."""
    return [json.loads(p.read_text()) for p in sorted((CORPUS / client).glob(f"{client}-*.json"))]


def claude_messages_requests() -> list[dict]:
    """Captured Claude Code `/v1/messages` requests: {"method", "path", "headers": [[name,
    value]], "body"}."""
    found = [json.loads(p.read_text()) for p in sorted((CORPUS / "claude").glob("*.json"))]
    return [r for r in found if r["method"] == "POST" and is_messages_route(r["path"])]
