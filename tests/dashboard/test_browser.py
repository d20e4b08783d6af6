"""End to end: `kvscope dashboard` serving real runs, loaded in headless Chromium.

Streamlit renders client-side over a websocket, so a one-shot ``--screenshot`` can fire before
anything is drawn. The test drives Chromium through the DevTools protocol instead (the
``websockets`` client ships with Streamlit): navigate, poll the rendered text until the page
has finished running, check it, take the screenshot.

Besides the golden run, three dashboards over engine runs (tiny model, CPU) with a host tier
and a file:// remote: a healthy run, a fault run (remote errors injected, so failed loads and
an open breaker show) and the two compared. Every page is loaded by its own URL; the numbers
on it are checked against ``kvscope analyze --format json`` (and ``kvscope compare --format
json``) of the same runs, formatted the same way. Screenshots go to the test's tmp_path (the
test prints it) and are copied to /tmp/kvscope-screens/.
"""

from __future__ import annotations

import base64
import json
import shutil
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

from analyzers.units import fmt_ns
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
        """Titles of the charts drawn so far, in page order: Plotly figures' (SVG text, not in
        innerText) and ECharts charts' (their ARIA label, set when ECharts has drawn)."""
        return self.eval(
            "Array.from(document.querySelectorAll('.js-plotly-plot .gtitle, "
            "[data-testid=\"stEChartsChart\"][aria-label]')).map(e => e.matches('.gtitle') "
            "? e.textContent : e.getAttribute('aria-label'))") or []

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

    def full_screenshot(self, path: Path) -> None:
        """The whole page: Streamlit scrolls inside its main block, not the body, so the
        viewport is grown to the content's height for the shot, then put back."""
        height = self.eval("Math.max(...Array.from(document.querySelectorAll("
                           "'[data-testid=\"stMain\"], [data-testid=\"stAppViewContainer\"], "
                           "section')).map(e => e.scrollHeight), document.body.scrollHeight)")
        height = max(int(height or _HEIGHT), _HEIGHT)
        self.call("Emulation.setDeviceMetricsOverride", width=_WIDTH, height=min(height, 12000),
                  deviceScaleFactor=1, mobile=False)
        time.sleep(1.0)  # Plotly redraws for the new size
        try:
            self.screenshot(path)
        finally:
            self.call("Emulation.setDeviceMetricsOverride", width=_WIDTH, height=_HEIGHT,
                      deviceScaleFactor=1, mobile=False)

    def problems(self) -> list[str]:
        """Exception boxes and "Page not found" on the page (what must never show)."""
        found = []
        if self.eval("document.querySelectorAll('[data-testid=\"stException\"]').length"):
            found.append("exception: " + (self.eval(
                "document.querySelector('[data-testid=\"stException\"]').innerText") or ""))
        text = self.eval("document.body ? document.body.innerText : ''") or ""
        if "Page not found" in text:
            found.append("Page not found")
        return found


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


@pytest.fixture(scope="module")
def devtools(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevTools]:
    tmp_path = tmp_path_factory.mktemp("chromium")
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
    text = devtools.load(f"{dashboard_url}/", until="Top findings", plots=3)
    for expected in ("Overview", "golden · run store · 10 requests",
                     "Requests with a first token", "TTFT p99", "Requests", "KV cache",
                     "Hardware"):
        assert expected in text, expected
    assert "\nCompare\n" not in text  # one run: no Compare page in the navigation
    assert devtools.plot_titles()[:2] == ["Where TTFT went: mean by stage",
                                          "Where the prompt tokens' KV came from"]
    shot = tmp_path / "overview.png"
    devtools.screenshot(shot)
    assert _png_size(shot) == (_WIDTH, _HEIGHT)

    text = devtools.load(f"{dashboard_url}/kv_cache", until="Evictions", plots=4)
    assert "lookup tokens (" in text  # ratios print their denominators
    assert "Share of prompt tokens by layer" in devtools.plot_titles()
    devtools.screenshot(tmp_path / "kv_cache.png")
    assert _png_size(tmp_path / "kv_cache.png") == (_WIDTH, _HEIGHT)


# ---- engine runs: a healthy one, a fault one, the two compared -------------------------------

SCREENS = Path("/tmp/kvscope-screens")
_ENGINE = ["-m", "kvscope.cli", "run", "-n", "60", "--rate", "20", "--model", "tiny",
           "--threads", "1", "--metrics-port", "0", "-q", "--num-blocks", "96",
           "--host-blocks", "32"]
