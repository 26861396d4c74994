"""Trust (issue #21), through real processes: a real headless Chromium page of another origin
and a DNS-rebinding page cannot drive the proxy, the Ollama routes check Origin like Ollama,
a llama-server started with --api-key, a model replaced at the same path, and (with a FAKE
server, for a hang a real one cannot show on demand) a save that never answers."""

from __future__ import annotations

import json
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import requests
from browser import Browser, chromium_binary
from fake_upstream import FakeFaultyLlama, Fault
from reliability import problems_in, reliability  # noqa: F401  (reliability: the fixture)
from testbed import Proxy, free_port, long_system_prompt

RELIABILITY_AREA = "attacks"
CHAT = "/v1/chat/completions"
SAVE_FAST = {"slotkeeper_small_request_chars": 0, "slotkeeper_min_save_tokens": 0,
             "slotkeeper_idle_save_seconds": 0, "slotkeeper_max_seeds": 0}
SYSTEM = long_system_prompt(60, seed=21)


def ask(url: str, session: str, question: str, headers: dict[str, str] | None = None,
        timeout: float = 300) -> requests.Response:
    body = {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": question}],
            "temperature": 0, "max_tokens": 8}
    return requests.post(url + CHAT, json=body, timeout=timeout,
                         headers={"X-Session-Id": session, **(headers or {})})


def claimed(proxy: Proxy, headers: dict[str, str] | None = None) -> set[str]:
    """The sessions holding a slot, as the proxy's own API says."""
    current = requests.get(proxy.url + "/api/sessions/current", timeout=30,
                           headers=headers or {}).json()
    return {slot["session"] for up in current["upstreams"].values()
            for slot in up["slots"].values() if slot.get("session")}


# ---- item 1: web pages ------------------------------------------------------------------------

ATTACK_PAGE = """<!doctype html><title>loading</title><script>
const proxy = "http://127.0.0.1:%(port)d";
const tries = [
  ["no-cors POST clear, text/plain", proxy + "/api/sessions/clear",
   {method: "POST", mode: "no-cors", body: "{}"}],
  ["no-cors POST clear, JSON header (dropped by the browser)", proxy + "/api/sessions/clear",
   {method: "POST", mode: "no-cors", body: "{}", headers: {"Content-Type": "application/json"}}],
  ["cors POST clear, JSON (needs a preflight)", proxy + "/api/sessions/clear",
   {method: "POST", mode: "cors", body: "{}", headers: {"Content-Type": "application/json"}}],
  ["no-cors POST drain", proxy + "/api/upstreams/drain",
   {method: "POST", mode: "no-cors", body: JSON.stringify({upstream: "%(llama)s"})}],
  ["cors GET sessions (read)", proxy + "/api/sessions/current", {mode: "cors"}],
];
window.results = {};
(async () => {
  for (const [name, url, init] of tries) {
    try {
      const r = await fetch(url, init);
      window.results[name] = r.type === "opaque" ? "sent (opaque)" : "read " + r.status;
    } catch (e) {
      window.results[name] = "blocked: " + e.name;
    }
  }
  document.title = "done";
})();
</script>"""


class _PageServer:
    """The attacker's page, served from another origin (127.0.0.1, another port)."""

    def __init__(self, html: str) -> None:
        page = html.encode()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(page)))
                self.end_headers()
                self.wfile.write(page)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def chromium() -> Path:
    found = chromium_binary()
    if found is None:
        pytest.fail("chromium not found: scripts/test installs Debian's `chromium` when run as "
                    "root; or set SLOTKEEPER_CHROMIUM", pytrace=False)
    return found


