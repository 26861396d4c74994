"""The real coding-agent CLIs (installed by scripts/install-clients), each configured only
through its own documented settings to use a slotkeeper proxy, and run non-interactively.

Every client gets its own HOME (all its config, sessions and caches live there) and its own
project folder, so runs never see the user's real configuration and `--continue` finds only
the conversation the test started. The settings written here are the ones README.md's
"Clients" section documents; the suite checks that they work.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from testbed import REPO

CLIENT_NAMES = ("claude", "codex", "pi", "opencode")
RUN_TIMEOUT_S = 1500.0  # a first turn prefills 5-25k tokens; other work shares the 2 cores
KEY_PREFIX = "sk-dummy-"  # each client gets its own dummy key, so the test can tell its flows
# Answers are capped (generation runs at ~2-5 tokens/s here): through each client's own
# output limit, and llama-server's -n for Codex, which sends none.
OUTPUT_TOKENS = 16
MODEL = "gemma-3-270m"
CAPPED_OUTPUT_EXIT = {"claude": "output token maximum"}  # llama-server serves its one model whatever name is asked for


def installed_clients() -> dict[str, Path]:
    """name -> executable, from $SLOTKEEPER_CLIENTS (set by scripts/test), else by running
    scripts/install-clients (which reuses the cache, installing only what is missing)."""
    listing = os.environ.get("SLOTKEEPER_CLIENTS")
    if not listing:
        listing = subprocess.run(["bash", str(REPO / "scripts" / "install-clients")],
                                 check=True, capture_output=True, text=True,
                                 stdin=subprocess.DEVNULL).stdout
    found = {}
    for line in listing.splitlines():
        name, _, path = line.strip().partition(" ")
        if name and path:
            found[name] = Path(path)
    return found


@dataclass
class Run:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    started: float
    ended: float

    def check(self, client: str) -> "Run":
        """The run ended well. Claude Code is the exception it must be: with its output
        capped, the tiny model never ends a turn by itself, and after three "resume" requests
        Claude Code exits 1 with "response exceeded the N output token maximum". Those
        requests are part of the traffic under test, answered 200 by llama-server."""
        capped = CAPPED_OUTPUT_EXIT.get(client)
        if capped is not None and self.returncode == 1 and capped in self.stdout:
            return self
        if self.returncode != 0:
            raise AssertionError(f"{' '.join(self.argv[:3])}... exited {self.returncode}\n"
                                 f"stdout: {self.stdout[-3000:]}\nstderr: {self.stderr[-3000:]}")
        return self


@dataclass
class Agent:
    """One client with its own HOME and project folder, pointed at `proxy_url`."""

    name: str
    executable: Path
    root: Path  # everything of this client lives under it
    proxy_url: str
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def project(self) -> Path:
        return self.root / "project"

    @property
    def key(self) -> str:
        return KEY_PREFIX + self.name

    def configure(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self.project.mkdir(parents=True, exist_ok=True)
        (self.project / "README.md").write_text("A tiny project.\n")
        getattr(self, f"_configure_{self.name}")()

    def env(self) -> dict[str, str]:
        node_dir = Path(shutil.which("node") or "/usr/bin/node").parent
        env = {
            "PATH": f"{self.executable.parent}:{node_dir}:/usr/local/bin:/usr/bin:/bin",
            "HOME": str(self.home),
            "XDG_CONFIG_HOME": str(self.home / ".config"),
            "XDG_DATA_HOME": str(self.home / ".local" / "share"),
            "XDG_STATE_HOME": str(self.home / ".local" / "state"),
            "XDG_CACHE_HOME": str(self.home / ".cache"),
            "TERM": "dumb",
            "NO_COLOR": "1",
            "LANG": "C.UTF-8",
        }
        for name in ("SSL_CERT_FILE", "NODE_EXTRA_CA_CERTS"):  # npm for OpenCode's provider
            if os.environ.get(name):
                env[name] = os.environ[name]
        env.update(getattr(self, f"_env_{self.name}")())
        env.update(self.extra_env)
        return env

    def first_turn(self, prompt: str) -> list[str]:
        return getattr(self, f"_argv_{self.name}")(prompt, False)

    def next_turn(self, prompt: str) -> list[str]:
        return getattr(self, f"_argv_{self.name}")(prompt, True)

    def start(self, argv: list[str]) -> subprocess.Popen[str]:
        return subprocess.Popen(argv, cwd=self.project, env=self.env(), text=True,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)

    def run(self, argv: list[str], timeout: float = RUN_TIMEOUT_S) -> Run:
        started = time.time()
        proc = self.start(argv)
        return finish(proc, argv, started, timeout)

    # ---- Claude Code: environment variables only ------------------------------------------
    def _configure_claude(self) -> None:
        pass

    def _env_claude(self) -> dict[str, str]:
        return {
            "ANTHROPIC_BASE_URL": self.proxy_url,
            "ANTHROPIC_API_KEY": self.key,
            # no telemetry, error reports, update checks: only the proxy is reachable
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(OUTPUT_TOKENS),
        }

    def _argv_claude(self, prompt: str, again: bool) -> list[str]:
        argv = [str(self.executable), "-p"]
        if again:
            argv.append("--continue")
        return argv + ["--model", MODEL, prompt]

    # ---- Codex: $CODEX_HOME/config.toml with a custom model provider -----------------------
    def _configure_codex(self) -> None:
        codex_home = self.home / ".codex"
        codex_home.mkdir(parents=True, exist_ok=True)
        (codex_home / "config.toml").write_text(
            f'model = "{MODEL}"\n'
            'model_provider = "slotkeeper"\n'
            '\n'
            '[model_providers.slotkeeper]\n'
            'name = "slotkeeper"\n'
            f'base_url = "{self.proxy_url}/v1"\n'
            'wire_api = "responses"\n'
            'env_key = "SLOTKEEPER_API_KEY"\n')

    def _env_codex(self) -> dict[str, str]:
        return {"CODEX_HOME": str(self.home / ".codex"), "SLOTKEEPER_API_KEY": self.key}

    def _argv_codex(self, prompt: str, again: bool) -> list[str]:
        argv = [str(self.executable), "exec"]
        if again:
            argv += ["resume", "--last"]
        return argv + ["--skip-git-repo-check", prompt]

    # ---- pi: ~/.pi/agent/models.json with a custom openai-completions provider --------------
    def _configure_pi(self) -> None:
        agent_dir = self.home / ".pi" / "agent"
        agent_dir.mkdir(parents=True, exist_ok=True)
        models = {"providers": {"slotkeeper": {
            "baseUrl": f"{self.proxy_url}/v1",
            "api": "openai-completions",
            "apiKey": self.key,
            "models": [{
                "id": MODEL,
                "contextWindow": 32768,
                "maxTokens": OUTPUT_TOKENS,
                # without it pi sends no session header at all
                "compat": {"sendSessionAffinityHeaders": True},
            }],
        }}}
        (agent_dir / "models.json").write_text(json.dumps(models, indent=2))

    def _env_pi(self) -> dict[str, str]:
        return {}

    def _argv_pi(self, prompt: str, again: bool) -> list[str]:
        argv = [str(self.executable), "-p"]
        if again:
            argv.append("--continue")
        return argv + ["--provider", "slotkeeper", "--model", MODEL, prompt]

    # ---- OpenCode: opencode.json with an @ai-sdk/openai-compatible provider ----------------
    def _configure_opencode(self) -> None:
        config = {
            "$schema": "https://opencode.ai/config.json",
            "provider": {"slotkeeper": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "slotkeeper",
                "options": {"baseURL": f"{self.proxy_url}/v1", "apiKey": self.key},
                "models": {MODEL: {"name": MODEL,
                                   "limit": {"context": 32768, "output": OUTPUT_TOKENS}}},
            }},
            "model": f"slotkeeper/{MODEL}",
            "small_model": f"slotkeeper/{MODEL}",
            "autoupdate": False,
            "share": "disabled",
        }
        config_dir = self.home / ".config" / "opencode"
        config_dir.mkdir(parents=True, exist_ok=True)
        (config_dir / "opencode.json").write_text(json.dumps(config, indent=2))

    def _env_opencode(self) -> dict[str, str]:
        return {"OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1"}

    def _argv_opencode(self, prompt: str, again: bool) -> list[str]:
        argv = [str(self.executable), "run"]
        if again:
            argv.append("--continue")
        return argv + [prompt]


def finish(proc: subprocess.Popen[str], argv: list[str], started: float,
           timeout: float = RUN_TIMEOUT_S) -> Run:
    """Wait for a started client; on timeout kill its whole process group (the CLIs start
    helpers of their own) and report what it printed."""
    try:
        stdout, stderr = proc.communicate(timeout=max(1.0, started + timeout - time.time()))
    except subprocess.TimeoutExpired:
        kill_group(proc)
        stdout, stderr = proc.communicate()
        return Run(argv, -9, stdout, stderr + f"\n(killed after {timeout} s)", started,
                   time.time())
    kill_group(proc)  # helpers it left behind (the group outlives its leader)
    return Run(argv, proc.returncode, stdout, stderr, started, time.time())


def kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, 9)
    except (ProcessLookupError, PermissionError):
        pass


# ---- emulated clients (issue #19): patterns the real CLIs above do not show -------------------

def words(count: int, seed: str) -> str:
    """`count` pseudo-random words, the same for the same seed in every run."""
    import random
    rng = random.Random(seed)
    vocab = ("the", "agent", "reads", "files", "before", "editing", "them", "keeps", "changes",
             "small", "tests", "pass", "commit", "explains", "parser", "config", "module",
             "error", "retry", "timeout", "buffer", "stream", "index", "cache", "token")
    return " ".join(rng.choice(vocab) for _ in range(count))


@dataclass
class RebuiltPromptAgent:
    """A header-less coding agent that rebuilds its prompt every turn: a fixed system prompt
    and two example exchanges, then the history (bare questions and replies), then one user
    message with the file it was given, the new question and a reminder. No turn extends the
    previous one; consecutive turns share a growing prefix."""
    name: str = "rebuilt"
    system_words: int = 600
    file_words: int = 300
    history: list[dict] = field(default_factory=list)

    def messages(self, turn: int) -> list[dict]:
        examples = []
        for k in (1, 2):
            examples += [{"role": "user", "content": "Example task: " + words(40, f"ex{k}")},
                         {"role": "assistant", "content": "Example answer: " + words(30, f"a{k}")}]
        last = (f"File src/main.py:\n{words(self.file_words, 'file')}\n\n{self.question(turn)}"
                "\n\n<reminder>Answer briefly; do not edit files you were not given.</reminder>")
        return [{"role": "system", "content": f"You are {self.name}, a careful coding agent. "
                 + words(self.system_words, "system")},
                *examples, *self.history, {"role": "user", "content": last}]

    def question(self, turn: int) -> str:
        return f"[turn {turn}] " + words(60, f"q{turn}")

    def record(self, turn: int, reply: str) -> None:
        self.history += [{"role": "user", "content": self.question(turn)},
                         {"role": "assistant", "content": reply}]
