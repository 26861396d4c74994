"""Several proxies sharing sessions through etcd (issue #33), with real processes: a 3-member
etcd cluster, two or three mitmdump proxies as hosts (each in a network namespace of its own
with its own address where the machine allows it, else on loopback with its own port: the
output says which; each its own state folder; only etcd, the network and the slot folder
shared, as two hosts would), one llama-server (-np 2 -c 4096) on the hosts' gateway. What the
server did is read from its own answers (`timings`)."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import requests
from helpers import QUESTIONS, Conversation, eventually
from testbed import long_system_prompt

TTL = 3  # seconds: a killed proxy's slot leases must be gone within this
# The proxies are other hosts: their metrics answer the test (not a loopback client) with a
# token, as in a deployment.
TOKEN = "etcd-real-test"
OPTIONS = {"slotkeeper_idle_save_seconds": 1, "slotkeeper_api_token": TOKEN,
           "slotkeeper_max_seeds": 0,
           "slotkeeper_etcd_lease_ttl": TTL, "slotkeeper_lock_timeout": 60,
           "slotkeeper_small_request_chars": 500}  # 300-word prompts are sessions here


def bed(proxy_hosts, make_etcd, make_llama, slot_dir: Path, count: int):
    """`count` hosts for proxies, a 3-member etcd cluster and a llama-server both served where
    the hosts reach them."""
    hosts = proxy_hosts(count)
    etcd = make_etcd(3, also_on=hosts.gateway if hosts.isolated else "")
    server = make_llama(np=2, ctx=4096, slot_save_path=slot_dir, host=hosts.gateway)
    return hosts, etcd, server


def proxies(make_proxy, hosts, server, etcd, slot_dir: Path, prefix: str, on: range):
    """A proxy on each of `hosts.hosts[i]` for i in `on`, in front of `server`."""
    made = [make_proxy(server, host=hosts.hosts[i], slotkeeper_slot_dir=str(slot_dir),
                       slotkeeper_etcd=etcd.endpoints_at(hosts.gateway),
                       slotkeeper_etcd_prefix=prefix, **OPTIONS) for i in on]
    for i, proxy in zip(on, made):
        assert proxy.url.startswith(f"http://{hosts.hosts[i].address}:"), proxy.url
    return made


def run_sessions(urls: list[str], tag: str, sessions: int = 4, turns: int = 4,
                 seed: int = 0) -> list[Conversation]:
    """`sessions` conversations at once, turn k of session i through urls[(i + k) % n]."""
    conversations = [Conversation(f"{tag}-{i}", long_system_prompt(300, seed=seed + i))
                     for i in range(sessions)]
    errors: list[BaseException] = []

    def run(i: int, c: Conversation) -> None:
        try:
            for k in range(turns):
                c.ask(urls[(i + k) % len(urls)], f"({c.session}) {QUESTIONS[k]}")
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(conversations)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return conversations


def later_prefill(conversations: list[Conversation]) -> int:
    return sum(t.prompt_n for c in conversations for t in c.turns[1:])


def turns_of(conversations: list[Conversation]) -> list[tuple[str, int, str | None, int, int]]:
    """What each turn did, for a failure's message: session, turn, action, cached, prefilled."""
    return [(t.session, t.turn, t.action, t.cache_n, t.prompt_n)
            for c in conversations for t in c.turns]


def assert_kept_turns_found_their_kv(conversations: list[Conversation]) -> None:
    """A turn kept on its slot must find its previous prompt there: another session's request
    on that slot meanwhile (two sessions on one slot) would have overwritten it."""
    for c in conversations:
        for before, turn in zip(c.turns, c.turns[1:]):
            if turn.action == "kept":
                assert turn.cache_n >= 0.9 * before.prompt_tokens, (c.session, before, turn)


def test_turns_going_round_three_proxies_prefill_as_through_one(
        proxy_hosts, make_llama, make_proxy, make_etcd, tmp_path):
    slot_dir = tmp_path / "slots"
    hosts, etcd, server = bed(proxy_hosts, make_etcd, make_llama, slot_dir, 4)
    three = proxies(make_proxy, hosts, server, etcd, slot_dir, "/three/", range(3))
    one = proxies(make_proxy, hosts, server, etcd, slot_dir, "/one/", range(3, 4))
    through_three = run_sessions([p.url for p in three], "three", seed=10)
    through_one = run_sessions([one[0].url], "one", seed=10)
    three_total, one_total = later_prefill(through_three), later_prefill(through_one)
    print(f"later turns prefilled: {three_total} through three proxies, {one_total} through one")
    assert three_total <= 1.05 * one_total, (three_total, one_total, turns_of(through_three),
                                              turns_of(through_one))
    assert_kept_turns_found_their_kv(through_three + through_one)


