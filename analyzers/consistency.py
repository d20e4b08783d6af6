"""The accounting recomputed from the physical operations (docs/DESIGN.md, "Token accounting").

The requests table's accounting columns are counters the engine keeps. This module recomputes
every one of them from other records — the `ledger` rows (each tier's lookup with the chain
range it promised, each admission's device hits, each load by the tier it came from, each
failed range with its reason, each preemption and write) and the `h2d` / `remote_read`
activity spans (each copy and read with its bytes, booked to the request that issued it) —
and compares them exactly. It never reads a counter to produce a counter, so one block booked
to the wrong tier, a byte counted twice or a promise counted at the wrong moment shows up as
a named request, column, recorded and recomputed value.

Rules it applies (the same ones the engine documents, re-derived here):

- The token columns describe the admission that produced the first token: the last
  `device_hit` row before the first token (for a request without one, its last admission).
- Promised (``host_hit_tokens``, ``remote_hit_tokens``): the part of the tier's lookup range
  beyond that admission's device hits. Found: loaded blocks outside their tier's lookup range.
- Failed: the admission's ``failed_<reason>`` rows.
- Bytes add up over every admission: ``host_read_bytes`` from host load rows, ``h2d_bytes``
  from the request's ``h2d`` spans, ``remote_read_bytes`` from the ``remote_read`` spans of
  the reads it issued and did not abandon (a read another request waited on is booked to its
  issuer), ``host_written_bytes`` from the blocks those reads staged plus host write rows,
  ``remote_written_bytes`` from remote write rows.
- ``preempted_loaded_tokens``: the loads of every admission a preemption ended.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from agent.schema import LOAD_FAIL_REASONS
from analyzers import frames as F
from analyzers.ttft import request_rows_by_num

__all__ = ["CHECKED_COLUMNS", "Consistency", "check_consistency", "kv_bytes_per_block_of"]

#: The accounting columns the check recomputes (the rest — prompt and output tokens — are
#: inputs, not counters).
CHECKED_COLUMNS: tuple[str, ...] = (
    "lookup_tokens", "device_hit_tokens", "host_hit_tokens", "remote_hit_tokens",
    "host_found_tokens", "remote_found_tokens", "host_loaded_tokens", "remote_loaded_tokens",
    "recomputed_tokens", "preempted_tokens", "preempted_loaded_tokens", "load_failed_tokens",
    *(f"load_failed_{r}_tokens" for r in LOAD_FAIL_REASONS),
    "host_read_bytes", "remote_read_bytes", "h2d_bytes", "host_written_bytes",
    "remote_written_bytes", "num_preemptions",
)

_LEDGER_COLS = ("request_id", "name", "start_ns", "tier", "tokens", "bytes", "block",
                "transfer_id")


@dataclass(slots=True, frozen=True)
class Consistency:
    """What `check_consistency` returns.

    Attributes:
        available: False when the run carries no ledger (an imported trace, a schema-1 store):
            nothing was checked, `reason` says why.
        requests: requests checked.
        columns: the columns checked (`CHECKED_COLUMNS` less those the run cannot support).
        mismatches: ``request_id, column, recorded, recomputed`` (empty when all agree).
        reason: why the check is unavailable, or which columns it left out and why.
    """

    available: bool
    requests: int = 0
    columns: tuple[str, ...] = ()
    mismatches: pd.DataFrame = field(default_factory=lambda: _mismatch_frame([]))
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.available and not len(self.mismatches)

    def to_dict(self) -> dict[str, Any]:
        from analyzers.ttft_summary import records

        return {"available": self.available, "requests": self.requests,
                "columns": list(self.columns), "mismatches": records(self.mismatches),
                "reason": self.reason}


def _mismatch_frame(rows: list[tuple[str, str, int, int]]) -> pd.DataFrame:
    return pd.DataFrame({
        "request_id": pd.Series([r[0] for r in rows], dtype=object),
        "column": pd.Series([r[1] for r in rows], dtype=object),
        "recorded": pd.Series([r[2] for r in rows], dtype=np.int64),
        "recomputed": pd.Series([r[3] for r in rows], dtype=np.int64),
    })


def kv_bytes_per_block_of(meta: dict[str, Any]) -> int | None:
    """KV payload bytes of one block (all layers, K and V), from a run's run.json."""
    cfg = meta.get("config") if isinstance(meta.get("config"), dict) else {}
    dev = (cfg.get("tiers") or {}).get("device") if isinstance(cfg.get("tiers"), dict) else None
    v = dev.get("kv_bytes_per_block") if isinstance(dev, dict) else None
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return v
    per_token, bs = cfg.get("kv_bytes_per_token"), cfg.get("block_size")
    if isinstance(per_token, int) and isinstance(bs, int) and per_token > 0 and bs > 0:
        return per_token * bs
    return None


