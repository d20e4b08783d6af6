"""Token accounting (docs/DESIGN.md, "Token accounting"): where each prompt token's KV came
from, with every
ratio carried as numerator / denominator (unit), never as a bare percentage.

The population is the requests that produced a first token (the identity
``prompt = device_hit + host_loaded + remote_loaded + recomputed`` is defined for them);
requests that failed before it are counted apart. Also here: the per-layer table, the identity
check that names offending requests, and the prefill time that reuse saved, from the run's
fitted step cost model (`analyzers.costmodel`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any

import numpy as np

from agent.schema import ACCOUNTING_COLUMNS, LOAD_FAIL_REASONS, TOKEN_SOURCES
from analyzers import frames as F
from analyzers.ratios import Ratio
from analyzers.ttft_summary import build_frame, column_array, int_column, valid_column

if TYPE_CHECKING:
    import pandas as pd

    from analyzers.costmodel import StepCost
else:  # imported on a thread while the caller reads (see `analyzers.frames`)
    pd = F.PANDAS

__all__ = [
    "Ratio",
    "SecondsSaved",
    "TokenAccounting",
    "check_identity",
    "layer_table",
    "prefill_seconds_saved",
    "token_accounting",
]

_SOURCE_COLUMNS = tuple(f"{s}_tokens" for s in TOKEN_SOURCES)


@dataclass(slots=True, frozen=True)
class TokenAccounting:
    """What `token_accounting` returns.

    Attributes:
        requests: requests that produced a first token (the population).
        without_first_token: requests that failed before their first token (excluded).
        totals: the accounting columns summed over the population.
        ratios: every ratio, request-, token- and byte-level (see `Ratio.key` for the names).
        tiers: per tier (device, host, remote): ``promised_tokens, loaded_tokens,
            shortfall_tokens, read_bytes, written_bytes, requests_loading``.
        failures: per load-failure reason: ``tokens`` and ``requests``.
        identity_violations: the output of `check_identity` (empty when all holds).
        groups: with ``by``: per group the numerators and denominators of the main shares.
    """

    requests: int
    without_first_token: int
    totals: dict[str, int]
    ratios: list[Ratio]
    tiers: pd.DataFrame
    failures: pd.DataFrame
    identity_violations: pd.DataFrame
    groups: pd.DataFrame | None = None

    def ratio(self, key: str) -> Ratio:
        """The ratio named `key` (KeyError if there is none)."""
        for r in self.ratios:
            if r.key == key:
                return r
        raise KeyError(key)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: ``{requests, without_first_token, totals, ratios: [Ratio.to_dict],
        tiers: [row], failures: [row], identity_violations: [row], groups: [row] | null}``."""
        from analyzers.ttft_summary import records

        return {
            "requests": self.requests,
            "without_first_token": self.without_first_token,
            "totals": dict(self.totals),
            "ratios": [r.to_dict() for r in self.ratios],
            "tiers": records(self.tiers),
            "failures": records(self.failures),
            "identity_violations": records(self.identity_violations),
            "groups": None if self.groups is None else records(self.groups),
        }


def _served(requests: pd.DataFrame) -> np.ndarray:
    return F.valid(requests["first_token_ns"])


def _matrix(requests: pd.DataFrame) -> dict[str, np.ndarray]:
    return {c: (F.ints(requests[c], 0) if c in requests else np.zeros(len(requests), np.int64))
            for c in ACCOUNTING_COLUMNS}


