"""The run directory's layout, shared by the writer and the reader.

    run-dir/run.json                         what ran, its clock anchor, how it ended
    run-dir/<table>/part-<seq>.parquet       one Parquet dataset folder per table
    run-dir/<table>/.part-<seq>.parquet.<pid>.tmp   a part being written (never read)
"""

from __future__ import annotations

import re

RUN_JSON = "run.json"
PART_RE = re.compile(r"^part-(\d{5,})\.parquet$")


def part_name(seq: int) -> str:
    """The file name of part `seq` of a table."""
    return f"part-{seq:05d}.parquet"
