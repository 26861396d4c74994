"""Browsers cannot drive the proxy (issue #21, items 1 and 2), at the unit level: the pure
rules of origins.py and the guard's decisions on flows. The same attacks through a real
mitmdump and a real headless Chromium are in test_browsers_real.py."""

from __future__ import annotations

import json
from contextlib import contextmanager

import pytest
from mitmproxy.addons import proxyserver
from mitmproxy.proxy.mode_specs import ProxyMode
from mitmproxy.test import taddons, tflow
from reliability import reliability  # noqa: F401  (the fixture)

from slotkeeper.guard import origins
from slotkeeper.guard.browser import BrowserGuard
from slotkeeper.guard.cors import ANSWER_KEY, put_answer_headers
from slotkeeper.surfaces.ollama_surface import OllamaSurface

RELIABILITY_AREA = "attacks"


@pytest.mark.parametrize("host,allowed", [
    ("127.0.0.1:8000", True), ("[::1]:8000", True), ("localhost:8000", True),
    ("LOCALHOST", True), ("app.localhost:8000", True), ("192.0.2.7:8000", True),
    ("", True), ("myproxy.lan:8000", True), ("myproxy.lan.:8000", True),
    ("evil.example", False), ("evil.example:8000", False), ("127.0.0.1.evil.example", False),
    ("localhost.evil.example:8000", False), ("[::1].evil", False),
])
def test_management_hosts_are_ip_addresses_loopback_names_and_known_names(host, allowed):
    assert origins.host_allowed(host, ["myproxy.lan", ""]) is allowed


def test_changes_refuse_foreign_origins_and_bodies_that_are_not_json():
    host = "127.0.0.1:8000"
    assert origins.mutation_refusal("POST", None, "application/json", True, host) is None
    assert origins.mutation_refusal("POST", "http://127.0.0.1:8000", "application/json; "
                                    "charset=utf-8", False, host) is None
    assert origins.mutation_refusal("DELETE", None, "", False, host) is None
    for origin in ("http://127.0.0.1:9999", "http://evil.example", "null", "",
                   "http://127.0.0.1:8000.evil.example"):
        status, message = origins.mutation_refusal("POST", origin, "application/json", True,
                                                   host)
        assert status == 403 and "Origin" in message, origin
    for content_type in ("text/plain", "", "application/x-www-form-urlencoded",
                         "multipart/form-data; boundary=x", "application/jsonp"):
        assert origins.mutation_refusal("POST", None, content_type, False, host)[0] == 415
    assert origins.mutation_refusal("DELETE", None, "text/plain", True, host)[0] == 415


@pytest.mark.parametrize("origin,allowed", [
    ("http://localhost", True), ("http://localhost:3000", True), ("https://127.0.0.1:8443", True),
    ("http://[::1]:5173", True), ("http://0.0.0.0:8080", True), ("app://obsidian.md", True),
    ("tauri://localhost", True), ("vscode-webview://abc", True), ("file://", True),
    ("chrome-extension://abcdef", True), ("moz-extension://x", True),
    ("http://evil.example", False), ("http://localhost.evil.example", False),
    ("http://127.0.0.1.nip.io", False), ("https://chat.example.com", False), ("null", False),
    ("http://localhost:3000/extra", False),
])
def test_ollama_origins_default_like_ollama(origin, allowed):
    assert origins.origin_allowed(origin) is allowed


def test_ollama_origins_option_adds_patterns():
    assert origins.origin_allowed("https://chat.example.com", ["https://*.example.com"])
    assert not origins.origin_allowed("https://example.org", ["https://*.example.com"])
    assert origins.origin_allowed("http://anything.example", ["*"])


# ---- the guard on flows ---------------------------------------------------------------------

@contextmanager
def guard_context(keep_host_header: bool = False):
    """A guard loaded as mitmdump loads a script: after the core options (keep_host_header as
    the user set it) and beside the Ollama surface, which declares slotkeeper_ollama_port."""
    with taddons.context(proxyserver.Proxyserver(), OllamaSurface(None)) as tctx:
        tctx.options.update(keep_host_header=keep_host_header)
        guard = BrowserGuard()
        tctx.master.addons.add(guard)
        yield guard, tctx


def request(guard, method, path, host="127.0.0.1:8000", port=8000, **headers):
    f = tflow.tflow()
    f.client_conn.proxy_mode = ProxyMode.parse("reverse:http://127.0.0.1:8080")
    f.client_conn.sockname = ("127.0.0.1", port)
    f.request.method = method
    f.request.path = path
    f.request.host, f.request.port = "127.0.0.1", 8080
    f.request.headers["Host"] = host
    for name, value in headers.items():
        f.request.headers[name.replace("_", "-")] = value
    guard.requestheaders(f)  # the guard's one hook: every refusal is decided here
    return f


