"""The metadata of a GGUF model file: its key/value header and the parameter count its tensor
table adds up to (what Ollama's `/api/show` reports as `model_info`). Reads the header only,
never the weights; arrays (the tokenizer's vocabulary) are skipped, as Ollama leaves them out
of `model_info` unless asked to be verbose."""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any, BinaryIO

MAGIC = b"GGUF"
# value type -> struct format of the fixed-size scalar types
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
MAX_STRING = 1 << 24  # a key or value longer than 16 MiB: not a GGUF header we should trust
MAX_ITEMS = 1 << 32


class NotGguf(ValueError):
    """The file is not a GGUF file this reader understands."""


def _read(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise NotGguf("truncated header")
    return data


def _unpack(f: BinaryIO, fmt: str) -> Any:
    return struct.unpack(fmt, _read(f, struct.calcsize(fmt)))[0]


def _string(f: BinaryIO) -> str:
    n = _unpack(f, "<Q")
    if n > MAX_STRING:
        raise NotGguf("string too long")
    return _read(f, n).decode("utf-8", "replace")


def _value(f: BinaryIO, kind: int) -> Any:
    """A scalar or string value; an array is skipped and read as None."""
    if kind in _SCALARS:
        return _unpack(f, _SCALARS[kind])
    if kind == STRING:
        return _string(f)
    if kind == ARRAY:
        item, count = _unpack(f, "<I"), _unpack(f, "<Q")
        if count > MAX_ITEMS:
            raise NotGguf("array too long")
        if item in _SCALARS:
            f.seek(count * struct.calcsize(_SCALARS[item]), 1)
        else:
            for _ in range(count):
                _value(f, item)
        return None
    raise NotGguf(f"unknown value type {kind}")


def read_metadata(path: str | Path) -> dict[str, Any]:
    """Scalar and string keys of the header, plus `general.parameter_count` (the sum of the
    tensors' element counts) when the file does not carry it. Raises NotGguf or OSError."""
    with open(path, "rb", buffering=1 << 20) as f:
        if _read(f, 4) != MAGIC:
            raise NotGguf("no GGUF magic")
        version = _unpack(f, "<I")
        if version < 2:
            raise NotGguf(f"GGUF version {version} is too old")
        n_tensors, n_kv = _unpack(f, "<Q"), _unpack(f, "<Q")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = _string(f)
            value = _value(f, _unpack(f, "<I"))
            if value is not None:
                meta[key] = value
        params = 0
        for _ in range(n_tensors):
            _string(f)  # the tensor's name
            dims = [_unpack(f, "<Q") for _ in range(_unpack(f, "<I"))]
            _read(f, 12)  # type (u32) and offset (u64)
            params += math.prod(dims)
    meta.setdefault("general.parameter_count", params)
    return meta