#: Ledger row names the recomputation reads (`failed_<reason>` rows are told by their prefix).
_LOOKUP, _DEVICE_HIT, _LOAD, _FAILED, _PREEMPTED, _ABANDONED, _WRITE = range(7)
_NAME_CODES = {"lookup": _LOOKUP, "device_hit": _DEVICE_HIT, "load": _LOAD,
               "preempted": _PREEMPTED, "abandoned": _ABANDONED, "write": _WRITE}
_HOST, _REMOTE = 0, 1


class _Spans:
    """The span columns the check reads, decoded once for every row as codes (the request row
    each span names, by `_span_request_rows`; dictionary codes of names and tiers), then
    taken for the rows of one kind; the integers converted for the rows read only. No
    DataFrame is built, no string copied."""

    def __init__(self, spans: pd.DataFrame, requests: pd.DataFrame, unique_ids: bool) -> None:
        self.df = spans
        self.request = _span_request_rows(spans, requests, unique_ids)
        self.named = F.valid(spans["request_id"])
        self.name = F.categorize(spans["name"])
        self.tier = F.categorize(spans["tier"])

    def rows(self, kind: str) -> np.ndarray:
        return np.flatnonzero(F.equals(self.df["kind"], kind))

    def ints(self, col: str, rows: np.ndarray, fill: int = -1) -> np.ndarray:
        # the rows read gathered before they are converted: no whole-column array
        return F.ints_at(self.df[col], rows, fill)


def _span_request_rows(spans: pd.DataFrame, requests: pd.DataFrame, unique_ids: bool
                       ) -> np.ndarray:
    """`_request_rows` of the spans' ids, by the int64 ``request_num`` instead when it names
    the same rows: a run store writes each span's request_num with its request_id, so when
    both tables carry the numbers, the spans' numbers are null exactly where their ids are,
    and the requests' numbers and ids are each given once (`unique_ids`: no id null, none
    twice), a span's number and its id name the same request (as `analyzers.report` matches
    spans for the partition, `analyzers.frames.nums_name_ids`). An int64 join instead of
    hashing every span's string id."""
    if unique_ids and F.nums_name_ids(spans, requests):
        return request_rows_by_num(spans, requests)[0]
    return _request_rows(spans["request_id"], requests["request_id"])


def _request_rows(span_ids: pd.Series, request_ids: pd.Series) -> np.ndarray:
    """Row of the request each span names by its string ``request_id`` (-1: none; for an id
    that appears twice in `request_ids`, its first row)."""
    return F.request_index(span_ids, request_ids)


def _pairs_in(a_group: np.ndarray, a_key: np.ndarray, b_group: np.ndarray, b_key: np.ndarray
              ) -> np.ndarray:
    """For each pair ``(a_group[i], a_key[i])``: is it one of the ``(b_group, b_key)`` pairs?"""
    if not len(a_group) or not len(b_group):
        return np.zeros(len(a_group), dtype=bool)
    base = min(int(a_key.min()), int(b_key.min()))
    span = max(int(a_key.max()), int(b_key.max())) - base + 1
    top = max(int(a_group.max()), int(b_group.max())) + 1
    if span <= (1 << 62) // top:  # one int64 per pair
        return np.isin(a_group * span + (a_key - base), b_group * span + (b_key - base))
    have = set(zip(b_group.tolist(), b_key.tolist(), strict=True))
    return np.fromiter(((g, k) in have for g, k in zip(a_group.tolist(), a_key.tolist(),
                                                       strict=True)),
                       dtype=bool, count=len(a_group))


