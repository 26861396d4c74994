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
import contextlib
import os
import shlex
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from .conf import (
    Scalar,
    UserOptions,
    conf_modes,
    default_conf,
    load_conf,
    mitmproxy_command,
    user_options,
)
from .local import (
    LOOPBACK_HOSTS,
    LocalServer,
    UsageError,
    answers,
    cached_model,
    find_llama_server,
    find_model,
    run_beside,
    start_local_server,
    state_dir,
)


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
                        help="options file (default: ./mitm.conf, else the one installed with "
                             "slotkeeper)")
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
    from .status import main as status_main

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
