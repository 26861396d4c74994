"""The admin client's kept-alive connections, against a FAKE server on a raw socket: a server
closing a reused connection at the instant a request goes out is a race a real llama-server
shows only now and then (cpp-httplib drops connections idle for 5 s), so it is staged here."""

from __future__ import annotations

import socket
import threading

import pytest

from slotkeeper.upstream.client import Upstream, UpstreamError

OK = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
      b"Connection: keep-alive\r\n\r\n{}")


class DroppingServer:
    """FAKE: answers the first request on each connection, then reads the next one and closes
    without a word, as a server does whose keep-alive timer fired as the request arrived.
    `always_drop`: closes every request unanswered."""

    def __init__(self, always_drop: bool = False) -> None:
        self.always_drop = always_drop
        self.requests = 0
        self.connections = 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._connection, args=(conn,), daemon=True).start()

    def _connection(self, conn: socket.socket) -> None:
        with conn:
            answered = 0
            while self._read_request(conn):
                self.requests += 1
                if self.always_drop or answered:
                    return  # closed under the request
                conn.sendall(OK)
                answered += 1

    @staticmethod
    def _read_request(conn: socket.socket) -> bool:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return False
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(body) < length:
            body += conn.recv(65536)
        return True

    def close(self) -> None:
        self._sock.close()


@pytest.fixture
def server():
    made: list[DroppingServer] = []

    def make(**kwargs) -> DroppingServer:
        made.append(DroppingServer(**kwargs))
        return made[-1]

    yield make
    for each in made:
        each.close()


def test_a_post_on_a_connection_closed_under_it_is_sent_again_on_a_fresh_one(server):
    fake = server()
    client = Upstream(fake.url, timeout=5, admin_timeout=5)
    assert client.post_json("/slots/0?action=save", {"filename": "a.bin"}) == {}
    # The same thread's connection is reused; the server closes it under the second request.
    assert client.post_json("/slots/0?action=save", {"filename": "a.bin"}) == {}
    assert (fake.requests, fake.connections) == (3, 2)


def test_a_get_on_a_connection_closed_under_it_is_sent_again(server):
    fake = server()
    client = Upstream(fake.url, timeout=5, admin_timeout=5)
    assert client.healthy() and client.healthy()
    assert (fake.requests, fake.connections) == (3, 2)


def test_a_server_that_never_answers_is_tried_twice_then_an_error(server):
    fake = server(always_drop=True)
    client = Upstream(fake.url, timeout=5, admin_timeout=5)
    with pytest.raises(UpstreamError, match="ConnectionError"):
        client.post_json("/slots/0?action=save", {"filename": "a.bin"})
    assert fake.requests == 2


def test_a_refused_connection_is_not_retried():
    with socket.create_server(("127.0.0.1", 0)) as placeholder:
        port = placeholder.getsockname()[1]
    client = Upstream(f"http://127.0.0.1:{port}", timeout=5, admin_timeout=5)
    with pytest.raises(UpstreamError, match="ConnectionError"):
        client.post_json("/slots/0?action=save", {"filename": "a.bin"})
