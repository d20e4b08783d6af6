"""The bad-input contract, checked the same way everywhere: a refused command exits 2 with one
``kvscope: error: ...`` line on stderr, no traceback, nothing on stdout, and nothing under the
watched directory written, changed or removed."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvscope.cli import main


def snapshot(root: Path | None) -> dict[str, tuple[int, str] | None]:
    """Every file and directory under `root`: (size, sha256) for files, None for directories."""
    if root is None or not root.exists():
        return {}
    out: dict[str, tuple[int, str] | None] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_dir() and not p.is_symlink():
            out[rel] = None
        elif p.is_file():
            data = p.read_bytes()
            out[rel] = (len(data), hashlib.sha256(data).hexdigest())
    return out


def assert_refused(argv: Sequence[str], capsys: pytest.CaptureFixture[str], *,
                   watch: Path | None = None, match: str | None = None) -> str:
    """Run ``kvscope <argv>`` in-process and check the contract; return the error line.

    Args:
        argv: the arguments after ``kvscope``.
        capsys: pytest's capture (drained before the run).
        watch: a directory that must be left exactly as it was (the run's inputs and the
            place its outputs would go).
        match: a regex the error line must match (the file / record / field it names).
    """
    capsys.readouterr()
    before = snapshot(watch)
    rc = main([str(a) for a in argv])
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err + cap.out, cap.err
    assert rc == 2, f"exit {rc} for {list(argv)}: {cap.err or cap.out}"
    assert cap.err.startswith("kvscope: error: ") and cap.err.count("\n") == 1, cap.err
    assert cap.out == "", cap.out
    if match is not None:
        assert re.search(match, cap.err), f"{cap.err!r} does not match {match!r}"
    assert snapshot(watch) == before, "a refused command wrote, changed or removed files"
    return cap.err.rstrip("\n")
