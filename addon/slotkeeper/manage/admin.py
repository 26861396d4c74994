"""Admin: what the /api/sessions endpoints (and `slotkeeper status`) do with the router's
state. Blocking: worker threads."""

from __future__ import annotations

import logging

from ..observe import metrics
from ..store.backends import store_of
from ..store.state import StateDoc, StoreUnavailable, UpstreamRecord
from ..upstream.client import UpstreamError
from ..upstream.models import split_key

log = logging.getLogger("slotkeeper")

ADMIN_LOCK_TIMEOUT = 30.0  # an API call waits this long for a slot's request to finish


class SessionAdmin:
    """What the /api/sessions endpoints do. Blocking: worker threads."""

    def __init__(self, router) -> None:
        """`router`: a router.Router (not imported: the router's rooms never import admin)."""
        self.router = router

    def current(self) -> dict:
        try:
            doc = self.router.state.read()
        except StoreUnavailable:  # etcd down: what this proxy last knew, and the store says so
            doc = self.router.state.last_read()
        folder = self.router.folder
        out: dict = {}
        pool = tuple(getattr(getattr(self.router, "config", None), "upstreams", ()))
        for url, up in {**{u: UpstreamRecord() for u in pool}, **doc.upstreams}.items():
            slots = {}
            for slot_id, rec in sorted(up.slots.items()):
                meta = folder.read_meta(rec.owner) if folder else None
                slots[str(slot_id)] = {
                    "session": rec.owner,
                    "resident": not rec.stale,
                    "claimed": rec.claimed,
                    "last_used": rec.last_used,
                    "tokens": rec.tokens,
                    "saved_tokens": rec.saved_tokens,
                    "file": None if meta is None else {"tokens": meta.n_tokens,
                                                       "bytes": meta.size_bytes},
                }
            known = getattr(self.router, "upstreams", None)  # none when read from the files
            info = known.peek(url) if known is not None else None
            out[url] = {"slots": slots, "draining": up.draining,
                        **({"costs": info.client.costs.rates().as_dict(),
                            "ram_cache": info.ram.as_dict()} if info else {}),
                        **({"model": split_key(url)[1]} if split_key(url)[1] else {}),
                        **({"pool": True, "up": self.router.upstreams.get(url).healthy}
                           if url in pool else {})}
        return {"upstreams": out, "slot_dir": str(folder.root) if folder else None,
                "store": store_of(self.router.state)}

    def saved(self) -> list[dict]:
        folder = self.router.folder
        if folder is None:
            raise NoSlotDir()
        resident = self._resident()
        return [
            {
                "id": meta.session_id,
                "kind": meta.kind,
                "bytes": meta.size_bytes,
                "tokens": meta.n_tokens,
                "messages": meta.n_messages,
                "created": meta.created,
                "last_used": meta.last_used,
                "resident": resident.get(meta.session_id),
            }
            for meta in sorted(folder.list_sessions(), key=lambda m: -m.last_used)
        ]

    def _resident(self) -> dict[str, dict]:
        return {
            rec.owner: {"upstream": url, "slot": slot_id,
                        **({"model": split_key(url)[1]} if split_key(url)[1] else {})}
            for url, up in self.router.state.read().upstreams.items()
            for slot_id, rec in up.slots.items()
            if not rec.stale
        }

    def clear(self) -> dict:
        """Erase every claimed slot and drop every claim, and what slotkeeper counted on in
        the servers' RAM caches (nothing is handed back from there afterwards). Saved files
        stay."""
        erased = []
        for url, up in self.router.state.read().upstreams.items():
            for slot_id in list(up.slots):
                self._release_slot(url, slot_id, owner=None)
                erased.append({"upstream": url, "slot": slot_id})
        for _, info in self.router.upstreams.known():
            info.ram.forget()
        return {"erased": erased}

    def forget(self, session: str) -> dict | None:
        """Erase the session's slot if it holds one and delete its files. None: unknown id."""
        found = False
        for url, up in self.router.state.read().upstreams.items():
            slot_id = up.slot_of(session)
            if slot_id is not None:
                self._release_slot(url, slot_id, owner=session)
                found = True
        for _, info in self.router.upstreams.known():
            info.ram.take(session)
        snapshots = self.router.snapshots
        deleted = snapshots.delete(session) if snapshots else False
        if not (found or deleted):
            return None
        return {"id": session, "slot_erased": found, "files_deleted": deleted}

    # ---- the pool (issue #13) ------------------------------------------------------------

    def pool(self) -> dict:
        router = self.router
        doc = router.state.read()
        members = []
        for url in router.config.upstreams:
            up = doc.upstreams.get(url)
            members.append({
                "url": url, "up": router.upstreams.get(url).healthy,
                "draining": bool(up and up.draining), "in_flight": router.pool.in_flight(url),
                "sessions": sorted(rec.owner for rec in up.slots.values()) if up else []})
        return {"placement": router.config.placement, "upstreams": members}

    def drain(self, url: str) -> dict:
        """Take no new sessions on `url` and move its sessions out: each resident session's
        KV is saved there and its claim dropped, so its next request is placed on another
        server and restores it. A session whose slot stays busy keeps its claim; its next
        request moves it (a draining server is never chosen)."""
        router = self.router
        router.pool.set_draining(url, True)
        moved, busy = [], []
        up = router.state.read().upstreams.get(url)
        for rec in list(up.slots.values()) if up else []:
            with router.pool.placement_lock(rec.owner):  # a request of it placing meanwhile waits
                saved = router.pool.evacuate(url, rec.owner, ADMIN_LOCK_TIMEOUT)
            if saved < 0:
                busy.append(rec.owner)
            else:
                moved.append({"session": rec.owner, "saved_tokens": saved})
        log.info("%s draining: %d sessions moved out, %d busy", url, len(moved), len(busy))
        return {"upstream": url, "draining": True, "moved": moved, "busy": busy}

    def undrain(self, url: str) -> dict:
        self.router.pool.set_draining(url, False)
        log.info("%s takes sessions again", url)
        return {"upstream": url, "draining": False}

    def _release_slot(self, url: str, slot: int, owner: str | None) -> None:
        router = self.router
        lease = router.locks.acquire(url, slot, exclusive=True, timeout=ADMIN_LOCK_TIMEOUT)
        if lease is None:
            raise SlotBusy(f"slot {slot} of {url} stayed busy for {ADMIN_LOCK_TIMEOUT:.0f} s")
        try:
            try:
                with metrics.timed("erase"):
                    router.upstreams.get(url).client.erase(slot)
            except UpstreamError as e:
                log.warning("erase of slot %d on %s failed: %s", slot, url, e)

            def drop(doc: StateDoc) -> None:
                up = doc.upstream(url)
                rec = up.slots.get(slot)
                if rec is not None and (owner is None or rec.owner == owner):
                    del up.slots[slot]

            router.state.update(drop)
        finally:
            lease.release()


class SlotBusy(Exception):
    """A slot was still serving a request when an admin call wanted it."""


class NoSlotDir(Exception):
    """The proxy was started without slotkeeper_slot_dir: there are no saved sessions."""
