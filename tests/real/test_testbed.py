"""The test bed itself, with real processes: llama-server, mitmdump with the addon, and the
`slotkeeper` launcher."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from testbed import (
    ADDON_SCRIPT,
    REPO,
    LlamaServer,
    Proxy,
    chat,
    content_of,
    free_port,
    log_tail,
    long_system_prompt,
    port_open,
    wait_for_mitmproxy,
)

SLOTKEEPER = Path(sys.executable).parent / "slotkeeper"
QUESTION = [{"role": "user", "content": "Name three colours."}]


def test_llama_server_answers_a_chat_with_timings(llama: LlamaServer) -> None:
    response = chat(llama.url, QUESTION)
    assert content_of(response)
    assert response["timings"]["prompt_n"] > 0
    slots = requests.get(llama.url + "/slots", timeout=10).json()
    assert [s["n_ctx"] for s in slots] == [llama.ctx_per_slot] * 4


def test_kill_then_restart_on_the_same_port(make_llama) -> None:
    server: LlamaServer = make_llama(np=2, ctx=4096)
    first = content_of(chat(server.url, QUESTION))
    server.kill()
    assert not server.alive and not port_open(server.port)
    server.restart()
    assert content_of(chat(server.url, QUESTION)) == first


def test_proxy_forwards_the_same_answer_as_the_server(llama: LlamaServer, make_proxy) -> None:
    """Each request is prefilled from scratch (cache_prompt: false, which slotkeeper keeps):
    greedy decoding after a reused prefix can differ from a whole prefill in a near-tie token
    (seen once on CI: "User:" against "Assistant:"), which is the server's numerics, not ours."""
    messages = [{"role": "system", "content": long_system_prompt(words=50)}, *QUESTION]
    direct = content_of(chat(llama.url, messages, cache_prompt=False))
    proxy: Proxy = make_proxy(llama)
    assert content_of(chat(proxy.url, messages, cache_prompt=False)) == direct
    streamed = chat(proxy.url, messages, stream=True, cache_prompt=False)
    assert streamed["content"] == direct
    assert streamed["timings"]["prompt_n"] + streamed["timings"]["cache_n"] > 0
    assert "/v1/chat/completions" in proxy.log_text()


def test_long_system_prompt_is_deterministic() -> None:
    assert long_system_prompt() == long_system_prompt()
    assert long_system_prompt(seed=1) != long_system_prompt()
    assert len(long_system_prompt(words=600).split()) > 600


# ---- the slotkeeper launcher ---------------------------------------------------------------

def slotkeeper(*args: str, env: dict[str, str] | None = None,
               cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SLOTKEEPER), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})}, cwd=cwd)


def dry_run(*args: str, **kwargs) -> list[list[str]]:
    done = slotkeeper("--dry-run", *args, **kwargs)
    assert done.returncode == 0, done.stderr
    return [shlex.split(line) for line in done.stdout.splitlines()]


def test_dry_run_puts_conf_options_first_and_user_args_last(tmp_path: Path) -> None:
    user = ["--set", "slotkeeper_ttl=7", "-p", "9123", "--set", "stream_large_bodies=1m"]
    # The last line is mitmdump; a line before it appears when nothing answers on :8080.
    cmd = dry_run("--conf", str(REPO / "mitm.conf"), *user, cwd=tmp_path)[-1]
    assert cmd[0] == str(Path(sys.executable).parent / "mitmdump")
    conf_part = cmd[1:-len(user)]
    assert cmd[-len(user):] == user
    assert pairs(conf_part, "-s") == [str(REPO / "addon" / "slotkeeper_addon.py")]
    assert pairs(conf_part, "--mode") == ["reverse:http://127.0.0.1:8080",
                                          "reverse:http://127.0.0.1:8080@11434"]
    sets = pairs(conf_part, "--set")
    for expected in ("connection_strategy=lazy", "tcp_timeout=3600", "store_streamed_bodies=true",
                     "slotkeeper_small_request_chars=2000", "slotkeeper_state_file="):
        assert expected in sets
    # What the user sets replaces the conf's value instead of being merged with it.
    assert not [s for s in sets if s.startswith(("slotkeeper_ttl=", "listen_port="))]
    # An empty list is `--set name` alone, which mitmproxy reads as [].
    assert "slotkeeper_session_headers" in sets


def test_dry_run_two_ports_to_one_server_still_plan_a_local_server(tmp_path: Path) -> None:
    """mitm.conf's main port plus Ollama's port in front of one upstream: one server."""
    port, ollama_port = free_port(), free_port()
    conf = tmp_path / "mitm.conf"
    conf.write_text(f'mode: ["reverse:http://127.0.0.1:{port}", '
                    f'"reverse:http://127.0.0.1:{port}@{ollama_port}"]\n')
    server, proxy = dry_run("--conf", str(conf), env={"XDG_STATE_HOME": str(tmp_path / "st")})
    assert server[server.index("--port") + 1] == str(port)
    assert pairs(proxy, "--mode") == [f"reverse:http://127.0.0.1:{port}",
                                      f"reverse:http://127.0.0.1:{port}@{ollama_port}"]
    # Two different upstreams are the user's own setup: no server is started for them.
    conf.write_text(f'mode: ["reverse:http://127.0.0.1:{port}", '
                    f'"reverse:http://127.0.0.1:{free_port()}@{ollama_port}"]\n')
    assert len(dry_run("--conf", str(conf))) == 1


