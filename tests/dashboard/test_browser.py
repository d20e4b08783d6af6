"""End to end: `kvscope dashboard` serving the golden run, loaded in headless Chromium.

Streamlit renders client-side over a websocket, so a one-shot ``--screenshot`` can fire before
anything is drawn. The test drives Chromium through the DevTools protocol instead (the
``websockets`` client ships with Streamlit): navigate, poll the rendered text until the page
has finished running, check it, take the screenshot.
"""

from __future__ import annotations

import base64
import json
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from websockets.sync.client import ClientConnection, connect

from tests.conftest import GOLDEN_RUN, REPO, free_port, require_binary

_TIMEOUT_S = 90.0
_WIDTH, _HEIGHT = 1400, 1000


def _wait_http(url: str, proc: subprocess.Popen[bytes], deadline: float) -> bytes:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            raise AssertionError(f"process exited with {proc.returncode}: {out}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return resp.read()
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"{url} did not answer within {_TIMEOUT_S:.0f} s")


class DevTools:
    """The few DevTools protocol calls the test needs, over one page target."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.n = 0

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.n += 1
        self.ws.send(json.dumps({"id": self.n, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=_TIMEOUT_S))
            if msg.get("id") == self.n:
                assert "error" not in msg, msg
                return msg["result"]

    def eval(self, expression: str) -> Any:
        return self.call("Runtime.evaluate", expression=expression,
                         returnByValue=True)["result"].get("value")

    def plot_titles(self) -> list[str]:
        """Titles of the Plotly figures drawn so far (SVG text, not in innerText)."""
        return self.eval("Array.from(document.querySelectorAll('.js-plotly-plot .gtitle'))"
                         ".map(e => e.textContent)") or []

    def load(self, url: str, until: str, plots: int) -> str:
        """Navigate; wait until the page shows `until`, Streamlit has stopped running and
        `plots` Plotly figures are drawn; return the page text."""
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + _TIMEOUT_S
        text = ""
        while time.monotonic() < deadline:
            text = self.eval("document.body ? document.body.innerText : ''") or ""
            running = self.eval("!!document.querySelector('[data-testid=\"stStatusWidget\"]')")
            if until in text and not running and len(self.plot_titles()) >= plots:
                return self.eval("document.body.innerText")
            time.sleep(0.3)
        raise AssertionError(f"{url}: {until!r} and {plots} figure(s) not rendered within "
                             f"{_TIMEOUT_S:.0f} s; page text: {text[:500]!r}")

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot",
                                                    format="png")["data"]))


@pytest.fixture()
def dashboard_url() -> Iterator[str]:
    if not (GOLDEN_RUN / "run.json").exists():
        pytest.skip("golden run store not built")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvscope.cli", "dashboard", str(GOLDEN_RUN), "--port", str(port)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        assert _wait_http(f"{url}/_stcore/health", proc,
                          time.monotonic() + _TIMEOUT_S) == b"ok"
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture()
def devtools(tmp_path: Path) -> Iterator[DevTools]:
    chromium = require_binary("chromium")
    port = free_port()
    proc = subprocess.Popen(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}",
         f"--window-size={_WIDTH},{_HEIGHT}", f"--remote-debugging-port={port}", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        targets = json.loads(_wait_http(f"http://127.0.0.1:{port}/json/list", proc,
                                        time.monotonic() + _TIMEOUT_S))
        page = next(t for t in targets if t["type"] == "page")
        with connect(page["webSocketDebuggerUrl"], max_size=None) as ws:
            tools = DevTools(ws)
            # --window-size includes the (headless) window frame; pin the viewport itself.
            tools.call("Emulation.setDeviceMetricsOverride", width=_WIDTH, height=_HEIGHT,
                       deviceScaleFactor=1, mobile=False)
            yield tools
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", head[16:24])


def test_dashboard_in_chromium(dashboard_url: str, devtools: DevTools, tmp_path: Path) -> None:
    text = devtools.load(f"{dashboard_url}/", until="Top findings", plots=2)
    for expected in ("Overview", "golden · run store · 10 requests",
                     "Requests with a first token", "TTFT p99", "Requests", "KV cache",
                     "Hardware"):
        assert expected in text, expected
    assert "\nCompare\n" not in text  # one run: no Compare page in the navigation
    assert devtools.plot_titles()[:2] == ["TTFT percentiles over time (by arrival window)",
                                          "Mean TTFT by stage"]
    shot = tmp_path / "overview.png"
    devtools.screenshot(shot)
    assert _png_size(shot) == (_WIDTH, _HEIGHT)

    text = devtools.load(f"{dashboard_url}/kv_cache", until="Evictions", plots=4)
    assert "lookup tokens (" in text  # ratios print their denominators
    assert "Share of prompt tokens by layer" in devtools.plot_titles()
    devtools.screenshot(tmp_path / "kv_cache.png")
    assert _png_size(tmp_path / "kv_cache.png") == (_WIDTH, _HEIGHT)
