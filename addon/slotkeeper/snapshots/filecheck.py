"""Is a snapshot file still the one its save wrote? (issue #31) Checked before each restore, so
it must not read the file whole: on a slow disk (or a GPU host's multi-GiB slots) a whole-file
crc32 took as long as the restore itself, and a save's crc32 as long as a second save.

What a save records: its first and last EDGE_BYTES' crc32 with its size (`edge`), and its
mtime. A file written since (any write moves the mtime) is refused unless an older proxy's
whole-file crc32 still matches (then it was only copied or touched); a replaced file differs
in its header's tokens, a truncated or grown one in size. Not caught: bytes flipped in place
with the mtime kept (a failing disk), which llama-server restores without complaint too."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

EDGE_BYTES = 64 * 1024


def file_crc32(path: Path, chunk: int = 1 << 20) -> str:
    """zlib.crc32 of a file as 8 hex digits ("" if it cannot be read). ~4 GB/s here: 4 ms for
    a 14 MB snapshot, 1 s for a 4 GiB one."""
    crc = 0
    try:
        with path.open("rb") as f:
            while block := f.read(chunk):
                crc = zlib.crc32(block, crc)
    except OSError:
        return ""
    return f"{crc:08x}"


def edge_crc32(path: Path, edge: int = EDGE_BYTES) -> str:
    """zlib.crc32 of the file's first and last `edge` bytes (all of a file up to 2 x edge), and
    its size, as 8 hex digits ("" if it cannot be read): 128 KiB read whatever the size."""
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            crc = zlib.crc32(f.read(edge))
            if size > edge:
                f.seek(max(edge, size - edge))
                crc = zlib.crc32(f.read(edge), crc)
    except OSError:
        return ""
    return f"{zlib.crc32(str(size).encode(), crc):08x}"


def changed_since_save(path: Path, *, mtime_ns: int, edge: str, crc: str) -> str:
    """Why the file is not the one saved ("" when it is, or nothing was recorded). `edge`,
    `mtime_ns`: what this proxy records; `crc`: an older proxy's whole-file crc32, read in
    full only for a file without `edge` or written to since its save."""
    if edge:
        try:
            written = bool(mtime_ns) and path.stat().st_mtime_ns != mtime_ns
        except OSError:
            return "state file missing"
        if written:
            if crc and file_crc32(path) == crc:
                return ""
            return "file changed since its save (written to after it)"
        actual = edge_crc32(path)
        return "" if actual == edge else (f"file changed since its save (edge crc32 {actual}, "
                                          f"saved {edge})")
    if crc:
        actual = file_crc32(path)
        return "" if actual == crc else f"file changed since its save (crc32 {actual}, saved {crc})"
    return ""
