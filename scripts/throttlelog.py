"""tests/bed/throttlefs.py's capped folder, with a log of what went through it: for
scripts/bench-profiles, which needs the bytes written to the slot folder and the moments each
save or restore ran (to tell which inter-token gaps of a stream a save or restore of another
slot caused).

    python scripts/throttlelog.py BACKING MOUNTPOINT --bytes-per-s N --log FILE.jsonl

Every opened file, when it is closed, adds one JSON line to FILE: its path, the
time.perf_counter() (CLOCK_MONOTONIC, the same clock in every process of the machine) of the
open, of the first and last read or write, of the close, and the bytes read and written.
`LoggedFolder` starts and stops it like `ThrottledFolder`."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "bed"))

from throttlefs import MOUNT_WAIT_S, Bucket, make_operations  # noqa: E402


def logged_operations(backing: Path, bucket: Bucket, log_path: Path) -> Any:
    ops = make_operations(backing, bucket)
    lock = threading.Lock()
    open_files: dict[int, dict[str, Any]] = {}
    log = log_path.open("a", buffering=1)

    def note_open(path: str, fh: int) -> int:
        with lock:
            open_files[fh] = {"path": path, "open": time.perf_counter(), "first": None,
                              "last": None, "read": 0, "written": 0}
        return fh

    def note_io(fh: int, key: str, nbytes: int, started: float) -> None:
        with lock:
            entry = open_files.get(fh)
            if entry is None:
                return
            entry[key] += nbytes
            if entry["first"] is None:
                entry["first"] = started
            entry["last"] = time.perf_counter()

    inner_open, inner_create = ops.open, ops.create
    inner_read, inner_write, inner_release = ops.read, ops.write, ops.release

    def open_(path, flags):
        return note_open(path, inner_open(path, flags))

    def create(path, mode, fi=None):
        return note_open(path, inner_create(path, mode, fi))

    def read(path, size, offset, fh):
        started = time.perf_counter()
        data = inner_read(path, size, offset, fh)
        note_io(fh, "read", len(data), started)
        return data

    def write(path, data, offset, fh):
        started = time.perf_counter()
        n = inner_write(path, data, offset, fh)
        note_io(fh, "written", n, started)
        return n

    def release(path, fh):
        with lock:
            entry = open_files.pop(fh, None)
        if entry is not None and (entry["read"] or entry["written"]):
            entry["close"] = time.perf_counter()
            log.write(json.dumps(entry) + "\n")
        return inner_release(path, fh)

    # mfusepy calls operations by name (getattr on the instance): these wrap the originals
    ops.open, ops.create, ops.read, ops.write, ops.release = open_, create, read, write, release
    return ops


class LoggedFolder:
    """A capped mount point (`path`) over `backing`, logging to `log_path`."""

    def __init__(self, root: Path, bytes_per_s: float) -> None:
        self.backing = root / "backing"
        self.path = root / "throttled"
        self.log_path = root / "io.jsonl"
        self.bytes_per_s = bytes_per_s
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> LoggedFolder:
        self.backing.mkdir(parents=True, exist_ok=True)
        self.path.mkdir(parents=True, exist_ok=True)
        self.log_path.touch()
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(self.backing), str(self.path),
             "--bytes-per-s", str(self.bytes_per_s), "--log", str(self.log_path)],
            stdout=subprocess.DEVNULL, stderr=open(self.path.parent / "throttlefs.log", "wb"))
        deadline = time.monotonic() + MOUNT_WAIT_S
        while not os.path.ismount(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"throttled folder not mounted: "
                                   f"{(self.path.parent / 'throttlefs.log').read_text()[-2000:]}")
            time.sleep(0.05)
        return self

    def entries(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log_path.read_text().splitlines()
                if line.strip()]

    def stop(self) -> None:
        if self.proc is None:
            return
        subprocess.run([shutil.which("fusermount3") or "fusermount3", "-u", "-z",
                        str(self.path)], capture_output=True, timeout=30)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def main() -> None:
    import mfusepy

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("backing", type=Path)
    parser.add_argument("mountpoint", type=Path)
    parser.add_argument("--bytes-per-s", type=float, required=True)
    parser.add_argument("--log", type=Path, required=True)
    args = parser.parse_args()
    ops = logged_operations(args.backing.resolve(), Bucket(args.bytes_per_s), args.log)
    mfusepy.FUSE(ops, str(args.mountpoint), foreground=True, nothreads=False)


if __name__ == "__main__":
    main()
