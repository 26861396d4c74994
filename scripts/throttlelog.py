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
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "bed"))

from throttlefs import Bucket, ThrottledFolder, make_operations  # noqa: E402

UNLIMITED = 1e15  # the inner passthrough's own bucket: the charge below is what waits


def charged(nbytes: float, small_per_token: float, per_token: float, fixed: float) -> float:
    """Bytes of a slot file that cost as KV of a model without a sliding window. The test
    model (gemma-3-270m, --swa-full) writes `small_per_token` a token up to its window, then
    `per_token` a token more (its full-attention layers) over a `fixed` part (its sliding-window
    layers' window): a file of n tokens is small_per_token x n (n <= window) or fixed +
    per_token x n. Charged: per_token x n in both cases, so a save or restore waits as long as
    its tokens of KV take at the cap, as a model whose every layer is full attention would
    (fixed 0: every byte is charged)."""
    if fixed <= 0 or small_per_token <= per_token:
        return nbytes
    knee = fixed * small_per_token / (small_per_token - per_token)
    return nbytes * per_token / small_per_token if nbytes <= knee else nbytes - fixed


def logged_operations(backing: Path, bucket: Bucket, log_path: Path,
                      charge: tuple[float, float, float] | None = None) -> Any:
    ops = make_operations(backing, Bucket(UNLIMITED))
    lock = threading.Lock()
    open_files: dict[int, dict[str, Any]] = {}
    log = log_path.open("a", buffering=1)

    import mfusepy

    def note_open(path: str, fh: int) -> int:
        try:
            pid = mfusepy.fuse_get_context()[2]  # who opened it: llama-server or slotkeeper
        except Exception:  # noqa: BLE001 - the log goes on without it
            pid = None
        with lock:
            open_files[fh] = {"path": path, "pid": pid, "open": time.perf_counter(), "first": None,
                              "last": None, "read": 0, "written": 0, "charged": 0.0}
        return fh

    def spend(fh: int, key: str, nbytes: int) -> None:
        """Wait for this call's share of the bucket: its bytes, or with `charge` what they
        add to the file's charged bytes."""
        if charge is None:
            with lock:
                if fh in open_files:
                    open_files[fh]["charged"] += nbytes
            bucket.spend(nbytes)
            return
        with lock:
            entry = open_files.get(fh)
            before = entry[key] if entry else 0
        cost = charged(before + nbytes, *charge) - charged(before, *charge)
        if entry is not None:
            with lock:
                entry["charged"] += cost
        bucket.spend(max(0, round(cost)))

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
        spend(fh, "read", len(data))
        note_io(fh, "read", len(data), started)
        return data

    def write(path, data, offset, fh):
        started = time.perf_counter()
        spend(fh, "written", len(data))
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


class LoggedFolder(ThrottledFolder):
    """A capped mount point (`path`) over `backing`, logging to `log_path`."""

    def __init__(self, root: Path, bytes_per_s: float,
                 charge: tuple[float, float, float] | None = None) -> None:
        super().__init__(root, bytes_per_s)
        self.log_path = root / "io.jsonl"
        self.charge = charge

    def command(self) -> list[str]:
        return [sys.executable, __file__, str(self.backing), str(self.path),
                "--bytes-per-s", str(self.bytes_per_s), "--rate-file", str(self.rate_file),
                "--log", str(self.log_path),
                *(["--charge", *map(str, self.charge)] if self.charge else [])]

    def start(self) -> LoggedFolder:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.touch()
        super().start()
        return self

    def entries(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log_path.read_text().splitlines()
                if line.strip()]


def main() -> None:
    import mfusepy

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("backing", type=Path)
    parser.add_argument("mountpoint", type=Path)
    parser.add_argument("--bytes-per-s", type=float, required=True)
    parser.add_argument("--rate-file", type=Path, default=None)
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--charge", type=float, nargs=3, default=None,
                        metavar=("SMALL_PER_TOKEN", "PER_TOKEN", "FIXED"),
                        help="charge a file's bytes as KV tokens x PER_TOKEN (see charged())")
    args = parser.parse_args()
    bucket = Bucket(args.bytes_per_s, args.rate_file)
    ops = logged_operations(args.backing.resolve(), bucket, args.log,
                            tuple(args.charge) if args.charge else None)
    mfusepy.FUSE(ops, str(args.mountpoint), foreground=True, nothreads=False)


if __name__ == "__main__":
    main()
