"""`kvscope run`: the instrumented engine against a workload, in real time.

Only typer and the standard library are imported here; torch, the engine and the exporters
load inside the command.
"""

from __future__ import annotations

import time
from pathlib import Path

import typer

# Mirrors kvscope.session.DEFAULT_METRICS_PORT (not imported: it would load numpy).
_DEFAULT_PORT = 9478


def _default_out(workload: str) -> Path:
    name = "trace" if workload.startswith("trace:") else workload
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def run(
    workload: str = typer.Option("docqa", "--workload", "-w",
                                 help="docqa, chat or trace:PATH (Mooncake JSONL)."),
    num_requests: int = typer.Option(30, "--num-requests", "-n", help="Requests to run."),
    seed: int = typer.Option(0, "--seed", help="Seed of the workload and the model's init."),
    out: Path | None = typer.Option(None, "--out", "-o",
                                    help="Run directory [default: runs/<workload>-<time>]."),
    model: str = typer.Option("small", "--model",
                              help="tiny, small, medium (random weights) or a Hugging Face "
                                   "Llama checkpoint directory."),
    block_size: int = typer.Option(16, "--block-size", help="Tokens per KV block."),
    num_blocks: int = typer.Option(512, "--num-blocks", help="Device KV pool size in blocks."),
    max_num_seqs: int = typer.Option(16, "--max-num-seqs", help="Requests running at once."),
    max_batched_tokens: int = typer.Option(512, "--max-batched-tokens",
                                           help="Token budget per step (chunked prefill)."),
    prefix_caching: bool = typer.Option(True, "--prefix-caching/--no-prefix-caching",
                                        help="Reuse cached KV blocks across requests."),
    rate: float = typer.Option(4.0, "--rate",
                               help="Poisson arrivals per second (docqa, chat); 0 = all at "
                                    "once. Traces use their own timestamps."),
    tenants: int = typer.Option(1, "--tenants",
                                help="Spread requests over N tenants (each its own cache "
                                     "namespace)."),
    scale: float | None = typer.Option(None, "--scale",
                                       help="trace: length factor; 512 x scale must be a "
                                            "multiple of --block-size [default: one block per "
                                            "trace block]."),
    time_scale: float = typer.Option(1.0, "--time-scale",
                                     help="trace: arrival-time factor (0.01 replays an hour "
                                          "in 36 s)."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda[:N]."),
    dtype: str | None = typer.Option(None, "--dtype",
                                     help="float32, float64, bfloat16, float16 [default: "
                                          "float32 on cpu, bfloat16 on cuda]."),
    metrics_port: int = typer.Option(_DEFAULT_PORT, "--metrics-port",
                                     help="Serve /metrics on this port while running; 0 = off."),
    listen_address: str = typer.Option("127.0.0.1", "--listen-address",
                                       help="Address /metrics binds (0.0.0.0 opens it)."),
    profile: bool = typer.Option(False, "--profile",
                                 help="Write a PyTorch profiler trace into the run directory."),
    threads: int = typer.Option(0, "--threads",
                                help="torch CPU threads; 0 = half the cores, at most 4."),
    collectors: bool = typer.Option(True, "--collectors/--no-collectors",
                                    help="Sample host (and GPU, NIC, RDMA where present) "
                                         "counters into the run store every second."),
    host_blocks: int = typer.Option(0, "--host-blocks",
                                    help="Host (CPU) KV tier size in blocks; 0 = none."),
    remote: str | None = typer.Option(None, "--remote",
                                      help="Remote KV tier: file://DIR or "
                                           "redis://HOST:PORT/DB [default: none]."),
    host_write: str = typer.Option("evict", "--host-write",
                                   help="How blocks reach the host tier: evict (device "
                                        "evictions are saved) or through (every new block)."),
    fault: list[str] = typer.Option([], "--fault",
                                    help="Inject a remote fault (repeatable): "
                                         "remote-latency=50ms, remote-error-rate=0.1, "
                                         "remote-corrupt-rate=0.05, remote-down-after=5s."),
    remote_timeout_ms: float = typer.Option(500.0, "--remote-timeout-ms",
                                            help="Deadline of one remote operation."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Run the instrumented paged-KV engine against a workload with real-time arrivals.

    Writes a run store (Parquet + run.json), serves /metrics on 127.0.0.1 while running and
    prints TTFT percentiles and the KV reuse share with its denominator.
    """
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from kvscope.session import RunOptions, run_session

    opts = RunOptions(
        workload=workload, num_requests=num_requests, seed=seed,
        out=out if out is not None else _default_out(workload), model=model,
        block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
        max_batched_tokens=max_batched_tokens, prefix_caching=prefix_caching, rate=rate,
        device=device, dtype=dtype, metrics_port=metrics_port, listen_address=listen_address,
        profile=profile, scale=scale, time_scale=time_scale, tenants=tenants, threads=threads,
        collectors=collectors, host_blocks=host_blocks, remote=remote, host_write=host_write,
        faults=tuple(fault), remote_timeout_ms=remote_timeout_ms,
    )
    err = Console(stderr=True)
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                        MofNCompleteColumn(), TextColumn("requests"), TimeElapsedColumn(),
                        console=err, disable=quiet, transient=False)
    task = progress.add_task(opts.workload, total=None)

    started = False

    def on_start(n: int, url: str | None) -> None:
        nonlocal started
        if url and not quiet:
            err.print(f"serving metrics at {url}")
        progress.update(task, total=n)
        progress.start()
        started = True

    try:
        summary = run_session(opts, on_start=on_start,
                              on_finished=lambda _o: progress.advance(task))
    finally:
        if started:  # stopping a progress that never started prints a stray blank line
            progress.stop()
    typer.echo("\n".join(summary.lines()))
