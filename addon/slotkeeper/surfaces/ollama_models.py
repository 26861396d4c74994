"""Ollama's model listings (`/api/tags`, `/api/ps`) and `/api/show`, from what llama-server
reports of its model (`/v1/models`, `/props`) and, when the model file is on this machine, its
GGUF header (architecture, parameter count, every scalar key: what Ollama's `model_info`
holds). Pure but for `ModelFiles`, which reads GGUF headers and file times, each file once."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from datetime import UTC, datetime
from typing import Any

from ..upstream import gguf
from .ollama import OllamaError, tagged, untagged


class ModelFiles:
    """What the model's file says, per model id or path: its GGUF metadata ({} when the file is
    not here or not GGUF) and a stable `modified_at` (the file's time, else the moment
    slotkeeper first saw the model: llama-server's `created` is the time of each request).
    Read once per file (a header read is ~0.1 s for a 262k-token vocabulary)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._meta: dict[tuple[str, int, int], dict[str, Any]] = {}
        self._first_seen: dict[str, float] = {}
        # What llama-server's /v1/models says of the model at a path (n_params, size, ...):
        # /api/show reads /props, which does not say it, and a remote server's file is not here.
        self._served: dict[str, dict[str, Any]] = {}

    def remember_served(self, path: str, meta: dict[str, Any]) -> None:
        with self._lock:
            self._served[path] = meta

    def served(self, path: str) -> dict[str, Any]:
        with self._lock:
            return self._served.get(path, {})

    def _stat(self, path: str) -> os.stat_result | None:
        try:
            return os.stat(path) if path and os.path.isfile(path) else None
        except (OSError, ValueError):
            return None

    def metadata(self, path: str) -> dict[str, Any]:
        st = self._stat(path)
        if st is None:
            return {}
        key = (path, st.st_mtime_ns, st.st_size)
        with self._lock:
            if key in self._meta:
                return self._meta[key]
        try:
            meta = gguf.read_metadata(path)
        except (OSError, gguf.NotGguf):
            meta = {}
        with self._lock:
            self._meta[key] = meta
        return meta

    def modified(self, model_id: str, path: str = "") -> float:
        for candidate in (path, model_id):
            st = self._stat(candidate)
            if st is not None:
                return st.st_mtime
        with self._lock:
            return self._first_seen.setdefault(model_id, time.time())


def _quantization(name: str) -> str:
    upper = name.upper()
    for marker in ("Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_0", "Q4_1", "Q4_K_S", "Q4_K_M",
                   "Q5_0", "Q5_1", "Q5_K_S", "Q5_K_M", "Q6_K", "Q8_0", "F16", "BF16", "F32",
                   "IQ4_XS", "IQ4_NL", "MXFP4"):
        if marker in upper:
            return marker
    return ""


def _parameter_size(n_params: Any) -> str:
    if not isinstance(n_params, (int, float)) or n_params <= 0:
        return ""
    if n_params >= 1e9:
        return f"{n_params / 1e9:.1f}B"
    return f"{n_params / 1e6:.0f}M"


def _details(model_id: str, meta: dict[str, Any], header: dict[str, Any]) -> dict[str, Any]:
    """Ollama's `details` from /v1/models' `meta` and the GGUF header (family: the
    architecture, as Ollama gives it)."""
    ftype = meta.get("ftype") if isinstance(meta.get("ftype"), str) else ""
    family = header.get("general.architecture")
    family = family if isinstance(family, str) else ""
    return {"parent_model": "", "format": "gguf", "family": family,
            "families": [family] if family else None,
            "parameter_size": _parameter_size(meta.get("n_params")
                                              or header.get("general.parameter_count")),
            # "Q4_K - Medium" (llama-server's ftype) -> "Q4_K_M" (Ollama's spelling)
            "quantization_level": _quantization(model_id) or _quantization(
                ftype.replace(" - Small", "_S").replace(" - Medium", "_M")
                .replace(" - Large", "_L"))}


def display_name(model_id: str) -> str:
    """llama-server names a model by its file path unless started with --alias: Ollama
    clients get the file name without `.gguf`, tagged (`gemma-3-270m-q4_k_m:latest`).
    llama-server serves its one model whatever name a request gives."""
    base = model_id.replace("\\", "/").rsplit("/", 1)[-1]
    return tagged(base[:-len(".gguf")] if base.lower().endswith(".gguf") else base)


def _digest(model_id: str) -> str:
    # Stable per model id (Ollama's is the manifest's sha256; there is no manifest here).
    return hashlib.sha256(model_id.encode()).hexdigest()


def _models(data: Any) -> list[tuple[str, dict[str, Any], int]]:
    """(id, meta, created) of each model in llama-server's /v1/models answer."""
    rows = data.get("data") if isinstance(data, dict) else None
    out = []
    for row in rows if isinstance(rows, list) else []:
        if isinstance(row, dict) and isinstance(row.get("id"), str):
            meta = row.get("meta") if isinstance(row.get("meta"), dict) else {}
            created = row.get("created") if isinstance(row.get("created"), int) else 0
            out.append((row["id"], meta, created))
    return out


def served_meta(models: Any) -> dict[str, Any]:
    """The `meta` of the model a single llama-server serves, from its /v1/models answer ({}
    when it lists none, or several: a router's models are not one file)."""
    rows = _models(models)
    return rows[0][1] if len(rows) == 1 else {}


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).isoformat().replace("+00:00", "Z")


