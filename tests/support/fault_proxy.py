"""An HTTP proxy on 127.0.0.1 in front of the test S3 endpoint that injects the faults real endpoints have.

Every request is forwarded to the upstream endpoint unless the proxy's `fault` decides otherwise for
it: answer with an error status, reset the connection halfway through the body, end the body
early, never answer at all (a partition or a black-holed route), send the headers and part of the
body and then fall silent (`stall`), send the body a byte at a time (`trickle`: never silent long
enough for a read timeout, yet slower than any transfer allowance), or flip one byte of the body
in flight (`flip`). The proxy counts requests per path, so a test can check how often one object
was tried. Used by the remote fault tests and by `benchmarks/silent_endpoint.py`.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import struct
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal
from urllib.parse import urlparse

Fault = Literal[
    "400", "403", "404", "408", "429", "500", "503", "reset", "truncate", "silent", "stall", "trickle", "flip"
]
FAULTS: tuple[Fault, ...] = ("503", "reset", "500", "truncate")
"""The transient faults a flaky endpoint cycles through."""
STATUS_TEXT = {"400": "BadRequest", "403": "AccessDenied", "404": "NoSuchKey", "408": "RequestTimeout"}


@dataclass(frozen=True)
class Seen:
    """A request as the proxy saw it: its number (from 0), method, path, and the byte range it asked for, if any."""

    number: int
    method: str
    path: str
    length: int | None  # bytes of the range asked for; None: the whole object

    @property
    def ranged(self) -> bool:
        """Whether the request asked for a byte range."""
        return self.length is not None


def range_length(header: str | None) -> int | None:
    """The number of bytes a `Range: bytes=a-b` header asks for (None: no range, or one without an end)."""
    if not header or not header.startswith("bytes="):
        return None
    start, _, end = header.removeprefix("bytes=").partition("-")
    return int(end) - int(start) + 1 if start.isdigit() and end.isdigit() else None


class FaultProxy:
    """Forwards to `upstream`; `fault(seen)` picks a fault for each request (None: forward it untouched)."""

    def __init__(self, upstream: str, stall_after: int = 1 << 20, trickle_interval: float = 0.25) -> None:
        parsed = urlparse(upstream)
        self.upstream = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self.stall_after = stall_after  # bytes of the body a stalled answer sends before its silence (at most half)
        self.trickle_interval = trickle_interval  # seconds between two bytes of a trickled body
        self.fault: Callable[[Seen], Fault | None] = lambda seen: None
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

    def count(self, method: str, path: str, length: int | None) -> Fault | None:
        """Record a request; the fault it gets."""
        with self.lock:
            number = sum(self.requests.values())
            self.requests[path] += 1
            fault = self.fault(Seen(number, method, path, length))
            if fault is not None:
                self.faults[fault] += 1
            return fault

    def handler_class(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                """Quiet: the tests read the counters instead."""

            def forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                fault = proxy.count(self.command, urlparse(self.path).path, range_length(self.headers.get("Range")))
                if fault == "silent":
                    self.fall_silent()
                    return
                if fault is not None and fault.isdigit():
                    self.answer_error(int(fault))
                    return
                upstream = http.client.HTTPConnection(*proxy.upstream, timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    response = upstream.getresponse()
                    data = response.read()
                finally:
                    upstream.close()
                if fault in ("reset", "truncate", "stall", "trickle", "flip") and len(data) > 1:
                    self.send_faulty(response, data, fault)
                    return
                self.send_head(response, len(data))
                if self.command != "HEAD":
                    self.wfile.write(data)

            def send_head(self, response: http.client.HTTPResponse, length: int) -> None:
                """The upstream's status and headers, with a body of `length` bytes announced."""
                self.send_response(response.status, response.reason)
                for key, value in response.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(length))
                self.end_headers()

            def answer_error(self, status: int) -> None:
                code = STATUS_TEXT.get(str(status), "SlowDown" if status == 429 else "ServiceUnavailable")
                text = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

            def fall_silent(self) -> None:
                """Keep the connection open and send nothing more until the proxy stops."""
                self.wfile.flush()
                proxy.stopping.wait()
                self.close_connection = True

            def send_faulty(self, response: http.client.HTTPResponse, data: bytes, fault: Fault) -> None:
                """Promise the whole body, then break the promise the way `fault` says."""
                self.send_head(response, len(data))
                if fault == "flip":
                    damaged = bytearray(data)
                    damaged[len(data) // 2] ^= 0x01
                    self.wfile.write(bytes(damaged))
                    return
                if fault == "trickle":
                    self.trickle(data)
                    return
                sent = min(len(data) // 2, proxy.stall_after) if fault == "stall" else len(data) // 2
                self.wfile.write(data[:sent])
                self.wfile.flush()
                if fault == "stall":
                    self.fall_silent()
                    return
                if fault == "reset":  # SO_LINGER 0: close sends RST instead of FIN
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True

            def trickle(self, data: bytes) -> None:
                """Send `data` a byte at a time until done, the client gives up or the proxy stops."""
                for position in range(len(data)):
                    try:
                        self.wfile.write(data[position : position + 1])
                        self.wfile.flush()
                    except OSError:
                        break  # the client gave up
                    if proxy.stopping.wait(proxy.trickle_interval):
                        break
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
def fault_proxy(upstream: str, **options: float) -> Iterator[FaultProxy]:
    """A running proxy in front of `upstream`, stopped afterwards (`options`: `stall_after`, `trickle_interval`)."""
    proxy = FaultProxy(upstream, **options).start()  # type: ignore[arg-type]
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
