"""Structural mutations for the fuzzers: a field's value replaced by a value of another type,
fields dropped, documents nested deeply, files cut short, gzip around garbage.

Every mutation is drawn through hypothesis (`st.data()`), so a failing example shrinks and
replays from the fixed seed.
"""

from __future__ import annotations

import copy
import gzip
import json
import math
from typing import Any

from hypothesis import strategies as st

#: values of the wrong type, out of range or degenerate, put where a field was
ODD_VALUES: tuple[Any, ...] = (
    "abc", "", "1e300", "-1", "0x10", {}, {"a": 1}, [], [1, 2], [[[]]], None, True, False,
    math.nan, math.inf, -math.inf, 1e300, -1e300, -1, 0, 1.5, -0.5, 2**63, 2**64, -(2**63) - 1,
    10**30, "\u00ff\u2028", "kvscope.queue#99999999999999999999999",
)
DEPTH = 3000  # deeper than orjson's 1024 and the standard library's recursion limit


#: stands for a value nested DEPTH lists deep until `to_bytes` writes it (json.dumps itself
#: would recurse too deeply on it)
DEEP = "\u0000deep\u0000"


def deep_json(depth: int = DEPTH) -> bytes:
    """JSON text of a value nested `depth` lists deep."""
    return b"[" * depth + b"]" * depth


def paths(doc: Any, limit: int = 5000) -> list[tuple[Any, ...]]:
    """Every (container path, key) below `doc`, breadth first, at most `limit`."""
    out: list[tuple[Any, ...]] = []
    todo: list[tuple[Any, tuple[Any, ...]]] = [(doc, ())]
    while todo and len(out) < limit:
        node, at = todo.pop(0)
        items = (node.items() if isinstance(node, dict)
                 else enumerate(node) if isinstance(node, list) else ())
        for k, v in items:
            out.append((*at, k))
            todo.append((v, (*at, k)))
    return out


def _parent(doc: Any, path: tuple[Any, ...]) -> Any:
    node = doc
    for k in path[:-1]:
        node = node[k]
    return node


def mutate_json(data: st.DataObject, doc: Any, n_max: int = 3,
                focus: tuple[Any, ...] | None = None,
                hot: tuple[tuple[Any, ...], ...] = ()) -> Any:
    """`doc` (a copy) with 1..n_max structural mutations at drawn places.

    Args:
        focus: the path of the list of records (``("traceEvents",)``); most mutations then
            go to one field of one record, the rest anywhere in the document.
        hot: field paths inside a record that the reader reads (``("args", "bytes")``; None
            stands for any list index); half the focused mutations go to one of them.
    """
    doc = json.loads(json.dumps(doc))
    for _ in range(data.draw(st.integers(1, n_max), label="mutations")):
        path = _draw_path(data, doc, focus, hot)
        if path is None:
            break
        parent = _parent(doc, path)
        op = data.draw(st.sampled_from(("replace", "replace", "replace", "drop", "deep",
                                        "duplicate")), label="op")
        key = path[-1]
        if op == "replace":
            # a copy: later mutations must not edit the shared constant
            parent[key] = copy.deepcopy(data.draw(st.sampled_from(ODD_VALUES), label="value"))
        elif op == "drop":
            del parent[key]
        elif op == "deep":
            parent[key] = DEEP
        elif isinstance(parent, list):
            parent.insert(key, json.loads(json.dumps(parent[key], allow_nan=True)))
    return doc


def _resolve(data: st.DataObject, node: Any, want: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """`want` inside `node`, None wildcards drawn as list indices; None if it is not there."""
    out: list[Any] = []
    for k in want:
        if k is None:
            if not isinstance(node, list) or not node:
                return None
            k = data.draw(st.integers(0, len(node) - 1), label="index")
        elif not isinstance(node, dict) or k not in node:
            return None
        out.append(k)
        node = node[k]
    return tuple(out)


def _draw_path(data: st.DataObject, doc: Any, focus: tuple[Any, ...] | None,
               hot: tuple[tuple[Any, ...], ...] = ()) -> tuple[Any, ...] | None:
    if focus is not None and data.draw(st.integers(0, 3), label="focused") > 0:
        try:
            records = _parent(doc, (*focus, None))
        except (KeyError, IndexError, TypeError):
            records = None
        if isinstance(records, list) and records:
            i = data.draw(st.integers(0, len(records) - 1), label="record")
            if hot and data.draw(st.booleans(), label="hot field"):
                got = _resolve(data, records[i], data.draw(st.sampled_from(hot), label="hot"))
                if got:
                    return (*focus, i, *got)
            inner = paths(records[i])
            if inner:
                return (*focus, i,
                        *inner[data.draw(st.integers(0, len(inner) - 1), label="field")])
            return (*focus, i)
    ps = paths(doc)
    return ps[data.draw(st.integers(0, len(ps) - 1), label="path")] if ps else None


def to_bytes(data: st.DataObject, doc: Any) -> bytes:
    """`doc` as JSON, then maybe cut, gzipped or replaced by garbage."""
    raw = json.dumps(doc, allow_nan=True).encode()  # NaN/Infinity literals: not JSON
    raw = raw.replace(json.dumps(DEEP).encode(), deep_json())
    return mutate_bytes(data, raw)


def mutate_bytes(data: st.DataObject, raw: bytes) -> bytes:
    """Whole-file damage: none (often), cut short, byte flips, gzip (of it or of garbage)."""
    damage = ("cut", "flip", "gzip", "gzip_cut", "gzip_garbage", "garbage", "bom")
    op = data.draw(st.sampled_from(("none",) * 10 + damage), label="file op")
    if op == "cut" and raw:
        return raw[: data.draw(st.integers(0, len(raw) - 1), label="cut at")]
    if op == "flip" and raw:
        b = bytearray(raw)
        for _ in range(data.draw(st.integers(1, 8), label="flips")):
            i = data.draw(st.integers(0, len(b) - 1), label="flip at")
            b[i] = data.draw(st.integers(0, 255), label="byte")
        return bytes(b)
    if op == "gzip":
        return gzip.compress(raw, mtime=0)
    if op == "gzip_cut":
        z = gzip.compress(raw, mtime=0)
        return z[: data.draw(st.integers(2, max(2, len(z) - 1)), label="cut gz at")]
    if op == "gzip_garbage":
        junk = data.draw(st.binary(min_size=0, max_size=64), label="junk")
        return gzip.compress(raw[:1] + junk, mtime=0)
    if op == "garbage":
        return data.draw(st.binary(min_size=1, max_size=64), label="garbage")
    if op == "bom":
        return b"\xef\xbb\xbf" + raw
    return raw
