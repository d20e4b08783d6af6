"""Per-process spool files: how each vLLM process hands its raw records to the run's sink.

Every process that hosts an observer part (the engine core's connector, each frontend's stat
logger) appends JSON lines to its own file `<run>/spool/<role>-<pid>.jsonl`: a header line
(role, pid, the process's clock anchor, what it observes), then one list per record. Records
are appended in memory on the hot path (one list append) and written in one `write()` at the
end of a step in which a request finished, else at most every 200 ms
(`observer.FLUSH_EVERY_NS`); a process that dies loses at most that much. The sink
(`kvscope.vllm.sink.join_run`) reads every spool file and writes the run store: one writer, no
cross-process locking, and the run store's layout stays the one docs/DESIGN.md gives.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.clock import ClockAnchor, process_anchor

SPOOL_DIR = "spool"


@dataclass(slots=True)
class Spool:
    """One process's spool file, read back."""

    path: Path
    role: str
    pid: int
    anchor: ClockAnchor
    meta: dict[str, Any]
    records: list[list[Any]] = field(default_factory=list)
    bad_lines: int = 0


class SpoolWriter:
    """Appends records of one process to its spool file (thread-safe, never raises).

    Args:
        run_dir: the run directory (created if missing).
        role: `scheduler` (the connector's process) or `frontend` (a stat logger).
        meta: what this process observes (vLLM version, block size, child connectors...).
    """

    def __init__(self, run_dir: str | os.PathLike[str], role: str,
                 meta: dict[str, Any] | None = None) -> None:
        self.anchor = process_anchor()
        d = Path(run_dir) / SPOOL_DIR
        d.mkdir(parents=True, exist_ok=True)
        self.path = d / f"{role}-{os.getpid()}.jsonl"
        k = 1
        while self.path.exists():  # a second observer of the same role in this process
            k += 1
            self.path = d / f"{role}-{os.getpid()}-{k}.jsonl"
        self._pending: list[list[Any]] = []
        self._lock = threading.Lock()
        self.errors = 0
        header = {"kind": "header", "role": role, "pid": os.getpid(),
                  "anchor": self.anchor.to_dict(), "meta": meta or {}}
        self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (lives with the process)
        self._fh.write(json.dumps(header, default=str) + "\n")
        self._fh.flush()

    def add(self, record: list[Any]) -> None:
        """(Hot path, any thread) queue one record: a list whose first item is its kind."""
        self._pending.append(record)  # list.append is atomic under the GIL

    def flush(self) -> None:
        """Write the queued records (one write call); failures are counted, never raised."""
        with self._lock:
            pending, self._pending = self._pending, []
            if not pending or self._fh.closed:
                return
            try:
                self._fh.write("".join(json.dumps(r, default=str) + "\n" for r in pending))
                self._fh.flush()
            except (OSError, ValueError, TypeError):
                self.errors += 1

    def close(self) -> None:
        self.flush()
        with self._lock:
            if not self._fh.closed:
                self._fh.close()


def read_spools(run_dir: str | os.PathLike[str]) -> list[Spool]:
    """Every spool file of a run, oldest first. A torn last line (a process killed mid-write)
    is skipped and counted in `bad_lines`.

    Raises:
        FileNotFoundError: the run has no spool directory.
        ValueError: a spool file has no header line (naming the file).
    """
    d = Path(run_dir) / SPOOL_DIR
    if not d.is_dir():
        raise FileNotFoundError(f"{d}: no spool directory (was the observer configured?)")
    out = []
    for p in sorted(d.glob("*.jsonl"), key=lambda q: (q.stat().st_mtime_ns, q.name)):
        lines = p.read_text(encoding="utf-8").splitlines()
        try:
            header = json.loads(lines[0]) if lines else None
        except json.JSONDecodeError:
            header = None
        if not isinstance(header, dict) or header.get("kind") != "header":
            raise ValueError(f"{p}: first line is not a kvscope spool header")
        a = header["anchor"]
        sp = Spool(p, str(header["role"]), int(header["pid"]),
                   ClockAnchor(wall_ns=int(a["wall_ns"]), mono_ns=int(a["mono_ns"])),
                   dict(header.get("meta") or {}))
        for line in lines[1:]:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                sp.bad_lines += 1
                continue
            if isinstance(rec, list) and rec and isinstance(rec[0], str):
                sp.records.append(rec)
            else:
                sp.bad_lines += 1
        out.append(sp)
    return out
