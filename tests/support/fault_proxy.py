"""An HTTP proxy on 127.0.0.1 in front of the test S3 endpoint that injects the faults real endpoints have.

Every request is forwarded to the upstream endpoint unless the proxy's `fault` decides otherwise for
it: answer 503 or 500, reset the connection halfway through the body, end the body early, or never
answer at all (a partition or a black-holed route). The proxy counts requests per path, so a test
can check how often one object was tried.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import struct
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal
from urllib.parse import urlparse

Fault = Literal["503", "500", "reset", "truncate", "silent"]
FAULTS: tuple[Fault, ...] = ("503", "reset", "500", "truncate")
"""The transient faults a flaky endpoint cycles through."""


class FaultProxy:
    """Forwards to `upstream`; `fault(number, method, path)` picks a fault for request `number` (None: forward)."""

    def __init__(self, upstream: str) -> None:
        parsed = urlparse(upstream)
        self.upstream = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self.fault: Callable[[int, str, str], Fault | None] = lambda number, method, path: None
        self.requests: Counter[str] = Counter()
        self.faults: Counter[Fault] = Counter()
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self.handler_class())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="fault-proxy", daemon=True)

    @property
    def endpoint(self) -> str:
        """The proxy's URL, to put where the upstream endpoint was."""
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def count(self, method: str, path: str) -> tuple[int, Fault | None]:
        """Record a request; its number and the fault it gets."""
        with self.lock:
            number = sum(self.requests.values())
            self.requests[path] += 1
            fault = self.fault(number, method, path)
            if fault is not None:
                self.faults[fault] += 1
            return number, fault

    def handler_class(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                """Quiet: the tests read the counters instead."""

            def forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                _, fault = proxy.count(self.command, urlparse(self.path).path)
                if fault == "silent":
                    proxy.stopping.wait()  # never answers; ends with the proxy
                    self.close_connection = True
                    return
                if fault in ("503", "500"):
                    self.answer_error(int(fault))
                    return
                upstream = http.client.HTTPConnection(*proxy.upstream, timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    response = upstream.getresponse()
                    data = response.read()
                    if fault in ("reset", "truncate") and len(data) > 1:
                        self.send_partial(response, data, reset=fault == "reset")
                        return
                    self.send_head(response, len(data))
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    upstream.close()

            def send_head(self, response: http.client.HTTPResponse, length: int) -> None:
                """The upstream's status and headers, with a body of `length` bytes announced."""
                self.send_response(response.status, response.reason)
                for key, value in response.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(length))
                self.end_headers()

            def answer_error(self, status: int) -> None:
                text = b"<Error><Code>ServiceUnavailable</Code><Message>injected</Message></Error>"
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

            def send_partial(self, response: http.client.HTTPResponse, data: bytes, reset: bool) -> None:
                """Promise the whole body, send half of it, then reset (RST) or close the connection."""
                self.send_head(response, len(data))
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                if reset:  # SO_LINGER 0: close sends RST instead of FIN
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = forward

        return Handler

    def start(self) -> FaultProxy:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


@contextlib.contextmanager
def fault_proxy(upstream: str) -> Iterator[FaultProxy]:
    """A running proxy in front of `upstream`, stopped afterwards."""
    proxy = FaultProxy(upstream).start()
    try:
        yield proxy
    finally:
        proxy.stop()


@contextlib.contextmanager
def silent_endpoint() -> Iterator[str]:
    """A TCP port on 127.0.0.1 that accepts connections (the kernel completes them) and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