def test_a_killed_proxy_frees_its_slots_and_the_session_goes_on(
        proxy_hosts, make_llama, make_proxy, make_etcd, tmp_path):
    slot_dir = tmp_path / "slots"
    hosts, etcd, server = bed(proxy_hosts, make_etcd, make_llama, slot_dir, 2)
    a, b = proxies(make_proxy, hosts, server, etcd, slot_dir, "/kill/", range(2))
    c = Conversation("killed", long_system_prompt(300, seed=40))
    first = c.ask(a.url, "Name one prime number.")
    # A long answer streams through A; A is SIGKILLed mid-stream, holding the slot's lease.
    body = {"messages": [{"role": "system", "content": c.system}, *c.messages,
                         {"role": "user", "content": "Count from one to a thousand."}],
            "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}
    with requests.post(a.url + "/v1/chat/completions", json=body, stream=True,
                       headers={c.header: c.session}, timeout=60) as r:
        next(r.iter_lines())
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait(10)
        killed = time.monotonic()
    # Every key there now is A's (B has made no request yet): the leases they hang on.
    leases_of_a = {lease for _, lease in lock_keys(etcd, "/kill/")}
    assert leases_of_a, "the killed proxy held no slot lease"

    def held_by_a() -> list[tuple[str, int]]:
        return [k for k in lock_keys(etcd, "/kill/") if k[1] in leases_of_a]

    # Watched while B answers the next turn (which does not wait for them: B's shared lease
    # on the session's slot goes with A's), so the time is the keys' own.
    gone_at: list[float] = []

    def watch_a() -> None:
        while held_by_a() and time.monotonic() - killed < TTL + 5:
            time.sleep(0.1)
        gone_at.append(time.monotonic() - killed)

    watcher = threading.Thread(target=watch_a)
    watcher.start()
    second = c.ask(b.url, "And another prime number?")
    waited = time.monotonic() - killed
    print(f"next turn through the other proxy answered {waited:.1f} s after the kill "
          f"({second.action}, cache_n {second.cache_n} of {second.prompt_tokens})")
    assert second.action is not None, "passed through unpinned"
    assert waited < TTL + 15, waited
    assert second.cache_n >= 0.9 * first.prompt_tokens, (first, second)
    # The killed proxy's slot lease (a key on its etcd lease) is gone within the TTL. What
    # stays is B's: its shared key on the slot lingers for its next kept turn (DESIGN).
    watcher.join(TTL + 10)
    gone = gone_at[0]
    print(f"the killed proxy's slot lease was gone {gone:.1f} s after the kill (TTL {TTL} s)")
    assert not held_by_a(), held_by_a()
    assert gone <= TTL + 1.5, gone
    # B's work after its kept turn (its usage written in the background) may hold another
    # key for a moment (CI once read one there, gone by the message): none may stay
    assert eventually(lambda: all("/sh/" in key for key, _ in lock_keys(etcd, "/kill/")), 3.0), \
        lock_keys(etcd, "/kill/")


def lock_keys(etcd, prefix: str) -> list[tuple[str, int]]:
    """The slot leases, named locks and saves in flight held under `prefix`, read from etcd
    itself (not the state, nor the hour's writes: records, not held), each with the etcd
    lease it hangs on."""
    import etcd3gw
    port = int(etcd.members[-1].endpoint.rsplit(":", 1)[1])
    return [(meta["key"].decode(), int(meta.get("lease", 0)))
            for _, meta in etcd3gw.client(port=port).get_prefix(prefix)
            if not meta["key"].endswith(b"/state") and b"/budget/writes/" not in meta["key"]]


def test_etcd_members_lost_and_back(proxy_hosts, make_llama, make_proxy, make_etcd, tmp_path):
    slot_dir = tmp_path / "slots"
    hosts, etcd, server = bed(proxy_hosts, make_etcd, make_llama, slot_dir, 2)
    a, b = proxies(make_proxy, hosts, server, etcd, slot_dir, "/faults/", range(2))
    c = Conversation("faults", long_system_prompt(300, seed=50))
    c.ask(a.url, "Name one prime number.")
    etcd.kill(0)  # one member of three: nothing changes
    t2 = c.ask(b.url, "Another one?")
    assert t2.action == "kept", t2
    etcd.kill(1)  # quorum lost: still answered
    # At once, A may still keep the turn from memory (CI saw it): its key on the slot lives
    # as long as its lease is sure to, and nobody can take the slot before. Unpinned is right
    # too. Either way the answer comes, and a kept turn must find its KV.
    t3 = c.ask(a.url, "And a third?")
    assert t3.action in (None, "kept"), t3
    # Once each proxy's keep-alive has found etcd gone (a third of the TTL, then its probes),
    # nothing is pinned: no lease is sure to live any more.
    assert eventually(lambda: store_reachable(a) == 0 and store_reachable(b) == 0, TTL + 5)
    t4 = c.ask(b.url, "And a fourth?")
    t5 = c.ask(a.url, "And a fifth?")
    print(f"quorum lost: actions {t3.action}, then {t4.action}, {t5.action}")
    assert t4.action is None and t5.action is None, (t4, t5)
    assert_kept_turns_found_their_kv([c])
    b.stop()  # graceful, with no store to read what it holds: one clear line
    assert "shutdown: no session saved: etcd" in b.log_text(), b.log_text()[-3000:]
    assert "Traceback" not in b.log_text(), b.log_text()[-3000:]
    etcd.restart(0, wait=False)
    etcd.restart(1)
    back = time.monotonic()
    while store_reachable(a) != 1 and time.monotonic() - back < 30:
        time.sleep(0.1)
    seen = time.monotonic() - back
    print(f"etcd seen back by the proxy {seen:.1f} s after quorum returned")
    assert seen < 5, seen
    turn = c.ask(a.url, "One more?")
    assert turn.action is not None, "still unpinned after the store answered again"
    assert "etcd unreachable" in a.log.read_text()


def store_reachable(proxy) -> float:
    text = requests.get(proxy.url + "/slotkeeper/metrics", timeout=5,
                        headers={"Authorization": f"Bearer {TOKEN}"}).text
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("slotkeeper_store_reachable "))
