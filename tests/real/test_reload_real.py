"""A script reload leaves nothing behind (issue #18, item 5): mitmproxy calls the old addons'
`done` from its sync reload path and loads fresh ones. `done` stops what `running` and
`configure` started (the health watcher, idle-save timers) and the old addon's executors shut
down, so reloading three times in one mitmdump (a request through each addon, so each has
started its worker threads) ends with as many threads as after the first addon's request."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from testbed import REPO, chat

SYSTEM = "You answer in one word. " * 100  # a main request: it claims a slot


def threads_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def settle_threads(pid: int, seconds: float = 3.0) -> int:
    """The thread count once idle worker threads of shut-down executors have exited."""
    deadline = time.monotonic() + seconds
    count = threads_of(pid)
    while time.monotonic() < deadline:
        time.sleep(0.25)
        count = threads_of(pid)
    return count


def reload(script: Path, proxy, loads: int) -> None:
    future = time.time() + 10 * loads
    os.utime(script, (future, future))
    deadline = time.monotonic() + 30
    while proxy.log_text().count("Loading script") < loads:
        assert time.monotonic() < deadline, f"no reload:\n{proxy.log_text()[-2000:]}"
        time.sleep(0.2)
    time.sleep(0.5)


def ask(proxy, n: int) -> None:
    chat(proxy.url, [{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": f"Question {n}?"}],
         session_headers={"x-session-id": "reload"}, n_predict=2)


def test_three_reloads_leave_no_threads_behind(llama, make_proxy, tmp_path):
    script = tmp_path / "slotkeeper_addon.py"
    shutil.copy(REPO / "addon" / "slotkeeper_addon.py", script)
    proxy = make_proxy(llama, script=script, slotkeeper_idle_save_seconds=1)
    ask(proxy, 0)
    time.sleep(1.5)  # the idle save ran on the release pool: its thread exists now
    first = settle_threads(proxy.proc.pid)
    counts = []
    for n in range(1, 4):
        reload(script, proxy, n + 1)
        ask(proxy, n)
        time.sleep(1.5)
        counts.append(settle_threads(proxy.proc.pid))
    log = proxy.log_text()
    assert "Traceback" not in log and log.count("Loading script") == 4
    # Each addon starts the same threads (routing and release workers); the old ones end.
    # Before the fix every reload left the old executors' threads running (+2 or more each).
    assert max(counts) <= first + 1, (first, counts)