def tags_answer(models: Any, files: ModelFiles) -> dict[str, Any]:
    """GET /api/tags from GET /v1/models (whose `created` is the time of the request: the
    file's time is given instead, as Ollama gives its manifest's)."""
    return {"models": [{"name": display_name(model_id), "model": display_name(model_id),
                        "modified_at": _iso(files.modified(model_id)),
                        "size": int(meta.get("size", 0) or 0),
                        "digest": _digest(model_id),
                        "details": _details(model_id, meta, files.metadata(model_id))}
                       for model_id, meta, _ in _models(models)]}


def ps_answer(models: Any, files: ModelFiles) -> dict[str, Any]:
    """GET /api/ps from GET /v1/models: the model is always loaded while llama-server runs."""
    never = "2318-01-01T00:00:00Z"  # Ollama's "kept loaded for ever" (keep_alive < 0)
    return {"models": [{"name": display_name(model_id), "model": display_name(model_id),
                        "size": int(meta.get("size", 0) or 0), "digest": _digest(model_id),
                        "details": _details(model_id, meta, files.metadata(model_id)),
                        "expires_at": never,
                        "size_vram": 0,
                        # the context each slot has (n_ctx), else what the model was trained on
                        "context_length": int(meta.get("n_ctx") or meta.get("n_ctx_train")
                                              or 0)}
                       for model_id, meta, _ in _models(models)]}


def show_answer(props: Any, requested: str, files: ModelFiles) -> dict[str, Any]:
    """POST /api/show from GET /props and the GGUF header (when the model file is on this
    machine): the template, the architecture and its keys, the parameter count, the served
    context size, what the model can do."""
    if not isinstance(props, dict):
        raise OllamaError(502, "llama-server's /props is not a JSON object")
    template = props.get("chat_template") if isinstance(props.get("chat_template"), str) else ""
    settings = props.get("default_generation_settings")
    settings = settings if isinstance(settings, dict) else {}
    n_ctx = int(settings.get("n_ctx", 0) or 0)
    path = props.get("model_path") if isinstance(props.get("model_path"), str) else ""
    header = files.metadata(path)
    meta = {**files.served(path), "ftype": props.get("model_ftype")}
    return {
        "license": header.get("general.license", "") if isinstance(
            header.get("general.license"), str) else "",
        "modelfile": f"# served by llama-server through slotkeeper\nFROM {path}\n",
        "parameters": f"num_ctx {n_ctx}" if n_ctx else "",
        "template": template,
        "details": _details(path or requested, meta, header),
        "model_info": model_info(header, meta, n_ctx, requested),
        "capabilities": _capabilities(props, template),
        "modified_at": _iso(files.modified(path or requested, path)),
    }


def model_info(header: dict[str, Any], meta: dict[str, Any], n_ctx: int, requested: str
               ) -> dict[str, Any]:
    """The GGUF's scalar keys, as Ollama lists them, with `general.parameter_count`;
    `<architecture>.context_length` is the context each slot serves (llama-server's is fixed
    at its start; the trained one stays in /v1/models). Without the file (a remote server) the
    architecture is unknown and named `unknown`, so `<arch>.context_length` still leads to
    the served size."""
    info = dict(header) if header else {"general.architecture": "unknown",
                                        "general.basename": untagged(requested)}
    arch = info.get("general.architecture")
    arch = arch if isinstance(arch, str) and arch else "unknown"
    info["general.architecture"] = arch
    params = meta.get("n_params") or info.get("general.parameter_count")
    if isinstance(params, int) and params > 0:
        info["general.parameter_count"] = params
    if n_ctx:
        info[f"{arch}.context_length"] = n_ctx
    return dict(sorted(info.items()))


def _capabilities(props: dict[str, Any], template: str) -> list[str]:
    modalities = props.get("modalities") if isinstance(props.get("modalities"), dict) else {}
    caps = props.get("chat_template_caps") if isinstance(props.get("chat_template_caps"),
                                                         dict) else {}
    capabilities = ["completion"]
    if caps.get("supports_tools") or caps.get("supports_tool_calls"):
        capabilities.append("tools")
    if modalities.get("vision"):
        capabilities.append("vision")
    if "enable_thinking" in template or caps.get("supports_reasoning_effort"):
        capabilities.append("thinking")
    return capabilities
