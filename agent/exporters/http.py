"""A small HTTP/1.1 /metrics server, in process or as its own process serving snapshots.

A thread per connection, and connections are kept alive, so a Prometheus that reuses its
connection costs no thread start per scrape; a connection idle for `IDLE_TIMEOUT_S` is closed.
A scrape only sends bytes already rendered; gzip is used when the scraper asks for it, as
Prometheus does, and OpenMetrics (with exemplars) when it is negotiated and available. The
listen backlog is `BACKLOG` connections, so a burst of scrapers waits in the kernel's queue
instead of being refused into a one-second SYN retry.

As a program (`python -m agent.exporters.http --dir D --port P`), it serves the snapshot files
`D/metrics.txt` and `D/metrics.om` that `agent.exporters.snapshot.SnapshotServer` rewrites: an
engine's scrapes then cost the engine's interpreter nothing. It prints `ready PORT` (or
`error ERRNO MESSAGE`) on its first line, and exits when its standard input closes (the parent
stopped or died). It imports the standard library only.
"""

from __future__ import annotations

import argparse
import errno
import gzip
import http.server
import logging
import os
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

IDLE_TIMEOUT_S = 30
#: Pending connections the kernel queues (the stdlib default of 5 makes 1 % of a burst of
#: 20 scrapers wait a full SYN retransmission, about a second).
BACKLOG = 128
TEXT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"
_INDEX = (b"<html><head><title>kvscope</title></head><body>"
          b"<h1>kvscope</h1><p><a href=\"/metrics\">/metrics</a></p></body></html>\n")


#: Header lines and line length a request may have (http.server's own limits).
_MAX_HEADERS = 100
_MAX_LINE = 65536


_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("", "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov",
           "Dec")


def http_date(timestamp: int) -> str:
    """`timestamp` (whole seconds) as an HTTP Date header: what http.server's
    `date_time_string` gives (`email.utils.formatdate(usegmt=True)`), without building a
    datetime (a scrape every 15 s finds the cached one stale every time)."""
    t = time.gmtime(timestamp)
    return (f"{_DAYS[t.tm_wday]}, {t.tm_mday:02d} {_MONTHS[t.tm_mon]} {t.tm_year:04d} "
            f"{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d} GMT")


