"""KV at real size (issue #31): the real llama-server with its slot folder on a FUSE passthrough
capped in bytes/s (tests/bed/throttlefs.py), so that saves and restores cost, next to the
prefill, what they cost for a large model on a GPU host. slotkeeper prices each with the
speeds it measured on this server and must pick what is cheaper."""

from __future__ import annotations

import re

import requests
from helpers import Conversation
from testbed import long_system_prompt
from throttlefs import ThrottledFolder

# A slot file of the test model is ~2.6 MB + ~4 KB a token here (measured: 181 tokens
# 3,341,768 bytes, 5,531 tokens 24,950,700). The folder's cap is set from the prefill speed
# measured on this machine, so that the two sessions land on either side of "restore pays":
# the short one's file reads in about twice its prefill (prefill it), the long one's in about
# half of its own (restore it). A fixed cap (5 MB/s) failed on a slow CI machine: at ~300
# tokens/s, reading the short one's 3 MB (~0.7 s) beat prefilling its 181 tokens (~0.6 s).
SHORT_FILE_BYTES = 3_341_768
LONG_TOKENS, LONG_FILE_BYTES = 5531, 24_950_700
STARTING_BYTES_PER_S = 5_000_000  # until the first prefill is measured; nothing is saved before


def cap_between(short_tokens: int, prefill_tokens_per_s: float) -> float:
    """The cap in the geometric middle of the window where reading the short session's file
    takes longer than prefilling it and reading the long one's takes less: about twice as far
    from either edge."""
    short_edge = SHORT_FILE_BYTES * prefill_tokens_per_s / short_tokens  # a higher cap restores
    long_edge = LONG_FILE_BYTES * prefill_tokens_per_s / LONG_TOKENS  # a lower cap prefills
    return (short_edge * long_edge) ** 0.5


def metric(url: str, name: str) -> float:
    text = requests.get(url + "/slotkeeper/metrics", timeout=30).text
    values = [float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    return sum(values)


def test_on_a_slow_folder_a_short_session_is_prefilled_and_a_long_one_restored(
        make_llama, make_proxy, tmp_path):
    folder = ThrottledFolder(tmp_path / "fuse", STARTING_BYTES_PER_S).start()
    try:
        # One slot: every turn of the other session is a handover. --cache-ram 0 (and
        # slotkeeper told so): the server's RAM cache would bring a prompt back by itself and
        # hide what was restored.
        server = make_llama(np=1, ctx=8192, slot_save_path=folder.path,
                            extra=["--cache-ram", "0"])
        proxy = make_proxy(server, slotkeeper_slot_dir=str(folder.path),
                           slotkeeper_small_request_chars=0, slotkeeper_min_save_tokens=0,
                           slotkeeper_idle_save_seconds=0, slotkeeper_max_seeds=0,
                           slotkeeper_upstream_cache_ram_mb=0)
        short = Conversation("short", long_system_prompt(150, seed=311))
        long = Conversation("long", long_system_prompt(5500, seed=312))
        short_first = short.ask(proxy.url, "Name a colour.")
        # slotkeeper's prefill speed starts from this answer's (an average that the long
        # prompt, slower a token, then pulls down a fifth of the way: the window has room)
        speed = short_first.prompt_n / (short_first.prompt_ms / 1000)
        folder.set_rate(cap_between(short_first.prompt_tokens, speed))
        long_first = long.ask(proxy.url, "Name a city.")  # saves short: measures the save speed
        # saves long; short's restore, of unknown cost yet, runs (measures the restore speed)
        short.ask(proxy.url, "And another?")
        long_again = long.ask(proxy.url, "And another?")  # saves short, restores long
        short_again = short.ask(proxy.url, "And one more?")
        log = proxy.log_text()
        skipped = metric(proxy.url, "slotkeeper_restores_skipped_total")
    finally:
        folder.stop()
    assert long_first.prompt_tokens > 5000, long_first
    # The long session: reading its ~27 MB beats prefilling ~6,000 tokens. The server reused it.
    assert long_again.action == "restored", (long_again, log[-3000:])
    assert long_again.cache_n >= 0.9 * long_first.prompt_tokens, long_again
    # The short one: its snapshot is on disk, but prefilling ~200 tokens beats reading it.
    assert short_again.action != "restored", (short_again, log[-3000:])
    assert "snapshot not restored: reading" in log, log[-3000:]
    assert short_again.prompt_n >= 0.8 * short_again.prompt_tokens, short_again  # prefilled
    assert skipped >= 1
