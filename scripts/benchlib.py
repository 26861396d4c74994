"""Shared code of the benchmark scripts (scripts/bench-*): real llama-server and mitmdump
processes, timed requests on loopback, token counts from the server, machine facts, results.

Run the scripts with the venv's python (`.venv/bin/python scripts/bench-agents`): they import
the installed `slotkeeper` package and the test bed in tests/bed/testbed.py."""

from __future__ import annotations

import datetime
import http.client
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "bed"))


def _use_the_venv() -> None:
    """Started with a python that lacks the project (`scripts/bench-agents` runs the first
    python3 on PATH): run again with the checkout's venv python, if there is one."""
    try:
        import slotkeeper  # noqa: F401
    except ImportError:
        venv_python = REPO / ".venv" / "bin" / "python"
        if venv_python.is_file() and Path(sys.executable) != venv_python:
            os.execv(venv_python, [str(venv_python), *sys.argv])
        raise


_use_the_venv()

from slotkeeper.launcher.conf import load_conf, set_args  # noqa: E402
from testbed import MITMDUMP, LlamaServer, Proxy  # noqa: E402

BENCH_DIR = REPO / "docs" / "bench"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
REQUEST_TIMEOUT_S = 900.0  # a long prompt on a loaded 2-core machine prefills at ~50 tokens/s
READY_TIMEOUT_S = 30.0  # a fresh proxy checks its server in 0.2-0.4 s here (props, digest, slots)
NP, CTX = 4, 16384  # the server flags of issue #5: -np 4 --swa-full -c 16384 --slot-save-path


class BenchError(Exception):
    """A request or process did not behave; the message says what came back."""


# ---- processes -----------------------------------------------------------------------------

class BareProxy(Proxy):
    """mitmdump in reverse mode without the addon (no -s): what mitmproxy alone costs."""

    def command(self) -> list[str]:
        options = {"listen_host": "127.0.0.1", "connection_strategy": "lazy",
                   "confdir": str(self.workdir / "confdir"), **self.options}
        cmd = [str(MITMDUMP), "--mode", f"reverse:{self.upstream}@{self.port}"]
        for name, value in options.items():
            cmd += set_args(name, value)
        return cmd


def conf_options(addon: bool) -> dict[str, Any]:
    """The options of the checkout's mitm.conf that the `slotkeeper` launcher would pass,
    less the ones each bench sets itself (mode, port, script, folders). Without the addon only
    mitmproxy's own options are kept, so bare mitmdump differs from slotkeeper by the addon."""
    conf = load_conf(REPO / "mitm.conf")
    skip = {"mode", "listen_port", "scripts"}
    return {name: value for name, value in conf.items()
            if name not in skip and value not in ("", None, [])
            and (addon or not name.startswith("slotkeeper_"))}