def test_dry_run_user_mode_replaces_the_conf_mode_and_starts_no_server() -> None:
    lines = dry_run("--mode", "reverse:http://127.0.0.1:1@9124")
    assert len(lines) == 1
    assert pairs(lines[0], "--mode") == ["reverse:http://127.0.0.1:1@9124"]
    assert not any(s.startswith("slotkeeper_slot_dir=/") for s in pairs(lines[0], "--set"))


def test_dry_run_plans_a_local_llama_server_when_nothing_answers(tmp_path: Path) -> None:
    port = free_port()
    conf = tmp_path / "conf" / "mitm.conf"
    conf.parent.mkdir()
    conf.write_text(f'mode: ["reverse:http://127.0.0.1:{port}"]\nscripts: ["my_addon.py"]\n')
    server, proxy = dry_run("--conf", str(conf), env={"XDG_STATE_HOME": str(tmp_path / "st")})
    slots = tmp_path / "st" / "slotkeeper" / "slots"
    assert server[server.index("--port") + 1] == str(port)
    assert server[server.index("--slot-save-path") + 1] == str(slots)
    assert {"--swa-full", "-np", "-c"} <= set(server)
    assert f"slotkeeper_slot_dir={slots}" in pairs(proxy, "--set")
    # A relative script path is taken from the conf file's folder, not the working directory.
    assert pairs(proxy, "-s") == [str(conf.parent / "my_addon.py")]


@pytest.mark.parametrize("text", ["mode: [reverse:http://x\nlisten_port: 8000\n",
                                  "- a list\n- not a mapping\n",
                                  "mode:\n  nested: mapping\n"])
def test_a_malformed_conf_is_one_line_and_exit_2(tmp_path: Path, text: str) -> None:
    conf = tmp_path / "bad.conf"
    conf.write_text(text)
    done = slotkeeper("--dry-run", "--conf", str(conf))
    assert done.returncode == 2
    assert done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith("slotkeeper: ") and str(conf) in done.stderr


def test_a_missing_conf_is_one_line_and_exit_2(tmp_path: Path) -> None:
    done = slotkeeper("--conf", str(tmp_path / "nope.conf"))
    assert done.returncode == 2
    assert done.stderr.strip() == f"slotkeeper: cannot read conf file {tmp_path / 'nope.conf'}: " \
                                  "No such file or directory"


def test_launcher_runs_mitmdump_with_the_conf(llama: LlamaServer, tmp_path: Path) -> None:
    """Every option of mitm.conf is accepted by the real mitmdump and the addon, and the
    proxy works. (`-s` is the conf's own script unless SLOTKEEPER_ADDON_SCRIPT says otherwise.)"""
    port = free_port()
    log = tmp_path / "slotkeeper.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(SLOTKEEPER), "--conf", str(REPO / "mitm.conf"),
             "-s", str(ADDON_SCRIPT), "--mode", f"reverse:{llama.url}@{port}",
             "--set", f"confdir={tmp_path / 'confdir'}", "--set", "listen_host=127.0.0.1",
             "--set", f"slotkeeper_state_file={tmp_path / 'state.json'}"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_for_mitmproxy(proc, port, log, 30)
        assert content_of(chat(f"http://127.0.0.1:{port}", QUESTION)) == \
            content_of(chat(llama.url, QUESTION))
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(15) == 0, log_tail(log)


def test_launcher_starts_and_stops_a_local_llama_server(llama_bin: Path, model_path: Path,
                                                        tmp_path: Path) -> None:
    """No --mode and nothing on the conf's upstream: the launcher starts llama-server, runs
    the proxy beside it, forwards SIGTERM to the proxy and stops the server after it."""
    upstream, listen = free_port(), free_port()
    conf = tmp_path / "mitm.conf"
    conf.write_text(
        f'mode: ["reverse:http://127.0.0.1:{upstream}"]\nlisten_port: {listen}\n'
        f'listen_host: 127.0.0.1\nscripts: ["{ADDON_SCRIPT}"]\n'
        f'confdir: "{tmp_path / "confdir"}"\nslotkeeper_state_file: "{tmp_path / "s.json"}"\n')
    log = tmp_path / "slotkeeper.log"
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"),
           "SLOTKEEPER_LLAMA_SERVER": str(llama_bin), "SLOTKEEPER_MODEL": str(model_path)}
    with log.open("wb") as out:
        proc = subprocess.Popen([str(SLOTKEEPER), "--conf", str(conf)], env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_for_mitmproxy(proc, listen, log, 150)
        started = re.search(r"started llama-server \(pid (\d+)\) on http://127\.0\.0\.1:(\d+)",
                            log.read_text())
        assert started and int(started[2]) == upstream, log_tail(log)
        assert content_of(chat(f"http://127.0.0.1:{listen}", QUESTION))
        assert (tmp_path / "state" / "slotkeeper" / "slots").is_dir()
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
    assert code == 0, log_tail(log)
    assert not port_open(upstream) and not port_open(listen)
    with pytest.raises(ProcessLookupError):
        os.kill(int(started[1]), 0)


def pairs(cmd: list[str], flag: str) -> list[str]:
    """The argument after each occurrence of `flag`."""
    return [cmd[i + 1] for i, arg in enumerate(cmd[:-1]) if arg == flag]

