"""One fingerprint whoever computes it (issue #33), with real processes: two llama-servers,
one on the test model and one on a copy of it at another path (another inode, another
mtime), as the same GGUF copied to two GPU hosts; two proxies, each its own state folder,
sharing only the slot folder. A session saved through one proxy is restored through the
other, into the other server; and by a proxy that cannot read the model file at all (a host
without the models), which must agree with one that can."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from helpers import Conversation
from testbed import Proxy, long_system_prompt

OPTIONS = {"slotkeeper_idle_save_seconds": 1, "slotkeeper_max_seeds": 0,
           "slotkeeper_small_request_chars": 500}


def saved_meta(slot_dir: Path, tokens: int, timeout: float = 30) -> dict:
    """The snapshot meta in the slot folder once it holds at least `tokens` tokens."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for path in slot_dir.glob("*.json"):
            meta = json.loads(path.read_text())
            if meta.get("n_tokens", 0) >= tokens:
                return meta
        time.sleep(0.2)
    raise AssertionError(f"no snapshot of {tokens} tokens in {slot_dir} within {timeout} s")


def test_a_copied_model_restores_the_other_proxys_snapshot(make_llama, make_proxy, model_path,
                                                           tmp_path):
    copy = tmp_path / "elsewhere" / model_path.name
    copy.parent.mkdir()
    shutil.copyfile(model_path, copy)
    os.utime(copy, (1_000_000, 1_000_000))
    assert os.stat(copy).st_ino != os.stat(model_path).st_ino
    slot_dir = tmp_path / "slots"
    here = make_llama(np=1, ctx=2048, slot_save_path=slot_dir)
    there = make_llama(np=1, ctx=2048, slot_save_path=slot_dir, model=copy)
    a = make_proxy(here, slotkeeper_slot_dir=str(slot_dir), **OPTIONS)
    b = make_proxy(there, slotkeeper_slot_dir=str(slot_dir), **OPTIONS)
    c = Conversation("copied-model", long_system_prompt(300, seed=60))
    first = c.ask(a.url, "Name one prime number.")
    saved_by_a = saved_meta(slot_dir, first.prompt_tokens)
    second = c.ask(b.url, "And another prime number?")
    print(f"through the other proxy and server: {second.action}, cache_n {second.cache_n} of "
          f"{second.prompt_tokens}; fingerprint {saved_by_a['fingerprint']}")
    assert second.action == "restored", second
    assert second.cache_n >= 0.9 * first.prompt_tokens, (first, second)
    saved_by_b = saved_meta(slot_dir, second.prompt_tokens)
    assert saved_by_b["fingerprint"] == saved_by_a["fingerprint"]
    # And back: the first proxy restores what the second saved.
    third = c.ask(a.url, "And a third one?")
    assert third.action in ("restored", "kept"), third
    assert third.cache_n >= 0.9 * second.prompt_tokens, (second, third)


def blind_proxy(server, workdir: Path, hidden: Path, slot_dir: Path) -> Proxy:
    """A proxy that sees an empty folder where the server's model is, as a proxy on a host
    without the model files would: run in a mount namespace of its own with a tmpfs over that
    folder (private to it: the server still reads the file)."""
    proxy = Proxy(server.url, workdir, options={"slotkeeper_slot_dir": str(slot_dir), **OPTIONS})
    proxy.prefix = ("unshare", "-m", "--", "sh", "-c", 'mount -t tmpfs none "$0" && exec "$@"',
                    str(hidden))
    return proxy


def test_a_proxy_without_the_model_file_agrees_with_one_that_has_it(make_llama, make_proxy,
                                                                     model_path, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    shutil.copyfile(model_path, models / model_path.name)
    slot_dir = tmp_path / "slots"
    server = make_llama(np=1, ctx=2048, slot_save_path=slot_dir, model=models / model_path.name)
    seeing = make_proxy(server, slotkeeper_slot_dir=str(slot_dir), **OPTIONS)
    blind = blind_proxy(server, tmp_path / "blind", models, slot_dir).start()
    try:
        c = Conversation("blind-proxy", long_system_prompt(300, seed=61))
        first = c.ask(seeing.url, "Name one prime number.")
        with_content = saved_meta(slot_dir, first.prompt_tokens)["fingerprint"]
        second = c.ask(blind.url, "And another prime number?")
        without = saved_meta(slot_dir, second.prompt_tokens)["fingerprint"]
        print(f"saved by the proxy that reads the model: {with_content}; by the one that "
              f"cannot: {without}; the blind proxy's turn {second.action}, cache_n "
              f"{second.cache_n} of {second.prompt_tokens}")
        assert with_content.split(".")[1] and not without.split(".")[1], (with_content, without)
        assert with_content.split(".")[0] == without.split(".")[0]
        assert second.cache_n >= 0.9 * first.prompt_tokens, (first, second)
        # The seeing proxy takes the blind one's snapshot: the slot was the blind proxy's since.
        third = c.ask(seeing.url, "And a third one?")
        assert third.cache_n >= 0.9 * second.prompt_tokens, (second, third)
    finally:
        blind.stop()
