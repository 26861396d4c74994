"""The front door (front.py): slotkeeper's one `request` hook, which hands each request to the
addons that act on one, in order, as mitmproxy would dispatch their own hooks."""

from __future__ import annotations

import asyncio

import pytest
from mitmproxy.test import tflow

from slotkeeper.addon import make_addons
from slotkeeper.front import Front


class _Handler:
    def __init__(self, name: str, seen: list[str], answer_async: bool = False,
                 fail: bool = False) -> None:
        self.name, self.seen, self.answer_async, self.fail = name, seen, answer_async, fail

    def on_request(self, flow):
        if self.fail:
            raise RuntimeError(self.name)
        if not self.answer_async:
            self.seen.append(self.name)
            return None

        async def later() -> None:
            await asyncio.sleep(0)
            self.seen.append(self.name)
        return later()


def test_each_handler_in_order_its_awaitable_awaited_before_the_next():
    seen: list[str] = []
    front = Front([_Handler("a", seen, answer_async=True), _Handler("b", seen),
                   _Handler("c", seen, answer_async=True)])
    asyncio.run(front.request(tflow.tflow()))
    assert seen == ["a", "b", "c"]


def test_an_exception_ends_the_hook_for_the_handlers_after_it_as_in_mitmproxy():
    seen: list[str] = []
    front = Front([_Handler("a", seen), _Handler("b", seen, fail=True), _Handler("c", seen)])
    with pytest.raises(RuntimeError, match="b"):
        asyncio.run(front.request(tflow.tflow()))
    assert seen == ["a"]


def test_every_addon_acting_on_a_request_goes_through_the_front_once():
    """No addon but the front has a `request` hook of its own (it would run twice, or out of
    order), and every addon with an `on_request` is one of the front's, in the order the
    addons are listed."""
    addons = make_addons()
    fronts = [a for a in addons if isinstance(a, Front)]
    assert len(fronts) == 1
    assert [a for a in addons if getattr(a, "request", None) is not None] == fronts
    handlers = [a for a in addons if callable(getattr(a, "on_request", None))]
    assert list(fronts[0].handlers) == handlers and len(handlers) == 5
