"""slotkeeper's mitmproxy options: declared (`declare`, from the addon's `load`), every value
checked before anything is built, then what they configure built in one go (`build`, from
`configure`): a bad value raises OptionsError before any file is touched (fault 6)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mitmproxy import exceptions

from .decisions import placement
from .identity.identity import IdentityConfig
from .routing.routes import RouterConfig
from .snapshots.slotfiles import SlotFolder
from .store import backends
from .store.budgets import Ledger
from .upstream.client import UPSTREAM_KEY_ENV, UPSTREAM_KEY_OPTION

log = logging.getLogger("slotkeeper")

# Disk budget by default (fault 7): every idle save rewrites a session's whole snapshot, GBs
# each on a large model, so "no limit" let a long-running proxy fill the disk. 20 GiB holds
# ~1,400 2k-token snapshots of the test model (14 MB each) or about ten 32k-token snapshots of
# a 7-8B model (~2 GB each); 0 still means no limit.
DEFAULT_DISK_MAX_MB = 20 * 1024


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                              "state")
    return Path(base) / "slotkeeper"


def declare(loader) -> None:
    _declare_routing(loader)
    _declare_storage(loader)
    _declare_save_timing(loader)


def _declare_routing(loader) -> None:
    loader.add_option("slotkeeper_ttl", int, 120,
                      "Seconds after its last use that a session's slot may be given to "
                      "another session before colder ones.")
    loader.add_option("slotkeeper_state_file", str, "",
                      "The JSON state file shared by every slotkeeper process on this "
                      "machine (default: $XDG_STATE_HOME/slotkeeper/state.json).")
    loader.add_option("slotkeeper_slots_timeout_ms", int, 1000,
                      "How long to wait for GET /slots and /props before falling back to "
                      "hashing sessions over the slot count.")
    loader.add_option("slotkeeper_session_headers", Sequence[str], [],
                      "Extra request header names that carry a session id, checked after "
                      "the built-in ones.")
    loader.add_option("slotkeeper_small_request_chars", int, 2000,
                      "Requests whose prompt has fewer characters are side requests "
                      "(titles, tags): placed without claiming a slot.")
    loader.add_option("slotkeeper_children_share_parent", bool, False,
                      "Subagent requests use their parent's session (and slot) instead of "
                      "a session of their own.")
    loader.add_option("slotkeeper_slot_count", int, 0,
                      "Slot count to hash sessions over when /props does not say.")
    loader.add_option("slotkeeper_slot_dir", str, "",
                      "llama-server's --slot-save-path, shared with the proxy: enables "
                      "saving and restoring sessions.")


def _declare_save_timing(loader) -> None:
    """When the saves that need not happen now run (issue #31)."""
    loader.add_option("slotkeeper_idle_save_seconds", int, 5,
                      "Save a session that grew once it has been idle this long (0: never), "
                      "so a crash of llama-server loses at most the turn in flight.")
    loader.add_option("slotkeeper_stall_budget_ms", int, 500,
                      "A save that need not happen now (an idle or a periodic one) runs while "
                      "another slot generates only if its predicted stall of the server, its "
                      "bytes at the measured save speed, is at most this long; else it waits "
                      "until no other slot generates. Handover and shutdown saves always run.")
    loader.add_option("slotkeeper_upstream_cache_ram_mb", int, 8192,
                      "llama-server's --cache-ram (its RAM prompt cache, 8192 MiB by default) as "
                      "slotkeeper counts on it: a session handed over to a dissimilar one is "
                      "left for the server to park there and bring back, instead of a disk "
                      "save and restore (needs a --slot-prompt-similarity above 0, "
                      "slotkeeper_upstream_slot_similarity; answers that show a miss send the "
                      "next ones to the disk). 0: do not "
                      "count on it (set 0 for servers run with --cache-ram 0); -1: no limit.")
    loader.add_option("slotkeeper_upstream_slot_similarity", str, "0.1",
                      "llama-server's --slot-prompt-similarity (0.1 by default; /props does "
                      "not report it) as slotkeeper counts on it: a request pinned to a slot "
                      "goes through the server's RAM cache when its similarity to the slot is "
                      "at or below it. 0: the server never does (-sps 0).")
    loader.add_option("slotkeeper_write_budget_mb_per_hour", int, 8192,
                      "MiB that idle and periodic saves may write into the slot folder within "
                      "an hour (0: no limit); past it they are skipped until the hour's "
                      "writes age out. Handover and shutdown saves always run and count.")


def _declare_storage(loader) -> None:
    loader.add_option("slotkeeper_min_save_tokens", int, 256,
                      "Sessions with fewer tokens are not saved (re-prefilling them is "
                      "cheap).")
    loader.add_option("slotkeeper_keep_prefix", bool, True,
                      "On a handover with nothing to restore, keep the slot's old content "
                      "instead of erasing it, so llama-server reuses what the new prompt "
                      "shares with it (as it would alone); false erases it.")
    loader.add_option("slotkeeper_save_every_tokens", int, 2048,
                      "Save a session that keeps its slot each time it grew by this many "
                      "tokens since its last save.")
    loader.add_option("slotkeeper_seed_min_chars", int, 2000,
                      "System prompts (plus tools) at least this long get a seed: their KV "
                      "saved once and restored into new sessions' slots.")
    loader.add_option("slotkeeper_max_seeds", int, 8, "How many seeds to keep (0: none).")
    loader.add_option("slotkeeper_disk_max_mb", int, DEFAULT_DISK_MAX_MB,
                      "Most MiB the saved sessions may take in the slot folder; least "
                      "recently used ones are removed first (0: no limit).")
    loader.add_option("slotkeeper_disk_max_age_hours", int, 0,
                      "Saved sessions unused for longer are removed (0: no limit).")
    loader.add_option("slotkeeper_max_body_mb", int, 32,
                      "Largest request body (after decoding) slotkeeper reads, in MiB.")
    loader.add_option("slotkeeper_lock_timeout", int, 600,
                      "Most seconds a request waits for a busy slot (a handover, a "
                      "client-pinned or fallback request) before it is placed another way.")
    loader.add_option("slotkeeper_upstreams", Sequence[str], [],
                      "Several llama-servers behind this address (repeat the option, one "
                      "base URL each, e.g. http://127.0.0.1:8081): each session is placed "
                      "on one of them and its KV moved when it has to leave. Empty: the "
                      "reverse mode's one upstream.")
    loader.add_option("slotkeeper_placement", str, placement.COST,
                      "How a request's server is chosen among slotkeeper_upstreams: cost "
                      "(the session's KV against each server's load), or the baselines "
                      "round-robin and least-busy.", choices=list(placement.POLICIES))
    loader.add_option("slotkeeper_api_token", str, "",
                      "Bearer token for the management endpoints (/api/..., /slotkeeper/metrics). "
                      "Unset: they answer loopback clients only. Set: they answer every "
                      "client, and every call needs 'Authorization: Bearer <token>'.")
    loader.add_option("slotkeeper_etcd", str, "",
                      "etcd endpoints (comma-separated host:port or http(s)://host:port) "
                      "that hold the sessions, slot claims and locks shared by proxies on "
                      "several hosts. Empty: the state file (one machine).")
    loader.add_option("slotkeeper_etcd_prefix", str, backends.DEFAULT_PREFIX,
                      "Key prefix in etcd: deployments that share a cluster each use their "
                      "own.")
    loader.add_option("slotkeeper_etcd_lease_ttl", int, backends.DEFAULT_LEASE_TTL,
                      "Seconds a killed proxy's slot locks outlive it in etcd (its lease's "
                      "TTL; kept alive every third of it while the proxy runs).")
    loader.add_option(UPSTREAM_KEY_OPTION, str, "",
                      "llama-server's --api-key, sent on slotkeeper's own calls (/slots, "
                      "/props, save/restore); clients' requests keep their own "
                      "Authorization. Empty: $SLOTKEEPER_UPSTREAM_API_KEY, if set.")


@dataclass
class Settings:
    """What the options configure, built."""
    router_config: RouterConfig
    state: backends.State
    locks: backends.Locks
    ledger: Ledger  # the disk and write budgets' accounting (the store's)
    folder: SlotFolder | None
    slot_dir_problem: str  # why sessions cannot be saved, shown by the session API
    identity_config: IdentityConfig
    max_body_bytes: int
    api_token: str
    idle_save_seconds: int
    store: backends.Store | None = None


def check(opts) -> tuple[str, ...]:
    """Every value checked (OptionsError on the first bad one); returns the pool's URLs."""
    for name in ("slotkeeper_ttl", "slotkeeper_small_request_chars", "slotkeeper_slot_count",
                 "slotkeeper_min_save_tokens", "slotkeeper_idle_save_seconds",
                 "slotkeeper_seed_min_chars", "slotkeeper_max_seeds",
                 "slotkeeper_disk_max_mb", "slotkeeper_disk_max_age_hours",
                 "slotkeeper_lock_timeout", "slotkeeper_stall_budget_ms",
                 "slotkeeper_write_budget_mb_per_hour"):
        if getattr(opts, name) < 0:
            raise exceptions.OptionsError(f"{name} must be 0 or more")
    slot_similarity_of(opts)
    if opts.slotkeeper_upstream_cache_ram_mb < -1:
        raise exceptions.OptionsError("slotkeeper_upstream_cache_ram_mb must be -1 (no limit), "
                                      "0 (not counted on) or more")
    for name in ("slotkeeper_slots_timeout_ms", "slotkeeper_save_every_tokens",
                 "slotkeeper_max_body_mb"):
        # slots_timeout_ms=0 made every /slots read time out at once: every request fell
        # back and the upstream watcher died.
        if getattr(opts, name) < 1:
            raise exceptions.OptionsError(f"{name} must be at least 1")
    if opts.slotkeeper_api_token and not all(
            "!" <= c <= "~" for c in opts.slotkeeper_api_token):
        raise exceptions.OptionsError("slotkeeper_api_token must be printable ASCII "
                                      "without spaces (it is sent in a header)")
    if not all("!" <= c <= "~" for c in upstream_key_of(opts)):
        raise exceptions.OptionsError(f"{UPSTREAM_KEY_OPTION} must be printable ASCII "
                                      f"without spaces (it is sent in a header)")
    for header in opts.slotkeeper_session_headers:
        if not header or not all(c.isalnum() or c in "-_" for c in header):
            raise exceptions.OptionsError(
                f"slotkeeper_session_headers: {header!r} is not a header name")
    if opts.slotkeeper_placement not in placement.POLICIES:
        raise exceptions.OptionsError(f"slotkeeper_placement must be one of "
                                      f"{', '.join(placement.POLICIES)}")
    check_etcd(opts)
    try:
        return tuple(placement.parse_upstreams(opts.slotkeeper_upstreams))
    except ValueError as e:
        raise exceptions.OptionsError(f"slotkeeper_upstreams: {e}") from None


def check_etcd(opts) -> None:
    if not opts.slotkeeper_etcd.strip():
        return
    for name, check_one in (("slotkeeper_etcd", backends.parse_endpoints),
                            ("slotkeeper_etcd_prefix", backends.check_prefix)):
        try:
            check_one(getattr(opts, name))
        except ValueError as e:
            raise exceptions.OptionsError(f"{name}: {e}") from None
    if opts.slotkeeper_etcd_lease_ttl < 2:
        # etcd's shortest lease is about 2 s (1.5 election timeouts on its defaults)
        raise exceptions.OptionsError("slotkeeper_etcd_lease_ttl must be at least 2")


def upstream_key_of(opts) -> str:
    """The upstream key: the option, else the environment (so it need not be on the command
    line, where the process list shows it)."""
    return getattr(opts, UPSTREAM_KEY_OPTION) or os.environ.get(UPSTREAM_KEY_ENV, "")


def state_path_of(opts) -> Path:
    return (Path(opts.slotkeeper_state_file).expanduser() if opts.slotkeeper_state_file
            else default_state_dir() / "state.json")


def build(opts, previous: backends.Store | None = None) -> Settings:
    """Check every option, then make the state file, lock folder and slot folder.
    `previous`: the store in use, reused when the store's options did not change."""
    upstreams = check(opts)
    state_path = state_path_of(opts)
    slot_dir = Path(opts.slotkeeper_slot_dir).expanduser() if opts.slotkeeper_slot_dir else None
    slot_dir_usable = slot_dir is not None and slot_dir.is_dir() and os.access(
        slot_dir, os.R_OK | os.W_OK | os.X_OK)
    # Everything is checked: from here on, files are made.
    try:
        store = backends.open_store(state_path, opts.slotkeeper_etcd,
                                    opts.slotkeeper_etcd_prefix, opts.slotkeeper_etcd_lease_ttl,
                                    previous)
        state, locks, ledger = store.state, store.locks, store.ledger
    except ValueError as e:  # the etcd client is not installed (the `etcd` extra)
        raise exceptions.OptionsError(f"slotkeeper_etcd: {e}") from None
    except OSError as e:
        raise exceptions.OptionsError(f"slotkeeper_state_file {state_path}: {e}") from None
    folder, problem = None, ""
    if slot_dir is None:
        problem = ("slotkeeper_slot_dir is not set: set it to llama-server's "
                   "--slot-save-path to save and restore sessions")
    elif not slot_dir_usable:
        # Pinning still works without it: say so loudly, and in the session API.
        problem = (f"slotkeeper_slot_dir {slot_dir} is not a folder this process can read and "
                   f"write (it must be llama-server's --slot-save-path): sessions are pinned "
                   f"but not saved")
        log.warning(problem)
    else:
        folder = SlotFolder(slot_dir, max_bytes=opts.slotkeeper_disk_max_mb * 1024 * 1024,
                            max_age_seconds=opts.slotkeeper_disk_max_age_hours * 3600)
        swept = folder.sweep_orphans()
        if swept:
            log.info("removed %d orphaned files from %s", swept, slot_dir)
    return Settings(
        router_config=router_config(opts, upstreams), state=state, locks=locks, ledger=ledger,
        folder=folder,
        slot_dir_problem=problem,
        identity_config=IdentityConfig(extra_headers=tuple(opts.slotkeeper_session_headers),
                                       children_share_parent=opts.slotkeeper_children_share_parent),
        max_body_bytes=opts.slotkeeper_max_body_mb * 1024 * 1024,
        api_token=opts.slotkeeper_api_token, idle_save_seconds=opts.slotkeeper_idle_save_seconds,
        store=store)


def slot_similarity_of(opts) -> float:
    """The servers' --slot-prompt-similarity, as llama-server reads it: a number from 0 to 1."""
    text = opts.slotkeeper_upstream_slot_similarity
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:  # NaN fails both
        raise exceptions.OptionsError(
            f"slotkeeper_upstream_slot_similarity must be a number from 0 to 1, like the "
            f"server's --slot-prompt-similarity (0.1 by default), not {text!r}")
    return value


def router_config(opts, upstreams: tuple[str, ...]) -> RouterConfig:
    return RouterConfig(
        ttl=float(opts.slotkeeper_ttl),
        slots_timeout=opts.slotkeeper_slots_timeout_ms / 1000,
        small_request_chars=opts.slotkeeper_small_request_chars,
        slot_count=opts.slotkeeper_slot_count,
        lock_timeout=float(opts.slotkeeper_lock_timeout),
        min_save_tokens=opts.slotkeeper_min_save_tokens,
        erase_on_handover=not opts.slotkeeper_keep_prefix,
        save_every_tokens=opts.slotkeeper_save_every_tokens,
        stall_budget=opts.slotkeeper_stall_budget_ms / 1000,
        ram_cache_bytes=opts.slotkeeper_upstream_cache_ram_mb * 2**20,
        slot_similarity=slot_similarity_of(opts),
        write_budget=opts.slotkeeper_write_budget_mb_per_hour * 2**20,
        seed_min_chars=opts.slotkeeper_seed_min_chars,
        max_seeds=opts.slotkeeper_max_seeds,
        idle_work=opts.slotkeeper_idle_save_seconds > 0,
        upstreams=upstreams,
        placement=opts.slotkeeper_placement,
        api_key=upstream_key_of(opts),
    )
