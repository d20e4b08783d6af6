"""What scraping /metrics costs a running engine: TTFT with 20 scrapers against none.

    .venv/bin/python benchmarks/bench_scrape.py [--reps 4] [--requests 30] [--clients 20]
        [--scrapes-per-s 250]

Each repetition runs the same `kvscope run` session (the demo's setup: `--model small`, docqa
at 4 requests/s, a 96-block device pool spilling to a 96-block host tier and a file:// remote)
three ways, in rotating order:

- `none`: /metrics off, nobody scrapes (the baseline);
- `thread`: /metrics from prometheus-client's server inside the engine's process (what
  `kvscope run` did before), scraped by `--clients` clients at `--scrapes-per-s` in all;
- `process`: /metrics from the snapshot child process (`agent.exporters.snapshot`, what
  `kvscope run` does now), scraped the same way.

The scrapers run in a process of their own at a lower CPU priority (they stand in for a
Prometheus on another machine; on this 2-core box they would otherwise take the engine's CPU),
keep their connections alive and ask for gzip, as Prometheus does. Printed: TTFT p50 and mean
per mode, and the ratio of each scraped mode to `none` within each repetition, with a bootstrap
95 % interval of its median over repetitions, plus the scrape rate the clients achieved.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a source checkout without installing
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from agent.runstore.reader import open_run  # noqa: E402
from kvscope.run_options import RunOptions  # noqa: E402
from kvscope.session import run_session  # noqa: E402

_SCRAPER = r"""
import http.client, os, sys, threading, time, urllib.parse
url, clients, rate, stop_file = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
# The scrapers stand in for a Prometheus on another machine: on this 2-core box they must not
# take the engine's CPU, so they run at a lower priority (as the /metrics child does).
os.nice(10)
u = urllib.parse.urlsplit(url)
done = [0]
errors = [0]
lock = threading.Lock()
def client():
    period = clients / rate
    nxt = time.monotonic()
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)  # kept alive, as
    while not os.path.exists(stop_file):                               # Prometheus does
        try:
            conn.request("GET", u.path, headers={"Accept-Encoding": "gzip"})
            conn.getresponse().read()
            with lock:
                done[0] += 1
        except Exception:
            conn.close()
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
            with lock:
                errors[0] += 1
        nxt += period
        time.sleep(max(0.0, nxt - time.monotonic()))
t0 = time.monotonic()
ts = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
for t in ts: t.start()
for t in ts: t.join()
print(done[0], errors[0], time.monotonic() - t0, flush=True)
"""

def _session(mode: str, out: Path, remote: Path, args: argparse.Namespace) -> dict[str, float]:
    stop = out.with_suffix(".stop")
    scraper: list[subprocess.Popen[str]] = []

    def on_start(_n: int, url: str | None) -> None:
        if url is not None:
            scraper.append(subprocess.Popen(
                [sys.executable, "-c", _SCRAPER, url, str(args.clients),
                 str(args.scrapes_per_s), str(stop)], stdout=subprocess.PIPE, text=True))
            time.sleep(0.2)  # the clients are up before the first request

    finished = [0]

    def on_finished(_out: object) -> None:
        finished[0] += 1
        if finished[0] == args.requests:  # the scrapers stop before the server does
            stop.touch()

    opts = RunOptions(workload="docqa", num_requests=args.requests, seed=0, out=out,
                      model="small", num_blocks=96, host_blocks=96,
                      remote=f"file://{remote}", rate=4.0, collectors=False,
                      metrics_port=0 if mode == "none" else _free_port())
    try:
        run_session(opts, on_start=on_start, on_finished=on_finished,
                    metrics_server="thread" if mode == "thread" else "process")
    finally:
        stop.touch()
        rate = errors = 0.0
        for p in scraper:
            line = p.communicate(timeout=60)[0].split()
            n, errors, wall = int(line[0]), int(line[1]), float(line[2])
            rate = n / wall
    req = open_run(out).requests
    ttft = (req["first_token_ns"].astype("int64") - req["arrival_ns"]).to_numpy() / 1e6
    return {"p50_ms": float(np.median(ttft)), "mean_ms": float(ttft.mean()),
            "scrapes_per_s": rate, "scrape_errors": errors}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ci(ratios: list[float], rng: np.random.Generator) -> tuple[float, float, float]:
    r = np.array(ratios)
    boots = np.median(rng.choice(r, size=(4000, len(r))), axis=1)
    return float(np.median(r)), float(np.quantile(boots, 0.025)), float(np.quantile(boots, 0.975))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--scrapes-per-s", type=float, default=250.0)
    args = ap.parse_args()
    modes = ["none", "thread", "process"]
    tmp = Path(tempfile.mkdtemp(prefix="kvscope-bench-scrape-"))
    remote = tmp / "remote"
    _session("none", tmp / "warmup", remote, args)  # torch init, and a warm remote for all
    results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for rep in range(args.reps):
        order = modes[rep % 3:] + modes[:rep % 3]
        for m in order:
            results[m].append(_session(m, tmp / f"{m}-{rep}", remote, args))
            print(f"rep {rep} {m:8s} {json.dumps(results[m][-1])}", file=sys.stderr)
    rng = np.random.default_rng(0)
    print(f"TTFT under /metrics scraping: {args.clients} clients at {args.scrapes_per_s:g} "
          f"scrapes/s, {args.reps} reps x {args.requests} docqa requests (model small, host + "
          "file:// tiers)")
    for m in modes:
        r = results[m]
        rates = [x["scrapes_per_s"] for x in r]
        errors = sum(x["scrape_errors"] for x in r)
        load = f"   scrapes {np.median(rates):6.1f}/s, errors {errors:.0f}" if m != "none" else ""
        print(f"  {m:8s} TTFT p50 {np.median([x['p50_ms'] for x in r]):7.2f} ms   mean "
              f"{np.median([x['mean_ms'] for x in r]):7.2f} ms{load}")
    for m in ("thread", "process"):
        for stat in ("p50_ms", "mean_ms"):
            ratios = [a[stat] / b[stat] for a, b in zip(results[m], results["none"], strict=True)]
            med, lo, hi = _ci(ratios, rng)
            print(f"  {m:8s} / none  TTFT {stat[:-3]:4s} ratio {med:6.2f}x  (95 % CI {lo:.2f} .. "
                  f"{hi:.2f})")


if __name__ == "__main__":
    main()