def test_the_guard_refuses_browsers_on_management_calls(reliability):
    with guard_context() as (guard, tctx):
        tctx.configure(guard, listen_host="127.0.0.1")
        assert tctx.options.keep_host_header and guard.restore_host
        ok = request(guard, "POST", "/api/sessions/clear", content_type="application/json")
        assert ok.response is None
        # The upstream's Host is forwarded, as without keep_host_header; the client's was
        # judged (the refusals of evil.example below) and is not left in the flow.
        assert ok.request.headers["Host"] == "127.0.0.1:8080"
        assert ok.metadata == {}  # the client's Host is judged in the hook, not kept
        chunked = request(guard, "POST", "/api/sessions/clear", transfer_encoding="chunked",
                          content_type="text/plain")  # a body is told by the headers alone
        assert chunked.response.status_code == 415
        assert request(guard, "DELETE", "/api/sessions/x", content_length="0").response is None
        plain = request(guard, "POST", "/api/sessions/clear", content_type="text/plain")
        assert plain.response.status_code == 415
        assert "application/json" in json.loads(plain.response.content)["error"]["message"]
        page = request(guard, "POST", "/api/upstreams/drain", content_type="application/json",
                       origin="http://127.0.0.1:5555")
        assert page.response.status_code == 403
        for path in ("/api/sessions", "/api/sessions/current", "/slotkeeper/metrics", "/api/upstreams"):
            rebound = request(guard, "GET", path, host="evil.example:8000")
            assert rebound.response.status_code == 403, path
            assert "slotkeeper_api_hosts" in rebound.response.text
        assert request(guard, "GET", "/slotkeeper/metrics", host="localhost:8000").response is None
        # Completions are not management calls: no Host or Origin rule.
        assert request(guard, "POST", "/v1/chat/completions", host="evil.example",
                       origin="http://evil.example").response is None
        tctx.configure(guard, slotkeeper_api_hosts=["evil.example"])
        assert request(guard, "GET", "/slotkeeper/metrics", host="evil.example:8000").response is None
    reliability.row("management calls as a browser sends them: POST /api/sessions/clear with a "
                    "text/plain body, a POST with another page's Origin, any call whose Host "
                    "is a DNS-rebinding name (unit level)",
                    outcome="415 naming application/json; 403 (Origin not this proxy's); 403 "
                            "naming slotkeeper_api_hosts. The client's Host is read although "
                            "reverse mode rewrites it (keep_host_header on, the upstream's Host "
                            "put back)")


def test_the_guard_checks_origins_on_the_ollama_routes_like_ollama(reliability):
    with guard_context(keep_host_header=True) as (guard, tctx):  # the user's: Host left alone
        tctx.configure(guard, slotkeeper_ollama_origins=["https://chat.example.com"])
        assert not guard.restore_host
        foreign = request(guard, "POST", "/api/chat", origin="http://evil.example")
        assert foreign.response.status_code == 403
        assert foreign.request.headers["Host"] == "127.0.0.1:8000"
        listed = request(guard, "POST", "/api/chat", origin="https://chat.example.com")
        assert listed.response is None
        assert listed.metadata[ANSWER_KEY]["Access-Control-Allow-Origin"] == (
            "https://chat.example.com")
        # On the Ollama port every route is Ollama's (its /v1 routes too).
        local = request(guard, "POST", "/v1/chat/completions", port=11434,
                        origin="http://localhost:3000")
        assert local.response is None
        assert request(guard, "POST", "/v1/chat/completions", port=11434,
                       origin="http://evil.example").response.status_code == 403
        assert request(guard, "POST", "/v1/chat/completions", port=8000,
                       origin="http://evil.example").response is None
        assert request(guard, "POST", "/api/chat").response is None  # no Origin: not a page
        # The answer names the origin it let in, never llama-server's "*".
        local.response = tflow.tresp()
        local.response.headers["Access-Control-Allow-Origin"] = "*"
        put_answer_headers(local.response.headers, local.metadata.get(ANSWER_KEY))
        assert local.response.headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
        assert local.response.headers["Vary"] == "Origin"
        plain = request(guard, "POST", "/api/chat")
        plain.response = tflow.tresp()
        plain.response.headers["Access-Control-Allow-Origin"] = "*"
        put_answer_headers(plain.response.headers, plain.metadata.get(ANSWER_KEY))
        assert "Access-Control-Allow-Origin" not in plain.response.headers
    reliability.row("Ollama routes called by a page of another origin (and on the Ollama "
                    "port, every route)",
                    outcome="403 like Ollama, unless the origin is a loopback one, an app or "
                            "extension scheme, or in slotkeeper_ollama_origins; an allowed "
                            "origin is named in Access-Control-Allow-Origin, never '*'")


def test_the_guard_looks_at_every_path_a_rule_applies_to():
    """The guard skips a path outside GUARDED_PREFIXES without a look (the hot path): each
    management route and Ollama route is inside them."""
    from slotkeeper.guard.access import MANAGEMENT_PREFIXES, is_management_path
    from slotkeeper.guard.browser import GUARDED_PREFIXES
    assert all(prefix.startswith(GUARDED_PREFIXES) for prefix in MANAGEMENT_PREFIXES)
    for path in ("/slotkeeper/metrics", "/slotkeeper/metrics/", "/slotkeeper/metrics?x=1",
                 "/api/sessions/a/clear", "/api/upstreams/drain", "/api/chat", "/api/tags"):
        assert path.startswith(GUARDED_PREFIXES), path
    assert not is_management_path("/v1/chat/completions")
    assert not is_management_path("/metrics")  # llama-server's own: passed through
