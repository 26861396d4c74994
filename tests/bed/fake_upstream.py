"""A FAKE llama-server, for the faults a real one cannot be made to show on demand.

`FakeFaultyLlama` listens on its own port and forwards every request to a REAL llama-server, so
completions are real answers, except the endpoints it is told to break: `GET /slots` answering
500 or answering only after a delay, for example. Responses are read whole and sent with a
Content-Length (no streaming), which is all the fault tests need, or, with `stall_end`, as
one HTTP chunk whose chunked terminator comes that many seconds late. It runs in a thread of the
test process; slotkeeper (a real mitmdump) is pointed at it as its upstream.

Nothing here is used by a test without saying so: every test that uses it has "fake" in its
name and in its reliability row."""

from __future__ import annotations

import http.client
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit


@dataclass
class Fault:
    """What to do instead of forwarding: answer `status` (with a llama-server-like error body)
    or wait `delay` seconds first. `count` limits how many requests are affected (None: all)."""

    status: int | None = None
    delay: float = 0.0
    count: int | None = None
    hits: int = 0
    query: str | None = None  # only requests whose query string contains this (action=save)
    stall_end: float = 0.0  # the real answer, chunked, its end of message this much later


@dataclass
class FakeFaultyLlama:
    """FAKE llama-server front: real answers from `real_url`, faults by route."""

    real_url: str
    faults: dict[str, Fault] = field(default_factory=dict)  # key: "GET /slots", "POST /slots/"
    seen: list[str] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None
    _open: set[socket.socket] = field(default_factory=set)  # its clients' connections

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeFaultyLlama:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def setup(self) -> None:
                super().setup()
                fake._open.add(self.connection)

            def finish(self) -> None:
                fake._open.discard(self.connection)
                super().finish()

            def _handle(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                route, _, query = self.path.partition("?")
                fake.seen.append(f"{self.command} {route}")
                fault = fake.fault_for(self.command, route, query)
                if fault is not None:
                    if fault.delay:
                        time.sleep(fault.delay)
                    if fault.status is not None:
                        payload = (b'{"error":{"code":%d,"message":"injected by the fake",'
                                   b'"type":"server_error"}}' % fault.status)
                        self._reply(fault.status, {"Content-Type": "application/json"},
                                    payload)
                        return
                target = urlsplit(fake.real_url)
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=600)
                try:
                    headers = {k: v for k, v in self.headers.items()
                               if k.lower() not in ("host", "connection", "content-length",
                                                    "transfer-encoding")}
                    headers["Content-Length"] = str(len(body))
                    conn.request(self.command, self.path, body=body, headers=headers)
                    answer = conn.getresponse()
                    data = answer.read()
                    out = {k: v for k, v in answer.getheaders()
                           if k.lower() not in ("connection", "content-length",
                                                "transfer-encoding", "keep-alive")}
                    if fault is not None and fault.stall_end:
                        self._reply_late_end(answer.status, out, data, fault.stall_end)
                    else:
                        self._reply(answer.status, out, data)
                except OSError:
                    # The real server is down: what a dead upstream looks like to a client.
                    self.close_connection = True
                finally:
                    conn.close()

            def _reply(self, status: int, headers: dict[str, str], data: bytes) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _reply_late_end(self, status: int, headers: dict[str, str], data: bytes,
                                wait: float) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
                time.sleep(wait)
                try:
                    self.wfile.write(b"0\r\n\r\n")
                except OSError:
                    self.close_connection = True  # the proxy went first

            do_GET = do_POST = do_DELETE = do_PUT = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True,
                         name="fake-faulty-llama").start()
        return self

    def fault_for(self, method: str, route: str, query: str = "") -> Fault | None:
        for key, fault in self.faults.items():
            key_method, _, key_route = key.partition(" ")
            if fault.query is not None and fault.query not in query:
                continue
            if key_method == method and (route == key_route or (
                    key_route.endswith("/") and route.startswith(key_route))):
                if fault.count is not None and fault.hits >= fault.count:
                    return None
                fault.hits += 1
                return fault
        return None

    def restart_as(self, real_url: str) -> None:
        """A restart faster than any poll: every connection open to the fake is closed at
        once, as a dying server's are, and from now on the answers come from `real_url`
        (another real llama-server). Its /health never failed in between."""
        self.real_url = real_url
        for conn in list(self._open):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