def check_consistency(requests: pd.DataFrame, spans: pd.DataFrame, *, block_size: int | None,
                      kv_bytes_per_block: int | None = None) -> Consistency:
    """Recompute every accounting column from the ledger and transfer spans; compare exactly.

    The ledger is replayed per request in time order (rows recorded at the same ns in the
    order they were recorded), as array operations over all requests at once: each row is
    booked to the admission (``device_hit`` row) current when it was recorded, and each
    request's columns are read off the admission that produced its first token.

    Args:
        requests: the run store's ``requests`` frame.
        spans: its ``spans`` frame (``ledger`` rows and ``h2d`` / ``remote_read`` activity).
        block_size: the run's KV block size (``agent.runstore.reader.block_size_of``).
        kv_bytes_per_block: payload bytes per block (`kv_bytes_per_block_of`); without it
            ``host_written_bytes`` (staged by remote reads) is not checked.

    Returns:
        a `Consistency`.
    """
    if not len(requests):
        return Consistency(False, reason="no requests")
    is_ledger = F.equals(spans["kind"], "ledger") if "kind" in spans else None
    if is_ledger is None or not is_ledger.any():
        return Consistency(False, reason="the run has no ledger rows; kvscope's engine records "
                           "them from run-store schema 2 on")
    if not block_size:
        return Consistency(False, reason="run.json does not give the block size")
    F.require_columns(spans, _LEDGER_COLS, "spans")
    columns = list(CHECKED_COLUMNS)
    reason = ""
    if kv_bytes_per_block is None:
        columns.remove("host_written_bytes")
        reason = "host_written_bytes not checked: run.json does not give the KV bytes per block"
    F.require_columns(requests, ("request_id", "first_token_ns", "prompt_tokens", *columns),
                      "requests")
    bs = block_size
    n = len(requests)
    want = _recompute(requests, spans, is_ledger, bs, kv_bytes_per_block)
    served = F.valid(requests["first_token_ns"])
    # Column by column (no request x column matrix is built), the mismatches then ordered
    # request by request, columns in their order.
    found: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    for j, c in enumerate(columns):
        recorded, expect = F.ints(requests[c], 0), want[c]
        bad = recorded != expect
        if c == "recomputed_tokens":  # the identity only holds with a first token
            bad &= served
        at = np.flatnonzero(bad)
        if len(at):
            found.append((at, np.full(len(at), j), recorded[at], expect[at]))
    rows: list[tuple[str, str, int, int]] = []
    if found:
        rows_i, cols_i, rec, exp = (np.concatenate(x) for x in zip(*found, strict=True))
        order = np.lexsort((cols_i, rows_i))
        ids = requests["request_id"].to_numpy(object)
        rows = [(ids[i], columns[j], int(r), int(e)) for i, j, r, e in zip(
            rows_i[order].tolist(), cols_i[order].tolist(), rec[order].tolist(),
            exp[order].tolist(), strict=True)]
    return Consistency(True, requests=n, columns=tuple(columns),
                       mismatches=_mismatch_frame(rows), reason=reason)


