"""`slotkeeper status`: upstreams, slots and saved sessions at a glance.

Read from a running proxy's session API (`GET /api/sessions/current` and `/api/sessions`), or,
when no proxy answers, from the state file and the slot folder directly: the proxy answers from
those same files, so both give the same picture. Each upstream's own `GET /slots` (one second
at most) adds what only the server knows: which slots are busy right now and what they hold.
Nothing here writes a file or changes a slot."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from ..manage.admin import SessionAdmin
from ..snapshots.slotfiles import SlotFolder
from ..store.backends import describe as describe_store
from ..store.state import StateDoc
from ..upstream.client import UPSTREAM_KEY_ENV, SlotsUnavailable
from ..upstream.models import Kinds, split_key
from .local import state_dir

DEFAULT_PROXY = "http://127.0.0.1:8000"
PROXY_TIMEOUT_S = 3.0
SLOTS_TIMEOUT_S = 1.0


class StatusError(Exception):
    """Nothing to report from: one line for the user, exit code 1."""


def default_state_file() -> Path:
    return state_dir() / "state.json"


def default_slot_dir() -> Path | None:
    """The folder the `slotkeeper` launcher gives its local llama-server, if it exists."""
    folder = state_dir() / "slots"
    return folder if folder.is_dir() else None


# ---- gathering -----------------------------------------------------------------------------

@dataclass
class Report:
    source: str  # "proxy" or "files"
    proxy: str
    proxy_error: str | None = None  # why the proxy was not used
    state_file: str | None = None
    slot_dir: str | None = None
    upstreams: list[dict[str, Any]] = field(default_factory=list)
    sessions: list[dict[str, Any]] | None = None
    sessions_note: str | None = None
    store: dict[str, Any] | None = None  # the proxy's store (file or etcd), and if it answers
    now: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def api_auth() -> dict[str, str]:
    """The proxy's slotkeeper_api_token, from $SLOTKEEPER_API_TOKEN: with a token set, every
    management call needs it, loopback included."""
    token = os.environ.get("SLOTKEEPER_API_TOKEN", "")
    return {"Authorization": f"Bearer {token}"} if token else {}


def from_proxy(url: str) -> tuple[dict, list[dict] | None, str | None]:
    """(current, saved sessions or None, note). Raises StatusError when no slotkeeper proxy
    answers at `url`."""
    base = url.rstrip("/")
    try:
        r = requests.get(base + "/api/sessions/current", timeout=PROXY_TIMEOUT_S,
                         headers=api_auth())
    except requests.RequestException as e:
        raise StatusError(f"no proxy at {url} ({_short(e)})") from None
    current = _json(r)
    if r.status_code != 200 or not isinstance(current, dict) or not isinstance(
            current.get("upstreams"), dict):
        raise StatusError(f"{url} is not a slotkeeper proxy (GET /api/sessions/current "
                          f"answered {r.status_code})")
    try:
        r = requests.get(base + "/api/sessions", timeout=PROXY_TIMEOUT_S, headers=api_auth())
    except requests.RequestException as e:
        return current, None, f"GET /api/sessions failed: {_short(e)}"
    saved = _json(r)
    if r.status_code == 409:
        return current, None, "the proxy has no slot folder (slotkeeper_slot_dir is not set)"
    if r.status_code != 200 or not isinstance(saved, dict) or not isinstance(
            saved.get("sessions"), list):
        return current, None, f"GET /api/sessions answered {r.status_code}"
    return current, saved["sessions"], None


class _FileState:
    """Just enough of a Router for SessionAdmin's read-only calls."""

    def __init__(self, doc: StateDoc, folder: SlotFolder | None) -> None:
        self.doc = doc
        self.folder = folder
        self.state = self

    def read(self) -> StateDoc:
        return self.doc


def read_state_file(path: Path) -> StateDoc:
    try:
        raw = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise StatusError(f"no state file at {path} (slotkeeper has not run as this user, or "
                          f"give --state-file)") from None
    except (OSError, ValueError) as e:
        raise StatusError(f"cannot read the state file {path}: {_short(e)}") from None
    try:
        return StateDoc.from_json(raw)
    except (ValueError, TypeError, KeyError) as e:
        raise StatusError(f"the state file {path} is not a slotkeeper state file: "
                          f"{_short(e)}") from None


def from_files(state_file: Path, slot_dir: Path | None) -> tuple[dict, list[dict] | None,
                                                                  str | None]:
    doc = read_state_file(state_file)
    folder = None
    note = None
    if slot_dir is None:
        note = "no slot folder given (--slot-dir): saved sessions not listed"
    elif not slot_dir.is_dir():
        note = f"slot folder {slot_dir} does not exist"
    else:
        folder = SlotFolder(slot_dir)
    admin = SessionAdmin(_FileState(doc, folder))  # type: ignore[arg-type]
    return admin.current(), admin.saved() if folder is not None else None, note


