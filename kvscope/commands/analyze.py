"""`kvscope analyze RUN`: the TTFT breakdown and token accounting of a run directory.

Light at import time (typer only); the analyzers and pandas load inside the command.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer

from kvscope.run_options import option

FORMATS = ("text", "markdown", "json")
GROUPS = ("tenant", "workload_class", "hit_class")


#: glibc's mallopt parameters (malloc.h) and what `_keep_freed_memory` sets them to. One
#: arena (``M_ARENA_MAX``) for every thread made afterwards: the reading threads, Arrow's
#: decoders and the report's threads then allocate from the heap the others freed (with an
#: arena each, what one thread freed stayed in its arena, and the next thread's arrays came
#: from fresh pages, each of which the kernel zeroes when first touched).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -2, -3, -8
_MALLOPT = ((_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 64 << 20), (_M_MMAP_THRESHOLD, 32 << 20),
            (_M_ARENA_MAX, 1))


def _keep_freed_memory() -> bool:
    """Let glibc's malloc keep the memory the analysis frees for its next allocations instead
    of handing it back to the kernel at once (which zeroes every page again when it is next
    touched: a fifth of the analysis' CPU time on a large run, most of it the cost model's
    bootstrap temporaries). A short-lived command's heap only; nothing else changes. Silently
    nothing where the C library is not glibc.

    Returns:
        whether glibc's malloc was set so (`_arrow_from_malloc` relies on it)."""
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        mallopt = ctypes.CDLL(None).mallopt
        done = [mallopt(ctypes.c_int(param), ctypes.c_int(value)) == 1
                for param, value in _MALLOPT]
    except (OSError, AttributeError, ValueError):
        return False
    return all(done)


@contextmanager
def _arrow_from_malloc(kept: bool) -> Iterator[None]:
    """While the report is made, Arrow allocates from the C library's malloc (its system
    pool), which `_keep_freed_memory` has told to keep what is freed, instead of its default
    mimalloc pool: mimalloc hands the pages Arrow frees (each Parquet part's decoded columns,
    once split) back to the kernel, which zeroes them again when the next part is decoded
    into them; on a large run that zeroing was a fifth of the command's CPU time. The same
    bytes either way (only where they live changes); the previous pool is restored
    afterwards (a buffer is always freed into the pool that allocated it). Nothing changes
    when malloc was not set (`kept` False) or when ``ARROW_DEFAULT_MEMORY_POOL`` names a
    pool: that choice stands."""
    import os

    if not kept or os.environ.get("ARROW_DEFAULT_MEMORY_POOL"):
        yield
        return
    import pyarrow as pa

    before = pa.default_memory_pool()
    pa.set_memory_pool(pa.system_memory_pool())
    try:
        yield
    finally:
        pa.set_memory_pool(before)


@contextmanager
def _without_cyclic_gc() -> Iterator[None]:
    """Python's cyclic garbage collector off while the report is made, on again (as it was)
    afterwards: the imports and the analysis allocate many objects, each batch of which
    set off a collection walking every object the imports made (about 200 of them, a
    tenth of a second on a large run), while what the analysis frees it frees by reference
    counting (its arrays and frames hold no cycles that grow with the run). The objects
    made meanwhile (the modules imported, mostly) are then counted among the oldest
    (``gc.freeze`` and ``gc.unfreeze``: no collection is run), so that the first young
    collection after does not walk them all at once."""
    import gc

    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if gc.get_freeze_count() == 0:  # a host's own frozen objects stay frozen
            gc.freeze()
            gc.unfreeze()
        if was:
            gc.enable()


def analyze(
    run: Path = typer.Argument(..., help="A kvscope run directory (holds run.json), or a file "
                               "to import: vLLM/SGLang /metrics text, vLLM OTLP JSON, a "
                               "PyTorch profiler trace (.json/.json.gz) or an Nsight Systems "
                               "SQLite export (picked by content)."),
    fmt: str = typer.Option("text", "--format", "-f", help="Output: text, markdown or json."),
    by: str | None = typer.Option(None, "--by",
                                  help="Split the TTFT table by tenant, workload_class or "
                                       "hit_class (each group with its request count)."),
    window_s: float | None = option("analyze", "window_s", None),
    output: Path | None = typer.Option(None, "--output", "-o",
                                       help="Write the report to this file instead of stdout "
                                            "(one line on stderr names it)."),
) -> None:
    """Where did TTFT go, stage by stage, and where did each prompt token's KV come from?

    Leads with the per-stage TTFT breakdown (p50/p90/p99 and share), then the accounting.
    Also: the measured prefill rate, the time reuse saved, per-layer table and the checks.
    Ratios print numerator / denominator (unit). --format json is a stable layout.
    """
    from agent.errors import InputError

    if fmt not in FORMATS:
        raise InputError(f"--format {fmt}: expected one of {', '.join(FORMATS)}")
    if by is not None and by not in GROUPS:
        raise InputError(f"--by {by}: expected one of {', '.join(GROUPS)}")

    window_ns = None if window_s is None else max(int(window_s * 1e9), 1)
    with _arrow_from_malloc(_keep_freed_memory()), _without_cyclic_gc():
        text = _report_text(run, fmt, by, window_ns)
    if output is None:
        typer.echo(text, nl=False)
    else:
        output.write_text(text)
        # stderr, so that stdout stays clean for pipelines
        from analyzers.units import fmt_bytes

        typer.echo(f"kvscope analyze: wrote {output} ({fmt}, {fmt_bytes(len(text.encode()))})",
                   err=True)


def _report_text(run: Path, fmt: str, by: str | None, window_ns: int | None) -> str:
    """The report on `run` (a run directory, or a file to import) in `fmt`."""
    from agent.errors import InputError

    if run.is_file():
        from analyzers.importers import load
        from analyzers.report import build_report, render_import

        imp = load(run)
        report = (build_report(imp.as_store(), by=by, window_ns=window_ns)
                  if len(imp.requests) else None)
        text = render_import(imp, report, fmt)
    else:
        # Only the span columns the report reads (Parquet decodes no others), and the step
        # spans (most of a run's rows) apart, reduced part by part to the step cost model's
        # samples as they are decoded, each part decoded once. Read on a thread (Arrow and
        # numpy only; both release the GIL while they work) while this one imports pandas
        # and the analyzers: on two cores the read and the imports overlap. A read that
        # fails raises here, as it did before.
        from concurrent.futures import ThreadPoolExecutor

        from analyzers.report_read import read_report_store

        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvscope-read") as pool:
            reading = pool.submit(read_report_store, run, samples=True)
            from analyzers.report import build_report, render

            store = reading.result()
        if not store.tables["requests"].num_rows:
            state = store.writer
            why = "" if state.status != "killed" else f"; the run was {state.describe()}"
            if "requests" in store.missing:
                from agent.runstore.reader import recorded_rows

                raise InputError(f"{run / 'requests'}: table missing (run.json records "
                                 f"{recorded_rows(store.meta, 'requests'):,} rows; its folder is "
                                 f"gone): nothing to analyze{why}")
            raise InputError(f"{run / 'requests'}: no requests recorded (nothing to "
                             f"analyze){why}")
        text = render(build_report(store, by=by, window_ns=window_ns,
                                   steps=store.apart["spans"]), fmt)
    return text
