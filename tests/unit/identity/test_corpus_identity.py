"""identity.identify() on real requests of the real clients (tests/bed/corpus/<client>/, captured
by the client conformance suite: see tests/bed/corpus.py). Fast: no server, no proxy.

Each client's corpus holds one conversation ("first", then "next": the same conversation
continued with the client's own --continue/resume) and a second, new conversation ("new").
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from agents import CLIENT_NAMES, Agent
from corpus import CORPUS, load

from slotkeeper.identity.identity import Identity, identify

# The header each client names its session with, and so the rule that must match.
SESSION_HEADER = {
    "claude": "x-claude-code-session-id",
    "codex": "session-id",
    "pi": "session_id",
    "opencode": "x-session-id",
}
# Side requests (no tools: titles) seen with the pinned versions, per client.
SENDS_SIDE_REQUESTS = {"opencode"}


def ident(entry: dict[str, Any]) -> Identity:
    return identify(entry["path"], dict(entry["headers"]), entry["body"])


def header(entry: dict[str, Any], name: str) -> str:
    return next(v for k, v in entry["headers"] if k.lower() == name)


def entries(client: str, phase: str | None = None, kind: str | None = None) -> list[dict]:
    found = [e for e in load(client)
             if (phase is None or e["phase"] == phase) and (kind is None or e["kind"] == kind)]
    assert found, f"no {phase or ''} {kind or ''} requests of {client} in {CORPUS / client}"
    return found


@pytest.mark.parametrize("client", CLIENT_NAMES)
def test_one_conversation_is_one_session_named_by_the_clients_header(client: str) -> None:
    conversation = entries(client, "first") + entries(client, "next")
    sent = {header(e, SESSION_HEADER[client]) for e in conversation}
    assert len(sent) == 1, f"{client} sent several session ids in one conversation: {sent}"
    for entry in conversation:
        found = ident(entry)
        assert found.session_id == next(iter(sent)), (entry["phase"], found)
        assert found.rule == f"header {SESSION_HEADER[client]}"
        assert found.parent_id is None  # no subagent in these conversations


@pytest.mark.parametrize("client", CLIENT_NAMES)
def test_a_new_conversation_is_another_session(client: str) -> None:
    old = {ident(e).session_id for e in entries(client, "first")}
    new = {ident(e).session_id for e in entries(client, "new")}
    assert len(new) == 1 and not old & new, (old, new)


def test_clients_never_share_a_session() -> None:
    sessions = {client: {ident(e).session_id for e in load(client)} for client in CLIENT_NAMES}
    for client in CLIENT_NAMES:
        for other in CLIENT_NAMES:
            if other != client:
                assert not sessions[client] & sessions[other], (client, other)


@pytest.mark.parametrize("client", CLIENT_NAMES)
def test_a_continued_turn_has_the_conversations_system_prompt_and_more_messages(
        client: str) -> None:
    """What pinning relies on: the continued turn's prompt extends the conversation, so its
    seed key (model, system prompt, tools) stays and its message count grows."""
    previous = ident(entries(client, "first", "main")[-1])
    continued = ident(entries(client, "next", "main")[0])
    assert continued.seed_key == previous.seed_key
    assert continued.message_count > previous.message_count


@pytest.mark.parametrize("client", CLIENT_NAMES)
def test_side_requests_are_told_by_their_content_not_their_session(client: str) -> None:
    """A side request carries its conversation's session id, so only its content tells it
    apart: another system prompt (another seed key) and a shorter prompt than the turn it
    came with. A client without side requests has tools on every request."""
    sides = [e for e in load(client) if e["kind"] == "side"]
    assert bool(sides) == (client in SENDS_SIDE_REQUESTS), [e["path"] for e in sides]
    for side in sides:
        main = entries(client, side["phase"], "main")[0]
        side_id, main_id = ident(side), ident(main)
        assert side_id.session_id == main_id.session_id
        assert side_id.seed_key != main_id.seed_key
        assert side_id.prompt_chars < main_id.prompt_chars
        assert not side["body"].get("tools")


@pytest.mark.parametrize("client", CLIENT_NAMES)
def test_corpus_holds_no_secret_or_machine_path(client: str) -> None:
    for path in sorted((CORPUS / client).glob("*.json")):
        text = path.read_text()
        assert "sk-dummy-" not in text, path
        assert not re.search(r"/tmp/pytest-|/tmp/clx|/root/", text), path
        assert not re.search(r"127\.0\.0\.1:(?!8000\b)\d+", text), path
        assert not re.search(r'device_id\\?"\s*:\s*\\?"(?!0{64})', text), path


def test_readme_documents_the_settings_the_suite_uses(tmp_path: Path) -> None:
    """README's "Clients" section gives, per client, the settings tests/bed/agents.py writes."""
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    section = readme.split("## Clients", 1)[1].split("\n## ", 1)[0]
    proxy = "http://127.0.0.1:8000"
    for name in CLIENT_NAMES:
        agent = Agent(name, Path("/bin/true"), tmp_path / name, proxy)
        agent.configure()
        env = agent.env()
        for var in ("ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY"):
            if var in env:
                assert f"export {var}=" in section, var
    codex = (tmp_path / "codex" / "home" / ".codex" / "config.toml").read_text()
    for line in codex.splitlines():
        if line.startswith(("model_provider", "wire_api", "base_url", "[model_providers")):
            assert line.split("#")[0].strip() in section, line
    pi = json.loads((tmp_path / "pi" / "home" / ".pi" / "agent" / "models.json").read_text())
    provider = pi["providers"]["slotkeeper"]
    assert f'"baseUrl": "{provider["baseUrl"]}"' in section
    assert f'"api": "{provider["api"]}"' in section
    assert '"compat": {"sendSessionAffinityHeaders": true}' in section
    assert provider["models"][0]["compat"] == {"sendSessionAffinityHeaders": True}
    opencode = json.loads(
        (tmp_path / "opencode" / "home" / ".config" / "opencode" / "opencode.json").read_text())
    options = opencode["provider"]["slotkeeper"]["options"]
    assert f'"npm": "{opencode["provider"]["slotkeeper"]["npm"]}"' in section
    assert f'"baseURL": "{options["baseURL"]}"' in section
    assert f'"model": "{opencode["model"]}"' in section
    assert f'"small_model": "{opencode["small_model"]}"' in section