#: Remote faults of the fault run. At 0.5 the retries hide most errors from the breakers of
#: a 60-request run; at 0.9 failed loads, remote errors and an open breaker all show.
_FAULTS = ["--fault", "remote-error-rate=0.9"]


def _cli_json(*args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "kvscope.cli", *args, "--format", "json"],
                         cwd=REPO, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``healthy`` and ``fault`` runs of the instrumented engine, recorded side by side."""
    base = tmp_path_factory.mktemp("runs")
    procs = {}
    for name, extra in (("healthy", []), ("fault", _FAULTS)):
        procs[name] = subprocess.Popen(
            [sys.executable, *_ENGINE, "--remote", f"file://{base / ('remote-' + name)}",
             "-o", str(base / name), *extra],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name}: {out.decode(errors='replace')}"
    return {name: base / name for name in procs}


@pytest.fixture(scope="module")
def dashboards(engine_runs: dict[str, Path]) -> Iterator[dict[str, str]]:
    """One `kvscope dashboard` per case (started together, reused across its pages)."""
    cases = {"healthy": [engine_runs["healthy"]], "fault": [engine_runs["fault"]],
             "compare": [engine_runs["healthy"], engine_runs["fault"]]}
    procs: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    try:
        for case, runs in cases.items():
            port = free_port()
            procs[case] = (subprocess.Popen(
                [sys.executable, "-m", "kvscope.cli", "dashboard", *map(str, runs), "--port",
                 str(port)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT),
                f"http://127.0.0.1:{port}")
        for proc, url in procs.values():
            assert _wait_http(f"{url}/_stcore/health", proc,
                              time.monotonic() + _TIMEOUT_S) == b"ok"
        yield {case: url for case, (_, url) in procs.items()}
    finally:
        for proc, _ in procs.values():
            proc.terminate()
        for proc, _ in procs.values():
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def screens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("screens")
    print(f"\nscreenshots: {d} (copied to {SCREENS})")
    SCREENS.mkdir(parents=True, exist_ok=True)
    return d


def _shoot(devtools: DevTools, screens: Path, name: str) -> None:
    shot = screens / f"{name}.png"
    devtools.full_screenshot(shot)
    width, height = _png_size(shot)
    assert width == _WIDTH and height >= _HEIGHT
    shutil.copy(shot, SCREENS / shot.name)


def _visit(devtools: DevTools, url: str, until: str, plots: int) -> str:
    """Load `url` and return its text with every run of whitespace as one space (a metric's
    label and value are separate lines or blocks, depending on the layout)."""
    text = devtools.load(url, until=until, plots=plots)
    assert devtools.problems() == [], url
    return " ".join(text.split())


def _share(r: dict[str, Any]) -> str:
    return "n/a" if r["value"] is None else f"{100 * r['value']:.1f} %"


def _check_run_pages(devtools: DevTools, url: str, run: Path, case: str,
                     screens: Path) -> dict[str, Any]:
    """Every page of a one-run dashboard, by its URL; the numbers against `kvscope analyze`."""
    report = _cli_json("analyze", str(run))
    ttft = {s["stage"]: s for s in report["ttft"]["stages"]}["ttft"]
    acct = report["accounting"]
    ratios = {r["key"]: r for r in acct["ratios"]}
    hit = ratios["token_hit_share"]
    n_req = report["run"]["requests"]

    # The root opens the Overview at its own URL.
    text = _visit(devtools, f"{url}/", "Top findings", 3)
    assert devtools.eval("location.pathname") == "/overview"
    text = _visit(devtools, f"{url}/overview", "Top findings", 3)
    assert f"{report['run']['run_id']} · run store · {n_req:,} requests" in text
    for expected in (
            f"Requests with a first token {report['ttft']['requests']:,}",
            f"Without a first token {report['ttft']['without_first_token']:,}",
            f"TTFT p50 {fmt_ns(ttft['p50_ns'])}", f"TTFT p99 {fmt_ns(ttft['p99_ns'])}",
            f"Token hit share {_share(hit)}",
            f"{hit['numerator']:,} / {hit['denominator']:,} {hit['unit']}",
            f"Failed-load tokens {acct['totals']['load_failed_tokens']:,}",
            f"{ratios['requests_load_failed']['numerator']:,} / "
            f"{ratios['requests_load_failed']['denominator']:,} requests met a failed load"):
        assert expected in text, (expected, text[:1500])
    for finding in report["findings"][:5]:
        assert " ".join(finding["title"].split()) in text, finding["title"]
    titles = devtools.plot_titles()
    assert {"Where TTFT went: mean by stage", "Where the prompt tokens' KV came from",
            "TTFT, failures, breaker and evictions on one time axis"} <= set(titles), titles
    _shoot(devtools, screens, f"{case}-overview")

    text = _visit(devtools, f"{url}/requests", "Token accounting", 2)
    assert any(t.endswith(": stages and transfers") for t in devtools.plot_titles())
    assert devtools.eval("Array.from(document.querySelectorAll('.js-plotly-plot "
                         ".annotation-text')).some(e => e.textContent.startsWith("
                         "'first token '))")
    _shoot(devtools, screens, f"{case}-requests")

    text = _visit(devtools, f"{url}/kv_cache", "Evictions", 4)
    for key in ("token_hit_share", "device_hit_share", "host_loaded_share",
                "remote_loaded_share", "prompt_recomputed"):
        r = ratios[key]
        assert f"{r['numerator']:,} / {r['denominator']:,} {r['unit']}" in text, key
    assert "Tier counters at the end of the run" in text
    titles = devtools.plot_titles()
    assert "Block pool states over time (blocks)" in titles
    assert "Share of prompt tokens by layer" in titles
    _shoot(devtools, screens, f"{case}-kv_cache")

    text = _visit(devtools, f"{url}/hardware", "samples from", 1)
    from agent.runstore import open_run

    cpu = open_run(run).samples
    cpu = cpu.loc[cpu["metric"] == "host_cpu_utilization_ratio", "value"]
    # A default series: utilisation (unless it never changed, e.g. both cores busy throughout
    # a run on a loaded machine: constant series are not defaults).
    assert ("host_cpu_utilization_ratio" in text) == bool(cpu.max() > cpu.min())
    assert "host_memory_total_bytes" not in text  # a constant: not a default
    if "nvml" not in text:
        assert "No GPU series: there are no NVML samples in this run" in text
    _shoot(devtools, screens, f"{case}-hardware")
    return report


def test_every_page_by_its_url_on_a_healthy_run(dashboards: dict[str, str],
                                               engine_runs: dict[str, Path],
                                               devtools: DevTools, screens: Path) -> None:
    report = _check_run_pages(devtools, dashboards["healthy"], engine_runs["healthy"],
                              "healthy", screens)
    # No remote faults: nothing failed on the remote (a healthy run may still lose KV that
    # its host tier evicted before it was read).
    failures = {f["reason"]: f["tokens"] for f in report["accounting"]["failures"]}
    assert failures["error"] == failures["timeout"] == failures["circuit_open"] == 0


def test_every_page_by_its_url_on_a_fault_run(dashboards: dict[str, str],
                                             engine_runs: dict[str, Path],
                                             devtools: DevTools, screens: Path) -> None:
    from agent.runstore import open_run

    report = _check_run_pages(devtools, dashboards["fault"], engine_runs["fault"], "fault",
                              screens)
    assert report["findings"], "the fault run should raise findings"
    text = _visit(devtools, f"{dashboards['fault']}/overview", "Top findings", 3)
    events = open_run(engine_runs["fault"]).events
    if (events["name"] == "circuit_open").any():
        assert "breaker open " in text  # when the remote went down, on the time axis
    assert "remote errors from" in text


def test_two_runs_compared_by_url(dashboards: dict[str, str], engine_runs: dict[str, Path],
                                  devtools: DevTools, screens: Path) -> None:
    url = dashboards["compare"]
    cmp = _cli_json("compare", str(engine_runs["healthy"]), str(engine_runs["fault"]))
    text = _visit(devtools, f"{url}/compare", "Token accounting, A vs B", 1)
    assert cmp["verdict"] in text  # the same intervals: the CLI's 2,000 resamples
    assert "2,000 bootstrap resamples" in text
    ids = [json.loads((engine_runs[k] / "run.json").read_text())["run_id"]
           for k in ("healthy", "fault")]
    assert f"{ids[0]} · run store" in text and f"{ids[1]} · run store" in text
    legend = devtools.eval("Array.from(document.querySelectorAll('.js-plotly-plot "
                           ".legendtext')).map(e => e.textContent)")
    assert legend[:2] == [f"A: {ids[0]}", f"B: {ids[1]}"]  # the selectors' labels
    _shoot(devtools, screens, "compare-compare")
    for page, until, plots in (("overview", "Top findings", 3),
                               ("requests", "Token accounting", 2),
                               ("kv_cache", "Evictions", 4), ("hardware", "samples from", 1)):
        text = _visit(devtools, f"{url}/{page}", until, plots)
        assert f"{ids[0]} · run store" in text  # the first run, by its label
