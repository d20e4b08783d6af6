"""What `kvscope analyze` reads of a run, importable without pandas: the report's span columns
and its step spans read apart (`read_report_store`). Light on purpose, so that the command can
start the read on a thread before it imports the analyzers (`analyzers.report` re-exports
these names)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent.runstore.reader import RunStore

#: The span columns the report reads (`kvscope analyze` projects its read to them): all but
#: ``waits_on`` and ``clock``.
REPORT_SPAN_COLUMNS: tuple[str, ...] = (
    "request_id", "request_num", "kind", "name", "start_ns", "end_ns", "tier", "layer",
    "tokens", "bytes", "step_id", "transfer_id", "batch_requests", "block")
#: The step spans' columns the cost model and the run's end need.
STEP_SPAN_COLUMNS: tuple[str, ...] = ("kind", "name", "start_ns", "end_ns", "tokens",
                                      "step_id", "batch_requests")
#: `open_run`'s ``apart`` for the spans: the step rows (most of a run's rows), which only the
#: step cost model reads, in `STEP_SPAN_COLUMNS`; the spans frame holds the others.
STEP_SPANS_APART: tuple[str, str, tuple[str, ...]] = ("kind", "step", STEP_SPAN_COLUMNS)


def read_report_store(path: str | os.PathLike[str]) -> RunStore:
    """A run as `kvscope analyze` reads it: every table, the spans projected to
    `REPORT_SPAN_COLUMNS` without their step rows, which are in ``store.apart["spans"]``
    (`STEP_SPAN_COLUMNS`, strings dictionary-encoded; ``build_report(store,
    steps=store.apart["spans"])``). Each spans part is decoded once for both. Arrow only:
    no DataFrame is built and pandas is not imported."""
    from agent.runstore.reader import open_run

    return open_run(path, columns={"spans": REPORT_SPAN_COLUMNS},
                    apart={"spans": STEP_SPANS_APART})
