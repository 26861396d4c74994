"""Paths: the one place that turns a session (or seed) id into a file name inside the slot
folder, and checks that a name stays inside it. Pure except `inside`, which only normalises.

Every name slotkeeper ever gives llama-server or deletes comes from here, so the rule "a
hostile session id never names a path outside the cache folder" is checked in one room."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

_PREFIX_MAX = 40
_HASH_HEX = 24
# llama-server refuses names containing "..", and a leading "-" or "." invites mistakes in
# shells and listings: the readable prefix avoids all three.
_STEM = r"(?!.*\.\.)[A-Za-z0-9_][A-Za-z0-9._-]{0,39}-[0-9a-f]{24}"
FILE_NAME_RE = re.compile(_STEM + r"\.bin")
META_RE = re.compile(_STEM + r"\.json")
TEMP_RE = re.compile(_STEM + r"\.json\.[0-9a-f]{8}\.tmp")
# A save in progress: llama-server writes the new snapshot under this name and the proxy renames
# it over the old one only once it is verified, so a failed save (disk full, read-only folder,
# proxy killed) never destroys the previous snapshot.
SAVING_RE = re.compile(_STEM + r"\.saving-[0-9a-f]{8}\.bin")


class PathOutsideFolder(ValueError):
    """A name that would leave the slot folder: only a bug can produce one. A real check, not
    an `assert` (gone under `python -O`): the next step may delete the path."""


def file_name_for(session_id: str) -> str:
    """The state file's basename for a session: a readable prefix of the id (only
    [A-Za-z0-9._-], no "..", no leading "." or "-", at most 40 characters) and the first 24 hex
    digits of the id's sha256, which alone tells sessions apart. Matches FILE_NAME_RE for any
    str, so it can never name a path outside the folder."""
    # surrogatepass: a str from a decoded header may hold lone surrogates; equal to plain
    # UTF-8 for every valid string.
    digest = hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).hexdigest()[:_HASH_HEX]
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", session_id)
    readable = re.sub(r"\.{2,}", ".", readable).lstrip(".-")[:_PREFIX_MAX]
    return f"{readable or 'session'}-{digest}.bin"


def inside(root: Path, name: str) -> Path:
    """`root / name`, refusing (PathOutsideFolder) anything that is not a plain child of root.
    abspath normalises ".." without following a symlink at the name: unlinking such a link
    stays inside root."""
    path = Path(os.path.abspath(root / name))
    if path.parent != root or not name or "/" in name or "\0" in name:
        raise PathOutsideFolder(f"{name!r} resolves outside {root}")
    return path


def require(pattern: re.Pattern[str], name: str) -> str:
    """A name must match one of our patterns before we rename or delete it."""
    if not pattern.fullmatch(name):
        raise PathOutsideFolder(f"{name!r} is not one of slotkeeper's file names")
    return name
