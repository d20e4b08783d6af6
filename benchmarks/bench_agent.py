"""Node-agent cost against a real node_exporter, measured in the same run.

    .venv/bin/python benchmarks/bench_agent.py [--reps 5] [--scrapes 300] [--cycles 10000]

What it prints:
- CPU per /metrics scrape of `kvscope agent` and of node_exporter (Debian
  `prometheus-node-exporter`) in three configurations: default collectors; the agent's sources
  (netdev, cpu, meminfo, without its Go runtime metrics); netdev only. Every target runs as its
  own process on 127.0.0.1; each is scraped in blocks over one kept-alive connection with the
  headers Prometheus sends (gzip), blocks interleaved in a shuffled order and repeated; the CPU
  is the process's user+system time (psutil) over the block. Series counts come from one scrape.
- CPU of one full agent collection cycle (every collector once) and of rendering /metrics in
  the agent process, from 10,000 cycles driven back to back (not by the 1 s schedule), plus
  the agent's RSS at start, after 1,000 and after 10,000 cycles.
- Whether the agent process imported torch or pandas.

node_exporter collects at scrape time; the agent collects on its schedule and a scrape formats
the last snapshot. So the like-for-like figure is agent (cycle + scrape) against node_exporter's
scrape; both are printed.

At the real cadence (`--windows N`, the figure to quote): every target runs at once over the
same wall-clock windows of `--window-s` seconds, each scraped every `--scrape-interval` (15 s,
Prometheus' default; staggered, kept alive, gzip) and otherwise left alone; the agent runs with
its default `--interval` (1 s), once without `--out` (collection timed to the scrape) and once
with `--out DIR` (collection on the fixed cadence, the run store's samples). CPU per wall
second is each process's utime+stime+cutime+cstime from `/proc/PID/stat` (10 ms ticks;
reaped children included, for both alike) and, to the
nanosecond, the sum of `/proc/PID/task/*/schedstat` (threads still alive). node_exporter runs
(a) on the agent's sources, netdev + cpu + meminfo, and (b) with the series count no greater
than the agent's: netdev on as many of the agent's interfaces as fit. Ratios agent/node_exporter
are paired by window; median and its distribution-free interval (`benchstats`), load average.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from benchstats import load_average, median_interval

REPO = Path(__file__).resolve().parents[1]
PROM_HEADERS = {
    "Accept": "text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "Accept-Encoding": "gzip",
    "User-Agent": "Prometheus/2.45.0",
}
NE_CONFIGS: dict[str, list[str]] = {
    "node_exporter (default collectors)": [],
    "node_exporter (netdev+cpu+meminfo)": [
        "--collector.disable-defaults", "--collector.netdev", "--collector.cpu",
        "--collector.meminfo", "--web.disable-exporter-metrics"],
    "node_exporter (netdev only)": [
        "--collector.disable-defaults", "--collector.netdev", "--web.disable-exporter-metrics"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Target:
    name: str
    proc: subprocess.Popen
    port: int
    series: int = 0
    cpu_ms: list[float] = field(default_factory=list)
    wall_ms: list[float] = field(default_factory=list)


def scrape(conn: http.client.HTTPConnection) -> bytes:
    conn.request("GET", "/metrics", headers=PROM_HEADERS)
    resp = conn.getresponse()
    body = resp.read()
    if resp.status != 200:
        raise RuntimeError(f"scrape failed: HTTP {resp.status}")
    if resp.getheader("Content-Encoding") == "gzip":
        import gzip

        body = gzip.decompress(body)
    return body


def wait_serving(t: Target, timeout_s: float = 60) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if t.proc.poll() is not None:
            raise RuntimeError(f"{t.name} exited with {t.proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", t.port, timeout=5)
            body = scrape(conn)
            conn.close()
            if b"kvscope_nic" in body or b"node_" in body:
                t.series = sum(1 for line in body.decode().splitlines()
                               if line and not line.startswith("#"))
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{t.name} did not serve /metrics within {timeout_s} s")


def measure_block(t: Target, n: int) -> None:
    p = psutil.Process(t.proc.pid)
    conn = http.client.HTTPConnection("127.0.0.1", t.port, timeout=10)
    scrape(conn)  # open the connection outside the measured block
    c0 = p.cpu_times()
    w0 = time.perf_counter()
    for _ in range(n):
        scrape(conn)
    w1 = time.perf_counter()
    c1 = p.cpu_times()
    conn.close()
    t.cpu_ms.append(((c1.user + c1.system) - (c0.user + c0.system)) / n * 1e3)
    t.wall_ms.append((w1 - w0) / n * 1e3)


def child_cycles(cycles: int, out: str) -> dict[str, object]:
    """Runs in a fresh process: the agent's collectors and store, driven back to back."""
    from kvscope.node.config import AgentConfig
    from kvscope.node.daemon import NodeAgent

    node = NodeAgent(AgentConfig(port=0, out=out, interval_s=3600))
    node.open_store()
    me = psutil.Process()
    node.runner.collect_once()
    node.flush()
    rss_start = me.memory_info().rss
    block = 1000
    flush_every = 30  # --flush-interval 30 s / --interval 1 s: one part per 30 cycles
    per_cycle_ms: list[float] = []
    flush_ms: list[float] = []
    rss: dict[int, int] = {}
    done = 0
    while done < cycles:
        n = min(block, cycles - done)
        spent = 0
        for i in range(n):
            t0 = time.thread_time_ns()
            node.runner.collect_once()
            spent += time.thread_time_ns() - t0
            if (done + i + 1) % flush_every == 0:
                t0 = time.thread_time_ns()
                node.flush()
                flush_ms.append((time.thread_time_ns() - t0) / 1e6)
        per_cycle_ms.append(spent / n / 1e6)
        done += n
        rss[done] = me.memory_info().rss
    from prometheus_client import generate_latest

    render_ms, ref_ms = [], []
    for _ in range(5):
        t0 = time.thread_time_ns()
        for _ in range(200):
            node.render()
        render_ms.append((time.thread_time_ns() - t0) / 200 / 1e6)
        t0 = time.thread_time_ns()
        for _ in range(200):
            generate_latest(node.registry)
        ref_ms.append((time.thread_time_ns() - t0) / 200 / 1e6)
    node.shutdown()
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "pandas"))
    return {
        "cycles": cycles,
        "collectors": [c.name for c in node.runner.collectors],
        "cycle_ms_blocks": per_cycle_ms,
        "flush_ms": flush_ms,
        "flush_every": flush_every,
        "rss_start": rss_start,
        "rss_after": rss,
        "render_ms": render_ms,
        "generate_latest_ms": ref_ms,
        "samples_per_cycle": sum(len(c.samples) for c in node.runner.latest().values()),
        "heavy_modules": heavy,
    }


