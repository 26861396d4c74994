"""The copy of a streamed answer that a flow gets when its client leaves before the stream's end
(streamed.py). The real case, against mitmweb, is in test_mitmweb_real.py."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from mitmproxy import http
from mitmproxy.addons import proxyserver
from mitmproxy.test import taddons, tflow

from slotkeeper.observe.streamed import KEY, StreamCopy, StreamedBodies


def test_the_copy_is_what_the_client_was_sent():
    copy = StreamCopy(lambda chunk: [chunk.upper(), b""])
    assert copy(b"data: a\n\n") == [b"DATA: A\n\n"]  # an empty part would end the body
    assert copy(b"") == []
    assert copy.body() == b"DATA: A\n\n"


def test_a_plain_stream_is_passed_on_as_it_is():
    copy = StreamCopy(None)  # response.stream = True
    assert copy(b"one") == [b"one"]
    assert copy(b"two") == [b"two"]
    assert copy.body() == b"onetwo"


def streaming_flow() -> http.HTTPFlow:
    flow = tflow.tflow(resp=True)
    flow.response.stream = lambda chunk: chunk
    return flow


@contextmanager
def streamed_bodies(store: bool) -> Iterator[StreamedBodies]:
    bodies = StreamedBodies()
    with taddons.context(proxyserver.Proxyserver(), bodies) as tctx:
        tctx.configure(bodies, store_streamed_bodies=store)
        yield bodies


def test_a_client_that_left_gets_the_copy_on_its_flow():
    with streamed_bodies(store=True) as bodies:
        flow = streaming_flow()
        bodies.responseheaders(flow)
        flow.response.data.content = None  # what mitmproxy leaves before the stream's end
        flow.response.stream(b"data: [DONE]\n\n")
        bodies.error(flow)
    assert flow.response.raw_content == b"data: [DONE]\n\n"
    assert KEY not in flow.metadata  # nothing unpicklable left for a saved flow


def test_a_finished_stream_keeps_mitmproxys_body():
    with streamed_bodies(store=True) as bodies:
        flow = streaming_flow()
        bodies.responseheaders(flow)
        flow.response.stream(b"data: x\n\n")
        flow.response.raw_content = b"mitmproxy's own"
        bodies.error(flow)  # an error after the body was stored changes nothing
        assert flow.response.raw_content == b"mitmproxy's own"
        other = streaming_flow()
        bodies.responseheaders(other)
        bodies.response(other)
        assert KEY not in other.metadata


def test_nothing_is_copied_when_streamed_bodies_are_not_stored():
    with streamed_bodies(store=False) as bodies:
        flow = streaming_flow()
        stream = flow.response.stream
        bodies.responseheaders(flow)
        assert flow.response.stream is stream and KEY not in flow.metadata