def _exit_on_signal(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


class Lab:
    """A temp folder and every process started in it. Leaving the `with` block (normally, by
    Ctrl-C, or by SIGTERM/SIGHUP) stops them all; the folder (logs) is kept after a failure.
    The processes also get SIGTERM from the kernel if this one dies (testbed's PDEATHSIG)."""

    def __init__(self, keep: bool = False) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="slotkeeper-bench-"))
        self.keep = keep
        self.procs: list[LlamaServer | Proxy] = []

    def __enter__(self) -> Lab:
        for s in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, _exit_on_signal)
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        for proc in reversed(self.procs):
            try:
                proc.stop()
            except Exception as e:  # keep stopping the others
                print(f"bench: stopping {proc.log.name} failed: {e}", file=sys.stderr)
        if kind is None and not self.keep:
            shutil.rmtree(self.root, ignore_errors=True)
        else:
            print(f"bench: logs kept in {self.root}", file=sys.stderr)

    def folder(self, name: str) -> Path:
        """A new folder for one process: a name used before gets a number, so nothing (slot
        files, state file) carries over from an earlier run."""
        path, n = self.root / name, 1
        while path.exists():
            n += 1
            path = self.root / f"{name}-{n}"
        path.mkdir(parents=True)
        return path

    def server(self, name: str, np: int = NP) -> LlamaServer:
        """A fresh llama-server with its own slot folder; `np` slots of CTX / NP tokens."""
        workdir = self.folder(name)
        server = LlamaServer(workdir, np=np, ctx=CTX // NP * np, slot_save_path=workdir / "slots")
        self.procs.append(server)
        return server.start()

    def slotkeeper(self, server: LlamaServer, name: str, **options: Any) -> Proxy:
        """mitmdump with the addon and mitm.conf's options, sharing the server's slot folder."""
        opts = {**conf_options(addon=True), "slotkeeper_slot_dir": str(server.slot_save_path),
                **options}
        proxy = Proxy(server.url, self.folder(name), options=opts)
        self.procs.append(proxy)
        return wait_until_ready(proxy.start())

    def bare(self, server: LlamaServer, name: str, **options: Any) -> Proxy:
        proxy = BareProxy(server.url, self.folder(name),
                          options={**conf_options(addon=False), **options})
        self.procs.append(proxy)
        return proxy.start()

    def pids(self) -> list[int]:
        """This process and the live servers and proxies: the CPU that is ours."""
        return [os.getpid()] + [p.proc.pid for p in self.procs if p.alive and p.proc]


def wait_until_ready(proxy: Proxy, timeout: float = READY_TIMEOUT_S) -> Proxy:
    """Until the proxy's start-up check is done (its log's `ready:` line): a proxy runs long
    before its first request, as a server loads its model before its first; the baselines'
    servers are started and checked before the workload too. A proxy that never says so is
    measured as it is, cold."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proxy.log.is_file() and "] ready: " in proxy.log.read_text(errors="replace"):
            break
        time.sleep(0.05)
    return proxy


# ---- requests ------------------------------------------------------------------------------

@dataclass
class Reply:
    status: int
    wall_s: float  # request sent -> last byte
    first_event_s: float | None  # streamed: the first SSE `data:` event
    first_token_s: float | None  # streamed: the first event carrying content text
    content: str
    timings: dict[str, Any]
    headers: dict[str, str]

    @property
    def prefilled(self) -> int:
        return int(self.timings.get("prompt_n", 0))

    @property
    def reused(self) -> int:
        return int(self.timings.get("cache_n", 0))

    @property
    def prompt_tokens(self) -> int:
        return self.prefilled + self.reused

    @property
    def server_ms(self) -> float:
        """Time llama-server spent on the prompt and the generation (its own timings)."""
        return float(self.timings.get("prompt_ms", 0.0)) + float(
            self.timings.get("predicted_ms", 0.0))

    @property
    def action(self) -> str | None:
        return self.headers.get("x-slotkeeper-action")

    @property
    def slot(self) -> str | None:
        return self.headers.get("x-slotkeeper-slot")


class Client:
    """One keep-alive HTTP/1.1 connection to a loopback URL, as an agent keeps one. Refuses
    any other address: the benchmarks only ever talk to processes on this machine."""

    def __init__(self, url: str, timeout: float = REQUEST_TIMEOUT_S) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname not in LOOPBACK or parts.port is None:
            raise ValueError(f"not a loopback http URL with a port: {url}")
        self.host, self.port, self.timeout = parts.hostname, parts.port, timeout
        self.conn: http.client.HTTPConnection | None = None

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def _send(self, method: str, path: str, body: bytes | None,
              headers: Mapping[str, str]) -> tuple[http.client.HTTPResponse, float]:
        for attempt in range(2):
            fresh = self.conn is None
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            t0 = time.perf_counter()
            try:
                self.conn.request(method, path, body, dict(headers))
                return self.conn.getresponse(), t0
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self.close()  # the server closed a kept-alive connection: once more, fresh
                if fresh or attempt:
                    raise
        raise AssertionError("unreachable")

    def get_json(self, path: str) -> Any:
        resp, _ = self._send("GET", path, None, {})
        raw = resp.read()
        if resp.status != 200:
            raise BenchError(f"GET {path} answered {resp.status}: {raw[:500]!r}")
        return json.loads(raw)

    def post_json(self, path: str, body: Mapping[str, Any]) -> Any:
        resp, _ = self._send("POST", path, json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
        raw = resp.read()
        if resp.status != 200:
            raise BenchError(f"POST {path} answered {resp.status}: {raw[:500]!r}")
        return json.loads(raw)

    def chat(self, messages: Sequence[Mapping[str, Any]], max_tokens: int,
             headers: Mapping[str, str] | None = None, stream: bool = False,
             **extra: Any) -> Reply:
        """POST /v1/chat/completions at temperature 0 and time it. Streamed: time to the first
        event and to the first content event (time to first token); the timings come from the
        last event. A non-200 answer raises with its body."""
        body = {"messages": list(messages), "max_tokens": max_tokens, "temperature": 0,
                "stream": stream, **extra}
        resp, t0 = self._send("POST", "/v1/chat/completions", json.dumps(body).encode(),
                              {"Content-Type": "application/json", **(headers or {})})
        got = {k.lower(): v for k, v in resp.getheaders()}
        if resp.status != 200:
            raise BenchError(f"chat answered {resp.status}: {resp.read()[:1000]!r}")
        if not stream:
            payload = json.loads(resp.read())
            wall = time.perf_counter() - t0
            content = payload["choices"][0]["message"].get("content") or ""
            return Reply(resp.status, wall, None, None, content, payload.get("timings", {}), got)
        first_event = first_token = None
        parts: list[str] = []
        timings: dict[str, Any] = {}
        while line := resp.readline():
            if not line.startswith(b"data:"):
                continue  # blank separators, SSE comments
            now = time.perf_counter() - t0
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            if first_event is None:
                first_event = now
            event = json.loads(data)
            for choice in event.get("choices", []):
                text = (choice.get("delta") or {}).get("content")
                if text:
                    parts.append(text)
                    if first_token is None:
                        first_token = now
            timings = event.get("timings", timings)
        resp.read()  # the end of the chunked body, so the connection can be reused
        wall = time.perf_counter() - t0
        return Reply(resp.status, wall, first_event, first_token, "".join(parts), timings, got)


class Tokens:
    """Token ids exactly as the server sees a chat prompt: its own chat template
    (/apply-template) and tokenizer (/tokenize, BOS added as for a completion)."""

    def __init__(self, url: str) -> None:
        self.client = Client(url)

    def prompt_text(self, messages: Sequence[Mapping[str, Any]]) -> str:
        return self.client.post_json("/apply-template", {"messages": list(messages)})["prompt"]

    def tokenize(self, text: str) -> list[int]:
        return self.client.post_json("/tokenize", {"content": text, "add_special": True})["tokens"]


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def minimum_prefill(prompts: Sequence[Sequence[int]],
                    histories: Sequence[Sequence[int]]) -> list[int]:
    """For each prompt, its tokens that no earlier request started with: the prompt's length
    less its longest common prefix with any earlier prompt or prompt+reply (`histories[j]`,
    j < i), of any session. At least 1: the server always evaluates the last prompt token."""
    out = []
    for i, prompt in enumerate(prompts):
        best = max((common_prefix_len(prompt, h)
                    for j in range(i) for h in (prompts[j], histories[j])), default=0)
        out.append(max(1, len(prompt) - best))
    return out


class ServerLog:
    """Prompt tokens llama-server evaluated, read from its log's `print_timing` lines. This
    counts every prefill, also those of requests slotkeeper makes itself (building a seed),
    which the client's `timings` do not show."""

    PATTERN = re.compile(rb"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens")

    def __init__(self, server: LlamaServer) -> None:
        self.path = server.log
        self.offset = self.path.stat().st_size

    def take(self, settle_s: float = 0.2) -> int:
        """Tokens prefilled since the last call. The server logs from a background thread,
        so wait a moment for the last request's line."""
        time.sleep(settle_s)
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        data = data[: data.rfind(b"\n") + 1]  # whole lines only
        self.offset += len(data)
        return sum(int(m) for m in self.PATTERN.findall(data))


# ---- the machine, and what else runs on it --------------------------------------------------

def _cpu_jiffies(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])  # utime + stime (fields 14 and 15)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far."""
    return _cpu_jiffies(pid) / os.sysconf("SC_CLK_TCK")


