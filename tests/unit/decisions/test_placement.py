"""The pure placement policy of a pool of llama-servers (issue #13): slotkeeper/placement.py."""

from __future__ import annotations

import pytest

from slotkeeper.decisions.placement import (
    CHEAPEST,
    COST,
    LEAST,
    LEAST_BUSY,
    MOVED,
    ROUND_ROBIN,
    STAY,
    TURN,
    ServerView,
    Weights,
    cost,
    load,
    parse_upstreams,
    place,
)

pytestmark = pytest.mark.pool

A, B, C = "http://127.0.0.1:8081", "http://127.0.0.1:8082", "http://127.0.0.1:8083"
W = Weights()


def view(url: str, **kw) -> ServerView:
    kw.setdefault("slots", 2)
    kw.setdefault("free", 2)
    return ServerView(url=url, **kw)


def test_a_resident_session_stays_even_where_another_server_is_idle() -> None:
    servers = [view(A, busy=1, free=0, reuse=1500, resident=True), view(B)]
    assert place(servers, 1600) == place(servers, 1600, COST)
    chosen = place(servers, 1600)
    assert (chosen.url, chosen.reason, chosen.leaving) == (A, STAY, None)


def test_a_new_session_goes_to_the_least_loaded_server() -> None:
    servers = [view(A, busy=2, free=0), view(B, busy=0)]
    chosen = place(servers, 800)
    assert (chosen.url, chosen.reason) == (B, CHEAPEST)


def test_ties_go_to_the_first_server() -> None:
    assert place([view(A), view(B)], 800).url == A


def test_a_compatible_snapshot_outweighs_a_little_load() -> None:
    # Only A's fingerprint matches the snapshot: restoring 2,000 tokens beats one busy slot.
    servers = [view(A, busy=1, free=1, reuse=2000), view(B)]
    assert place(servers, 2100).url == A
    # ...but a queue on A (more requests than slots) costs more than the re-prefill.
    servers = [view(A, busy=2, in_flight=4, free=0, reuse=600), view(B)]
    assert place(servers, 700).url == B


def test_a_displaced_session_restores_where_it_is_cheapest() -> None:
    # The snapshot restores on both (shared folder, same fingerprint): load decides.
    servers = [view(A, busy=1, free=1, reuse=3000), view(B, reuse=3000)]
    chosen = place(servers, 3100)
    assert (chosen.url, chosen.reason) == (B, CHEAPEST)


def test_a_server_that_is_down_or_draining_is_never_chosen() -> None:
    servers = [view(A, up=False, reuse=3000, resident=True), view(B, draining=True), view(C)]
    chosen = place(servers, 3100)
    assert chosen.url == C
    assert chosen.leaving is None  # A is down: nothing to save there
    assert place([view(A, up=False), view(B, draining=True)], 100) is None


def test_a_session_on_a_draining_server_leaves_it_after_a_save() -> None:
    servers = [view(A, draining=True, reuse=3000, resident=True), view(B)]
    chosen = place(servers, 3100)
    assert (chosen.url, chosen.leaving) == (B, A)


def test_a_saturated_server_lets_its_session_move_when_clearly_cheaper() -> None:
    home = view(A, busy=2, in_flight=3, free=0, reuse=2000, resident=True)
    chosen = place([home, view(B)], 2100)
    assert (chosen.url, chosen.reason, chosen.leaving) == (B, MOVED, A)
    # Not saturated (as many requests as slots): it stays.
    home = view(A, busy=2, in_flight=2, free=0, reuse=2000, resident=True)
    assert place([home, view(B)], 2100).reason == STAY
    # Saturated, but the other server is as loaded: within the margin, it stays.
    other = view(B, busy=2, in_flight=3, free=0)
    home = view(A, busy=2, in_flight=3, free=0, reuse=2000, resident=True)
    assert place([home, other], 2100).reason == STAY


def test_cost_counts_prefill_load_and_displacement() -> None:
    s = view(A, busy=1, free=0, reuse=1000)
    assert load(s, W) == W.busy
    assert cost(s, 1500, W) == 500 + W.busy + W.displace
    assert cost(view(A, reuse=5000), 1500, W) == 0  # never negative
    q = view(A, slots=2, busy=2, in_flight=5, free=0)
    assert load(q, W) == 2 * W.busy + 3 * W.queued