def test_web_pages_cannot_clear_drain_or_read_the_proxy(chromium, llama, make_proxy, tmp_path,
                                                       reliability):
    proxy = make_proxy(llama, **SAVE_FAST)
    assert ask(proxy.url, "victim", "Name a colour.").status_code == 200
    assert "victim" in claimed(proxy)
    page = _PageServer(ATTACK_PAGE % {"port": proxy.port, "llama": llama.url})
    rebinding = ("--host-resolver-rules=MAP rebind.example 127.0.0.1",)
    try:
        with Browser(chromium, tmp_path / "profile", extra_flags=rebinding) as browser:
            browser.goto(page.url)
            browser.wait_for("document.title === 'done'", timeout=60)
            results = browser.evaluate("window.results")
            # DNS rebinding: a page of rebind.example, now resolving to the proxy, reads its
            # own origin (the browser allows it: same origin) under its own Host name.
            browser.goto(f"http://rebind.example:{proxy.port}/health")
            browser.wait_for("document.readyState === 'complete'")
            rebound = {path: browser.evaluate(f"fetch('{path}').then(r => r.status)")
                       for path in ("/api/sessions/current", "/api/sessions", "/slotkeeper/metrics")}
    finally:
        page.close()
    assert results["no-cors POST clear, text/plain"] == "sent (opaque)", results  # it did go
    assert "victim" in claimed(proxy)  # nothing cleared
    assert results["cors GET sessions (read)"].startswith("blocked"), results
    assert rebound == {"/api/sessions/current": 403, "/api/sessions": 403, "/slotkeeper/metrics": 403}
    log = proxy.log_text()
    # Each reached the proxy and was refused there (not by the browser on its own).
    assert log.count("POST /api/sessions/clear refused (403)") == 2, log[-3000:]
    assert "POST /api/upstreams/drain refused (403)" in log
    assert "OPTIONS /api/sessions/clear refused (403)" in log  # the CORS preflight
    assert log.count("is not a name this proxy answers") == 3
    reliability.row("a web page of another origin in headless Chromium: fetch no-cors POST "
                    "/api/sessions/clear and /api/upstreams/drain, a CORS POST with JSON, a "
                    "CORS read; and a DNS-rebinding page (rebind.example mapped to 127.0.0.1) "
                    "reading /api/sessions and /slotkeeper/metrics",
                    outcome=f"the no-cors POSTs arrive (text/plain, the page's Origin) and get "
                            f"403 for the foreign Origin; the CORS POST's preflight gets 403, "
                            f"so it is never sent; the CORS read gets no CORS headers; the "
                            f"rebinding page's same-origin reads get 403 (Host not the "
                            f"proxy's); the sessions stay. Browser saw: {json.dumps(results)}")


