"""The agent's /metrics endpoint: a small HTTP/1.1 server.

A thread per connection, and connections are kept alive, so a Prometheus that reuses its
connection costs no thread start per scrape; a connection idle for `IDLE_TIMEOUT_S` is closed.
A scrape only formats the collectors' latest snapshot. gzip is used when the scraper asks for
it, as Prometheus does.
"""

from __future__ import annotations

import gzip
import http.server
import logging
import socket
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

IDLE_TIMEOUT_S = 30
_INDEX = (b"<html><head><title>kvscope agent</title></head><body>"
          b"<h1>kvscope agent</h1><p><a href=\"/metrics\">/metrics</a></p></body></html>\n")


class _Handler(http.server.BaseHTTPRequestHandler):
    server: MetricsServer
    protocol_version = "HTTP/1.1"
    timeout = IDLE_TIMEOUT_S
    server_version = "kvscope-agent"

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            try:
                body = self.server.render()
            except Exception:
                log.exception("kvscope agent: rendering /metrics failed")
                self._send(500, b"rendering failed\n", "text/plain; charset=utf-8")
                return
            gz = "gzip" in self.headers.get("Accept-Encoding", "")
            self._send(200, gzip.compress(body, 1) if gz else body, self.server.content_type,
                       gz)
        elif path == "/":
            self._send(200, _INDEX, "text/html; charset=utf-8")
        else:
            self._send(404, b"not found; try /metrics\n", "text/plain; charset=utf-8")

    def _send(self, code: int, body: bytes, ctype: str, gz: bool = False) -> None:
        # Status line, headers and body in one write: split writes of a small response meet
        # Nagle's algorithm and the peer's delayed ACK and stall a keep-alive scrape ~40 ms.
        head = (f"{self.protocol_version} {code} {self.responses[code][0]}\r\n"
                f"Server: {self.server_version}\r\nDate: {self.date_time_string()}\r\n"
                f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                + ("Content-Encoding: gzip\r\n" if gz else "") + "\r\n")
        self.wfile.write(head.encode("latin-1") + body)

    def log_message(self, format: str, *args: object) -> None:
        pass  # a scrape every few seconds is not news


class MetricsServer(http.server.ThreadingHTTPServer):
    """Serves `render()` on GET /metrics.

    Args:
        address: host to bind (IPv6 literals work).
        port: TCP port (0 = any free port).
        render: returns the exposition bytes.
        content_type: the Content-Type of /metrics.
    """

    daemon_threads = True

    def __init__(self, address: str, port: int, render: Callable[[], bytes],
                 content_type: str) -> None:
        self.address_family = _family(address, port)
        self.render = render
        self.content_type = content_type
        super().__init__((address, port), _Handler)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Serve on a daemon thread."""
        self._thread = threading.Thread(target=self.serve_forever, name="kvscope-agent-http",
                                        kwargs={"poll_interval": 0.2}, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join(5)


def _family(address: str, port: int) -> socket.AddressFamily:
    infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    return infos[0][0] if infos else socket.AF_INET
