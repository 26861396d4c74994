"""The test bed at real cost ratios (issue #31): a folder whose reads and writes are capped at
a number of bytes per second, so that llama-server's slot saves and restores into it take as
long as a multi-GiB slot does on a GPU host, and stall its main loop as they would there.

A FUSE passthrough (libfuse3 from Debian's `fuse3`, the `mfusepy` binding): every file of the
mount point is a file of the backing folder, and each read and write first waits its turn on
one token bucket. llama-server writes and reads its state files with plain file calls, so a
slow folder slows exactly the calls a slow disk, a network folder or a GPU copy slows.

    python tests/bed/throttlefs.py BACKING MOUNTPOINT --bytes-per-s 5000000

runs in the foreground until unmounted (`fusermount3 -u MOUNTPOINT`). `ThrottledFolder` starts
and stops it for tests and benchmarks."""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

MOUNT_WAIT_S = 20.0


class Bucket:
    """Bytes at most `rate` a second, in order of arrival: each call waits until the bytes
    before it have gone through. With a `rate_file`, the rate is the number in that file
    whenever it changes (ThrottledFolder.set_rate), so that a test can set the cap from a speed
    it measured after the folder is in use."""

    def __init__(self, rate: float, rate_file: Path | None = None) -> None:
        self.rate = rate
        self.rate_file = rate_file
        self._rate_version: tuple[int, int] = (0, 0)
        self._free_at = 0.0
        self._lock = threading.Lock()

    def _follow_rate_file(self) -> None:
        if self.rate_file is None:
            return
        try:
            st = os.stat(self.rate_file)  # a new file each time: its inode tells it apart
            if (st.st_ino, st.st_mtime_ns) != self._rate_version:
                self.rate = float(self.rate_file.read_text())
                self._rate_version = (st.st_ino, st.st_mtime_ns)
        except (OSError, ValueError):
            pass  # no file yet, or one being replaced: keep the rate in force

    def spend(self, nbytes: int) -> None:
        with self._lock:
            self._follow_rate_file()
            now = time.monotonic()
            start = max(now, self._free_at)
            self._free_at = start + nbytes / self.rate
            wait = self._free_at - now
        if wait > 0:
            time.sleep(wait)


def make_operations(backing: Path, bucket: Bucket):
    import mfusepy  # only in the FUSE process: the tests import ThrottledFolder without it

    class Passthrough(mfusepy.Operations):
        def _full(self, path: str) -> str:
            return os.path.join(backing, path.lstrip("/"))

        def getattr(self, path, fh=None):
            try:
                st = os.lstat(self._full(path))
            except OSError as e:
                raise mfusepy.FuseOSError(e.errno) from None
            return {key: getattr(st, key) for key in (
                "st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_atime", "st_mtime",
                "st_ctime")}

        def readdir(self, path, fh):
            return [".", "..", *os.listdir(self._full(path))]

        def access(self, path, amode):
            if not os.access(self._full(path), amode):
                raise mfusepy.FuseOSError(errno.EACCES)
            return 0

        def open(self, path, flags):
            return os.open(self._full(path), flags)

        def create(self, path, mode, fi=None):
            return os.open(self._full(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

        def read(self, path, size, offset, fh):
            bucket.spend(size)
            return os.pread(fh, size, offset)

        def write(self, path, data, offset, fh):
            bucket.spend(len(data))
            return os.pwrite(fh, data, offset)

        def truncate(self, path, length, fh=None):
            os.truncate(self._full(path), length)
            return 0

        def flush(self, path, fh):
            return 0

        def fsync(self, path, datasync, fh):
            os.fsync(fh)
            return 0

        def release(self, path, fh):
            os.close(fh)
            return 0

        def unlink(self, path):
            os.unlink(self._full(path))
            return 0

        def rename(self, old, new):
            os.rename(self._full(old), self._full(new))
            return 0

        def mkdir(self, path, mode):
            os.mkdir(self._full(path), mode)
            return 0

        def rmdir(self, path):
            os.rmdir(self._full(path))
            return 0

        def chmod(self, path, mode):
            os.chmod(self._full(path), mode)
            return 0

        def chown(self, path, uid, gid):
            os.chown(self._full(path), uid, gid)
            return 0

        def utimens(self, path, times=None):
            os.utime(self._full(path), times)
            return 0

        def statfs(self, path):
            st = os.statvfs(self._full(path))
            return {key: getattr(st, key) for key in (
                "f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files",
                "f_flag", "f_frsize", "f_namemax")}

    return Passthrough()


class ThrottledFolder:
    """A mount point whose reads and writes go at most `bytes_per_s` (a FUSE process of its
    own). Its files are also reachable, unthrottled, in `backing`."""

    def __init__(self, root: Path, bytes_per_s: float) -> None:
        self.backing = root / "backing"
        self.path = root / "throttled"
        self.bytes_per_s = bytes_per_s
        self.rate_file = root / "rate"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ThrottledFolder:
        self.backing.mkdir(parents=True, exist_ok=True)
        self.path.mkdir(parents=True, exist_ok=True)
        self.set_rate(self.bytes_per_s)
        self.proc = subprocess.Popen(
            self.command(),
            stdout=subprocess.DEVNULL, stderr=open(self.path.parent / "throttlefs.log", "wb"))
        deadline = time.monotonic() + MOUNT_WAIT_S
        while not os.path.ismount(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"throttled folder not mounted: "
                                   f"{(self.path.parent / 'throttlefs.log').read_text()[-2000:]}")
            time.sleep(0.05)
        return self

    def command(self) -> list[str]:
        """The FUSE process: this file run as a script (a subclass may run another)."""
        return [sys.executable, __file__, str(self.backing), str(self.path),
                "--bytes-per-s", str(self.bytes_per_s), "--rate-file", str(self.rate_file)]

    def set_rate(self, bytes_per_s: float) -> None:
        """The cap from the next read or write on (the FUSE process follows `rate_file`)."""
        self.bytes_per_s = bytes_per_s
        staged = self.rate_file.with_suffix(".new")
        staged.write_text(repr(float(bytes_per_s)))
        os.replace(staged, self.rate_file)

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
    parser.add_argument("--rate-file", type=Path, default=None,
                        help="follow the number in this file as the cap when it changes")
    args = parser.parse_args()
    bucket = Bucket(args.bytes_per_s, args.rate_file)
    mfusepy.FUSE(make_operations(args.backing.resolve(), bucket),
                 str(args.mountpoint), foreground=True, nothreads=False)


if __name__ == "__main__":
    main()