def token_accounting(requests: pd.DataFrame, by: str | Sequence[str] | None = None
                     ) -> TokenAccounting:
    """Token, byte and request accounting of a run.

    Args:
        requests: the run store's ``requests`` frame.
        by: optional grouping column(s) (e.g. ``tenant``) for the `groups` table.

    Returns:
        a `TokenAccounting`.
    """
    F.require_columns(requests, ("request_id", "first_token_ns"), "requests")
    served = valid_column(requests, "first_token_ns")
    # Each column's array looked up once (`column_array`: no Series built).
    given = {c: column_array(requests, c) for c in ACCOUNTING_COLUMNS if c in requests}
    # `_matrix` as one int64 matrix, a row per accounting column (absent ones 0): one mask,
    # one sum and one sign test for all of them.
    mat = np.empty((len(ACCOUNTING_COLUMNS), len(requests)), dtype=np.int64)  # every row set
    for i, c in enumerate(ACCOUNTING_COLUMNS):
        a = given.get(c)
        if a is None:
            mat[i] = 0
        elif type(a) is np.ndarray and a.dtype == np.int64:  # (`int_column` of this array)
            mat[i] = a
        else:
            mat[i] = int_column(requests, c, 0)
    full = dict(zip(ACCOUNTING_COLUMNS, mat, strict=True))
    smat = mat if served.all() else mat[:, served]
    cols = dict(zip(ACCOUNTING_COLUMNS, smat, strict=True))
    tot = dict(zip(ACCOUNTING_COLUMNS, smat.sum(axis=1).tolist(), strict=True))
    unknown = _unknown_columns(requests, given, served)
    n = int(served.sum())
    reused = cols["device_hit_tokens"] + cols["host_loaded_tokens"] + cols["remote_loaded_tokens"]
    lookup = tot["lookup_tokens"]
    promised = tot["host_hit_tokens"] + tot["remote_hit_tokens"]
    computed = tot["recomputed_tokens"] + tot["preempted_tokens"]
    reads = tot["host_read_bytes"] + tot["remote_read_bytes"]
    loaded = tot["host_loaded_tokens"] + tot["remote_loaded_tokens"]
    # Every admission's loads (the byte columns add up over all of them).
    loaded_all = loaded + tot["preempted_loaded_tokens"]

    def req(key: str, label: str, mask: np.ndarray) -> Ratio:
        return Ratio(key, label, int(np.count_nonzero(mask)), n, "requests", "request")

    def tok(key: str, label: str, num: int, den: int, unit: str, tier: str | None = None
            ) -> Ratio:
        return Ratio(key, label, num, den, unit, "token", tier=tier)

    lookup_positive = cols["lookup_tokens"] > 0
    ratios = [
        req("requests_with_hit", "requests that reused any KV", reused > 0),
        req("requests_full_hit", "requests that reused every lookup token",
            lookup_positive & (reused >= cols["lookup_tokens"])),
        req("requests_cold", "requests that reused nothing", reused == 0),
        req("requests_device_hit", "requests with device hits", cols["device_hit_tokens"] > 0),
        req("requests_host_loaded", "requests that loaded from host",
            cols["host_loaded_tokens"] > 0),
        req("requests_remote_loaded", "requests that loaded from remote",
            cols["remote_loaded_tokens"] > 0),
        req("requests_load_failed", "requests with a failed load",
            cols["load_failed_tokens"] > 0),
        req("requests_preempted", "requests preempted", cols["num_preemptions"] > 0),
        Ratio("requests_without_first_token", "requests that failed before a first token",
              len(requests) - n, len(requests), "requests", "request"),
        tok("token_hit_share", "token hit share (KV reused)", int(reused.sum()), lookup,
            "lookup tokens"),
        tok("device_hit_share", "device hits", tot["device_hit_tokens"], lookup,
            "lookup tokens", "device"),
        tok("host_loaded_share", "loaded from host", tot["host_loaded_tokens"], lookup,
            "lookup tokens", "host"),
        tok("remote_loaded_share", "loaded from remote", tot["remote_loaded_tokens"], lookup,
            "lookup tokens", "remote"),
        tok("host_promised_share", "promised by host", tot["host_hit_tokens"], lookup,
            "lookup tokens", "host"),
        tok("remote_promised_share", "promised by remote", tot["remote_hit_tokens"], lookup,
            "lookup tokens", "remote"),
        tok("host_found_share", "found in host (no lookup promised them)",
            tot["host_found_tokens"], lookup, "lookup tokens", "host"),
        tok("remote_found_share", "found in remote (no lookup promised them)",
            tot["remote_found_tokens"], lookup, "lookup tokens", "remote"),
        # Loaded tokens that were promised (loaded - found) over the promise: a subset.
        tok("host_load_yield", "host promises loaded",
            tot["host_loaded_tokens"] - tot["host_found_tokens"], tot["host_hit_tokens"],
            "promised host tokens", "host"),
        tok("remote_load_yield", "remote promises loaded",
            tot["remote_loaded_tokens"] - tot["remote_found_tokens"], tot["remote_hit_tokens"],
            "promised remote tokens", "remote"),
        tok("load_failed_share", "promised tokens that failed to load",
            tot["load_failed_tokens"], promised, "promised tokens"),
        *(tok(f"load_failed_{r}_share", f"failed: {r.replace('_', ' ')}",
              tot[f"load_failed_{r}_tokens"], promised, "promised tokens")
          for r in LOAD_FAIL_REASONS),
        *(tok(f"prompt_{s}", f"prompt tokens {s.replace('_', ' ')}", tot[f"{s}_tokens"],
              tot["prompt_tokens"], "prompt tokens") for s in TOKEN_SOURCES),
        tok("preemption_waste", "computed tokens thrown away by preemption",
            tot["preempted_tokens"], computed, "computed tokens"),
        Ratio("remote_read_byte_share", "bytes read from remote", tot["remote_read_bytes"],
              reads, "bytes read", "byte", tier="remote"),
        Ratio("h2d_bytes_per_loaded_token", "H2D bytes per loaded token", tot["h2d_bytes"],
              loaded_all, "loaded tokens (every admission)", "byte", numerator_unit="bytes"),
        Ratio("remote_read_bytes_per_remote_token", "remote bytes read per remote-loaded token",
              tot["remote_read_bytes"], tot["remote_loaded_tokens"], "remote-loaded tokens",
              "byte", tier="remote", numerator_unit="bytes"),
    ]
    # Imported runs may not carry some counts at all (null, not 0): no ratio is made from them.
    ratios = [r for r in ratios if not (_RATIO_INPUTS.get(r.key, ()) and
                                        set(_RATIO_INPUTS[r.key]) & unknown)]
    return TokenAccounting(
        requests=n,
        without_first_token=len(requests) - n,
        totals={c: v for c, v in tot.items() if c not in unknown},
        ratios=ratios,
        tiers=_tiers(cols, tot),
        failures=build_frame({
            "reason": LOAD_FAIL_REASONS,
            "tokens": np.array([tot[f"load_failed_{r}_tokens"] for r in LOAD_FAIL_REASONS],
                               dtype=np.int64),
            "requests": np.array([np.count_nonzero(cols[f"load_failed_{r}_tokens"] > 0)
                                  for r in LOAD_FAIL_REASONS], dtype=np.int64),
        }, len(LOAD_FAIL_REASONS)),
        identity_violations=_identity(requests, full, served, mat),
        groups=None if by is None else _groups(requests.loc[served], by),
    )


