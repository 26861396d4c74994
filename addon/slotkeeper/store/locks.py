"""Per-slot locks shared by every proxy process: flock on one small file per (upstream, slot).

A request that keeps its session's slot holds the lock shared; a handover (claim, save the
outgoing session, restore the incoming one, forward) holds it exclusive until its response
ends, so no other session's request reaches the slot in between, in this process or another.
flock belongs to the open file, so two leases in one process exclude each other just as two
processes do."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path


class SlotLease:
    """A held lock. release() is idempotent and never blocks. A context manager: `with
    lease:` releases it on every way out; code that hands a lease on (to a Route that lives
    until the response ends) enters it in an ExitStack and pops the stack only once the
    hand-over is complete, so an exception in between still releases it (issue #11 fault 1)."""

    def __init__(self, fd: int, exclusive: bool,
                 on_release: Callable[[], None] | None = None) -> None:
        self._fd: int | None = fd
        self.exclusive = exclusive
        self._on_release = on_release

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        if self._on_release is not None:
            self._on_release()  # a shared lease on the process's kept-open file
        else:
            os.close(fd)  # closing the file drops the flock

    def __enter__(self) -> SlotLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class SlotLocks:
    """Shared leases (the fast path: a session keeping its slot) use one lock file per slot that
    this process keeps open, locked shared while at least one of its leases holds it: no
    open/close per request (docs/BENCHMARKS.md measured those on the hot path). Exclusive
    leases open their own file each time, so they exclude this process's shared holders the
    same way they exclude other processes."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._paths: dict[tuple[str, int], Path] = {}
        self._shared: dict[tuple[str, int], list[int]] = {}  # key -> [fd, holders]
        self._mutex = threading.Lock()

    def path(self, upstream: str, slot: int) -> Path:
        key = (upstream, int(slot))
        path = self._paths.get(key)
        if path is None:
            tag = hashlib.sha256(upstream.encode()).hexdigest()[:12]
            path = self._paths[key] = self.folder / f"{tag}-slot{int(slot)}.lock"
        return path

    def _open(self, upstream: str, slot: int) -> int:
        return os.open(self.path(upstream, slot), os.O_RDWR | os.O_CREAT, 0o600)

    def try_acquire(self, upstream: str, slot: int, exclusive: bool) -> SlotLease | None:
        """Non-blocking: safe to call on the event loop."""
        if not exclusive:
            return self._try_shared(upstream, int(slot))
        fd = self._open(upstream, slot)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return SlotLease(fd, exclusive)

    def _try_shared(self, upstream: str, slot: int) -> SlotLease | None:
        key = (upstream, slot)
        with self._mutex:
            entry = self._shared.get(key)
            if entry is None:
                entry = self._shared[key] = [self._open(upstream, slot), 0]
            if entry[1] == 0:
                try:
                    fcntl.flock(entry[0], fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    return None
            entry[1] += 1
            return SlotLease(entry[0], exclusive=False,
                             on_release=lambda: self._release_shared(key))

    def _release_shared(self, key: tuple[str, int]) -> None:
        with self._mutex:
            entry = self._shared[key]
            entry[1] -= 1
            if entry[1] == 0:
                fcntl.flock(entry[0], fcntl.LOCK_UN)

    def acquire(
        self, upstream: str, slot: int, exclusive: bool, timeout: float
    ) -> SlotLease | None:
        """Blocking with a deadline (worker threads only). Polls, because flock has no timeout;
        the wait is for another request on the same slot, so 20 ms steps lose little."""
        return _poll(lambda: self.try_acquire(upstream, slot, exclusive), timeout)

    # ---- one save pipeline per snapshot, one placement per session ----------------------------

    def snapshot(self, snapshot_id: str, timeout: float) -> SlotLease | None:
        """The lock of one session's (or seed's) snapshot files, held across save, verify,
        commit and the meta write, and around every read-modify-write of its meta, in every
        thread and process (issue #11 fault 4). Exclusive; None after `timeout` seconds."""
        return self._exclusive(self._named_path("snapshot", snapshot_id), timeout)

    def placement(self, session: str, timeout: float) -> SlotLease | None:
        """The lock of one session's placement on a pool of servers, held from reading the
        servers' views until its claim is written (issue #13): two processes placing the same
        new session at once would otherwise each see it nowhere and send its two requests to
        two servers. Exclusive; None after `timeout` seconds."""
        return self._exclusive(self._named_path("placement", session), timeout)

    def _named_path(self, kind: str, name: str) -> Path:
        # A digest, never the name itself: session ids come from clients (hostile).
        tag = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:24]
        return self.folder / f"{kind}-{tag}.lock"

    @staticmethod
    def _exclusive(path: Path, timeout: float) -> SlotLease | None:
        """A lock file per name would pile up (one per session ever seen), so the holder
        removes it on release; whoever locked the removed file retries on the new one."""

        def attempt() -> SlotLease | None:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if os.fstat(fd).st_ino != os.stat(path).st_ino:
                    raise BlockingIOError  # locked a file its holder had just removed
            except (BlockingIOError, FileNotFoundError):
                os.close(fd)
                return None

            def remove_and_close() -> None:
                with contextlib.suppress(OSError):
                    path.unlink()  # before the close: nobody can lock it and see it vanish
                os.close(fd)

            return SlotLease(fd, exclusive=True, on_release=remove_and_close)

        return _poll(attempt, timeout)


def _poll(attempt, timeout: float) -> SlotLease | None:
    deadline = time.monotonic() + timeout
    while True:
        lease = attempt()
        if lease is not None or time.monotonic() >= deadline:
            return lease
        time.sleep(0.02)
