"""`MetricsServer` answers a request taken from its read buffer in one piece exactly as
http.server's line-by-line reading does (its `handle_one_request`, with the server's own
`parse_request`), and its Date header is http.server's."""

from __future__ import annotations

import email.utils
import gzip
import http.server
import random
import socket

import pytest

from agent.exporters import http as metrics_http
from agent.exporters.http import MetricsServer, http_date

BODY = b"x 1\n"
GZ = gzip.compress(BODY, mtime=0)


class _Render:
    """The body, and its gzip member fixed (gzip.compress stamps the time)."""

    def __call__(self) -> bytes:
        return BODY

    def gzipped(self) -> bytes:
        return GZ


@pytest.fixture()
def port():
    srv = MetricsServer("127.0.0.1", 0, _Render(), "text/plain")
    srv.start()
    try:
        yield srv.server_address[1]
    finally:
        srv.stop()


def _ask(port: int, raw: bytes) -> bytes:
    """Send `raw`, then half-close and read to EOF."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(raw)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    # The Date header is the second's: the two answers may straddle one.
    return b"\r\n".join(line for line in b"".join(chunks).split(b"\r\n")
                        if not line.startswith(b"Date: "))


CASES = [
    b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept-Encoding: gzip\r\n\r\n",
    b"GET /metrics?x=1 HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /metrics HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
    b"GET /metrics HTTP/1.0\r\n\r\n",
    b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n",
    b"GET /nope HTTP/1.1\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\nAccept-Encoding: identity\r\naccept-encoding: gzip\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\nHost : x\r\n\r\n",  # space before the colon: 400
    b"GET /metrics HTTP/1.1\r\n Host: x\r\n\r\n",  # a continuation line: 400
    b"GET /metrics HTTP/1.1\r\nno colon\r\n\r\n",
    b"GET /metrics HTTP/1.1\nHost: x\n\n",  # bare LF
    b"GET /metrics HTTP/1.1\r\nHost: x\nAccept-Encoding: gzip\r\n\r\n",
    b"GET /metrics HTTP/2.0\r\n\r\n",
    b"GET /metrics\r\n\r\n",
    b"HEAD /metrics HTTP/1.1\r\n\r\n",
    b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(100)) + b"\r\n",
    b"GET /metrics HTTP/1.1\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(101)) + b"\r\n",
    # Two requests in one segment, the second closing the connection.
    b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\nGET / HTTP/1.1\r\nConnection: close\r\n\r\n",
]


@pytest.mark.parametrize("raw", CASES)
def test_a_request_is_answered_as_http_server_reading_lines_answers_it(port, raw, monkeypatch):
    fast = _ask(port, raw)
    monkeypatch.setattr(metrics_http._Handler, "handle_one_request",
                        http.server.BaseHTTPRequestHandler.handle_one_request)
    assert _ask(port, raw) == fast


def test_the_fast_path_serves_metrics_gzipped_and_keeps_the_connection(port):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        for _ in range(3):
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept-Encoding: gzip\r\n\r\n")
            data = b""
            while b"\r\n\r\n" not in data:
                data += s.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.startswith(b"Content-Length")))
            while len(body) < length:
                body += s.recv(65536)
            assert head.startswith(b"HTTP/1.1 200 OK")
            assert b"Content-Encoding: gzip" in head
            assert gzip.decompress(body) == BODY


def test_http_date_is_what_http_server_writes():
    rng = random.Random(3)
    stamps = [0, 951_782_400, 1_709_164_800, 2**31 - 1, 4_102_444_800]
    stamps += [rng.randrange(0, 2**33) for _ in range(2000)]
    for t in stamps:
        assert http_date(t) == email.utils.formatdate(t, usegmt=True)
