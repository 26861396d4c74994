"""A model's identity from its content (issue #33): the same bytes give the same digest on any
host, whatever the path, inode or modification time of the copy. Used when the proxy can read
the server's model file (the server says its path in /props); docs/DESIGN.md, "One
fingerprint", says why this is unique enough and what happens when the file is not readable.

The digest covers the GGUF header whole (every key, the tokenizer's arrays, the tensor table
with each tensor's name, shape, type and offset) and a sample of every tensor's weights: a
finetune (full, or a merged LoRA on a few projections) changes nearly every element of each
tensor it trains, so a few KiB from the middle of each tensor tell two finetunes of one base
apart even when their headers are byte for byte the same."""

from __future__ import annotations

import hashlib
import os
import threading

from . import gguf

SAMPLE_BYTES = 4096  # from the middle of each tensor's data
_cache: dict[tuple[int, int, int, int], str] = {}
_computing: dict[tuple[int, int, int, int], threading.Lock] = {}  # one reader a file version
_cache_mutex = threading.Lock()


def content_digest(path: str) -> str:
    """16 hex digits identifying the model file's content, "" when it is not readable here
    (a server on another host) or not a GGUF file. Computed once per file version in this
    process: the local stat (device, inode, size, mtime) is only the cache's key, never part
    of the digest."""
    if not os.path.isabs(path):  # relative to the server's folder, not ours: another file
        return ""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return ""
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    with _cache_mutex:
        computing = _computing.setdefault(key, threading.Lock())
    # A second caller (the first request, while the start-up check reads the file) waits for
    # the first one's digest instead of reading the file again beside it.
    with computing:
        with _cache_mutex:
            cached = _cache.get(key)
        if cached is not None:
            return cached
        try:
            digest = _digest(path)
        except (OSError, ValueError):  # gguf.NotGguf is a ValueError
            return ""
        with _cache_mutex:
            _cache[key] = digest
    return digest


def _digest(path: str) -> str:
    layout = gguf.read_layout(path)
    h = hashlib.sha256()
    ends = sorted({t.offset for t in layout.tensors} | {layout.file_size})
    end_of = {start: end for start, end in zip(ends, ends[1:])}
    with open(path, "rb") as f:
        h.update(f.read(layout.header_end))
        for tensor in sorted(layout.tensors, key=lambda t: t.offset):
            size = max(end_of.get(tensor.offset, layout.file_size) - tensor.offset, 0)
            f.seek(tensor.offset + max(size // 2 - SAMPLE_BYTES // 2, 0))
            h.update(f.read(min(SAMPLE_BYTES, size)))
    return h.hexdigest()[:16]
