"""The benchmarks' build of llama-server (scripts/bed/llama-server-host-copy.patch, issue #31).
On a GPU host every prompt llama-server parks in its RAM prompt cache, and every one it takes
back, crosses PCIe; on this CPU build it costs nothing. The bed's build waits
$SLOTKEEPER_BED_HOST_COPY_US_PER_TOKEN for each token it copies, on the main loop as the copy
would run, and logs the copy for the benchmark to count; without the variable it is upstream's."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from testbed import LlamaServer, chat, long_system_prompt

ENV = "SLOTKEEPER_BED_HOST_COPY_US_PER_TOKEN"
COPY = re.compile(r"slotkeeper-bed: host copy of (\d+) tokens")
US_PER_TOKEN = 4000  # 4 ms: ~0.8 s for one of these prompts, far above the copy's own time


def conversation(seed: int) -> list[dict[str, str]]:
    # different from the first word on, so neither conversation is a prefix of the other
    return [{"role": "system", "content": long_system_prompt(150, seed=seed)},
            {"role": "user", "content": "Say hello."}]


def lru_server(make_llama: Callable[..., LlamaServer], binary: Path) -> LlamaServer:
    # one slot, similarity off: every change of conversation goes through the RAM cache
    return make_llama(binary=binary, np=1, ctx=4096,
                      extra=("--slot-prompt-similarity", "0"))


def test_the_bed_server_waits_for_and_logs_each_ram_cache_copy(
        bed_llama_bin: Path, make_llama: Callable[..., LlamaServer],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, str(US_PER_TOKEN))
    server = lru_server(make_llama, bed_llama_bin)
    first_a = chat(server.url, conversation(1), n_predict=4)
    chat(server.url, conversation(2), n_predict=4)  # parks A
    before = server.log.stat().st_size
    started = time.monotonic()
    back_a = chat(server.url, conversation(1), n_predict=4)  # parks B, takes A back
    took = time.monotonic() - started
    time.sleep(0.5)  # the server logs from a thread of its own
    copies = [int(n) for n in COPY.findall(server.log.read_bytes()[before:].decode(errors="replace"))]

    assert len(copies) == 2, copies
    assert back_a["timings"]["cache_n"] >= first_a["timings"]["prompt_n"] - 1, \
        "A came back from the RAM cache"
    assert min(copies) >= first_a["timings"]["prompt_n"] - 1
    # the wait is real and on the request's path
    assert took >= sum(copies) * US_PER_TOKEN / 1e6


def test_without_the_variable_the_bed_server_is_upstreams(
        bed_llama_bin: Path, make_llama: Callable[..., LlamaServer],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    server = lru_server(make_llama, bed_llama_bin)
    first_a = chat(server.url, conversation(1), n_predict=4)
    chat(server.url, conversation(2), n_predict=4)
    back_a = chat(server.url, conversation(1), n_predict=4)
    time.sleep(0.5)

    assert back_a["timings"]["cache_n"] >= first_a["timings"]["prompt_n"] - 1
    assert not COPY.search(server.log.read_text(errors="replace"))