@pytest.mark.parametrize("client", CLIENT_NAMES)
def test_seed_key_is_the_digest_of_system_and_canonical_tools(client: str) -> None:
    """The seed key (and the chain's first link) is built around the tools' JSON made once;
    it must stay the digest of the full {"system", "tools"} object it always was, or every
    seed and every recorded conversation would stop matching after an upgrade."""
    import hashlib

    from slotkeeper.identity import identity, prompts

    checked = 0
    for entry in load(client):
        prompt = prompts.read_prompt(entry["path"], entry["body"])
        tools = entry["body"].get("tools") if isinstance(entry["body"], dict) else None
        canonical = prompts.canonical(tools) if isinstance(tools, list) and tools else None
        system = identity._hashable_system(prompt.system_parts)
        whole = json.dumps({"system": system, "tools": canonical},
                           ensure_ascii=True, sort_keys=True, separators=(",", ":"))
        for _twice in range(2):  # made, then found in the memory: the same digest
            assert identity._system_digest(prompt, system)[0] == hashlib.sha256(
                whole.encode()).hexdigest()
        if canonical is not None:
            exact = len(json.dumps(canonical, ensure_ascii=False, sort_keys=True,
                                   separators=(",", ":")))
            assert abs(prompt.tools_chars - exact) <= exact // 100, (prompt.tools_chars, exact)
            checked += 1
    assert checked, f"no request with tools in the {client} corpus"


@pytest.mark.parametrize("client", CLIENT_NAMES)
def test_chain_is_the_cumulative_hash_it_always_was(client: str) -> None:
    """The chain is recorded in the state file: blake2b links from the system digest over each
    message's (role, texts) JSON, the same whether the system digest was made or found in the
    memory, or every recorded conversation would stop matching after an upgrade."""
    import hashlib

    from mitmproxy.http import Headers

    from slotkeeper.identity import identity, prompts

    checked = 0
    for entry in load(client):
        prompt = prompts.read_prompt(entry["path"], entry["body"])
        if prompt.raw_prompt is not None or not prompt.messages:
            continue
        system = identity._hashable_system(prompt.system_parts)
        digest = identity._system_digest(prompt, system)[0]
        links = [hashlib.blake2b(digest.encode(), digest_size=12).hexdigest()]
        for message in prompt.messages:
            step = hashlib.blake2b(links[-1].encode(), digest_size=12)
            step.update(json.dumps(message, ensure_ascii=True, separators=(",", ":")).encode())
            links.append(step.hexdigest())
        headers = Headers([(k.encode(), v.encode()) for k, v in entry["headers"]])
        for _twice in range(2):
            assert identity.identify(entry["path"], headers, entry["body"]).chain == tuple(links)
        checked += 1
    assert checked, f"no conversation in the {client} corpus"
