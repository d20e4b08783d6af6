"""The checks `kvscope analyze` runs on a run store, for the commands that read a run without
printing analyze's report (`kvscope compare`, `kvscope timeline`).

The store's own validation (run.json's fields and schema version, every table's schema, gaps
and missing tables) is `agent.runstore.open_run`'s, shared by every reader; this module adds
what analyze checks on top of it, and says each problem in the words of analyze's report:

- the run's state when it did not complete (`killed: its writer (pid 12) is gone; ...`);
- gaps in the store (missing parts, missing tables);
- partition: requests whose spans broke the partition rules;
- accounting: requests whose token accounting breaks the identity;
- ledger: accounting columns that disagree with the recorded lookups, loads, reads and copies.

Only problems are returned: a clean run gives an empty list.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

    from agent.runstore.reader import RunStore

__all__ = ["MAX_LISTED", "accounting_problem", "ledger_problem", "partition_problem",
           "run_checks"]

#: Requests listed by name in one line (as in analyze's report).
MAX_LISTED = 10


def _more(n: int) -> str:
    return f" and {n - MAX_LISTED} more" if n > MAX_LISTED else ""


def partition_problem(violations: pd.DataFrame) -> str | None:
    """analyze's `partition:` line when some request broke the partition rules, else None."""
    if not len(violations):
        return None
    listed = ", ".join(f"{x.request_id} ({x.violation})"
                       for x in violations.head(MAX_LISTED).itertuples())
    return (f"partition: {len(violations):,} request(s) broke the partition rules and were "
            f"resolved by the sweep line: {listed}{_more(len(violations))}")


def accounting_problem(identity: pd.DataFrame) -> str | None:
    """analyze's `accounting:` line when the token accounting identity breaks, else None."""
    if not len(identity):
        return None
    listed = ", ".join(f"{x.request_id} ({x.check}: expected {x.expected}, got {x.actual})"
                       for x in identity.head(MAX_LISTED).itertuples())
    return f"accounting: {len(identity):,} violation(s): {listed}"


def ledger_problem(consistency: Any) -> str | None:
    """analyze's `ledger:` line when accounting values disagree with the ledger, else None
    (also when the run has no ledger to check against: nothing is wrong then)."""
    m = consistency.mismatches
    if not consistency.available or not len(m):
        return None
    listed = ", ".join(f"{x.request_id} {x.column} recorded {x.recorded:,}, recomputed "
                       f"{x.recomputed:,}" for x in m.head(MAX_LISTED).itertuples())
    return (f"ledger: {len(m):,} accounting value(s) disagree with the recorded lookups, "
            f"loads, reads and copies: {listed}{_more(len(m))}")


def run_checks(store: RunStore, *, part: pd.DataFrame | None = None) -> list[str]:
    """The problems analyze would report about `store`, one line each (empty: none).

    Args:
        store: an opened run store (its requests and spans read).
        part: `analyzers.ttft.partition` of it, when the caller has one already.
    """
    from agent.runstore.reader import block_size_of
    from analyzers.accounting import check_identity
    from analyzers.consistency import check_consistency, kv_bytes_per_block_of
    from analyzers.ttft import partition, violations

    out: list[str] = []
    state = store.writer
    if state.status != "complete":
        out.append(f"the run is {state.describe()}")
    if store.gaps:
        out.append(f"gaps in the store: {'; '.join(store.gaps)}")
    req, spans = store.requests, store.spans
    if not len(req):
        return out
    if part is None:
        part = partition(req, spans)
    for line in (partition_problem(violations(part)), accounting_problem(check_identity(req)),
                 ledger_problem(check_consistency(
                     req, spans, block_size=block_size_of(store.meta),
                     kv_bytes_per_block=kv_bytes_per_block_of(store.meta)))):
        if line is not None:
            out.append(line)
    return out