def proc_cpu(pid: int) -> tuple[float, float]:
    """(utime+stime+cutime+cstime seconds from /proc/PID/stat, sum of live threads'
    schedstat seconds)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # utime, stime, cutime, cstime (fields 14-17): the process and its reaped children.
    ticks = int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
    ns = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ns += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # the thread exited
    return ticks / os.sysconf("SC_CLK_TCK"), ns / 1e9


def count_series(port: int) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    body = scrape(conn)
    conn.close()
    return sum(1 for line in body.decode().splitlines() if line and not line.startswith("#"))


def start_ne(ne_bin: str, flags: list[str], name: str) -> Target:
    port = free_port()
    proc = subprocess.Popen([ne_bin, f"--web.listen-address=127.0.0.1:{port}", *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t = Target(name, proc, port)
    wait_serving(t)
    return t


def stop_all(targets: list[Target]) -> None:
    for t in targets:
        t.proc.terminate()
    for t in targets:
        try:
            t.proc.wait(15)
        except subprocess.TimeoutExpired:
            t.proc.kill()


NE_BASE = ["--collector.disable-defaults", "--web.disable-exporter-metrics"]


def cadence(args: argparse.Namespace, ne_bin: str, env: dict[str, str], tmp: Path) -> None:
    """CPU per wall second at the real cadence; see the module docstring."""
    targets: list[Target] = []
    try:
        for name, extra in (("kvscope agent (no --out)", []),
                            ("kvscope agent (--out)", ["--out", str(tmp / "cadence-run")])):
            port = free_port()
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvscope.cli", "agent", "--port", str(port), *extra],
                cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            targets.append(Target(name, proc, port))
            wait_serving(targets[-1])
        time.sleep(1.5)  # a second collection: the rate gauges (CPU utilization) appear
        agent_series = max(count_series(t.port) for t in targets[:2])
        for t in targets[:2]:
            t.series = count_series(t.port)
        # (b): netdev on the agent's interfaces, as many as keep the series <= the agent's.
        devs = sorted(os.listdir("/sys/class/net"))
        best: tuple[list[str], int] | None = None
        for k in range(1, len(devs) + 1):
            flags = [*NE_BASE, "--collector.netdev", "--collector.netdev.device-exclude=",
                     f"--collector.netdev.device-include=^({'|'.join(devs[:k])})$"]
            probe = start_ne(ne_bin, flags, "probe")
            stop_all([probe])
            if probe.series > agent_series:
                break
            best = (flags, probe.series)
        ne_cfgs: list[tuple[str, list[str]]] = [
            ("node_exporter netdev+cpu+meminfo", [*NE_BASE, "--collector.netdev",
                                                  "--collector.cpu", "--collector.meminfo"])]
        if best is not None:
            ne_cfgs.append(("node_exporter netdev, series <= agent", best[0]))
        for name, flags in ne_cfgs:
            targets.append(start_ne(ne_bin, flags, name))
        stat_ms: dict[str, list[float]] = {t.name: [] for t in targets}
        sched_ms: dict[str, list[float]] = {t.name: [] for t in targets}
        conns = {t.name: http.client.HTTPConnection("127.0.0.1", t.port, timeout=10)
                 for t in targets}
        # Staggered scrape times within each scrape interval, as Prometheus spreads targets.
        offset = {t.name: args.scrape_interval * i / len(targets) for i, t in enumerate(targets)}
        next_at = {t.name: time.monotonic() + offset[t.name] for t in targets}
        time.sleep(2.0)
        for _ in range(args.windows):
            w0 = time.monotonic()
            c0 = {t.name: proc_cpu(t.proc.pid) for t in targets}
            end = w0 + args.window_s
            while True:
                now = time.monotonic()
                if now >= end:
                    break
                due = min(next_at.values())
                if due > now:
                    time.sleep(min(due, end) - now)
                    continue
                for t in targets:
                    if next_at[t.name] <= now:
                        scrape(conns[t.name])
                        next_at[t.name] += args.scrape_interval
            w1 = time.monotonic()
            for t in targets:
                a, b = c0[t.name], proc_cpu(t.proc.pid)
                stat_ms[t.name].append((b[0] - a[0]) / (w1 - w0) * 1e3)
                sched_ms[t.name].append((b[1] - a[1]) / (w1 - w0) * 1e3)
        for c in conns.values():
            c.close()
    finally:
        stop_all(targets)

    print()
    print(f"real cadence: {args.windows} windows x {args.window_s:g} s, every target scraped "
          f"every {args.scrape_interval:g} s (staggered, kept alive, gzip), agent at its default "
          f"--interval; load average {load_average()}")
    print("CPU ms per wall second, median [min-max] over windows: /proc/PID/stat "
          "utime+stime+cutime+cstime "
          "(10 ms ticks) | task schedstat (ns)")
    for t in targets:
        print(f"  {t.name:38} {t.series:4d} series  stat {fmt_ms(stat_ms[t.name])}  "
              f"schedstat {fmt_ms(sched_ms[t.name])}")
    for t in targets[len(targets) - len(ne_cfgs):]:
        flags = " ".join(f for f in t.proc.args[2:] if f not in NE_BASE)  # type: ignore[union-attr]
        print(f"  {t.name}: flags {' '.join(NE_BASE)} {flags}")
    total_s = args.windows * args.window_s
    print(f"  /proc/PID/stat over all {total_s:g} s: " + "; ".join(
        f"{t.name} {statistics.fmean(stat_ms[t.name]):.3f} ms/s" for t in targets))
    print("ratio agent / node_exporter of schedstat CPU per window (paired): median "
          "[interval]; ratio of the stat totals")
    for a in targets[:2]:
        for ne in targets[2:]:
            d = sched_ms
            ratios = [x / y for x, y in zip(d[a.name], d[ne.name], strict=True) if y > 0]
            lo, hi, cov = median_interval(ratios)
            ne_stat = statistics.fmean(stat_ms[ne.name])
            tot = (f"{statistics.fmean(stat_ms[a.name]) / ne_stat:.2f}" if ne_stat > 0
                   else "n/a (no tick)")
            print(f"  {a.name} / {ne.name}: {statistics.median(ratios):.3f} "
                  f"[{lo:.3f}-{hi:.3f}] ({cov:.0%} interval, {len(ratios)} windows); stat "
                  f"totals {tot}; series {a.series} vs {ne.series}")


def fmt_ms(xs: list[float]) -> str:
    return f"{statistics.median(xs):7.3f} [{min(xs):.3f}-{max(xs):.3f}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions")
    ap.add_argument("--scrapes", type=int, default=300, help="scrapes per block")
    ap.add_argument("--cycles", type=int, default=10_000, help="collection cycles driven")
    ap.add_argument("--windows", type=int, default=0,
                    help="real-cadence windows (0: skip that part)")
    ap.add_argument("--window-s", type=float, default=60.0, help="seconds per window")
    ap.add_argument("--scrape-interval", type=float, default=15.0,
                    help="seconds between scrapes of each target at the real cadence")
    ap.add_argument("--only-cadence", action="store_true",
                    help="skip the back-to-back scrape blocks and cycles")
    ap.add_argument("--child-cycles", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_cycles:
        print(json.dumps(child_cycles(args.child_cycles, args.child_out)))
        return 0

    ne_bin = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
    if ne_bin is None:
        print("node_exporter not found: apt-get install -y prometheus-node-exporter",
              file=sys.stderr)
        return 2
    ne_version = subprocess.run([ne_bin, "--version"], capture_output=True, text=True)
    ne_version = (ne_version.stdout or ne_version.stderr).splitlines()[0]
    tmp = Path(tempfile.mkdtemp(prefix="kvscope-bench-agent-"))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if args.only_cadence:
        try:
            print(f"kvscope node agent vs {ne_version}; host: {os.cpu_count()} CPUs")
            cadence(args, ne_bin, env, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return 0
    targets: list[Target] = []
    try:
        port = free_port()
        agent = subprocess.Popen(
            [sys.executable, "-m", "kvscope.cli", "agent", "--port", str(port), "--interval",
             "3600", "--out", str(tmp / "agent-run")],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        targets.append(Target("kvscope agent (/metrics)", agent, port))
        for name, flags in NE_CONFIGS.items():
            port = free_port()
            proc = subprocess.Popen([ne_bin, f"--web.listen-address=127.0.0.1:{port}", *flags],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            targets.append(Target(name, proc, port))
        for t in targets:
            wait_serving(t)
        agent_rss_start = psutil.Process(agent.pid).memory_info().rss
        rng = random.Random(0)
        for _ in range(args.reps):
            order = targets[:]
            rng.shuffle(order)
            for t in order:
                measure_block(t, args.scrapes)
        agent_rss_end = psutil.Process(agent.pid).memory_info().rss

        child = subprocess.run(
            [sys.executable, __file__, "--child-cycles", str(args.cycles), "--child-out",
             str(tmp / "cycles-run")], cwd=REPO, env=env, capture_output=True, text=True,
            timeout=3600)
        if child.returncode != 0:
            print(child.stderr, file=sys.stderr)
            return 1
        cyc = json.loads(child.stdout.strip().splitlines()[-1])
    finally:
        stop_all(targets)
        shutil.rmtree(tmp, ignore_errors=True)

    mib = 1 / (1 << 20)
    print(f"kvscope node agent vs {ne_version}; host: {os.cpu_count()} CPUs; "
          f"{args.reps} interleaved reps x {args.scrapes} scrapes (kept-alive, gzip); "
          "CPU = process user+system per scrape; median [min-max] over reps")
    print(f"{'target':38} {'series':>6}  {'CPU ms/scrape':>24}  {'us/series':>9}  "
          f"{'wall ms':>7}")
    for t in targets:
        med = statistics.median(t.cpu_ms)
        print(f"{t.name:38} {t.series:6d}  {fmt_ms(t.cpu_ms):>24}  "
              f"{med * 1e3 / max(t.series, 1):9.2f}  {statistics.median(t.wall_ms):7.3f}")
    agent_t = targets[0]
    cycle = statistics.median(cyc["cycle_ms_blocks"])
    scrape_ms = statistics.median(agent_t.cpu_ms)
    print()
    print(f"agent collection cycle ({', '.join(cyc['collectors'])}; "
          f"{cyc['samples_per_cycle']} samples): {fmt_ms(cyc['cycle_ms_blocks'])} ms CPU "
          f"(median of {len(cyc['cycle_ms_blocks'])} blocks of 1,000 back-to-back cycles)")
    print(f"agent run-store part every {cyc['flush_every']} cycles: "
          f"{statistics.median(cyc['flush_ms']):.3f} ms CPU per part (median of "
          f"{len(cyc['flush_ms'])}), {statistics.median(cyc['flush_ms']) / cyc['flush_every']:.3f}"
          " ms per cycle")
    print(f"agent /metrics render in-process: {fmt_ms(cyc['render_ms'])} ms; "
          f"prometheus-client generate_latest of the same registry: "
          f"{fmt_ms(cyc['generate_latest_ms'])} ms")
    print(f"agent cycle + scrape: {cycle + scrape_ms:.3f} ms")
    for t in targets[1:]:
        ne = statistics.median(t.cpu_ms)
        print(f"  vs {t.name}: scrape ratio agent/NE = {scrape_ms / ne:.2f}; "
              f"(cycle+scrape)/NE scrape = {(cycle + scrape_ms) / ne:.2f}; "
              f"per series = {(scrape_ms / agent_t.series) / (ne / t.series):.2f}")
    after = {int(k): v for k, v in cyc["rss_after"].items()}
    first = min(after)
    last = max(after)
    print()
    print(f"agent RSS (cycle process): start {cyc['rss_start'] * mib:.1f} MiB, after "
          f"{first:,} cycles {after[first] * mib:.1f} MiB, after {last:,} cycles "
          f"{after[last] * mib:.1f} MiB (growth after warm-up "
          f"{(after[last] - after[first]) / 1024:+.0f} KiB)")
    print(f"agent RSS (kvscope agent process): at start {agent_rss_start * mib:.1f} MiB, after "
          f"{args.reps * args.scrapes:,} scrapes {agent_rss_end * mib:.1f} MiB")
    print(f"torch/pandas imported by the agent: {cyc['heavy_modules'] or 'none'}")
    if args.windows:
        tmp = Path(tempfile.mkdtemp(prefix="kvscope-bench-agent-"))
        try:
            cadence(args, ne_bin, env, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
