"""The metadata of a GGUF model file: its key/value header and the parameter count its tensor
table adds up to (what Ollama's `/api/show` reports as `model_info`). Reads the header only,
never the weights; arrays (the tokenizer's vocabulary) are skipped, as Ollama leaves them out
of `model_info` unless asked to be verbose."""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAGIC = b"GGUF"
# value type -> struct format of the fixed-size scalar types
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
MAX_STRING = 1 << 24  # a key or value longer than 16 MiB: not a GGUF header we should trust
MAX_ITEMS = 1 << 32


class NotGguf(ValueError):
    """The file is not a GGUF file this reader understands."""


class _Reader:
    """Reads the header through a memory map: the vocabulary's 262k strings are walked by
    offset, not read (0.48 s with buffered reads, 0.11 s here)."""

    def __init__(self, data: mmap.mmap) -> None:
        self.data = data
        self.at = 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.data):
            raise NotGguf("truncated header")
        value = struct.unpack_from(fmt, self.data, self.at)[0]
        self.at += size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if n > MAX_STRING or self.at + n > len(self.data):
            raise NotGguf("string too long")
        text = bytes(self.data[self.at:self.at + n]).decode("utf-8", "replace")
        self.at += n
        return text

    def skip_strings(self, count: int) -> None:
        data, at, end = self.data, self.at, len(self.data)
        for _ in range(count):
            if at + 8 > end:
                raise NotGguf("truncated header")
            at += 8 + struct.unpack_from("<Q", data, at)[0]
        if at > end:
            raise NotGguf("truncated header")
        self.at = at

    def value(self, kind: int) -> Any:
        """A scalar or string value; an array is skipped and read as None."""
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            if count > MAX_ITEMS:
                raise NotGguf("array too long")
            if item in _SCALARS:
                self.at += count * struct.calcsize(_SCALARS[item])
            elif item == STRING:
                self.skip_strings(count)
            else:
                for _ in range(count):
                    self.value(item)
            return None
        raise NotGguf(f"unknown value type {kind}")


def read_metadata(path: str | Path) -> dict[str, Any]:
    """Scalar and string keys of the header, plus `general.parameter_count` (the sum of the
    tensors' element counts) when the file does not carry it. Raises NotGguf or OSError."""
    layout = read_layout(path)
    layout.meta.setdefault("general.parameter_count",
                           sum(math.prod(t.dims) for t in layout.tensors))
    return layout.meta


@dataclass(frozen=True)
class Tensor:
    name: str
    dims: tuple[int, ...]
    offset: int  # in the file, from its start


@dataclass(frozen=True)
class Layout:
    """The header as read: its scalar and string keys, the tensor table (offsets made
    absolute), where the header ends and the file's size."""
    meta: dict[str, Any]
    tensors: list[Tensor]
    header_end: int
    file_size: int


def read_layout(path: str | Path) -> Layout:
    """The header and tensor table of a GGUF file, without reading the weights. Raises
    NotGguf or OSError."""
    with open(path, "rb") as f:
        try:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file
            raise NotGguf("empty file") from None
    with data:
        return _walk(data)


def _walk(data: mmap.mmap) -> Layout:
    r = _Reader(data)
    if bytes(data[:4]) != MAGIC:
        raise NotGguf("no GGUF magic")
    r.at = 4
    version = r.take("<I")
    if version < 2:
        raise NotGguf(f"GGUF version {version} is too old")
    n_tensors, n_kv = r.take("<Q"), r.take("<Q")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = r.string()
        value = r.value(r.take("<I"))
        if value is not None:
            meta[key] = value
    table = []
    for _ in range(n_tensors):
        name = r.string()
        dims = tuple(r.take("<Q") for _ in range(r.take("<I")))
        r.take("<I")  # the tensor's type
        table.append((name, dims, r.take("<Q")))
    # The data section starts at the next multiple of general.alignment (32 by default).
    align = meta.get("general.alignment", 32)
    align = align if isinstance(align, int) and align > 0 else 32
    start = -(-r.at // align) * align
    tensors = [Tensor(name, dims, start + offset) for name, dims, offset in table]
    return Layout(meta, tensors, r.at, len(data))
