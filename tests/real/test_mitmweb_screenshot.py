"""What a user sees in mitmweb, in a real browser: headless Chromium (Debian's `chromium`) on
mitmweb started by `slotkeeper --web`, in front of a real llama-server. At mitmweb's default
column widths each completion's row must show its session, slot and action, its marker must be
drawn from a text font (no emoji font needed), and the status bar must name the port the proxy
listens on. The screenshots are kept in the test's folder; with SLOTKEEPER_SCREENSHOTS=DIR they
are also written to DIR (how docs/img/ is made)."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from browser import Browser, chromium_binary
from mitmproxy.utils.emoji import emoji
from testbed import free_port, log_tail, long_system_prompt, wait_for_mitmproxy

from slotkeeper.flows import MARKERS
from slotkeeper.observe.contentview import flow_comment

SLOTKEEPER = Path(sys.executable).parent / "slotkeeper"
LONG_ID = "3f2a9c71-0b6e-4d1a-9c55-1e2f3a4b5c6d"  # as Claude Code names sessions

# For each row with a comment: its text, whether it overflows its cell (then the browser cuts
# it with an ellipsis), the cell's width, the marker, and whether the marker's glyph is drawn
# and differs from what the same font draws for a character no font has (a box).
ROWS_JS = """
(() => {
  const canvas = document.createElement('canvas');
  canvas.width = 40; canvas.height = 40;
  const ctx = canvas.getContext('2d', {willReadFrequently: true});
  const pixels = (text, font) => {
    ctx.clearRect(0, 0, 40, 40); ctx.font = font; ctx.fillStyle = '#000';
    ctx.fillText(text, 4, 28);
    return Array.from(ctx.getImageData(0, 0, 40, 40).data).join(',');
  };
  return [...document.querySelectorAll('.flow-table tbody tr')].map(row => {
    const cell = row.querySelector('td.col-comment');
    const marker = row.querySelector('.marker');
    const mark = marker ? marker.textContent : '';
    const font = marker ? getComputedStyle(marker).font : '';
    const drawn = mark ? pixels(mark, font) : '';
    return {
      text: cell ? cell.textContent : '',
      overflows: cell ? cell.scrollWidth > cell.clientWidth : null,
      width: cell ? cell.getBoundingClientRect().width : null,
      marker: mark,
      markerDrawn: !!mark && drawn !== pixels('', font),
      markerIsTofu: !!mark && drawn === pixels('\\u{10FFFD}', font),
    };
  }).filter(r => r.text);
})()
"""


@pytest.fixture(scope="session")
def chromium() -> Path:
    found = chromium_binary()
    if found is None:
        pytest.fail("chromium not found: scripts/test installs Debian's `chromium` when run as "
                    "root; otherwise run `sudo apt-get install chromium`, or set "
                    "SLOTKEEPER_CHROMIUM to a Chromium binary", pytrace=False)
    return found


def launch_web(upstream: str, workdir: Path, port: int, web_port: int, password: str
               ) -> subprocess.Popen[bytes]:
    """mitmweb through the launcher, as `slotkeeper --web` runs it (mitm.conf's options),
    with a port of its own in the mode."""
    log = workdir / "slotkeeper-web.log"
    with log.open("wb") as out:
        return subprocess.Popen(
            [str(SLOTKEEPER), "--web", "--mode", f"reverse:{upstream}@{port}",
             "--set", f"web_port={web_port}", "--set", f"web_password={password}",
             "--set", "web_open_browser=false", "--set", f"confdir={workdir / 'confdir'}",
             "--set", f"slotkeeper_state_file={workdir / 'state.json'}",
             "--set", f"slotkeeper_slot_dir={workdir / 'slots'}",
             "--set", "slotkeeper_idle_save_seconds=0", "--set", "slotkeeper_max_seeds=0",
             # the rows must show a disk restore, not the server's RAM cache's swap
             "--set", "slotkeeper_upstream_cache_ram_mb=0"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def keep(path: Path) -> None:
    if folder := os.environ.get("SLOTKEEPER_SCREENSHOTS"):
        shutil.copy(path, Path(folder) / path.name)


def test_mitmweb_rows_show_session_slot_and_action(chromium, make_llama, tmp_path):
    slots = tmp_path / "slots"
    server = make_llama(np=2, ctx=8192, slot_save_path=slots)
    port, web_port, password = free_port(), free_port(), "pw-" + secrets.token_hex(8)
    proc = launch_web(server.url, tmp_path, port, web_port, password)
    log = tmp_path / "slotkeeper-web.log"
    try:
        wait_for_mitmproxy(proc, port, log, 60)
        url = f"http://127.0.0.1:{port}"
        # Three sessions on two slots, long enough to be saved (2,000+ characters, 256+
        # tokens), so the third takes a slot over and the first comes back restored, then
        # stays (kept); a short request is a side request.
        sessions = {"web-1": 1, "web-2": 2, LONG_ID: 3, "web-3": 4}
        conversations = {s: [{"role": "system", "content": long_system_prompt(350, seed=k)}]
                         for s, k in sessions.items()}
        conversations["web-3"] = []
        heads, actions = [], []
        for session in ["web-1", "web-2", LONG_ID, "web-1", "web-1", "web-3"]:
            messages = conversations[session]
            messages.append({"role": "user", "content": "What is the capital of France?"})
            r = requests.post(url + "/v1/chat/completions", timeout=600,
                              headers={"X-Session-Id": session},
                              json={"messages": messages, "temperature": 0, "max_tokens": 16})
            assert r.status_code == 200, r.text[:500]
            messages.append(r.json()["choices"][0]["message"])
            routing = {"session": r.headers["X-Slotkeeper-Session"],
                       "slot": int(r.headers["X-Slotkeeper-Slot"])
                       if r.headers["X-Slotkeeper-Slot"] else None,
                       "action": r.headers["X-Slotkeeper-Action"]}
            assert routing["session"] == session
            heads.append(flow_comment(routing))
            actions.append(routing["action"])
        assert actions == ["assigned", "assigned", "assigned", "restored", "kept", "side"]

        with Browser(chromium, tmp_path / "chromium-profile") as browser:
            browser.goto(f"http://127.0.0.1:{web_port}/?token={password}")
            browser.wait_for("document.querySelectorAll('td.col-comment').length >= 6")
            rows = browser.evaluate(ROWS_JS)
            footer = browser.evaluate("document.querySelector('footer').innerText")
            shot = tmp_path / "mitmweb.png"
            browser.screenshot(shot)
            keep(shot)
            view_shot = open_restored_flow(browser, tmp_path)
            keep(view_shot)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    assert [r["text"] for r in rows] == heads, (rows, log_tail(log))
    for row, action in zip(rows, actions):
        # Session, slot and action fit: nothing cut at mitmweb's default column width.
        assert row["width"] <= 151 and not row["overflows"], row
        assert row["marker"] == emoji[MARKERS[action]], row
        assert row["markerDrawn"] and not row["markerIsTofu"], row
    assert rows[2]["text"].startswith("…5c6d #")  # the long id by its end
    assert f"127.0.0.1:{port}" in footer.split(), footer


def open_restored_flow(browser: Browser, folder: Path) -> Path:
    """Select the restored flow and show its response in the slotkeeper view."""
    browser.evaluate("[...document.querySelectorAll('.flow-table tbody tr')]"
                     ".find(r => r.textContent.includes(' restored')).click()")
    browser.wait_for("[...document.querySelectorAll('a, button')]"
                     ".some(e => e.textContent.trim() === 'Response')")
    browser.evaluate("[...document.querySelectorAll('a, button')]"
                     ".find(e => e.textContent.trim() === 'Response').click()")
    browser.wait_for("document.body.innerText.includes('reused:')")
    time.sleep(0.5)
    shot = folder / "mitmweb-view.png"
    browser.screenshot(shot)
    return shot