_REUSED = ("device_hit_tokens", "host_loaded_tokens", "remote_loaded_tokens")
_PROMISED = ("host_hit_tokens", "remote_hit_tokens")
#: The accounting columns each ratio is made from (a ratio is left out when one is unknown).
_RATIO_INPUTS: dict[str, tuple[str, ...]] = {
    "requests_with_hit": _REUSED,
    "requests_full_hit": (*_REUSED, "lookup_tokens"),
    "requests_cold": _REUSED,
    "requests_device_hit": ("device_hit_tokens",),
    "requests_host_loaded": ("host_loaded_tokens",),
    "requests_remote_loaded": ("remote_loaded_tokens",),
    "requests_load_failed": ("load_failed_tokens",),
    "requests_preempted": ("num_preemptions",),
    "token_hit_share": (*_REUSED, "lookup_tokens"),
    "device_hit_share": ("device_hit_tokens", "lookup_tokens"),
    "host_loaded_share": ("host_loaded_tokens", "lookup_tokens"),
    "remote_loaded_share": ("remote_loaded_tokens", "lookup_tokens"),
    "host_promised_share": ("host_hit_tokens", "lookup_tokens"),
    "remote_promised_share": ("remote_hit_tokens", "lookup_tokens"),
    "host_found_share": ("host_found_tokens", "lookup_tokens"),
    "remote_found_share": ("remote_found_tokens", "lookup_tokens"),
    "host_load_yield": ("host_loaded_tokens", "host_found_tokens", "host_hit_tokens"),
    "remote_load_yield": ("remote_loaded_tokens", "remote_found_tokens", "remote_hit_tokens"),
    "load_failed_share": ("load_failed_tokens", *_PROMISED),
    **{f"load_failed_{r}_share": (f"load_failed_{r}_tokens", *_PROMISED)
       for r in LOAD_FAIL_REASONS},
    **{f"prompt_{s}": (f"{s}_tokens", "prompt_tokens") for s in TOKEN_SOURCES},
    "preemption_waste": ("preempted_tokens", "recomputed_tokens"),
    "remote_read_byte_share": ("host_read_bytes", "remote_read_bytes"),
    "h2d_bytes_per_loaded_token": ("h2d_bytes", "host_loaded_tokens", "remote_loaded_tokens",
                                   "preempted_loaded_tokens"),
    "remote_read_bytes_per_remote_token": ("remote_read_bytes", "remote_loaded_tokens"),
}


