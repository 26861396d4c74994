"""Installable as a package (issue #18, item 4): a wheel built from this tree, installed into
a fresh venv outside the checkout, runs `slotkeeper --help`, `slotkeeper status` and one
proxied request against the real llama-server, with the working directory and HOME away from
the checkout. Nothing at run time may come from the checkout: the launcher's default conf and
the mitmproxy entry script must be the installed ones. The install fetches the dependencies
with pip (from its cache when it has them; PyPI otherwise)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from testbed import REPO, chat, end_process, free_port, wait_for_mitmproxy

PIP_TIMEOUT_S = 900


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{shlex.join(cmd)}: {done.returncode}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with slotkeeper installed from a wheel of this tree (a copy of it, so the
    build leaves nothing in the checkout)."""
    root = tmp_path_factory.mktemp("package")
    source = root / "source"
    source.mkdir()
    shutil.copy(REPO / "pyproject.toml", source)
    shutil.copytree(REPO / "addon", source / "addon",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    wheels = root / "wheels"
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(wheels),
         str(source)], timeout=PIP_TIMEOUT_S)
    wheel = next(wheels.glob("slotkeeper-*.whl"))
    venv = root / "venv"
    run([sys._base_executable, "-m", "venv", str(venv)])  # type: ignore[attr-defined]
    run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
         "--disable-pip-version-check", str(wheel)], timeout=PIP_TIMEOUT_S)
    return venv


def env_outside(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    return {**env, "HOME": str(home), "XDG_STATE_HOME": str(home / "state"),
            "XDG_CACHE_HOME": str(home / "cache")}


def test_the_wheel_runs_outside_the_checkout(installed, llama, tmp_path):
    slotkeeper = str(installed / "bin" / "slotkeeper")
    env, cwd = env_outside(tmp_path), tmp_path / "home"
    # The package is the installed one, not the checkout's.
    where = run([str(installed / "bin" / "python"), "-c",
                 "import slotkeeper, slotkeeper_addon; print(slotkeeper.__file__)"],
                env=env, cwd=cwd).stdout
    assert str(installed) in where and str(REPO) not in where

    help_text = run([slotkeeper, "--help"], env=env, cwd=cwd, timeout=60).stdout
    assert "slotkeeper" in help_text and "--conf" in help_text

    port = free_port()
    mode = f"reverse:{llama.url}@{port}"
    dry = run([slotkeeper, "--dry-run", "--mode", mode], env=env, cwd=cwd, timeout=120)
    command = shlex.split(dry.stdout.splitlines()[-1])
    script = command[command.index("-s") + 1]
    assert Path(script).is_file() and str(installed) in script, command
    assert str(REPO) not in dry.stdout

    log = tmp_path / "slotkeeper.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([slotkeeper, "--mode", mode], stdout=out,
                                stderr=subprocess.STDOUT, env=env, cwd=cwd)
    try:
        wait_for_mitmproxy(proc, port, log, 120)
        answer = chat(f"http://127.0.0.1:{port}",
                      [{"role": "system", "content": "Answer in one word. " * 120},
                       {"role": "user", "content": "Name a colour."}],
                      session_headers={"x-session-id": "packaged"}, n_predict=4)
        assert answer["choices"][0]["message"]["content"] is not None
        status = run([slotkeeper, "status", "--proxy", f"http://127.0.0.1:{port}", "--json"],
                     env=env, cwd=cwd, timeout=60)
        report = json.loads(status.stdout)
        assert "packaged" in json.dumps(report)
    finally:
        end_process(proc, signal.SIGINT)
    assert "Traceback" not in log.read_text(errors="replace")