def test_text_plain_posts_and_foreign_hosts_are_refused(llama, make_proxy, reliability):
    proxy = make_proxy(llama, **SAVE_FAST)
    assert ask(proxy.url, "keeper", "Name a colour.").status_code == 200
    r = requests.post(proxy.url + "/api/sessions/clear", data="{}", timeout=30,
                      headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    r = requests.post(proxy.url + "/api/sessions/clear", json={}, timeout=30,
                      headers={"Origin": "http://127.0.0.1:1"})
    assert r.status_code == 403
    assert "keeper" in claimed(proxy)
    for path in ("/api/sessions/current", "/slotkeeper/metrics"):
        r = requests.get(proxy.url + path, headers={"Host": "evil.example"}, timeout=30)
        assert r.status_code == 403 and "slotkeeper_api_hosts" in r.text, path
    # The proxy's own page origin may change things; completions ignore Host and Origin.
    r = requests.post(proxy.url + "/api/sessions/clear", json={}, timeout=30,
                      headers={"Origin": proxy.url})
    assert r.status_code == 200 and "keeper" not in claimed(proxy)
    assert ask(proxy.url, "keeper", "Name a colour.",
               headers={"Host": "evil.example", "Origin": "http://evil.example"}
               ).status_code == 200
    assert not problems_in(proxy.log_text())
    reliability.row("from loopback: POST /api/sessions/clear with a text/plain body, or "
                    "another origin's Origin; GET /api/sessions/current and /slotkeeper/metrics with "
                    "Host: evil.example",
                    outcome="415 naming application/json; 403; 403 naming "
                            "slotkeeper_api_hosts; the sessions stay; with JSON and no "
                            "Origin (or the proxy's own) the call works as before")


# ---- item 2: the Ollama port ---------------------------------------------------------------

def test_ollama_routes_check_origin_like_ollama(llama, make_proxy, reliability):
    proxy = make_proxy(llama, slotkeeper_ollama_origins=["https://chat.example.com"])
    generate = {"model": "m", "prompt": "Say yes.", "stream": False,
                "options": {"num_predict": 2, "temperature": 0}}
    outcomes = {}
    for origin in ("http://evil.example", "https://attacker.example.com", None,
                   "http://localhost:3000", "https://chat.example.com"):
        headers = {"Origin": origin} if origin else {}
        r = requests.post(proxy.url + "/api/generate", json=generate, headers=headers,
                          timeout=120)
        outcomes[origin or "no Origin"] = r.status_code
        allow = r.headers.get("Access-Control-Allow-Origin")
        if r.status_code == 200:
            assert allow == origin, (origin, allow)  # never llama-server's "*"
    assert outcomes == {"http://evil.example": 403, "https://attacker.example.com": 403,
                        "no Origin": 200, "http://localhost:3000": 200,
                        "https://chat.example.com": 200}
    # An answer the proxy makes itself names the origin too (mitmproxy calls responseheaders
    # for it), and none without an Origin.
    version = requests.get(proxy.url + "/api/version", timeout=30,
                           headers={"Origin": "http://localhost:3000"})
    assert version.headers.get("Access-Control-Allow-Origin") == "http://localhost:3000"
    assert "Access-Control-Allow-Origin" not in requests.get(proxy.url + "/api/version",
                                                             timeout=30).headers
    # A browser's preflight (issue #20.3), through the whole proxy (guard, then the surface):
    # answered as Ollama answers it for an allowed origin, refused for another.
    asks = {"Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type"}
    allowed = requests.options(proxy.url + "/api/chat", timeout=30, headers={
        "Origin": "https://chat.example.com", **asks})
    assert allowed.status_code == 204, (allowed.status_code, allowed.text)
    assert allowed.headers["Access-Control-Allow-Origin"] == "https://chat.example.com"
    assert "POST" in allowed.headers["Access-Control-Allow-Methods"]
    assert "content-type" in allowed.headers["Access-Control-Allow-Headers"].lower()
    refused = requests.options(proxy.url + "/api/chat", timeout=30, headers={
        "Origin": "http://evil.example", **asks})
    assert refused.status_code == 403
    assert "Access-Control-Allow-Origin" not in refused.headers
    # On the Ollama port every route is Ollama's, its OpenAI ones too; on another port the
    # OpenAI routes answer as before.
    port = free_port()
    on_port = make_proxy(llama, port=port, slotkeeper_ollama_port=port)
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    foreign = {"Origin": "http://evil.example"}
    assert requests.post(on_port.url + CHAT, json=chat, headers=foreign,
                         timeout=120).status_code == 403
    local = requests.post(on_port.url + CHAT, json=chat, timeout=120,
                          headers={"Origin": "http://localhost:3000"})
    assert local.status_code == 200
    assert local.headers.get("Access-Control-Allow-Origin") == "http://localhost:3000"
    assert requests.post(proxy.url + CHAT, json=chat, headers=foreign,
                         timeout=120).status_code == 200
    reliability.row("Ollama routes (/api/generate) from a page of another origin; every route "
                    "on the Ollama port",
                    outcome="403 as Ollama answers, unless loopback, an app scheme or in "
                            "slotkeeper_ollama_origins; the answer's Access-Control-Allow-"
                            "Origin names that origin (llama-server's '*' is dropped): "
                            + json.dumps(outcomes))


# ---- item 3: llama-server --api-key ----------------------------------------------------------

def test_a_server_with_an_api_key(make_llama, make_proxy, tmp_path, reliability, monkeypatch):
    key = "upstream-key-" + "7" * 16
    slot_dir = tmp_path / "slots"
    server = make_llama(np=1, ctx=4096, slot_save_path=slot_dir, extra=["--api-key", key])
    keyless = make_proxy(server, slotkeeper_slot_dir=str(slot_dir), **SAVE_FAST)
    deadline = time.monotonic() + 30
    while "slotkeeper_upstream_api_key" not in keyless.log_text():
        assert time.monotonic() < deadline, keyless.log_text()[-2000:]
        time.sleep(0.2)
    time.sleep(1)
    lines = [line for line in keyless.log_text().splitlines()
             if "slotkeeper_upstream_api_key" in line]
    assert len(lines) == 1 and "401" in lines[0], lines  # one clear line at start
    keyless.stop()

    # The key from the environment, so it is not on the command line (the process list).
    monkeypatch.setenv("SLOTKEEPER_UPSTREAM_API_KEY", key)
    proxy = make_proxy(server, slotkeeper_slot_dir=str(slot_dir), **SAVE_FAST)
    assert key not in " ".join(proxy.command())
    auth = {"Authorization": f"Bearer {key}"}
    first = ask(proxy.url, "keyed-a", "Name a colour.", headers=auth)
    assert first.status_code == 200 and first.headers["X-Slotkeeper-Action"] == "assigned"
    # The client's own Authorization is what the server checks on completions.
    assert ask(proxy.url, "keyed-x", "Name a colour.").status_code == 401
    other = ask(proxy.url, "keyed-b", "Name a tree.", headers=auth)  # takes the one slot
    assert other.status_code == 200 and "fallback" not in other.headers["X-Slotkeeper-Action"]
    back = ask(proxy.url, "keyed-a", "Name a colour.", headers=auth)
    assert back.status_code == 200 and back.headers["X-Slotkeeper-Action"] == "restored", \
        dict(back.headers)
    assert key not in proxy.log_text()
    reliability.row("llama-server started with --api-key; a proxy without the key, then one "
                    "with $SLOTKEEPER_UPSTREAM_API_KEY",
                    outcome="without: one warning line at start naming the option (401); with: "
                            "/slots, /props and save/restore carry the key, a session is "
                            "saved and restored; clients' Authorization forwarded as before")


# ---- item 4: a model replaced at the same path -----------------------------------------------

def edited_copy(model: Path, target: Path) -> str:
    """Copy the model and change one hyperparameter in the copy's metadata with the gguf
    package (a GGUF edited in place keeps every size and shape): the rope base frequency,
    which changes every key vector the KV cache holds."""
    from gguf import GGUFReader

    shutil.copyfile(model, target)
    reader = GGUFReader(target, "r+")
    key = next(k for k in reader.fields if k.endswith(".rope.freq_base"))
    field = reader.fields[key]
    value = field.parts[field.data[0]]
    value[0] = value[0] * 4
    reader.data.flush()
    del reader
    return key


def test_a_model_replaced_at_the_same_path_is_not_restored(make_llama, make_proxy, model_path,
                                                          tmp_path, reliability):
    slot_dir = tmp_path / "slots"
    model = tmp_path / "models" / model_path.name  # the name gets the test bed's template
    model.parent.mkdir()
    shutil.copyfile(model_path, model)
    server = make_llama(np=1, ctx=4096, slot_save_path=slot_dir, model=model)
    proxy = make_proxy(server, slotkeeper_slot_dir=str(slot_dir), **SAVE_FAST)
    assert ask(proxy.url, "swap", "Name a colour.").status_code == 200
    assert ask(proxy.url, "swap-other", "Name a tree.").status_code == 200  # saves "swap"
    saved = list(slot_dir.glob("*.json"))
    assert saved, "the session was not saved"
    server.stop()
    edited = tmp_path / "models" / "edited.gguf"
    key = edited_copy(model_path, edited)
    edited.replace(model)  # another model file, the same path
    server.start()
    turn = ask(proxy.url, "swap", "Name a colour.")
    assert turn.status_code == 200
    assert turn.headers["X-Slotkeeper-Action"] != "restored", dict(turn.headers)
    cold = ask(proxy.url, "swap-cold", "Name a colour.")
    assert cold.headers["X-Slotkeeper-Action"] == "assigned"
    answer = turn.json()["choices"][0]["message"]["content"]
    assert answer == cold.json()["choices"][0]["message"]["content"]
    metrics = requests.get(proxy.url + "/slotkeeper/metrics", timeout=30).text
    refused = [line for line in metrics.splitlines()
               if line.startswith('slotkeeper_restore_refused_total{reason="fingerprint"}')]
    assert refused and float(refused[0].split()[-1]) >= 1, refused
    reliability.row(f"llama-server restarted on another GGUF at the same path (the test model "
                    f"with {key} changed by the gguf package), a saved session's next turn",
                    outcome="not restored (fingerprint: the model file's identity changed), "
                            "counted in slotkeeper_restore_refused_total{reason=fingerprint}; "
                            "its answer equals a cold run's",
                    lost="the session's snapshot (prefilled again)")


# ---- item 7: a save that never answers (FAKE) ------------------------------------------------

def test_fake_server_hanging_mid_save_holds_nobody_for_long(make_llama, make_proxy, tmp_path,
                                                            reliability):
    slot_dir = tmp_path / "slots"
    server = make_llama(np=1, ctx=4096, slot_save_path=slot_dir)
    fake = FakeFaultyLlama(server.url, faults={
        "POST /slots/": Fault(delay=150, count=1, query="action=save")}).start()
    try:
        proxy = make_proxy(fake.url, slotkeeper_slot_dir=str(slot_dir), **SAVE_FAST)
        assert ask(proxy.url, "hang-a", "Name a colour.").status_code == 200
        started = time.monotonic()
        # Another session takes the one slot: the proxy saves hang-a first, and the FAKE
        # server accepts that save and never answers it.
        other = ask(proxy.url, "hang-b", "Name a tree.", timeout=120)
        took = time.monotonic() - started
        assert other.status_code == 200, other.text
        # The bound is 5 s; the rest is the turn itself (~10 s on a loaded 2-core machine).
        # Waiting for the save, as before, took the fake's 150 s (or 600 s for a real hang).
        assert took < 45, f"served after {took:.1f} s"
        assert any("action=save" in line or "POST /slots/" in line for line in fake.seen)
        log = proxy.log_text()
        assert "server marked suspect" in log, log[-3000:]
        # And the next request after that, of a third session, is not held either.
        t0 = time.monotonic()
        assert ask(proxy.url, "hang-c", "Name a river.", timeout=120).status_code == 200
        third = time.monotonic() - t0
    finally:
        fake.stop()
    reliability.row("FAKE llama-server that accepts a save and never answers it (handover "
                    "of the only slot)",
                    outcome=f"the save gives up after its size's bound (5 s + bytes at "
                            f"50 MB/s), the server is marked suspect, the other session is "
                            f"served in {took:.1f} s without that snapshot, the next one in "
                            f"{third:.1f} s",
                    lost="that save (the session re-prefills)")
