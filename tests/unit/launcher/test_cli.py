"""The `slotkeeper` command line without a model: what the launcher would run (`--dry-run`),
the quick start's listening address, and `slotkeeper status` writing into a closed pipe."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from slotkeeper.launcher.conf import load_conf
from slotkeeper.launcher.local import DEMO_MODEL_FLAGS, MODEL_NAME, LocalServer, model_flags
from slotkeeper.store.state import StateDoc

REPO_ROOT = Path(__file__).resolve().parents[3]

SLOTKEEPER = Path(sys.executable).parent / "slotkeeper"
ADDON = str(REPO_ROOT / "addon" / "slotkeeper_addon.py")


def dry_run(*args: str, cwd: Path | None = None) -> list[str]:
    """The mitmdump command the launcher would run (its last line)."""
    done = subprocess.run([str(SLOTKEEPER), "--dry-run", *args], capture_output=True,
                          text=True, timeout=60, cwd=cwd)
    assert done.returncode == 0, done.stderr
    return shlex.split(done.stdout.splitlines()[-1])


def after(cmd: list[str], flag: str) -> list[str]:
    return [cmd[i + 1] for i, arg in enumerate(cmd[:-1]) if arg == flag]


def test_a_users_script_is_loaded_beside_the_slotkeeper_addon(tmp_path: Path) -> None:
    extra = tmp_path / "extra.py"
    extra.write_text("")
    cmd = dry_run("--mode", "reverse:http://127.0.0.1:1@9124", "-s", str(extra))
    assert after(cmd, "-s") == [ADDON, str(extra)]


def test_naming_the_addon_itself_loads_it_once(tmp_path: Path) -> None:
    cmd = dry_run("--mode", "reverse:http://127.0.0.1:1@9124", "-s", ADDON, cwd=tmp_path)
    assert after(cmd, "-s") == [ADDON]


def test_set_scripts_still_replaces_the_conf_scripts(tmp_path: Path) -> None:
    cmd = dry_run("--mode", "reverse:http://127.0.0.1:1@9124", "--set", "scripts=mine.py")
    assert after(cmd, "-s") == []
    assert "scripts=mine.py" in after(cmd, "--set")


def test_the_quick_start_proxy_listens_on_loopback_only() -> None:
    assert load_conf(REPO_ROOT / "mitm.conf")["listen_host"] == "127.0.0.1"
    cmd = dry_run("--mode", "reverse:http://127.0.0.1:1@9124")
    assert "listen_host=127.0.0.1" in after(cmd, "--set")
    # The user can still open it.
    cmd = dry_run("--mode", "reverse:http://127.0.0.1:1@9124", "--set", "listen_host=0.0.0.0")
    assert [s for s in after(cmd, "--set") if s.startswith("listen_host=")] == \
        ["listen_host=0.0.0.0"]


def test_listen_port_follows_the_port_the_mode_names() -> None:
    """mitmweb's status bar shows the listen_port option: it must be the mode's port."""
    sets = after(dry_run("--mode", "reverse:http://127.0.0.1:1@9124"), "--set")
    assert [s for s in sets if s.startswith("listen_port=")] == ["listen_port=9124"]
    sets = after(dry_run("--mode", "reverse:http://127.0.0.1:1@127.0.0.2:9125"), "--set")
    assert "listen_port=9125" in sets and "listen_host=127.0.0.2" in sets
    assert "listen_host=127.0.0.1" not in sets
    # Without a port in the mode, the conf's listen_port stands.
    sets = after(dry_run("--mode", "reverse:http://127.0.0.1:1"), "--set")
    assert [s for s in sets if s.startswith("listen_port=")] == ["listen_port=8000"]


def test_the_demo_model_gets_its_chat_template_and_stops(tmp_path: Path) -> None:
    server = LocalServer("127.0.0.1", 9, tmp_path, tmp_path / "log")
    cmd = server.command("llama-server", tmp_path / MODEL_NAME)
    template = cmd[cmd.index("--chat-template") + 1]
    assert "'User: '" in template and "'Assistant:'" in template
    assert after(cmd, "-r") == ["User:", "Assistant:"]
    assert "--no-repack" in cmd
    # Another model keeps its own template.
    assert model_flags(tmp_path / "other.gguf") == ()
    assert "--chat-template" not in server.command("llama-server", tmp_path / "other.gguf")
    assert model_flags(tmp_path / MODEL_NAME) == DEMO_MODEL_FLAGS


def test_status_into_a_closed_pipe_is_no_traceback(tmp_path: Path) -> None:
    """`slotkeeper status --json | head -c1`: the reader is gone before the output is."""
    state = tmp_path / "state.json"
    state.write_text(json.dumps(StateDoc().to_json()))
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody will read: the first write fails with EPIPE
    try:
        done = subprocess.run([str(SLOTKEEPER), "status", "--json", "--proxy",
                               "http://127.0.0.1:9", "--state-file", str(state),
                               "--no-upstream"], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, timeout=60)
    finally:
        os.close(write_end)
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
    assert done.stderr == ""
    assert done.returncode == 141


def test_status_still_prints_into_an_open_pipe(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    state.write_text(json.dumps(StateDoc().to_json()))
    done = subprocess.run([str(SLOTKEEPER), "status", "--json", "--proxy", "http://127.0.0.1:9",
                           "--state-file", str(state), "--no-upstream"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["source"] == "files"