def test_round_robin_ignores_the_kv() -> None:
    servers = [view(A, reuse=3000, resident=True), view(B), view(C, up=False)]
    turns = [place(servers, 3100, ROUND_ROBIN, turn=t) for t in range(4)]
    assert [t.url for t in turns] == [A, B, A, B]
    assert {t.reason for t in turns} == {TURN}
    assert turns[1].leaving == A  # the session leaves its server (what the router saves)


def test_least_busy_ignores_the_kv() -> None:
    servers = [view(A, busy=1, free=1, reuse=3000, resident=True), view(B, busy=0)]
    chosen = place(servers, 3100, LEAST_BUSY)
    assert (chosen.url, chosen.reason, chosen.leaving) == (B, LEAST, A)


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError):
        place([view(A)], 10, "random")


def test_upstream_urls_are_normalised_and_checked() -> None:
    assert parse_upstreams(["http://127.0.0.1:8081/", " http://127.0.0.1:8081",
                            "https://gpu2", "http://[::1]:9000"]) == [
        "http://127.0.0.1:8081", "https://gpu2:443", "http://[::1]:9000"]
    for bad in ("127.0.0.1:8081", "ftp://x:1", "http://x:1/v1", "http://u:p@x:1",
                "http://x:99999", ""):
        with pytest.raises(ValueError):
            parse_upstreams([bad])


def test_a_handover_in_progress_keeps_the_session_where_it_is() -> None:
    # Another request (or proxy process) is restoring the session on A right now: placing it
    # on B would run one session on two servers at once, however loaded A is.
    servers = [view(A, busy=2, in_flight=3, free=0, pending=True), view(B)]
    chosen = place(servers, 2000)
    assert (chosen.url, chosen.reason, chosen.leaving) == (A, STAY, None)
    # A displaced session (its claim stale, no handover running) goes where it is cheapest,
    # and there is nothing to save on its old server.
    servers = [view(A, busy=2, in_flight=3, free=0, reuse=900), view(B, reuse=900)]
    chosen = place(servers, 1000)
    assert (chosen.url, chosen.leaving) == (B, None)


# ---- the glue: options, the flow's destination, the comment --------------------------------

def test_pool_options_are_checked_and_reach_the_router(tmp_path) -> None:
    from mitmproxy import exceptions
    from mitmproxy.test import taddons

    from slotkeeper.addon import SlotKeeper

    keeper = SlotKeeper()
    with taddons.context(keeper) as tctx:
        tctx.configure(keeper, slotkeeper_state_file=str(tmp_path / "state.json"))
        assert not keeper.router.pool.pooled  # empty: one upstream, as before
        tctx.configure(keeper, slotkeeper_upstreams=[A, B + "/"],
                       slotkeeper_placement=LEAST_BUSY)
        assert keeper.router.config.upstreams == (A, B)
        assert keeper.router.config.placement == LEAST_BUSY
        with pytest.raises(exceptions.OptionsError, match="slotkeeper_upstreams"):
            tctx.configure(keeper, slotkeeper_upstreams=["127.0.0.1:8081"])
        with pytest.raises(exceptions.OptionsError):
            tctx.configure(keeper, slotkeeper_placement="random")
        assert keeper.router.config.upstreams == (A, B)  # a refused change keeps the router
    keeper.pool.shutdown()
    keeper.release_pool.shutdown()


def test_a_flow_is_pointed_at_its_server_with_a_matching_host_header() -> None:
    from mitmproxy.test import tflow

    from slotkeeper.flows import point_at, upstream_of

    flow = tflow.tflow()
    flow.request.scheme, flow.request.host, flow.request.port = "http", "127.0.0.1", 8081
    flow.request.headers["Host"] = "127.0.0.1:8081"
    point_at(flow, B)
    assert upstream_of(flow) == B
    assert flow.request.headers["Host"] == "127.0.0.1:8082"
    point_at(flow, "https://[::1]:9443")
    assert upstream_of(flow) == "https://[::1]:9443"
    assert flow.request.host == "::1"


def test_the_flow_comment_names_the_server_briefly() -> None:
    from slotkeeper.observe.contentview import flow_comment

    summary = {"session": "web-1", "slot": 1, "action": "restored"}
    assert flow_comment(summary) == "web-1 #1 restored"  # one upstream: as before
    assert flow_comment({**summary, "server": B}) == "web-1 #1 restored @8082"
    assert flow_comment({**summary, "server": "http://gpu2:8080"}) == \
        "web-1 #1 restored @gpu2:8080"
