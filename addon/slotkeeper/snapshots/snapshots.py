"""The snapshot service: save a slot as a session's (or seed's) snapshot, verify it, commit it,
restore it, count its misses, keep the disk budget. Blocking: worker threads only.

One pipeline per snapshot: every step that writes a snapshot's files (save, verify, commit,
meta) and every read-modify-write of its meta (a miss, a restore's last_used) runs under that
snapshot's lock (locks.SlotLocks.snapshot, a flock), so two saves of one session in two threads
or processes can never pair one save's meta with the other's file (issue #11, fault 4)."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from contextlib import nullcontext

from ..decisions import pricing
from ..observe import metrics
from ..store.budgets import Ledger, LocalLedger
from ..store.locks import SlotLocks
from ..upstream.client import ServerProps, Upstream, UpstreamError
from .paths import file_name_for
from .slotfiles import SessionMeta, SlotFolder

log = logging.getLogger("slotkeeper")

# A snapshot's lock is held for one save (a 2k-token slot saves in ~7 ms, a large model's in
# seconds); a pipeline that waits longer than this for it gives up that save and says so.
SNAPSHOT_LOCK_TIMEOUT = 60.0


def seed_id(seed_key: str) -> str:
    """A seed's snapshot id. "~" followed by 32 hex digits is a form no session id can take
    (identity: a verbatim id never holds "~", a hashed one has 16 hex digits after it), so a
    client cannot name its session after a seed and overwrite it (issue #11, fault 9)."""
    return f"seed~{seed_key[:32]}"


def hand_back_id(fingerprint: str) -> str:
    """The snapshot id of one model's hand-back file: a slot holding only the hand-back
    prompt (routing/ramhandover.py). Per model, in the same unforgeable form as a seed's."""
    return f"handback~{hashlib.sha256(fingerprint.encode()).hexdigest()[:32]}"


class Snapshots:
    def __init__(self, folder: SlotFolder, locks: SlotLocks,
                 clock: Callable[[], float] = time.time,
                 lock_timeout: float = SNAPSHOT_LOCK_TIMEOUT, ledger: Ledger | None = None
                 ) -> None:
        self.folder = folder
        self.locks = locks
        self.clock = clock
        self.lock_timeout = lock_timeout
        # The budgets' accounting: bytes saved within the hour (the write budget) and the
        # saves in flight (the disk budget), this process's or the cluster's (store.budgets).
        self.writes: Ledger = ledger if ledger is not None else LocalLedger()

    def check(self, props: ServerProps, snapshot: str, message_count: int,
              content: bool = True) -> tuple[bool, str]:
        return self.folder.check(snapshot, fingerprint=props.fingerprint, n_ctx=props.n_ctx,
                                 message_count=message_count, content=content)

    # ---- save ------------------------------------------------------------------------------------

    def save(self, client: Upstream, props: ServerProps, slot: int, owner: str, messages: int,
             kind: str = "session") -> int:
        """Save the slot as `owner`'s snapshot and write its metadata; tokens saved, or 0 when
        nothing new is on disk (the previous snapshot, if any, stays whole). Never writes a
        0-token snapshot: it would restore nothing and replace a useful one."""
        if client.slot_actions_disabled:
            return 0
        lock = self.locks.snapshot(owner, self.lock_timeout)
        if lock is None:
            log.warning("save of %s skipped: another save of it held its lock for %.0f s",
                        owner, self.lock_timeout)
            return 0
        with lock:
            return self._save_locked(client, props, slot, owner, messages, kind)

    def _save_locked(self, client: Upstream, props: ServerProps, slot: int, owner: str,
                     messages: int, kind: str) -> int:
        folder = self.folder
        old = folder.read_meta(owner)
        # Room for the new file before writing it: its old size, or for a first save the
        # largest snapshot there is (sizes are not linear in tokens, so no per-token guess).
        expected = old.size_bytes if old else max(
            (m.size_bytes for m in folder.list_sessions()), default=0)
        saving = folder.saving_name(owner)
        # Reserved before the others' reservations are read: of two saves starting at once,
        # at least one makes room for both (store.budgets).
        # No disk budget: nothing to make room for, no round trip to etcd.
        budgeted = folder.max_bytes > 0
        with self.writes.reserve(saving, expected) if budgeted else nullcontext():
            folder.make_room(expected + self._others_pending(saving), keep={owner})
            return self._save_reserved(client, props, slot, owner, messages, kind, old,
                                       saving, expected)

    def _others_pending(self, saving: str) -> int:
        """Bytes the other saves in flight (any proxy's, with the etcd store) will still add."""
        if not self.folder.max_bytes:
            return 0
        return self.writes.pending(self.folder.file_size, exclude=saving)

    def _save_reserved(self, client: Upstream, props: ServerProps, slot: int, owner: str,
                       messages: int, kind: str, old: SessionMeta | None, saving: str,
                       expected: int) -> int:
        folder = self.folder
        # The server writes in place (over whatever has the name), so it writes under a fresh
        # name and the verified file is renamed over the old snapshot: a save that fails while
        # writing (disk full, read-only folder) or a proxy killed meanwhile leaves the previous
        # snapshot whole and restorable.
        t0 = time.monotonic()
        try:
            answer = client.save(slot, saving, expected_bytes=expected)
        except UpstreamError as e:
            log.warning("save of %s from slot %d failed: %s; the previous snapshot stays", owner,
                        slot, e)
            metrics.slot_op("save", ok=False)
            folder.discard_saving(saving)
            return 0
        waited_and_saved = time.monotonic() - t0
        n_saved = int(answer.get("n_saved", 0))
        # The server defers a save until the slot's request ends: the time we waited is not
        # the save's. Its own save_ms is (issue #11, fault 9).
        save_ms = _number((answer.get("timings") or {}).get("save_ms"), waited_and_saved * 1000)
        if n_saved <= 0:
            log.info("save of %s from slot %d held no tokens: not kept", owner, slot)
            folder.discard_saving(saving)
            return 0
        ok, why = folder.verify_saved(owner, n_written=int(answer.get("n_written", -1)),
                                      n_saved=n_saved, name=saving)
        if not ok:
            # A full disk truncates the file while its header still claims every token.
            log.warning("save of %s from slot %d is unusable (%s): removed; the previous "
                        "snapshot stays", owner, slot, why)
            metrics.slot_op("save", ok=False)
            folder.discard_saving(saving)
            return 0
        edge = folder.edge_crc32_of(saving)  # 128 KiB, not the whole file (issue #31)
        folder.commit_saved(owner, saving)
        now = self.clock()
        folder.secure(owner)
        stat = folder.state_path(owner).stat()  # after the chmod: its mtime is the file's own
        _count_save(client, self.writes, size := stat.st_size, n_saved, save_ms)
        folder.write_meta(SessionMeta(
            session_id=owner, kind=kind, file_name=file_name_for(owner),
            fingerprint=props.fingerprint, n_ctx=props.n_ctx, n_tokens=n_saved,
            n_messages=messages, created=old.created if old else now, last_used=now,
            size_bytes=size, misses=0, edge_crc32=edge, mtime_ns=stat.st_mtime_ns,
        ))
        try:
            # the estimate may have been low
            folder.make_room(self._others_pending(saving), keep={owner})
        except OSError as e:
            log.warning("disk budget check after saving %s failed: %s", owner, e)
        log.info("saved %s from slot %d: %d tokens, %d bytes in %.0f ms (%.0f ms with the wait "
                 "for the slot)", owner, slot, n_saved, size, save_ms, waited_and_saved * 1000)
        return n_saved

    # ---- restore ---------------------------------------------------------------------------------

    def restore(self, client: Upstream, props: ServerProps, slot: int, snapshot: str,
                message_count: int, notes: list[str], what: str = "",
                useful_tokens: int = 0, resident_tokens: int = 0,
                priced: bool = True) -> int:
        """Check and restore a snapshot into the slot under its lock (a save of it cannot swap
        the file between the check and the restore); tokens restored, 0 when it was not
        usable, not worth it (`useful_tokens`: what the request will reuse of it, when not all
        of it: another session's prefix; `resident_tokens`: what the slot already holds of the
        request, kept by the server without a restore) or failed. A failed restore may leave
        the slot half-written, so it is erased. `priced` False: restored whatever it costs
        (the hand-back file, a few tokens that are not prefilled but cleared)."""
        lock = self.locks.snapshot(snapshot, self.lock_timeout)
        if lock is None:
            notes.append(f"{what or 'snapshot'} busy: not restored")
            return 0
        with lock:
            ok, reason = self.check(props, snapshot, message_count)
            if not ok:
                if reason != "no snapshot":
                    notes.append(f"{what or 'snapshot'} not used: {reason}")
                    metrics.restore_refused(reason)
                return 0
            if priced and not self._restore_pays(client, snapshot, what, notes, useful_tokens,
                                                 resident_tokens):
                return 0
            t0 = time.monotonic()
            try:
                answer = client.restore(slot, file_name_for(snapshot),
                                        nbytes=self.folder.size_of(snapshot))
            except UpstreamError as e:
                notes.append(f"{what or 'snapshot'} restore failed ({e})")
                metrics.slot_op("restore", ok=False)
                try:
                    with metrics.timed("erase"):
                        client.erase(slot)
                except UpstreamError:
                    pass
                return 0
            restored = int(answer.get("n_restored", 0))
            ms = (time.monotonic() - t0) * 1000
            _count_restore(client, answer, restored, ms)
            notes.append(f"restored {what + ' of ' if what else ''}{restored:,} tokens in "
                         f"{ms:.0f} ms")
            self._touch_locked(snapshot)
            return restored

    def _restore_pays(self, client: Upstream, snapshot: str, what: str, notes: list[str],
                      useful_tokens: int, resident_tokens: int = 0) -> bool:
        """pricing.restore_pays with this server's speeds and the snapshot's own size; the
        prefill it saves is what it holds beyond what the slot already holds of the request
        (`resident_tokens`, a shared system prompt: the server keeps that either way)."""
        meta = self.folder.read_meta(snapshot)
        if meta is None:
            return True
        rates = client.costs.rates()
        tokens = max((useful_tokens or meta.n_tokens) - resident_tokens, 0)
        if pricing.restore_pays(rates, meta.size_bytes, tokens):
            return True
        metrics.restore_skipped()
        notes.append(f"{what or 'snapshot'} not restored: reading {meta.size_bytes / 1e6:,.0f} "
                     f"MB takes ~{rates.restore_seconds(meta.size_bytes) or 0:.1f} s, "
                     f"prefilling its {tokens:,} tokens"
                     f"{' the slot lacks' if resident_tokens else ''} "
                     f"~{rates.prefill_seconds(tokens) or 0:.1f} s")
        return False

    def _touch_locked(self, snapshot: str) -> None:
        """A restored snapshot was used: it is the last one the disk budget should drop."""
        meta = self.folder.read_meta(snapshot)
        if meta is not None:
            meta.last_used = self.clock()
            self.folder.write_meta(meta)

    def record_miss(self, snapshot: str) -> int:
        """A restore the server did not reuse; returns the snapshot's miss count (slotfiles
        retires it at MAX_MISSES)."""
        lock = self.locks.snapshot(snapshot, self.lock_timeout)
        if lock is None:
            return 0
        with lock:
            return self.folder.record_miss(snapshot)

    def delete(self, snapshot: str) -> bool:
        lock = self.locks.snapshot(snapshot, self.lock_timeout)
        if lock is None:
            return False
        with lock:
            return self.folder.delete(snapshot)


def _count_save(client: Upstream, writes: Ledger, size: int, n_saved: int,
                save_ms: float) -> None:
    """A save in the metrics, the server's measured costs and the hour's writes."""
    metrics.slot_op("save", seconds=save_ms / 1000, nbytes=size, tokens=n_saved)
    client.costs.saved(size, n_saved, save_ms)
    writes.wrote(size)


def _count_restore(client: Upstream, answer: dict, restored: int, ms: float) -> None:
    """A restore in the metrics and in the server's measured costs, which take the server's
    own restore_ms (the wall time `ms` includes waiting for the slot)."""
    metrics.slot_op("restore", seconds=ms / 1000, nbytes=answer.get("n_read"), tokens=restored)
    client.costs.restored(_number(answer.get("n_read"), 0), restored,
                          _number((answer.get("timings") or {}).get("restore_ms"), ms))


def _number(value: object, default: float) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else default