def _recompute(requests: pd.DataFrame, spans: pd.DataFrame, is_ledger: np.ndarray, bs: int,
               pb: int | None) -> dict[str, np.ndarray]:
    """Every checked column, recomputed per request (one int64 array per column).

    The records are gathered per *owner*: the first request row with the span's request id
    (each row of an id given twice reads the same records, with its own first token)."""
    n = len(requests)
    req_ids = requests["request_id"]
    owner = _request_rows(req_ids, req_ids)
    # Every id given once, none null (index_in matches a null with a null: one null id is
    # its own row here, and the string join books the spans without an id to it).
    unique_ids = bool((owner == np.arange(n)).all()) and bool(F.valid(req_ids).all())
    owner = np.where(owner >= 0, owner, np.arange(n))
    prompt = F.ints(requests["prompt_tokens"], 0)
    served = F.valid(requests["first_token_ns"])
    first_ns = F.ints(requests["first_token_ns"])
    out: dict[str, np.ndarray] = {}
    out["lookup_tokens"] = np.maximum(0, (prompt - 1) // bs * bs)

    sp = _Spans(spans, requests, unique_ids)
    led = np.flatnonzero(is_ledger)
    r_all = sp.request[led]
    t_all = sp.ints("start_ns", led)
    # Per owner, in time order; rows at the same ns in their recorded order (lexsort is
    # stable). Rows of requests not in the table are never read.
    order = np.flatnonzero(r_all >= 0)
    order = order[np.lexsort((t_all[order], r_all[order]))]
    r, t = r_all[order], t_all[order]
    names = (sp.name[0][led], sp.name[1])
    name_map: dict[str, int] = dict(_NAME_CODES)
    reasons: list[str] = []
    for v in names[1]:
        if v is not None and v.startswith("failed_") and v not in name_map:
            name_map[v] = _FAILED
            reasons.append(v.removeprefix("failed_"))
    code = F.recode(names, name_map)[order]
    reason_of = F.recode(names, {f"failed_{x}": i for i, x in enumerate(reasons)})[order]
    lo = led[order]  # the ledger rows in that order
    tier = F.recode((sp.tier[0][lo], sp.tier[1]), {"host": _HOST, "remote": _REMOTE})
    tokens = sp.ints("tokens", lo, 0)
    nbytes = sp.ints("bytes", lo, 0)
    block = sp.ints("block", lo, 0)
    tid = sp.ints("transfer_id", lo)

    # The admission each row is booked to: its owner's latest device_hit row up to it.
    is_dh = code == _DEVICE_HIT
    seen = np.cumsum(is_dh)  # device_hit rows up to and including each row
    starts = np.flatnonzero(np.r_[True, r[1:] != r[:-1]]) if len(r) else np.zeros(0, np.int64)
    before = np.repeat((seen - is_dh)[starts], np.diff(np.r_[starts, len(r)]))
    has_adm = seen > before
    adm = np.where(has_adm, seen - 1, -1)  # admission number: device_hit rows in this order
    n_adm = int(is_dh.sum())
    adm_owner, adm_hit, adm_t = r[is_dh], tokens[is_dh], t[is_dh]

    # Each tier's lookup range: the owner's last lookup row of the tier.
    lookup_lo = np.zeros((n, 2), np.int64)
    lookup_hi = np.zeros((n, 2), np.int64)
    lk = np.flatnonzero((code == _LOOKUP) & (tier >= 0))
    lookup_lo[r[lk], tier[lk]] = block[lk] * bs  # later rows overwrite earlier ones
    lookup_hi[r[lk], tier[lk]] = block[lk] * bs + tokens[lk]

    # Each admission's loads by tier; found: the part outside the tier's lookup range.
    ld = (code == _LOAD) & has_adm
    adm_loaded = np.zeros((n_adm, 2), np.int64)
    adm_found = np.zeros((n_adm, 2), np.int64)
    for k in (_HOST, _REMOTE):
        m = ld & (tier == k)
        s0 = block[m] * bs
        lo, hi = lookup_lo[r[m], k], lookup_hi[r[m], k]
        inside = np.maximum(0, np.minimum(s0 + tokens[m], hi) - np.maximum(s0, lo))
        adm_loaded[:, k] = F.group_sums(adm[m], tokens[m], n_adm)
        adm_found[:, k] = F.group_sums(adm[m], tokens[m] - inside, n_adm)
    fl = (code == _FAILED) & has_adm
    adm_failed = np.zeros((n_adm, max(len(reasons), 1)), np.int64)
    np.add.at(adm_failed, (adm[fl], reason_of[fl]), tokens[fl])

    # Owner totals over every admission (or none).
    per_owner: dict[str, np.ndarray] = {}
    host_load = ld & (tier == _HOST)
    per_owner["host_read_bytes"] = F.group_sums(r[host_load], nbytes[host_load], n)
    pre = code == _PREEMPTED
    per_owner["preempted_tokens"] = F.group_sums(r[pre], tokens[pre], n)
    per_owner["num_preemptions"] = np.bincount(r[pre], minlength=n).astype(np.int64)
    ended = np.zeros(n_adm, dtype=bool)
    ended[adm[pre & has_adm]] = True
    adm_all_loads = F.group_sums(adm[ld], tokens[ld], n_adm)  # every tier's
    per_owner["preempted_loaded_tokens"] = F.group_sums(adm_owner[ended], adm_all_loads[ended],
                                                        n)
    wr_host = (code == _WRITE) & (tier == _HOST)
    wr_other = (code == _WRITE) & (tier != _HOST)
    host_written = F.group_sums(r[wr_host], nbytes[wr_host], n)
    per_owner["remote_written_bytes"] = F.group_sums(r[wr_other], nbytes[wr_other], n)
    h2d, remote, staged = _transfers(sp, n, r[code == _ABANDONED], tid[code == _ABANDONED], bs)
    per_owner["h2d_bytes"] = h2d
    per_owner["remote_read_bytes"] = remote
    per_owner["host_written_bytes"] = (staged * pb if pb is not None else 0) + host_written
    for c, v in per_owner.items():
        out[c] = v[owner]

    # The admission that produced each request's first token: its owner's last one recorded
    # at or before it (the last one of all for a request without a first token).
    final = np.full(n, -1, dtype=np.int64)
    if n_adm:
        a, i = _admissions_by_row(owner, adm_owner)
        eligible = ~served[i] | (adm_t[a] <= first_ns[i])
        np.maximum.at(final, i[eligible], a[eligible])
    has = final >= 0
    f = final[has]

    def pick(values: np.ndarray) -> np.ndarray:
        col = np.zeros(n, np.int64)
        col[has] = values[f]
        return col

    hit = pick(adm_hit)
    out["device_hit_tokens"] = hit
    for k, name in ((_HOST, "host"), (_REMOTE, "remote")):
        lo, hi = lookup_lo[owner, k], lookup_hi[owner, k]
        out[f"{name}_hit_tokens"] = np.where(has & (hi > lo),
                                             np.maximum(0, hi - np.maximum(hit, lo)), 0)
        out[f"{name}_loaded_tokens"] = pick(adm_loaded[:, k])
        out[f"{name}_found_tokens"] = pick(adm_found[:, k])
    failed_total = np.zeros(n, np.int64)
    for c in CHECKED_COLUMNS:
        if c.startswith("load_failed_") and c != "load_failed_tokens":
            out[c] = np.zeros(n, np.int64)
    for j, x in enumerate(reasons):
        col = pick(adm_failed[:, j])
        failed_total += col
        if f"load_failed_{x}_tokens" in out:
            out[f"load_failed_{x}_tokens"] = col
    out["load_failed_tokens"] = failed_total
    out["recomputed_tokens"] = np.where(
        served & has, prompt - hit - out["host_loaded_tokens"] - out["remote_loaded_tokens"], 0)
    return out


def _admissions_by_row(owner: np.ndarray, adm_owner: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray]:
    """Every (admission, request row) pair whose owner is the same: one pair per admission
    unless a request id is given twice."""
    n = len(owner)
    rows = np.argsort(owner, kind="stable")
    count = np.bincount(owner, minlength=n)
    first = np.cumsum(count) - count
    rep = count[adm_owner]
    a = np.repeat(np.arange(len(adm_owner)), rep)
    offset = np.arange(len(a)) - np.repeat(np.cumsum(rep) - rep, rep)
    return a, rows[first[adm_owner[a]] + offset]


def _transfers(sp: _Spans, n: int, ab_owner: np.ndarray, ab_tid: np.ndarray, bs: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per owner: bytes of its ``h2d`` spans; bytes of the ``remote_read`` spans of the reads
    it issued and did not abandon, and the blocks those reads staged."""
    act = sp.rows("activity")
    if not len(act):
        return (np.zeros(n, np.int64),) * 3
    ar = sp.request[act]
    ok = (ar >= 0) & sp.named[act]
    which = F.recode((sp.name[0][act], sp.name[1]), {"h2d": 0, "remote_read": 1})
    # Only the transfer rows' integers are gathered (a run's activity is mostly lookups and
    # writes).
    moved = np.flatnonzero(ok & (which >= 0))
    act, ar, which = act[moved], ar[moved], which[moved]
    nb, tk, tids = (sp.ints("bytes", act, 0), sp.ints("tokens", act, 0),
                    sp.ints("transfer_id", act))
    h = which == 0
    reads = np.flatnonzero(which == 1)
    kept = reads[~_pairs_in(ar[reads], tids[reads], ab_owner, ab_tid)]
    return (F.group_sums(ar[h], nb[h], n), F.group_sums(ar[kept], nb[kept], n),
            F.group_sums(ar[kept], tk[kept] // bs, n))