def live_slots(url: str) -> tuple[dict[int, Any] | None, str | None]:
    """The upstream's own view of its slots (id -> SlotView), or None and why."""
    base, model = split_key(url)
    kinds = Kinds(SLOTS_TIMEOUT_S, api_key=os.environ.get(UPSTREAM_KEY_ENV, ""))
    if model:  # a router's or llama-swap's model: read without loading it (issue #22)
        kinds.of(base)
    try:
        views = kinds.client(url, SLOTS_TIMEOUT_S, api_key=kinds.api_key).slots()
    except SlotsUnavailable as e:
        return None, _short(e)
    return {v.id: v for v in views}, None


def merge(current: dict, check_upstreams: bool) -> list[dict[str, Any]]:
    """One entry per upstream with every slot: the claimed ones from the state, the free ones
    from the server's /slots."""
    out = []
    for url, up in sorted(current.get("upstreams", {}).items()):
        claimed = {int(k): v for k, v in (up.get("slots") or {}).items()}
        live, error = live_slots(url) if check_upstreams else (None, "not checked")
        ids = sorted(set(claimed) | set(live or {}))
        slots = []
        for slot_id in ids:
            rec = claimed.get(slot_id) or {}
            view = (live or {}).get(slot_id)
            slots.append({
                "slot": slot_id,
                "session": rec.get("session"),
                "resident": rec.get("resident") if rec else None,
                "busy": view.is_processing if view is not None else None,
                "tokens": rec.get("tokens") if rec else None,
                "live_tokens": view.n_tokens if view is not None else None,
                "saved_tokens": rec.get("saved_tokens") if rec else None,
                "last_used": rec.get("last_used") if rec else None,
                "file": rec.get("file") if rec else None,
            })
        out.append({"url": split_key(url)[0], "model": split_key(url)[1] or None,
                    "reachable": live is not None if check_upstreams else None,
                    "error": error if check_upstreams else None,
                    "slot_count": len(live) if live is not None else None,
                    "owned": len(claimed), "slots": slots, "costs": up.get("costs"),
                    "draining": bool(up.get("draining")), "pool": bool(up.get("pool"))})
    return out


def gather(proxy: str, state_file: Path, slot_dir: Path | None,
           check_upstreams: bool = True) -> Report:
    try:
        current, sessions, note = from_proxy(proxy)
        report = Report("proxy", proxy, slot_dir=current.get("slot_dir"),
                        store=current.get("store"))
    except StatusError as proxy_error:
        try:
            current, sessions, note = from_files(state_file, slot_dir)
        except StatusError as e:
            raise StatusError(f"{proxy_error}; {e}") from None
        report = Report("files", proxy, proxy_error=str(proxy_error),
                        state_file=str(state_file),
                        slot_dir=str(slot_dir) if slot_dir is not None else None)
    report.upstreams = merge(current, check_upstreams)
    report.sessions, report.sessions_note = sessions, note
    return report


# ---- printing ------------------------------------------------------------------------------

def age(then: float | None, now: float) -> str:
    if not then:
        return "-"
    seconds = max(now - then, 0.0)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"