def _unknown_columns(requests: pd.DataFrame, given: dict[str, Any], served: np.ndarray
                     ) -> set[str]:
    """Accounting columns the input does not carry (`given`: the arrays of those it has, by
    name): absent, or null for every served request."""
    out = set()
    some = bool(served.any())
    for c in ACCOUNTING_COLUMNS:
        col = given.get(c)
        if col is None or (some and not _null_free(col)
                           and not valid_column(requests, c)[served].any()):
            out.add(c)
    return out


def _null_free(col: Any) -> bool:
    """A numpy integer or boolean column (its array): it cannot hold a null."""
    return isinstance(col, np.ndarray) and col.dtype.kind in "iub"


def _tiers(cols: dict[str, np.ndarray], tot: dict[str, int]) -> pd.DataFrame:
    """Per tier: promised (planned at admission), found (loaded at positions no lookup
    promised it), loaded (found included), shortfall = promised - (loaded - found): promised
    tokens the tier did not supply (failed loads, or served by another tier). Device: its
    hits at admission, so no shortfall. `tot`: the columns' int64 sums over `cols`' rows."""
    promised = [tot["device_hit_tokens"], tot["host_hit_tokens"], tot["remote_hit_tokens"]]
    found = [0, tot["host_found_tokens"], tot["remote_found_tokens"]]
    loaded = [tot["device_hit_tokens"], tot["host_loaded_tokens"], tot["remote_loaded_tokens"]]
    loaded_cols = ("device_hit_tokens", "host_loaded_tokens", "remote_loaded_tokens")

    def sums(values: list[int]) -> np.ndarray:
        return np.array(values, dtype=np.int64)

    return build_frame({
        "tier": ("device", "host", "remote"),
        "promised_tokens": sums(promised),
        "found_tokens": sums(found),
        "loaded_tokens": sums(loaded),
        # Never negative when the counts are right (the consistency check holds it); not
        # clamped, so a wrong count shows. The int64 sum of the per-request differences.
        "shortfall_tokens": sums([_wrap64(p - (x - f))
                                  for p, x, f in zip(promised, loaded, found, strict=True)]),
        "read_bytes": sums([0, tot["host_read_bytes"], tot["remote_read_bytes"]]),
        "written_bytes": sums([0, tot["host_written_bytes"], tot["remote_written_bytes"]]),
        "requests_loading": sums([int(np.count_nonzero(cols[c] > 0)) for c in loaded_cols]),
    }, 3)


def _wrap64(v: int) -> int:
    """`v` as int64 arithmetic has it (modulo 2**64, signed)."""
    return (v + 2**63) % 2**64 - 2**63


