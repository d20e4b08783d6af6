"""Importers: what vLLM, SGLang, the PyTorch profiler and Nsight Systems export → kvscope frames.

`load(path)` picks the importer from the file's *content* (magic bytes, JSON keys, the SQLite
header, Prometheus text), not its extension, and returns an `ImportedRun`. `kvscope analyze FILE`
calls it for a file; a run directory goes to the run store instead.

| source | format | gives |
|---|---|---|
| ``vllm-prometheus-v0/-v1``, ``sglang-prometheus`` | /metrics text | distributions, ratios |
| ``kvscope-prometheus`` (``-agent-``) | kvscope's /metrics | stages, ratios, failures; hardware |
| ``vllm-otlp`` | OTLP/JSON `llm_request` spans | requests, other/queue/prefill |
| ``kineto`` | PyTorch profiler JSON(.gz) | kvscope.* stages, h2d, kernel totals |
| ``nsys`` | Nsight Systems SQLite | kvscope NVTX stages, h2d, kernel totals |
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable
from pathlib import Path

from agent.errors import InputError
from analyzers.importers.base import GZIP_MAGIC, ImportedRun

__all__ = ["FORMATS", "ImportedRun", "detect", "load"]

#: format name → "module:function"; imported lazily so `detect` stays cheap.
FORMATS: dict[str, str] = {
    "prometheus": "analyzers.importers.metrics_text:load_prometheus",
    "otlp": "analyzers.importers.otlp:load_otlp",
    "kineto": "analyzers.importers.kineto:load_kineto",
    "nsys": "analyzers.importers.nsys:load_nsys",
}
EXPECTED = ("Prometheus text, OTLP/JSON spans, a Kineto trace (.json/.json.gz) or an "
            "Nsight Systems SQLite export")
_HEAD = 1 << 16
_SQLITE = b"SQLite format 3\x00"
# A Prometheus exposition starts with a comment (# HELP / # TYPE) or a sample line.
_PROM_LINE = re.compile(
    rb"^(#\s*(HELP|TYPE|UNIT|EOF)\b|[a-zA-Z_:][a-zA-Z0-9_:]*(\{[^}]*\})?\s+[-+0-9.eEnaNIf]+)")


def detect(path: str | Path) -> str:
    """Which importer reads `path`, judged by content.

    Args:
        path: the file.
    Returns:
        A key of FORMATS: ``prometheus``, ``otlp``, ``kineto`` or ``nsys``.
    Raises:
        InputError: missing file, a directory, or content none of the importers reads.
    """
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{p}: is a directory (a run store needs run.json; importers read "
                         "files)")
    try:
        with p.open("rb") as f:
            head = f.read(_HEAD)
    except FileNotFoundError:
        raise InputError(f"{p}: no such file") from None
    except OSError as exc:
        raise InputError(f"{p}: cannot read ({exc.strerror or exc})") from None
    if not head:
        raise InputError(f"{p}: empty file (expected {EXPECTED})")
    if head.startswith(_SQLITE):
        return "nsys"
    if head.startswith(GZIP_MAGIC):
        head = _gunzip_head(head, p)
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    if text.startswith((b"{", b"[")):
        return _json_kind(p, text)
    if b"\x00" not in head[:4096] and _is_prometheus(text):  # NUL bytes: not text
        return "prometheus"
    kind = "binary data" if b"\x00" in head[:512] or _not_text(head) else "text"
    raise InputError(f"{p}: unrecognised {kind} (expected {EXPECTED})")


def load(path: str | Path) -> ImportedRun:
    """Import `path` with the importer its content calls for.

    Args:
        path: a file in one of the formats of FORMATS.
    Returns:
        The ImportedRun (requests, spans, distributions, ratios, what it can and cannot tell).
    Raises:
        InputError: unknown, truncated or foreign input, with one line naming the file.
    """
    p = Path(path)
    kind = detect(p)
    return _loader(kind)(p)


def _loader(kind: str) -> Callable[[Path], ImportedRun]:
    import importlib

    mod, fn = FORMATS[kind].split(":")
    return getattr(importlib.import_module(mod), fn)


def _gunzip_head(data: bytes, p: Path) -> bytes:
    d = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        out = d.decompress(data, _HEAD)
    except zlib.error as exc:
        raise InputError(f"{p}: corrupt gzip ({exc})") from None
    if not out:
        raise InputError(f"{p}: gzip with no readable content (truncated?)")
    return out


def _json_kind(p: Path, head: bytes) -> str:
    if b'"traceEvents"' in head:
        return "kineto"
    if b'"resourceSpans"' in head:
        return "otlp"
    # The telling key may come after a large first key: parse the whole document.
    from analyzers.importers.base import parse_json, read_bytes

    doc = parse_json(read_bytes(p), p)
    if isinstance(doc, dict):
        if "traceEvents" in doc:
            return "kineto"
        if "resourceSpans" in doc:
            return "otlp"
        keys = ", ".join(sorted(doc)[:5])
        raise InputError(f"{p}: JSON with neither traceEvents (Kineto) nor resourceSpans "
                         f"(OTLP); top-level keys: {keys or 'none'}")
    raise InputError(f"{p}: JSON {type(doc).__name__}, expected an object with traceEvents "
                     "(Kineto) or resourceSpans (OTLP)")


def _is_prometheus(text: bytes) -> bool:
    """The first line that is not a free comment is # HELP/# TYPE or a sample."""
    for line in text.splitlines()[:200]:
        line = line.strip()
        if not line:
            continue
        if _PROM_LINE.match(line):
            return True
        if not line.startswith(b"#"):
            return False
    return False


def _not_text(head: bytes) -> bool:
    try:
        head[:4096].decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.start < 4090  # a multibyte character cut at the end is still text
    return False