def size(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def num(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def table(rows: list[list[str]], right: set[int] = frozenset()) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(cell.rjust(w) if i in right else cell.ljust(w)
                             for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
            for row in rows]


def kv_state(slot: dict) -> str:
    if slot["session"] is None:
        return "free"
    return "resident" if slot["resident"] else "stale"


def busy(slot: dict) -> str:
    return "?" if slot["busy"] is None else ("busy" if slot["busy"] else "idle")


def render(report: Report) -> str:
    now = report.now
    if report.source == "proxy":
        head = f"slotkeeper status, from the proxy at {report.proxy}"
    else:
        head = f"slotkeeper status, read from {report.state_file}: {report.proxy_error}"
    lines = [head]
    if report.store:
        lines.append(f"Store: {describe_store(report.store)}")
    if not report.upstreams:
        lines += ["", "No upstream has been used yet."]
    for up in report.upstreams:
        reach = ("reachable" if up["reachable"] else f"not reachable: {up['error']}"
                 ) if up["reachable"] is not None else "not checked"
        count = f"{up['slot_count']} slots, " if up["slot_count"] is not None else ""
        pool = " (pool member, draining)" if up.get("draining") else (
            " (pool member)" if up.get("pool") else "")
        model = f", model {up['model']}" if up.get("model") else ""
        lines += ["", f"Upstream {up['url']}{model}{pool}: {count}{up['owned']} owned, {reach}"]
        rows = [["SLOT", "SESSION", "KV", "NOW", "TOKENS", "SAVED", "LAST USE"]]
        for s in up["slots"]:
            rows.append([str(s["slot"]), s["session"] or "-", kv_state(s), busy(s),
                         num(s["tokens"] if s["tokens"] is not None else s["live_tokens"]),
                         num(s["saved_tokens"] or None), age(s["last_used"], now)])
        lines += table(rows, right={4, 5}) if len(rows) > 1 else ["  (no slots known)"]
        if up.get("costs"):
            lines.append(measured_costs(up["costs"]))
    lines.append("")
    if report.sessions is None:
        lines.append(f"Saved sessions: not listed ({report.sessions_note})")
    else:
        total = sum(s.get("bytes") or 0 for s in report.sessions)
        where = f" in {report.slot_dir}" if report.slot_dir else ""
        lines.append(f"Saved sessions: {len(report.sessions)}, {size(total)}{where}")
        rows = [["SESSION", "KIND", "TOKENS", "SIZE", "LAST USED", "CREATED", "RESIDENT"]]
        for s in report.sessions:
            res = s.get("resident")
            rows.append([s["id"], s["kind"], num(s["tokens"]), size(s["bytes"]),
                         age(s["last_used"], now), age(s["created"], now),
                         _resident_at(res)])
        if len(rows) > 1:
            lines += table(rows, right={2, 3})
    return "\n".join(lines) + "\n"


# (label, key of the upstream's "costs", unit): token rates as counts, byte ones as sizes.
MEASURED = (("prefill", "prefill_tokens_per_s", " tokens/s"),
            ("decode", "decode_tokens_per_s", " tokens/s"),
            ("save", "save_bytes_per_s", "/s"), ("restore", "restore_bytes_per_s", "/s"),
            ("KV", "kv_bytes_per_token", "/token"), ("plus", "slot_fixed_bytes", " a file"))


def measured_costs(costs: dict) -> str:
    """One line of what the server costs, as slotkeeper measured it (issue #31)."""
    said = []
    for label, key, unit in MEASURED:
        value = costs.get(key)
        if isinstance(value, (int, float)) and value > 0:  # a fixed part of 0: one size known
            amount = num(round(value)) if unit == " tokens/s" else size(round(value))
            said.append(f"{label} {amount}{unit}")
    return "  Measured: " + (", ".join(said) if said else "nothing yet")


def _resident_at(res: dict | None) -> str:
    if not res:
        return "-"
    base, model = split_key(str(res.get("upstream", "")))
    return f"slot {res['slot']} of {base}" + (f" ({model})" if model else "")


# ---- the command ---------------------------------------------------------------------------

def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="slotkeeper status", allow_abbrev=False,
        description="Show upstreams, slots and saved sessions: from the proxy's session API, "
                    "or from the state file and slot folder when no proxy answers.")
    parser.add_argument("--proxy", default=DEFAULT_PROXY,
                        help=f"the proxy's URL (default {DEFAULT_PROXY})")
    parser.add_argument("--state-file", type=Path, default=None,
                        help=f"state file when the proxy is down (default "
                             f"{default_state_file()})")
    parser.add_argument("--slot-dir", type=Path, default=None,
                        help="llama-server's --slot-save-path, for saved sessions when the "
                             "proxy is down (default: the launcher's folder, if it exists)")
    parser.add_argument("--json", action="store_true", help="print JSON, for scripts")
    parser.add_argument("--no-upstream", action="store_true",
                        help="do not ask the upstreams' GET /slots which slots are busy")
    args = parser.parse_args(list(argv))
    state_file = (args.state_file or default_state_file()).expanduser()
    slot_dir = args.slot_dir.expanduser() if args.slot_dir else default_slot_dir()
    try:
        report = gather(args.proxy, state_file, slot_dir, check_upstreams=not args.no_upstream)
    except StatusError as e:
        print(f"slotkeeper status: {e}", file=sys.stderr)
        return 1
    if args.json:
        json.dump(report.to_json(), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render(report))
    return 0


def _json(r: requests.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return None


def _short(e: BaseException) -> str:
    """An exception as one short line (requests' messages nest the whole cause chain)."""
    text = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, requests.ConnectionError) and "Connection refused" in text:
        return "connection refused"
    if isinstance(e, requests.Timeout):
        return "timed out"
    return text if len(text) <= 200 else text[:197] + "..."