def _groups(served: pd.DataFrame, by: str | Sequence[str]) -> pd.DataFrame:
    by_l = [by] if isinstance(by, str) else list(by)
    F.require_columns(served, by_l, "requests")
    cols = _matrix(served)
    df = pd.DataFrame({c: cols[c] for c in ("prompt_tokens", "lookup_tokens",
                                            *_SOURCE_COLUMNS, "load_failed_tokens",
                                            "preempted_tokens")}, index=served.index)
    df["reused_tokens"] = (df["device_hit_tokens"] + df["host_loaded_tokens"]
                           + df["remote_loaded_tokens"])
    keys = [served[c].astype(object).where(served[c].notna(), "(none)") for c in by_l]
    g = df.groupby(keys, sort=True, observed=True)
    out = g.sum()
    out.insert(0, "requests", g.size())
    with np.errstate(divide="ignore", invalid="ignore"):
        out["token_hit_share"] = out["reused_tokens"] / out["lookup_tokens"].where(
            out["lookup_tokens"] > 0)
    return out.reset_index()


def check_identity(requests: pd.DataFrame) -> pd.DataFrame:
    """Requests whose accounting breaks a rule of docs/DESIGN.md, "Token accounting".

    Checked for requests with a first token: ``prompt = device_hit + host_loaded +
    remote_loaded + recomputed``; ``load_failed`` equals the sum of its reasons; for every
    request: no negative count; ``lookup_tokens <= prompt_tokens - 1`` (when there is a prompt).

    Returns:
        DataFrame ``request_id, check, expected, actual`` (one row per broken rule; empty when
        everything holds).
    """
    F.require_columns(requests, ("request_id", "first_token_ns"), "requests")
    return _identity(requests, _matrix(requests), _served(requests))


def _identity(requests: pd.DataFrame, cols: dict[str, np.ndarray], served: np.ndarray,
              mat: np.ndarray | None = None) -> pd.DataFrame:
    """`check_identity` on already extracted columns (one row per request; `mat`: the same
    columns as the rows of one matrix, in `ACCOUNTING_COLUMNS` order)."""
    sources = sum(cols[c] for c in _SOURCE_COLUMNS)
    reasons = sum(cols[f"load_failed_{r}_tokens"] for r in LOAD_FAIL_REASONS)
    if mat is not None:
        negative = (np.zeros(mat.shape[1], dtype=np.int64) if mat.size == 0 or mat.min() >= 0
                    else np.count_nonzero(mat < 0, axis=0).astype(np.int64, copy=False))
    else:
        negative = np.zeros(len(requests), dtype=np.int64)
        for c in ACCOUNTING_COLUMNS:
            negative += cols[c] < 0
    prompt = cols["prompt_tokens"]
    checks = [
        ("prompt = device_hit + host_loaded + remote_loaded + recomputed", served,
         prompt, sources),
        ("load_failed = sum of reasons", np.ones(len(requests), bool),
         cols["load_failed_tokens"], reasons),
        ("no negative counts", np.ones(len(requests), bool), np.zeros_like(negative), negative),
        ("lookup_tokens <= prompt_tokens - 1", prompt > 0, np.minimum(cols["lookup_tokens"],
                                                                      prompt - 1),
         cols["lookup_tokens"]),
    ]
    frames = []
    for name, applies, expected, actual in checks:
        bad = applies & (expected != actual)
        if bad.any():
            ids = requests["request_id"].to_numpy()[bad]  # few rows: only the offenders
            frames.append(pd.DataFrame({"request_id": ids, "check": name,
                                        "expected": expected[bad], "actual": actual[bad]}))
    if not frames:
        return _no_violations().copy()  # a deep copy: each result its own frame
    return pd.concat(frames, ignore_index=True)


@cache
def _no_violations() -> pd.DataFrame:
    """The empty identity-violation frame (built once; `_identity` hands out copies)."""
    return build_frame({"request_id": np.array([], dtype=object),
                        "check": np.array([], dtype=object),
                        "expected": np.array([], dtype=np.int64),
                        "actual": np.array([], dtype=np.int64)}, 0)


