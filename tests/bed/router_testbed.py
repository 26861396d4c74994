"""llama-server in router mode (issue #22): one real router process that starts a child
llama-server per model on demand, with the test model under several names (symlinks in a
models folder; the router follows them and names each model after its file, less `.gguf`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import requests
from testbed import LlamaServer

from slotkeeper.launcher.local import model_flags

MODEL_NAMES = ("model-a", "model-b")
LOAD_TIMEOUT_S = 120.0


def models_folder(folder: Path, model: Path, names: Sequence[str] = MODEL_NAMES) -> Path:
    """`folder/NAME.gguf` -> the test model, one symlink per name."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        link = folder / f"{name}.gguf"
        if not link.is_symlink():
            link.symlink_to(model.resolve())
    return folder


class RouterServer(LlamaServer):
    """`llama-server --models-dir DIR --models-max N` (no -m). The flags given to the router
    (-np, -c, --swa-full, --no-repack, --slot-save-path, the chat template) are passed to
    every child. `np`/`ctx` are per child, as with LlamaServer."""

    def __init__(self, workdir: Path, *, names: Sequence[str] = MODEL_NAMES,
                 models_max: int = 1, **kwargs: Any) -> None:
        super().__init__(workdir, **kwargs)
        self.names = tuple(names)
        self.models_max = models_max
        self.models_dir = workdir / "models"
        self.log = workdir / f"llama-router-{self.port}.log"

    def command(self) -> list[str]:
        cmd = [str(self.binary), "--models-dir", str(self.models_dir),
               "--models-max", str(self.models_max), "--host", "127.0.0.1",
               "--port", str(self.port), "-np", str(self.np), "--swa-full", "-c", str(self.ctx),
               "-t", "2", "--no-repack", *model_flags(self.model, stops=False)]
        if self.slot_save_path is not None:
            cmd += ["--slot-save-path", str(self.slot_save_path)]
        return cmd + self.extra

    def start(self) -> RouterServer:
        models_folder(self.models_dir, self.model, self.names)
        super().start()
        return self

    # ---- what the tests ask the router ----

    def models(self) -> dict[str, str]:
        """name -> status value ("loaded", "unloaded", "loading", ...)."""
        data = requests.get(self.url + "/models", timeout=10).json()
        return {m["id"]: m["status"]["value"] for m in data["data"]}

    def loaded(self) -> list[str]:
        return sorted(name for name, status in self.models().items() if status == "loaded")

    def load(self, name: str) -> None:
        """POST /models/load and wait until the model answers /slots (bounded)."""
        r = requests.post(self.url + "/models/load", json={"model": name}, timeout=30)
        if r.status_code != 200 and "already running" not in r.text:
            raise AssertionError(f"load {name}: {r.status_code} {r.text[:300]}")
        self.wait_for(name, "loaded")

    def unload(self, name: str) -> None:
        r = requests.post(self.url + "/models/unload", json={"model": name}, timeout=30)
        if r.status_code != 200:
            raise AssertionError(f"unload {name}: {r.status_code} {r.text[:300]}")
        self.wait_for(name, "unloaded")

    def wait_for(self, name: str, status: str, timeout: float = LOAD_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while (now := self.models().get(name)) != status:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} is {now!r}, not {status!r} after {timeout} s")
            time.sleep(0.1)