class _Headers(dict[str, str]):
    """Request headers by lower-cased name (the first of repeated ones), looked up in any
    case, as `email.message.Message.get` does."""

    def get(self, name: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return dict.get(self, name.lower(), default)

    def __getitem__(self, name: str) -> str:
        return dict.__getitem__(self, name.lower())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and dict.__contains__(self, name.lower())


class _Handler(http.server.BaseHTTPRequestHandler):
    server: MetricsServer
    protocol_version = "HTTP/1.1"
    timeout = IDLE_TIMEOUT_S
    server_version = "kvscope"
    _date: tuple[int, str] = (0, "")

    def parse_request(self) -> bool:
        """A GET or HEAD over HTTP/1.0 or 1.1, what every scraper sends, without the email
        package's header parser (most of a scrape's request handling); anything else goes
        to http.server's own parser."""
        line = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
        words = line.split()
        if (len(words) != 3 or words[0] not in ("GET", "HEAD")
                or words[2] not in ("HTTP/1.1", "HTTP/1.0")):
            return super().parse_request()
        self.requestline = line
        self.command, self.path, self.request_version = words
        headers = _Headers()
        for _ in range(_MAX_HEADERS + 1):
            raw = self.rfile.readline(_MAX_LINE + 1)
            if len(raw) > _MAX_LINE:
                self.send_error(431, "Line too long")
                return False
            if raw in (b"\r\n", b"\n", b""):
                break
            name, sep, value = raw.decode("iso-8859-1").partition(":")
            if not sep or not name or name != name.strip():
                self.send_error(400, "Bad header line")
                return False
            headers.setdefault(name.lower(), value.strip())
        else:
            self.send_error(431, "Too many headers")
            return False
        self._take_headers(headers)
        return True

    def _take_headers(self, headers: _Headers) -> None:
        """The request's headers, and whether the connection closes after it (HTTP/1.1 keeps
        it open unless told to close, HTTP/1.0 closes it unless told to keep it)."""
        self.headers = headers  # type: ignore[assignment]
        conn = (headers.get("connection") or "").lower()
        if self.request_version == "HTTP/1.1":
            self.close_connection = conn == "close"
        else:
            self.close_connection = conn != "keep-alive"

    def handle_one_request(self) -> None:
        """One request. A GET whose request line and headers are in the read buffer whole
        (what a scraper sends, in one segment) is taken from it in one piece; anything else
        (a request still arriving, other methods, a header `parse_request` would refuse or
        parse otherwise) goes through http.server's line by line reading, which answers it
        as it always has."""
        try:
            data = self.rfile.peek(_MAX_LINE)  # what is buffered, or one read when nothing is
        except TimeoutError as e:
            self.log_error("Request timed out: %r", e)
            self.close_connection = True
            return
        end = data.find(b"\r\n\r\n")
        if (end < 0 or not data.startswith(b"GET ")
                or data.count(b"\n", 0, end) != data.count(b"\r\n", 0, end)):
            super().handle_one_request()
            return
        lines = data[:end].decode("iso-8859-1").split("\r\n")
        words = lines[0].split()
        if len(words) != 3 or words[2] not in ("HTTP/1.1", "HTTP/1.0") or len(lines) > (
                _MAX_HEADERS + 1):
            super().handle_one_request()
            return
        headers = _Headers()
        for raw in lines[1:]:
            name, sep, value = raw.partition(":")
            if not sep or not name or name != name.strip():
                super().handle_one_request()  # its 400, from the same bytes
                return
            headers.setdefault(name.lower(), value.strip())
        self.rfile.read(end + 4)  # from the buffer: no read on the socket
        self.raw_requestline = lines[0].encode("iso-8859-1") + b"\r\n"
        self.requestline = lines[0]
        self.command, self.path, self.request_version = words
        self._take_headers(headers)
        try:
            self.do_GET()
            self.wfile.flush()
        except TimeoutError as e:
            self.log_error("Request timed out: %r", e)
            self.close_connection = True

    def date_time_string(self, timestamp: float | None = None) -> str:
        """The Date header, formatted once a second."""
        if timestamp is not None:
            return super().date_time_string(timestamp)
        now = int(time.time())
        cached = _Handler._date
        if cached[0] != now:
            cached = _Handler._date = (now, http_date(now))
        return cached[1]

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            srv = self.server
            om = srv.openmetrics is not None and (
                "application/openmetrics-text" in self.headers.get("Accept", ""))
            try:
                body = srv.openmetrics() if om else srv.render()  # type: ignore[misc]
            except Exception:
                log.exception("kvscope: rendering /metrics failed")
                self._send(500, b"rendering failed\n", "text/plain; charset=utf-8")
                return
            gz = "gzip" in self.headers.get("Accept-Encoding", "")
            if gz:
                src = srv.openmetrics if om else srv.render
                cached = getattr(src, "gzipped", None)
                body = cached() if cached is not None else gzip.compress(body, 1)
            self._send(200, body, OPENMETRICS_TYPE if om else srv.content_type, gz)
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
        openmetrics: returns the OpenMetrics exposition, served when the scraper's Accept
            header asks for it (None: always `render`).
    """

    daemon_threads = True
    request_queue_size = BACKLOG

    def __init__(self, address: str, port: int, render: Callable[[], bytes],
                 content_type: str, *, openmetrics: Callable[[], bytes] | None = None) -> None:
        self.address_family = _family(address, port)
        self.render = render
        self.openmetrics = openmetrics
        self.content_type = content_type
        super().__init__((address, port), _Handler)
        self._thread: threading.Thread | None = None
        self._closing = False
        self._wake_r = self._wake_w = -1

    def start(self) -> None:
        """Serve on a daemon thread. It sleeps in the kernel until a connection or `stop()`
        (a pipe wakes it), where `serve_forever` would wake every poll interval to look for
        a shutdown request: a few wake-ups a second cost an idle agent more CPU than its
        scrapes."""
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._serve, name="kvscope-http", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while not self._closing:
                ready = sel.select()
                if self._closing:
                    break
                for key, _ in ready:
                    if key.fileobj is self:
                        self._handle_request_noblock()

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._closing = True
        if self._wake_w >= 0:
            os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(5)
        self.server_close()
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1


def _family(address: str, port: int) -> socket.AddressFamily:
    infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    return infos[0][0] if infos else socket.AF_INET


class SnapshotFile:
    """The bytes of a file another process replaces atomically, re-read when it changed (and
    gzipped once per version, not once per scrape)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._key: tuple[int, int, int] | None = None
        self._data = b""
        self._gz: bytes | None = None
        self._lock = threading.Lock()

    def __call__(self) -> bytes:
        st = os.stat(self.path)
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        with self._lock:
            if key != self._key:
                with open(self.path, "rb") as fh:
                    self._data = fh.read()
                self._key = key
                self._gz = None
            return self._data

    def gzipped(self) -> bytes:
        data = self()
        with self._lock:
            if self._gz is None:
                self._gz = gzip.compress(data, 1)
            return self._gz


def main(argv: list[str] | None = None) -> int:
    """Serve the snapshot files of a directory until standard input closes."""
    ap = argparse.ArgumentParser(prog="python -m agent.exporters.http")
    ap.add_argument("--dir", required=True)
    ap.add_argument("--address", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--nice", type=int, default=10,
                    help="CPU priority below the engine's: a scrape can wait, a token cannot")
    args = ap.parse_args(argv)
    if args.nice:
        try:
            os.nice(args.nice)
        except OSError:
            pass
    text = SnapshotFile(os.path.join(args.dir, "metrics.txt"))
    om_path = os.path.join(args.dir, "metrics.om")
    om = SnapshotFile(om_path) if os.path.exists(om_path) else None
    try:
        srv = MetricsServer(args.address, args.port, text, TEXT_TYPE, openmetrics=om)
    except OSError as exc:
        print(f"error {exc.errno or errno.EINVAL} {exc.strerror or exc}", flush=True)
        return 2
    print(f"ready {srv.server_address[1]}", flush=True)
    srv.start()
    try:
        while sys.stdin.buffer.read(1):  # EOF: the parent closed the pipe or died
            pass
    finally:
        srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
