"""First render of each dashboard page on a large synthetic run, against the golden run.

    .venv/bin/python benchmarks/bench_dashboard.py [--requests 100000] [--repeat 3]

Builds a run store (``analyzers.synthetic`` requests and spans, plus layers, pool, NVML and NIC
samples and eviction events generated here) in a temporary directory, then renders every page
with Streamlit's AppTest. For each repeat, and interleaved with the same measurements on the
small golden run (the baseline, so machine noise hits both alike):

- ``cold``: the page rendered with empty caches (load + analyses + figures);
- ``first``: the page's first render after Overview has loaded the run (what a user switching
  pages waits for);
- ``warm``: a rerender with everything cached (what a widget interaction costs).

Prints medians (and min/max over repeats) per page, and the ratio large / golden.

With ``--browser`` it also serves both runs with ``kvscope dashboard`` and times each page in
headless Chromium (navigation until the page has stopped running and its figures are drawn):
the first visit, then a second one, for the large runs and the golden run alternately.

``--engine N`` records a real engine run of N requests (``kvscope run -n N --rate 0 --model
tiny``, with a host tier and a file:// remote: hundreds of Parquet parts, every table) and uses
it instead of the synthetic runs; ``--run PATH`` uses an existing run store.

``--before DIR`` times, in the same process and interleaved with the current dashboard, the
dashboard of another checkout (DIR holds its ``dashboard/`` package, e.g. a copy taken before a
change): the first render of each page in headless Chromium on the large run, a fresh server
per repeat, and prints after / before with a bootstrap interval over the repeats; also each
server's start-up (spawn until it answers its health check: work a server does before its first
session, such as preloading, is counted there and not hidden), and all pages' first renders
summed.

    .venv/bin/python benchmarks/bench_dashboard.py --engine 2000 --before /tmp/kvscope-before \
        --repeat 5 --browser-only
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agent.schema import TABLES  # noqa: E402

APP = REPO / "dashboard" / "streamlit_app.py"
GOLDEN = REPO / "tests" / "golden" / "run"
PAGES = ("views/overview.py", "views/requests.py", "views/kv_cache.py", "views/hardware.py",
         "views/compare.py")
_LAYERS = 4
_SAMPLE_NS = 100_000_000  # collectors sample every 100 ms


def _extra_tables(requests: pa.Table, rng: np.random.Generator) -> dict[str, pa.Table]:
    """Layers, samples and events consistent with the synthetic requests' accounting."""
    n = requests.num_rows
    col = {c: requests[c].to_numpy() for c in ("prompt_tokens", "device_hit_tokens",
                                                "host_loaded_tokens", "remote_loaded_tokens",
                                                "recomputed_tokens", "arrival_ns")}
    ids = requests["request_id"].combine_chunks()
    loaded = col["host_loaded_tokens"] + col["remote_loaded_tokens"]
    layers = pa.table({
        "request_id": ids.take(pa.array(np.repeat(np.arange(n), _LAYERS))),
        "layer": pa.array(np.tile(np.arange(_LAYERS, dtype=np.int32), n)),
        "hit_tokens": pa.array(np.repeat(col["device_hit_tokens"], _LAYERS)),
        "loaded_tokens": pa.array(np.repeat(loaded, _LAYERS)),
        "recomputed_tokens": pa.array(np.repeat(col["recomputed_tokens"], _LAYERS)),
        "prompt_tokens": pa.array(np.repeat(col["prompt_tokens"], _LAYERS)),
        "load_ns": pa.array(np.repeat(loaded * 400, _LAYERS)),
        "wait_ns": pa.array(np.repeat(loaded * 40, _LAYERS)),
    }, schema=TABLES["layers"])
    t0, t1 = int(col["arrival_ns"].min()), int(col["arrival_ns"].max())
    ts = np.arange(t0, t1 + _SAMPLE_NS, _SAMPLE_NS, dtype=np.int64)
    k = len(ts)
    in_use = rng.integers(100, 900, k).astype(np.float64)
    cached = np.floor((1000 - in_use) * rng.uniform(0.5, 1.0, k))
    series = [
        ("pool", "device", "in_use", in_use, "blocks"),
        ("pool", "device", "cached_free", cached, "blocks"),
        ("pool", "device", "empty", 1000 - in_use - cached, "blocks"),
        ("nvml", "0", "gpu_pcie_receive_bytes_per_second", rng.uniform(1e8, 2e10, k),
         "bytes_per_second"),
        ("nvml", "0", "gpu_utilization_ratio", rng.uniform(0.2, 1.0, k), "ratio"),
        ("nic", "eth0", "nic_receive_bytes_total", np.cumsum(rng.uniform(1e6, 1e9, k)),
         "bytes"),
        ("nic", "eth1", "nic_receive_bytes_total", np.cumsum(rng.uniform(1e6, 1e8, k)),
         "bytes"),
    ]
    samples = pa.table({
        "ts_ns": pa.array(np.tile(ts, len(series))),
        "source": pa.array(np.repeat([s[0] for s in series], k)),
        "entity": pa.array(np.repeat([s[1] for s in series], k)),
        "metric": pa.array(np.repeat([s[2] for s in series], k)),
        "value": pa.array(np.concatenate([s[3] for s in series])),
        "unit": pa.array(np.repeat([s[4] for s in series], k)),
    }, schema=TABLES["samples"])
    m = max(n // 50, 1)
    events = pa.table({
        "ts_ns": pa.array(np.sort(rng.integers(t0, t1 + 1, m))),
        "source": pa.array(np.full(m, "engine")), "name": pa.array(np.full(m, "eviction")),
        "request_id": pa.nulls(m, pa.string()),
        "detail": pa.array(np.full(m, '{"blocks": 16, "tier": "device"}')),
    }, schema=TABLES["events"])
    return {"layers": layers, "samples": samples, "events": events}


def build_run(path: Path, requests: int, *, seed: int = 0, **knobs: float) -> Path:
    """Write a synthetic run store of `requests` requests to `path`; returns `path`."""
    from agent.runstore import RunStoreWriter
    from tests.synthetic_run import SyntheticConfig, generate

    tables = generate(SyntheticConfig(requests=requests, seed=seed, **knobs))
    tables.update(_extra_tables(tables["requests"], np.random.default_rng(seed + 1)))
    w = RunStoreWriter(path, config={"workload": f"synthetic {requests}"},
                       run_id=f"synthetic-{requests}")
    w.write_all(tables)
    w.close()
    return path


def _render(runs: list[str], page: str, *, clear: bool, before: str | None = None,
            rerender: bool = False) -> float:
    """Seconds for one page render in AppTest (after optional cache clearing and a prior page)."""
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    if clear:
        st.cache_data.clear()
        st.cache_resource.clear()
    at = AppTest.from_file(str(APP), default_timeout=600)
    at.session_state["kvscope_runs"] = runs
    if before is not None:
        at.switch_page(before)
        at.run()
    at.switch_page(page)
    if rerender:
        at.run()
    t = time.perf_counter()
    at.run()
    dt = time.perf_counter() - t
    if at.exception:
        raise RuntimeError(f"{page}: {at.exception[0].message}")
    return dt


#: (URL path, text the page shows once it has run, figures it draws) per page. The current
#: dashboard serves the Overview at /overview (the root opens it there) with four figures.
_BROWSER_PAGES = (("overview", "Top findings", 3), ("requests", "Token accounting", 2),
                  ("kv_cache", "Evictions", 4), ("hardware", "samples from", 1),
                  ("compare", "Token accounting, A vs B", 1))
#: The same for a dashboard from before that change: its Overview is only at the root.
_BEFORE_PAGES = (("", "Top findings", 2), *_BROWSER_PAGES[1:])


def _pages_of(before: Path | None) -> tuple[tuple[str, str, int], ...]:
    """The pages to time on the dashboard of checkout `before` (None: this one): a checkout
    that already serves the Overview at /overview is timed as this one is."""
    if before is None:
        return _BROWSER_PAGES
    app = (before / "dashboard" / "streamlit_app.py").read_text()
    if 'url_path="overview"' not in app:
        return _BEFORE_PAGES
    if "echarts" in (before / "dashboard" / "views" / "overview.py").read_text():
        return _BROWSER_PAGES
    # An Overview of four Plotly figures (before it drew with ECharts).
    return (("overview", "Top findings", 4), *_BROWSER_PAGES[1:])


def _serve(runs: list[str], port: int, before: Path | None) -> subprocess.Popen[bytes]:
    """`kvscope dashboard RUNS`, or the dashboard of the checkout `before` (its package first
    on the path) served the same way."""
    if before is None:
        return subprocess.Popen([sys.executable, "-m", "kvscope.cli", "dashboard", *runs,
                                 "--port", str(port)], cwd=REPO, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    env = dict(os.environ, PYTHONPATH=f"{before}{os.pathsep}{REPO}")
    # Served as `kvscope dashboard` served it then: with its pre-import and warm-up when the
    # checkout has them (dashboard/serve.py), else by Streamlit alone.
    server = "dashboard.serve" if (before / "dashboard" / "serve.py").exists() else "streamlit"
    return subprocess.Popen(
        [sys.executable, "-m", server, "run", str(before / "dashboard" / "streamlit_app.py"),
         "--server.headless", "true", "--server.address", "127.0.0.1", "--server.port",
         str(port), "--browser.gatherUsageStats", "false", "--", *runs],
        cwd=before, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _browser_times(runs: list[str], profile: Path, before: Path | None = None,
                   visits: tuple[str, ...] = ("first", "second")
                   ) -> dict[tuple[str, str], float]:
    """Seconds per (visit, page) in headless Chromium against a fresh dashboard over RUNS
    (the current one, or that of checkout `before`). The first visit of the Overview is the
    run's first render (it loads the run and runs every analysis); each other page's first
    visit is its first render after that."""
    import json

    from websockets.sync.client import connect

    from tests.conftest import free_port
    from tests.dashboard.test_browser import DevTools, _wait_http

    port, cdp = free_port(), free_port()
    started = time.perf_counter()
    dash = _serve(runs, port, before)
    chrome = subprocess.Popen(
        ["/usr/bin/chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={profile}", "--window-size=1400,1000",
         f"--remote-debugging-port={cdp}", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out: dict[tuple[str, str], float] = {}
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_http(f"{url}/_stcore/health", dash, time.monotonic() + 120)
        # Start-up: until the server answers (what preloading in the server moves there).
        out[("startup", "server")] = time.perf_counter() - started
        targets = json.loads(_wait_http(f"http://127.0.0.1:{cdp}/json/list", chrome,
                                        time.monotonic() + 120))
        page = next(t for t in targets if t["type"] == "page")
        with connect(page["webSocketDebuggerUrl"], max_size=None) as ws:
            tools = DevTools(ws)
            for visit in visits:
                for path, until, plots in _pages_of(before):
                    t = time.perf_counter()
                    tools.load(f"{url}/{path}", until, plots)
                    out[(visit, path or "overview")] = time.perf_counter() - t
    finally:
        for proc in (chrome, dash):
            proc.terminate()
            proc.wait(timeout=30)
    return out


def _ratio_ci(after: list[float], before: list[float], *, n_boot: int = 2000,
              level: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """median(after) / median(before), with a percentile bootstrap interval (repeats
    resampled independently on each side)."""
    rng = np.random.default_rng(seed)
    a, b = np.asarray(after), np.asarray(before)
    ra = np.median(rng.choice(a, (n_boot, len(a))), axis=1)
    rb = np.median(rng.choice(b, (n_boot, len(b))), axis=1)
    lo, hi = np.quantile(ra / rb, [(1 - level) / 2, (1 + level) / 2])
    return float(np.median(a) / np.median(b)), float(lo), float(hi)


def _report_before_after(runs: list[str], before: Path, repeat: int, tmp: Path) -> None:
    """First render of each page, current dashboard vs checkout `before`, interleaved."""
    res: dict[tuple[str, str], list[float]] = {}
    for i in range(repeat):
        for state, where in (("before", before), ("after", None)):
            times = _browser_times(runs, tmp / f"profile-{state}-{i}", where, visits=("first",))
            for (_, page), dt in times.items():
                res.setdefault((state, page), []).append(dt)
            res.setdefault((state, "all pages"), []).append(
                sum(dt for (visit, _), dt in times.items() if visit == "first"))
            print(f"  repeat {i + 1}/{repeat} {state}: " + ", ".join(
                f"{page} {dt:.2f} s" for (_, page), dt in times.items()), flush=True)
    print(f"\nfirst render per page, headless Chromium, {repeat} fresh server(s) each, "
          f"interleaved\n{'page':<12}{'before s':>10}{'[min, max]':>16}{'after s':>10}"
          f"{'[min, max]':>16}{'after/before':>14}{'95 % CI':>18}")
    pages = ["server", *(path or "overview" for path, _, _ in _BROWSER_PAGES), "all pages"]
    for page in pages:
        b, a = res[("before", page)], res[("after", page)]
        r, lo, hi = _ratio_ci(a, b)
        print(f"{page:<12}{statistics.median(b):>10.2f}{f'[{min(b):.2f}, {max(b):.2f}]':>16}"
              f"{statistics.median(a):>10.2f}{f'[{min(a):.2f}, {max(a):.2f}]':>16}"
              f"{r:>14.2f}{f'[{lo:.2f}, {hi:.2f}]':>18}")


def engine_run(path: Path, requests: int) -> Path:
    """A real engine run of `requests` requests, all at once (tiny model, CPU, host tier and
    a file:// remote, so every table and tier counter is recorded)."""
    subprocess.run([sys.executable, "-m", "kvscope.cli", "run", "-n", str(requests), "--rate",
                    "0", "--model", "tiny", "--threads", "1", "--metrics-port", "0", "-q",
                    "--host-blocks", "64", "--remote", f"file://{path.parent / 'remote'}",
                    "-o", str(path)], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return path


def _report_browser(cases: dict[str, list[str]], repeat: int, tmp: Path) -> None:
    res: dict[tuple[str, str, str], list[float]] = {}
    for i in range(repeat):
        for name, runs in cases.items():
            for key, dt in _browser_times(runs, tmp / f"profile-{name}-{i}").items():
                res.setdefault((name, *key), []).append(dt)
    print(f"\nheadless Chromium\n{'page':<12}{'visit':<8}{'large median s':>15}"
          f"{'[min, max]':>18}{'golden s':>10}{'ratio':>8}")
    for path, _, _ in _BROWSER_PAGES:
        for visit in ("first", "second"):  # (the "startup" visit is not reported here)
            big = res[("large", visit, path or "overview")]
            small = res[("golden", visit, path or "overview")]
            mb, ms = statistics.median(big), statistics.median(small)
            print(f"{path or 'overview':<12}{visit:<8}{mb:>15.2f}"
                  f"{f'[{min(big):.2f}, {max(big):.2f}]':>18}{ms:>10.2f}{mb / ms:>8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--browser", action="store_true",
                    help="also time each page in headless Chromium (/usr/bin/chromium)")
    ap.add_argument("--engine", type=int, default=0, metavar="N",
                    help="record a real N-request engine run and use it as the large run")
    ap.add_argument("--run", type=Path, default=None, help="use this run store as the large run")
    ap.add_argument("--before", type=Path, default=None, metavar="DIR",
                    help="also time the dashboard of checkout DIR (before a change) in "
                         "Chromium, interleaved with this one")
    ap.add_argument("--browser-only", action="store_true",
                    help="skip the AppTest timings")
    args = ap.parse_args()
    import logging

    logging.getLogger("streamlit").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        if args.run is not None:
            big_a = big_b = str(args.run)
            print(f"large run: {args.run}")
        elif args.engine:
            big_a = big_b = str(engine_run(Path(tmp) / "engine" / "run", args.engine))
            print(f"recorded a {args.engine:,}-request engine run in "
                  f"{time.perf_counter() - t:.1f} s")
        else:
            big_a = str(build_run(Path(tmp) / "a", args.requests, seed=0))
            big_b = str(build_run(Path(tmp) / "b", args.requests, seed=1,
                                  remote_read_scale=3.0))
            print(f"built two {args.requests:,}-request runs in {time.perf_counter() - t:.1f} s")
        cases = {"large": [big_a, big_b], "golden": [str(GOLDEN), str(GOLDEN)]}
        if not args.browser_only:
            res: dict[tuple[str, str, str], list[float]] = {}
            for _ in range(args.repeat):
                for page in PAGES:
                    for name, runs in cases.items():  # interleaved: noise hits both alike
                        res.setdefault((name, page, "cold"), []).append(
                            _render(runs, page, clear=True))
                        res.setdefault((name, page, "first"), []).append(
                            _render(runs, page, clear=True, before="views/overview.py"))
                        res.setdefault((name, page, "warm"), []).append(
                            _render(runs, page, clear=False, rerender=True))
            _report_apptest(res)
        if args.browser:
            _report_browser(cases, args.repeat, Path(tmp))
        if args.before is not None:
            _report_before_after(cases["large"], args.before.resolve(), args.repeat, Path(tmp))


def _report_apptest(res: dict[tuple[str, str, str], list[float]]) -> None:
    print(f"AppTest\n{'page':<22}{'mode':<7}{'large median s':>15}{'[min, max]':>18}"
          f"{'golden s':>10}{'ratio':>8}")
    for page in PAGES:
        for mode in ("cold", "first", "warm"):
            big, small = res[("large", page, mode)], res[("golden", page, mode)]
            mb, ms = statistics.median(big), statistics.median(small)
            print(f"{page:<22}{mode:<7}{mb:>15.2f}{f'[{min(big):.2f}, {max(big):.2f}]':>18}"
                  f"{ms:>10.2f}{mb / ms:>8.1f}")


if __name__ == "__main__":
    main()