def _busy_jiffies() -> int:
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(values) - values[3] - values[4]  # less idle and iowait


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


class CpuWatch:
    """CPU used on the machine while a measurement ran, split into ours (this process, its
    servers and proxies) and everyone else's (other engineers' tests), in cores. More than
    ~0.3 cores of others means the numbers were disturbed."""

    def __init__(self, pids: Callable[[], list[int]]) -> None:
        self.pids = pids
        self.result: dict[str, float] = {}

    def __enter__(self) -> CpuWatch:
        self.t0 = time.monotonic()
        self.load0 = loadavg()
        self.busy0 = _busy_jiffies()
        self.ours0 = {pid: _cpu_jiffies(pid) for pid in self.pids()}
        return self

    def __exit__(self, *_: object) -> None:
        seconds = time.monotonic() - self.t0
        tick = os.sysconf("SC_CLK_TCK")
        busy = (_busy_jiffies() - self.busy0) / tick
        ours = sum(_cpu_jiffies(pid) - start for pid, start in self.ours0.items()
                   if Path(f"/proc/{pid}").exists()) / tick
        self.result = {
            "seconds": round(seconds, 2), "load_before": self.load0, "load_after": loadavg(),
            "busy_cores": round(busy / seconds, 2) if seconds else 0.0,
            "our_cores": round(ours / seconds, 2) if seconds else 0.0,
            "other_cores": round(max(0.0, busy - ours) / seconds, 2) if seconds else 0.0,
        }


