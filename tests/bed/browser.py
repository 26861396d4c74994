"""Headless Chromium (Debian's `chromium`) driven over the DevTools protocol, through the pipe
Chromium opens with --remote-debugging-pipe: no driver, no websocket library, nothing
downloaded. Enough to load a page, wait for what its JavaScript renders, read it back and take
a screenshot."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Self

from slotkeeper.launcher.local import die_with_parent

# As Debian's headless Chromium runs best in a container: no sandbox (root), no GPU, and no
# network of its own (QUIC, background updates, sync) since only loopback is reachable.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--remote-debugging-pipe")
COMMAND_TIMEOUT_S = 60.0


def chromium_binary() -> Path | None:
    found = os.environ.get("SLOTKEEPER_CHROMIUM") or shutil.which("chromium")
    return Path(found) if found else None


class Browser:
    """One Chromium process with one page."""

    def __init__(self, binary: Path, profile: Path, width: int = 1280, height: int = 800,
                 extra_flags: tuple[str, ...] = ()) -> None:
        self.binary = binary
        self.profile = profile
        self.extra_flags = extra_flags  # e.g. --host-resolver-rules for a rebinding name
        self.size = (width, height)
        self.proc: subprocess.Popen[bytes] | None = None
        self.next_id = 0
        self.session: str | None = None
        self.buffer = b""

    def __enter__(self) -> Self:
        # Chromium reads commands from fd 3 and writes answers to fd 4.
        to_chrome_r, self.to_chrome = os.pipe()
        self.from_chrome, from_chrome_w = os.pipe()
        child_in, child_out = 3, 4
        keep = {to_chrome_r: child_in, from_chrome_w: child_out}
        parent_death = die_with_parent()

        def setup() -> None:
            for src, dst in keep.items():
                os.dup2(src, dst)
                os.set_inheritable(dst, True)
            if parent_death is not None:
                parent_death()

        self.profile.mkdir(parents=True, exist_ok=True)
        self.log = (self.profile / "chromium.log").open("wb")
        self.proc = subprocess.Popen(
            [str(self.binary), *FLAGS, *self.extra_flags, f"--user-data-dir={self.profile}",
             f"--window-size={self.size[0]},{self.size[1]}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
            preexec_fn=setup, pass_fds=(child_in, child_out))  # kept open after setup()
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target,
                                 flatten=True)["sessionId"]
        self.call("Emulation.setDeviceMetricsOverride", width=self.size[0],
                  height=self.size[1], deviceScaleFactor=1, mobile=False)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for fd in (self.to_chrome, self.from_chrome):
            try:
                os.close(fd)
            except OSError:
                pass
        self.log.close()

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one command (to the page once attached) and return its result."""
        self.next_id += 1
        message: dict[str, Any] = {"id": self.next_id, "method": method, "params": params}
        if self.session is not None and not method.startswith("Target."):
            message["sessionId"] = self.session
        os.write(self.to_chrome, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def _read(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self.buffer:
            if time.monotonic() > deadline:
                raise TimeoutError("no answer from chromium")
            chunk = os.read(self.from_chrome, 1 << 16)
            if not chunk:
                raise RuntimeError(f"chromium closed the pipe (exit {self.proc.poll()}); "
                                   f"see {self.profile / 'chromium.log'}")
            self.buffer += chunk
        raw, _, self.buffer = self.buffer.partition(b"\0")
        return json.loads(raw)

    def goto(self, url: str) -> None:
        self.call("Page.enable")
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (awaited if it is a promise)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                           awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}...: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0) -> Any:
        """Poll a JavaScript expression until it is truthy; return its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"still false after {timeout} s: {expression}")
            time.sleep(0.2)

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))
