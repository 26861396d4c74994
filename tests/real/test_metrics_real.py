"""GET /slotkeeper/metrics of a real mitmdump in front of a real llama-server: the counters match
what the run did, as the client saw it. GET /metrics is llama-server's own, passed through."""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from testbed import REPO, long_system_prompt

from slotkeeper.observe import metrics
from slotkeeper.snapshots.slotfiles import SlotFolder
from slotkeeper.upstream import costs

TIMEOUT_S = 600


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of GET /slotkeeper/metrics, keyed by (sample name, sorted labels)."""
    r = requests.get(url + "/slotkeeper/metrics", timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples: dict, name: str, **labels: str) -> float:
    """Sum over every label set that includes `labels`."""
    return sum(v for (n, ls), v in samples.items()
               if n == name and set(labels.items()) <= set(ls))


class Chat:
    """One session; keeps every response's full timings (the client's view of the run)."""

    def __init__(self, session: str, system: str) -> None:
        self.session = session
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}]

    def ask(self, url: str, question: str) -> dict[str, Any]:
        self.messages.append({"role": "user", "content": question})
        r = requests.post(url + "/v1/chat/completions", timeout=TIMEOUT_S,
                          headers={"X-Session-Id": self.session},
                          json={"messages": self.messages, "temperature": 0, "max_tokens": 8})
        assert r.status_code == 200, r.text[:500]
        data = r.json()
        self.messages.append({"role": "assistant",
                              "content": data["choices"][0]["message"]["content"]})
        return {"action": r.headers["X-Slotkeeper-Action"], **data["timings"]}


def expected_seconds_saved(responses: list[dict[str, Any]]) -> float:
    """The documented estimate, recomputed from the responses: an EMA (alpha EMA_ALPHA) of
    prompt_ms / prompt_n over responses that prefilled at least EMA_MIN_TOKENS; each response's
    reused tokens times the average after it; tokens reused before the first measurement are
    credited at the first measured speed."""
    speed, pending, saved = None, 0, 0.0
    for t in responses:
        if t["prompt_n"] >= metrics.EMA_MIN_TOKENS and t["prompt_ms"] > 0:
            sample = t["prompt_ms"] / 1000 / t["prompt_n"]
            speed = sample if speed is None else speed + metrics.EMA_ALPHA * (sample - speed)
        if speed is None:
            pending += t["cache_n"]
            continue
        saved += (t["cache_n"] + pending) * speed
        pending = 0
    return saved


def handover_proxy(make_llama, make_proxy, tmp_path: Path, **options: Any):
    """One slot, so a second session evicts the first: every disk handover path runs. These
    tests count the disk's saves and restores, so slotkeeper is told the server keeps no RAM
    cache (else it leaves the two dissimilar sessions to that cache: tests/real/
    test_ram_cache_real.py)."""
    slots = tmp_path / "slots"
    server = make_llama(np=1, ctx=4096, slot_save_path=slots)
    options = {"slotkeeper_small_request_chars": 0, "slotkeeper_slot_dir": str(slots),
               "slotkeeper_max_seeds": 0, "slotkeeper_idle_save_seconds": 0,
               "slotkeeper_upstream_cache_ram_mb": 0, **options}
    return server, make_proxy(server, **options), slots


def test_counters_match_a_real_handover_run(make_llama, make_proxy, tmp_path):
    # keep_prefix off: the two `assigned` handovers erase the slot, so the erase counters run.
    server, proxy, slots = handover_proxy(make_llama, make_proxy, tmp_path,
                                          slotkeeper_keep_prefix=False)
    a = Chat("a", long_system_prompt(300, seed=1))
    b = Chat("b", long_system_prompt(300, seed=2))
    responses = [a.ask(proxy.url, "hi"), b.ask(proxy.url, "hi"), a.ask(proxy.url, "more"),
                 a.ask(proxy.url, "again")]
    assert [t["action"] for t in responses] == ["assigned", "assigned", "restored", "kept"]
    # A body the addon cannot read passes through; a bad id_slot is refused by the addon.
    r = requests.post(proxy.url + "/v1/chat/completions", data=b"not json", timeout=60,
                      headers={"Content-Type": "application/json"})
    assert "X-Slotkeeper-Action" not in r.headers
    r = requests.post(proxy.url + "/v1/chat/completions", json={"id_slot": "x"}, timeout=60)
    assert r.status_code == 400

    started = time.monotonic()
    m = scrape(proxy.url)
    scrape_ms = (time.monotonic() - started) * 1000
    endpoint = "/v1/chat/completions"
    assert value(m, "slotkeeper_requests_total", endpoint=endpoint, action="assigned") == 2
    assert value(m, "slotkeeper_requests_total", endpoint=endpoint, action="restored") == 1
    assert value(m, "slotkeeper_requests_total", endpoint=endpoint, action="kept") == 1
    assert value(m, "slotkeeper_requests_total", endpoint=endpoint,
                 action="passed_through") == 1
    assert value(m, "slotkeeper_requests_total", endpoint=endpoint, action="rejected") == 1
    assert total(m, "slotkeeper_requests_total") == 6
    assert total(m, "slotkeeper_routing_seconds_count") == 4

    assert value(m, "slotkeeper_prompt_tokens_total", kind="reused") == sum(
        t["cache_n"] for t in responses)
    assert value(m, "slotkeeper_prompt_tokens_total", kind="prefilled") == sum(
        t["prompt_n"] for t in responses)
    assert value(m, "slotkeeper_prompt_tokens_total", kind="reused") > 0
    saved = value(m, "slotkeeper_prefill_seconds_saved_total")
    assert saved == pytest.approx(expected_seconds_saved(responses), rel=1e-9)
    assert saved > 0

    # a was saved when b took the slot, b when a came back: two saves, each file written
    # once, so the bytes counted are the files on disk. One restore, of a's snapshot.
    bins = sorted(slots.glob("*.bin"))
    assert len(bins) == 2
    assert value(m, "slotkeeper_slot_operations_total", operation="save", outcome="ok") == 2
    assert value(m, "slotkeeper_slot_operation_bytes_total", operation="save") == sum(
        p.stat().st_size for p in bins)
    assert value(m, "slotkeeper_slot_operation_seconds_count", operation="save") == 2
    folder = SlotFolder(slots)
    meta_a, meta_b = folder.read_meta("a"), folder.read_meta("b")
    assert value(m, "slotkeeper_slot_operation_tokens_total", operation="save") == \
        meta_a.n_tokens + meta_b.n_tokens
    assert value(m, "slotkeeper_slot_operations_total", operation="restore", outcome="ok") == 1
    assert value(m, "slotkeeper_slot_operation_tokens_total", operation="restore") == \
        meta_a.n_tokens
    assert value(m, "slotkeeper_slot_operation_bytes_total", operation="restore") == \
        meta_a.size_bytes
    assert value(m, "slotkeeper_slot_operations_total", operation="erase", outcome="ok") == 2
    assert total(m, "slotkeeper_slot_operations_total", outcome="failed") == 0
    assert value(m, "slotkeeper_evictions_total", by="session", saved="true") == 2
    assert total(m, "slotkeeper_restore_misses_total") == 0
    assert total(m, "slotkeeper_fallbacks_total") == 0

    assert value(m, "slotkeeper_slots_owned", upstream=server.url) == 1
    assert value(m, "slotkeeper_slots_resident", upstream=server.url) == 1
    assert value(m, "slotkeeper_slots_total", upstream=server.url) == 1
    assert value(m, "slotkeeper_prefill_seconds_per_token", upstream=server.url) > 0
    files = [p for p in slots.iterdir() if p.is_file()]
    assert value(m, "slotkeeper_disk_files") == len(files) == 4  # two states, two metas
    assert value(m, "slotkeeper_disk_bytes") == sum(p.stat().st_size for p in files)
    print(f"scrape of /slotkeeper/metrics took {scrape_ms:.1f} ms")


def test_restore_that_is_not_reused_counts_a_miss(make_llama, make_proxy, tmp_path):
    """A client that rewrote its conversation's start under the same session id: its
    snapshot is restored, but it is not a prefix of the new prompt, so the server reuses
    next to nothing."""
    _server, proxy, _slots = handover_proxy(make_llama, make_proxy, tmp_path)
    a = Chat("a", long_system_prompt(300, seed=1))
    a.ask(proxy.url, "hi")
    Chat("b", long_system_prompt(300, seed=2)).ask(proxy.url, "hi")
    a.messages[0]["content"] = long_system_prompt(300, seed=3)
    turn = a.ask(proxy.url, "more")
    assert turn["action"] == "restored"
    m = scrape(proxy.url)
    assert value(m, "slotkeeper_restore_misses_total", kind="session") == 1
    assert value(m, "slotkeeper_slot_operations_total", operation="restore", outcome="ok") == 1


def test_fallbacks_are_counted(make_llama, make_proxy):
    server = make_llama(extra=["--no-slots"])
    proxy = make_proxy(server, slotkeeper_small_request_chars=0)
    for name in ("fa", "fb"):
        assert Chat(name, "Be brief.").ask(proxy.url, "hello")["action"] == "fallback"
    m = scrape(proxy.url)
    assert value(m, "slotkeeper_fallbacks_total", reason="slots_unavailable") == 2
    assert value(m, "slotkeeper_requests_total", endpoint="/v1/chat/completions",
                 action="fallback") == 2
    assert value(m, "slotkeeper_slots_owned", upstream=server.url) == 0


def test_seed_builds_are_counted(make_llama, make_proxy, tmp_path):
    slots = tmp_path / "slots"
    server = make_llama(slot_save_path=slots, extra=["--cache-ram", "0"])  # the disk's way
    proxy = make_proxy(server, slotkeeper_slot_dir=str(slots), slotkeeper_idle_save_seconds=0,
                       slotkeeper_upstream_cache_ram_mb=0)
    system = long_system_prompt(600, seed=4)
    first = Chat("s1", system)
    first.ask(proxy.url, "hi")
    first.ask(proxy.url, "and again")  # a conversation: it comes back
    # The second conversation with the system prompt starts from s1's prefix (s1 saved from
    # its slot, restored into s2's); its seed is taken after its answer (issue #23), from its
    # slot, after saving the session itself.
    assert Chat("s2", system).ask(proxy.url, "hello")["action"] == "restored"
    turn = Chat("s3", system).ask(proxy.url, "hey")
    assert turn["action"] == "seeded"
    m = scrape(proxy.url)
    assert value(m, "slotkeeper_slot_operations_total", operation="seed_build",
                 outcome="ok") == 1
    assert value(m, "slotkeeper_slot_operation_seconds_count", operation="seed_build") == 1
    # The seed is saved like any snapshot (after s1's save and s2's own), holding what the
    # third session then reused; the server prefilled nothing for it: cutting s2's slot down
    # to the system prefix evaluates one token.
    assert value(m, "slotkeeper_slot_operations_total", operation="save", outcome="ok") == 3
    assert value(m, "slotkeeper_slot_operation_tokens_total", operation="save") >= \
        turn["cache_n"] > 0
    assert 1 <= value(m, "slotkeeper_slot_operation_tokens_total", operation="seed_build") <= 2


def test_counters_survive_a_change_of_the_entry_script(llama, make_proxy, tmp_path):
    """mitmproxy reloads the entry script when it changes: the old addons are removed (their
    `done` must work from mitmproxy's sync reload path) and fresh ones load. The counters live
    in slotkeeper.observe.metrics, which a reload does not re-import, so they carry on and the new
    addons keep routing and counting."""
    script = tmp_path / "slotkeeper_addon.py"
    shutil.copy(REPO / "addon" / "slotkeeper_addon.py", script)
    proxy = make_proxy(llama, script=script, slotkeeper_small_request_chars=0)
    chat = Chat("reload-1", "Be brief.")
    chat.ask(proxy.url, "hi")
    before = scrape(proxy.url)
    assert total(before, "slotkeeper_requests_total") == 1

    future = time.time() + 10
    os.utime(script, (future, future))
    deadline = time.monotonic() + 30
    while proxy.log_text().count("Loading script") < 2:
        assert time.monotonic() < deadline, f"no reload:\n{proxy.log_text()[-2000:]}"
        time.sleep(0.2)
    time.sleep(0.5)
    after = scrape(proxy.url)
    # Counters and histograms; slotkeeper_slots_total is a gauge the new addon fills in once
    # it has seen the upstream.
    counted = [k for k in before if k[0].startswith("slotkeeper_")
               and k[0].endswith(("_total", "_count", "_sum", "_bucket"))
               and k[0] != "slotkeeper_slots_total"]
    assert len(counted) > 20
    assert {k: after.get(k) for k in counted} == {k: before[k] for k in counted}
    chat.ask(proxy.url, "again")
    m = scrape(proxy.url)
    assert total(m, "slotkeeper_requests_total") == 2
    assert value(m, "slotkeeper_prompt_tokens_total", kind="prefilled") > value(
        before, "slotkeeper_prompt_tokens_total", kind="prefilled")
    log = proxy.log_text()
    assert "Traceback" not in log and "cannot be called from sync context" not in log
    assert log.count("Loading script") == 2


def test_metrics_answer_while_the_server_is_down(make_proxy, tmp_path):
    """Served by the proxy itself: no upstream needed, and only GET."""
    dead = "http://127.0.0.1:9"  # discard port: nothing listens
    proxy = make_proxy(dead, slotkeeper_slot_dir=str(tmp_path))
    m = scrape(proxy.url)
    assert value(m, "slotkeeper_disk_files") == 0
    assert value(m, "slotkeeper_slot_operations_total", operation="save", outcome="ok") == 0
    assert any(name == "process_resident_memory_bytes" for name, _ in m)
    r = requests.post(proxy.url + "/slotkeeper/metrics", json={}, timeout=10)  # past the guard
    assert r.status_code == 405


# Hop-by-hop and per-answer headers: mitmproxy's reverse mode may set these itself (issue #32
# asks for the server's answer unchanged: its status, its own headers and its body).
PER_HOP = frozenset({"date", "connection", "keep-alive", "transfer-encoding"})


@pytest.mark.parametrize("server_metrics", [True, False], ids=["--metrics", "no --metrics"])
def test_llama_servers_own_metrics_pass_through_unchanged(make_llama, make_proxy,
                                                          server_metrics):
    """GET /metrics through slotkeeper is llama-server's answer: its `llamacpp:*` series with
    `--metrics`, its 501 without; slotkeeper's own are at /slotkeeper/metrics (issue #32)."""
    server = make_llama(np=1, ctx=2048, extra=["--metrics"] if server_metrics else [])
    proxy = make_proxy(server.url)
    direct = requests.get(server.url + "/metrics", timeout=30)
    through = requests.get(proxy.url + "/metrics", timeout=30)
    assert direct.status_code == (200 if server_metrics else 501)
    assert through.status_code == direct.status_code
    assert through.content == direct.content
    own = {k.lower(): v for k, v in direct.headers.items() if k.lower() not in PER_HOP}
    seen = {k.lower(): v for k, v in through.headers.items() if k.lower() not in PER_HOP}
    assert seen == own
    assert ("llamacpp:prompt_tokens_total" in through.text) == server_metrics
    assert "slotkeeper_" not in through.text
    ours = requests.get(proxy.url + "/slotkeeper/metrics", timeout=30)
    assert ours.status_code == 200 and "slotkeeper_requests_total" in ours.text


def ema(samples: list[float]) -> float | None:
    """upstream/costs.py's moving average of `samples`, in order."""
    out = None
    for sample in samples:
        out = sample if out is None else out + costs.ALPHA * (sample - out)
    return out


SAVED_LINE = re.compile(r"saved \S+ from slot \d+: (\d+) tokens, (\d+) bytes in (\d+) ms")


def test_measured_costs_follow_the_servers_own_figures(make_llama, make_proxy, tmp_path):
    """Issue #31: the prefill and decode speeds slotkeeper shows (/slotkeeper/metrics and
    `slotkeeper status --json`) are the moving average of llama-server's own timings in the
    answers; a slot file's size line and the save speed those of the saves the log reports."""
    server, proxy, slots = handover_proxy(make_llama, make_proxy, tmp_path)
    a = Chat("a", long_system_prompt(300, seed=1))
    b = Chat("b", long_system_prompt(300, seed=2))
    responses = [a.ask(proxy.url, "hi"), b.ask(proxy.url, "hi"), a.ask(proxy.url, "more"),
                 b.ask(proxy.url, "more")]
    assert [t["action"] for t in responses] == ["assigned", "assigned", "restored", "restored"]
    prefill = ema([t["prompt_n"] / t["prompt_ms"] * 1000 for t in responses
                   if t["prompt_n"] >= costs.MIN_PREFILL_TOKENS])
    decode = ema([t["predicted_n"] / t["predicted_ms"] * 1000 for t in responses
                  if t["predicted_n"] >= costs.MIN_DECODE_TOKENS])
    m = scrape(proxy.url)
    up = server.url
    assert value(m, "slotkeeper_prefill_tokens_per_second", upstream=up) == pytest.approx(
        prefill, rel=1e-3)
    assert value(m, "slotkeeper_decode_tokens_per_second", upstream=up) == pytest.approx(
        decode, rel=1e-3)
    saves = [(int(n), int(size), int(ms)) for n, size, ms in SAVED_LINE.findall(
        proxy.log_text())]
    assert len(saves) >= 2, proxy.log_text()[-2000:]
    # The restores read back the files these saves wrote: the same points of the size line.
    per_token, fixed = costs.size_line([(n, float(size)) for n, size, _ in saves])
    kv = value(m, "slotkeeper_kv_bytes_per_token", upstream=up)
    assert kv == pytest.approx(per_token, rel=0.01), (kv, saves)
    assert value(m, "slotkeeper_slot_fixed_bytes", upstream=up) == pytest.approx(
        fixed, rel=0.01, abs=1024)
    save_rate = value(m, "slotkeeper_save_bytes_per_second", upstream=up)
    assert min(size / (ms + 0.5) for _, size, ms in saves) * 1000 <= save_rate <= max(
        size / max(ms - 0.5, 0.01) for _, size, ms in saves) * 1000, (save_rate, saves)
    assert value(m, "slotkeeper_restore_bytes_per_second", upstream=up) > 0
    # The session API (what `slotkeeper status` shows) gives the same figures.
    current = requests.get(proxy.url + "/api/sessions/current", timeout=30).json()
    shown = current["upstreams"][up]["costs"]
    assert shown["prefill_tokens_per_s"] == pytest.approx(prefill, rel=1e-3)
    assert shown["kv_bytes_per_token"] == pytest.approx(kv, rel=1e-3)
    assert shown["samples"] >= len(responses)