def layer_groups_of(meta: dict[str, Any]) -> list[dict[str, Any]]:
    """run.json's KV-cache layer groups (`config.tiers.device.layer_groups`): per group its
    `name`, `kind`, `layers` and `window`; [] for a run that does not list them (one group)."""
    cfg = meta.get("config") if isinstance(meta.get("config"), dict) else {}
    dev = (cfg.get("tiers") or {}).get("device") if isinstance(cfg.get("tiers"), dict) else None
    groups = dev.get("layer_groups") if isinstance(dev, dict) else None
    if not isinstance(groups, list):
        return []
    return [g for g in groups if isinstance(g, dict) and isinstance(g.get("layers"), list)]


def layer_table(layers: pd.DataFrame, groups: list[dict[str, Any]] | None = None
                ) -> pd.DataFrame:
    """Per layer: tokens by source with ``prompt_tokens`` as the denominator, load and wait time.

    Args:
        layers: the run store's ``layers`` frame.
        groups: the run's layer groups (`layer_groups_of`), to name each layer's group.

    Returns:
        DataFrame ``layer, group, requests, prompt_tokens, hit_tokens, loaded_tokens,
        recomputed_tokens, skipped_tokens, hit_share, loaded_share, recomputed_share,
        skipped_share, load_ns, wait_ns, wait_mean_ns, identity_violations`` (rows where
        hit + loaded + recomputed + skipped differs from prompt). `skipped` are the prompt
        tokens outside a sliding-window layer's window (neither read nor recomputed there);
        0 for full attention and for stores written before the column existed.
    """
    cols = ["hit_tokens", "loaded_tokens", "recomputed_tokens", "prompt_tokens", "load_ns",
            "wait_ns"]
    F.require_columns(layers, ["layer", *cols], "layers")
    df = pd.DataFrame({c: F.ints(layers[c], 0) for c in cols})
    df["skipped_tokens"] = (F.ints(layers["skipped_tokens"], 0) if "skipped_tokens" in layers
                            else np.zeros(len(layers), np.int64))
    df["layer"] = F.ints(layers["layer"], -1)
    df["identity_violations"] = (df["hit_tokens"] + df["loaded_tokens"] + df["recomputed_tokens"]
                                 + df["skipped_tokens"] != df["prompt_tokens"]).astype(np.int64)
    sums = [*cols, "skipped_tokens", "identity_violations"]
    g = df.groupby("layer", sort=True)
    out = g[sums].sum()
    out.insert(0, "requests", g.size())
    den = out["prompt_tokens"].where(out["prompt_tokens"] > 0)
    for c in ("hit", "loaded", "recomputed", "skipped"):
        out[f"{c}_share"] = out[f"{c}_tokens"] / den
    out["wait_mean_ns"] = out["wait_ns"] / out["requests"]
    out = out.reset_index()
    name = {int(x): str(gr.get("name", gr.get("kind", ""))) for gr in groups or ()
            for x in gr["layers"] if isinstance(x, int)}
    out.insert(1, "group", [name.get(int(x)) for x in out["layer"]])
    return out[["layer", "group", "requests", "prompt_tokens", "hit_tokens", "loaded_tokens",
                "recomputed_tokens", "skipped_tokens", "hit_share", "loaded_share",
                "recomputed_share", "skipped_share", "load_ns", "wait_ns", "wait_mean_ns",
                "identity_violations"]]