def wait_for_quiet(max_seconds: float, load: float = 0.7) -> float:
    """Wait up to max_seconds for the 1-minute load to fall under `load` (others' tests done).
    Returns the load when it stopped waiting."""
    deadline = time.monotonic() + max_seconds
    while loadavg() > load and time.monotonic() < deadline:
        time.sleep(5)
    return loadavg()


def rss_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak) of a process, in KiB, from /proc/PID/status."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            out[name] = int(value.split()[0])
    return out


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                              timeout=10).stdout.rstrip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def machine(server: LlamaServer | None = None) -> dict[str, Any]:
    """What the numbers were measured on."""
    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                  if line.startswith("model name")), "?")
    meminfo = Path("/proc/meminfo").read_text().split()
    from mitmproxy.version import VERSION as MITMPROXY_VERSION
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "cpu": model,
        "memory_gib": round(int(meminfo[meminfo.index("MemTotal:") + 1]) / 1024 ** 2, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "mitmproxy": MITMPROXY_VERSION,
        "git_commit": _git("rev-parse", "HEAD"),
        # Other engineers edit the tree while benches run: say what differed from the commit.
        "git_dirty": _git("status", "--porcelain", "--", "addon", "mitm.conf").splitlines(),
    }
    if server is not None:
        props = Client(server.url).get_json("/props")
        info["server"] = {
            "binary": str(server.binary), "build_info": props.get("build_info"),
            "model": server.model.name, "model_bytes": server.model.stat().st_size,
            "flags": f"-np {server.np} --swa-full -c {server.ctx} -t 2 --slot-save-path DIR",
            "total_slots": props.get("total_slots"),
        }
    return info


# ---- text, numbers and results ------------------------------------------------------------

_VOCAB = ("function", "returns", "parser", "config", "module", "error", "handler", "retry",
          "timeout", "buffer", "stream", "index", "commit", "branch", "merge", "build", "deploy",
          "schema", "column", "query", "cache", "token", "worker", "thread", "socket", "client",
          "server", "request", "header", "payload", "field", "value", "default", "option", "test",
          "fixture", "assert", "mock", "patch", "class", "method", "import", "package", "path",
          "file", "folder", "read", "write", "lock", "queue", "event", "loop", "async", "await")


def words(count: int, seed: str) -> str:
    """`count` pseudo-random words, the same for the same seed in every run."""
    import random
    rng = random.Random(seed)
    return " ".join(rng.choice(_VOCAB) for _ in range(count))


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks; q in [0, 100]."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def write_result(name: str, data: Mapping[str, Any], out: Path | None) -> Path:
    path = out or BENCH_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def log_lines(proxy: Proxy, needle: str, limit: int = 40) -> list[str]:
    """The proxy's log lines that mention `needle` (a session id), for bug reports."""
    return [line for line in proxy.log_text().splitlines() if needle in line][-limit:]


@dataclass
class Table:
    """A plain-text table for the terminal."""
    header: Sequence[str]
    rows: list[Sequence[Any]] = field(default_factory=list)

    def add(self, *row: Any) -> None:
        self.rows.append(row)

    def __str__(self) -> str:
        cells = [[str(c) for c in self.header]] + [
            [f"{c:.2f}" if isinstance(c, float) else str(c) for c in row] for row in self.rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(self.header))]
        return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True))
                         for r in cells)
