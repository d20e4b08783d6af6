"""The node agent's /metrics with gzip: the body rendered for the scrape, compressed once."""

from __future__ import annotations

import gzip
import http.client
import threading

from collectors.base import BaseCollector, Collection, Reading
from kvscope.node.config import AgentConfig
from kvscope.node.daemon import NodeAgent, _Served


class _Counting(BaseCollector):
    name = "nic"
    source = "nic"

    def __init__(self) -> None:
        super().__init__()
        self.runs = 0

    def collect(self) -> Collection:
        self.runs += 1
        col = Collection(self.runs)
        col.readings.append(Reading("kvscope_nic_receive_bytes_total", ("eth0",),
                                    float(self.runs)))
        return col


def _get(port: int, gz: bool) -> tuple[str | None, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/metrics", headers={"Accept-Encoding": "gzip"} if gz else {})
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.getheader("Content-Encoding"), body


def test_a_gzip_scrape_renders_once_and_compresses_that_body():
    # --interval 0.01: scrapes collect, so each render gives another body.
    node = NodeAgent(AgentConfig(port=0, interval_s=0.01), collectors=[_Counting()])
    rendered: list[bytes] = []
    real = node.render

    def render() -> bytes:
        rendered.append(real())
        return rendered[-1]

    node.render = render  # type: ignore[method-assign]
    node.start()
    try:
        port = node.address[1]
        for i in range(1, 4):
            enc, body = _get(port, gz=True)
            assert enc == "gzip"
            assert len(rendered) == i
            assert gzip.decompress(body) == rendered[-1]
            assert b'kvscope_nic_receive_bytes_total{device="eth0"}' in rendered[-1]
        enc, plain = _get(port, gz=False)
        assert enc is None and plain == rendered[-1] and len(rendered) == 4
    finally:
        node.shutdown()


def test_served_compresses_what_its_own_thread_rendered():
    bodies = iter([b"a" * 100, b"b" * 100])
    served = _Served(lambda: next(bodies))
    assert served() == b"a" * 100
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(served()))
    t.start()
    t.join()
    assert got == [b"b" * 100]
    assert gzip.decompress(served.gzipped()) == b"a" * 100
