"""mitm.conf (mitmproxy options in mitmproxy's YAML format) -> mitmdump/mitmweb arguments,
merged with the user's own arguments the way mitmproxy itself reads them. The default conf
ships in the package (slotkeeper/mitm.conf); a ./mitm.conf in the working directory wins."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .local import UsageError

PACKAGED_CONF = Path(__file__).resolve().parents[1] / "mitm.conf"

Scalar = str | int | float | bool | None


def default_conf() -> Path:
    local = Path("mitm.conf")
    return local if local.is_file() else PACKAGED_CONF


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
                         for arg in ("-s", os.path.normpath(base / Path(format_value(s))
                                                             .expanduser()))]
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