def group_limits(spans: pd.DataFrame, requests: pd.DataFrame,
                 groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Device hits a layer group shortened, from the ``group_limited`` ledger rows.

    A hit is usable only up to the shortest safe boundary across the groups: a sliding-window
    group that no longer holds the blocks just before the full-attention hit's end cuts it
    (the cut tokens are recomputed although the full-attention layers held them).

    Returns:
        Per group that cut a hit: ``{group, layers, requests, tokens, served, hit_tokens}``
        — `requests` of `served` (requests in the run) met a cut, `tokens` were cut in all,
        `hit_tokens` is the device hit tokens the run used (the cut is beside, not part of,
        it). [] when no group cut anything.
    """
    if not len(spans) or "kind" not in spans or not groups:
        return []
    led = F.rows(spans, F.equals(spans["kind"], "ledger")
                 & F.equals(spans["name"], "group_limited"), ("layer", "tokens", "request_id"))
    if not len(led):
        return []
    first = {int(g["layers"][0]): g for g in groups if g["layers"]}
    lay = F.ints(led["layer"], -1)
    tok = F.ints(led["tokens"], 0)
    rid = led["request_id"].to_numpy(object)
    hit = (int(F.ints(requests["device_hit_tokens"], 0).sum())
           if "device_hit_tokens" in requests else 0)
    out = []
    for layer in sorted(set(lay.tolist())):
        m = lay == layer
        g = first.get(int(layer), {"name": f"layer {layer}", "layers": [int(layer)]})
        out.append({"group": str(g.get("name")), "layers": [int(x) for x in g["layers"]],
                    "requests": len(set(rid[m].tolist())), "tokens": int(tok[m].sum()),
                    "served": len(requests), "hit_tokens": hit})
    return out


@dataclass(slots=True, frozen=True)
class SecondsSaved:
    """Prefill time that reuse saved, estimated with the run's fitted step cost model.

    ``gross_seconds`` = reused tokens x the per-token cost (the fixed per-step cost is paid
    anyway; a linear estimate: attention's quadratic term makes long prefixes somewhat dearer
    to recompute than this says), with ``gross_ci_seconds`` from the cost's interval.
    ``load_seconds`` is the TTFT time the run spent getting that KV (remote_read + h2d +
    sync), when a partition was given; ``net_seconds`` = gross - load.
    """

    per_token_ns: float
    reused_tokens: int
    by_source: dict[str, dict[str, float]] = field(default_factory=dict)
    gross_seconds: float = 0.0
    gross_ci_seconds: tuple[float, float] = (float("nan"), float("nan"))
    load_seconds: float | None = None
    net_seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"per_token_ns": self.per_token_ns, "reused_tokens": self.reused_tokens,
                "by_source": self.by_source, "gross_seconds": self.gross_seconds,
                "gross_ci_seconds": list(self.gross_ci_seconds),
                "load_seconds": self.load_seconds, "net_seconds": self.net_seconds}


def prefill_seconds_saved(requests: pd.DataFrame, cost: StepCost,
                          part: pd.DataFrame | None = None) -> SecondsSaved:
    """Estimate the prefill seconds that KV reuse saved in a run.

    Args:
        requests: the run store's ``requests`` frame.
        cost: the run's step cost model (`analyzers.costmodel.fit_step_cost`).
        part: the run's partition, to subtract the time spent loading.

    Returns:
        a `SecondsSaved` (NaN seconds when no model was fitted).
    """
    served = _served(requests)
    cols = _matrix(requests)
    per = cost.per_token_ns if cost.fitted else float("nan")
    by_source = {}
    reused = 0
    for s in ("device_hit", "host_loaded", "remote_loaded"):
        t = int(cols[f"{s}_tokens"][served].sum())
        reused += t
        by_source[s] = {"tokens": t, "seconds": t * per / 1e9}
    gross = reused * per / 1e9
    lo, hi = cost.per_token_ci_ns
    load = net = None
    if part is not None:
        load_ns = sum(int(F.ints(part[f"{s}_ns"], 0).sum()) for s in ("remote_read", "h2d",
                                                                         "sync"))
        load = load_ns / 1e9
        net = gross - load
    return SecondsSaved(per_token_ns=per, reused_tokens=reused, by_source=by_source,
                        gross_seconds=gross, gross_ci_seconds=(reused * lo / 1e9,
                                                               reused * hi / 1e9),
                        load_seconds=load, net_seconds=net)
