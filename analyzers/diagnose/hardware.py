"""Rules on the links KV travels over: H2D copies far below the PCIe link's data rate, and
remote reads that load one NIC while others idle."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from agent.intervals import merge_intervals, union_length
from analyzers import frames as F
from analyzers.diagnose.model import (
    Context,
    Finding,
    NotEvaluated,
    dur,
    pct,
    rate_bytes,
    size_bytes,
)

#: PCIe raw signalling rate per lane, GT/s, by generation (PCI-SIG base specifications 1.0-7.0).
PCIE_GT_PER_S: dict[int, float] = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0, 7: 128.0}
#: Line-encoding efficiency by generation: 8b/10b (gen 1-2), 128b/130b (gen 3-5), and FLIT
#: mode from gen 6 (236 TLP bytes per 256-byte FLIT). Protocol overhead (TLP headers, DLLPs)
#: comes on top, so real copies peak at roughly 80-90 % of the resulting figure.
PCIE_ENCODING: dict[int, tuple[str, float]] = {
    1: ("8b/10b", 8 / 10), 2: ("8b/10b", 8 / 10), 3: ("128b/130b", 128 / 130),
    4: ("128b/130b", 128 / 130), 5: ("128b/130b", 128 / 130),
    6: ("FLIT 236/256", 236 / 256), 7: ("FLIT 236/256", 236 / 256),
}
NVML_GEN = "gpu_pcie_link_generation"
NVML_WIDTH = "gpu_pcie_link_width"
#: (samples source, receive-rate metric) of the NIC rule, most specific first.
NIC_RX: tuple[tuple[str, str], ...] = (("rdma", "rdma_receive_bytes_per_second"),
                                       ("nic", "nic_receive_bytes_per_second"))
#: Span names that mean bytes coming from the remote tier.
REMOTE_READ_SPANS: tuple[str, ...] = ("remote_read", "prefetch")


def pcie_bytes_per_s(gen: int, width: int) -> float:
    """Data rate of a PCIe link after line encoding, one direction, in bytes/s.

    Args:
        gen: link generation (1-7).
        width: lanes.
    Returns:
        GT/s per lane x encoding efficiency / 8 bits x lanes (e.g. gen 4 x16: 31.5 GB/s).
    Raises:
        ValueError: a generation outside 1-7 or a width below 1.
    """
    if gen not in PCIE_GT_PER_S:
        raise ValueError(f"PCIe generation: expected 1-7, got {gen}")
    if width < 1:
        raise ValueError(f"PCIe width: expected >= 1 lanes, got {width}")
    return PCIE_GT_PER_S[gen] * 1e9 * PCIE_ENCODING[gen][1] / 8 * width


def _latest(samples: pd.DataFrame, source: str, metric: str) -> pd.Series:
    """Per entity, the value of the newest sample of `metric` (empty Series when none)."""
    sel = samples.loc[(samples["source"] == source) & (samples["metric"] == metric)]
    if not len(sel):
        return pd.Series(dtype=np.float64)
    entity = sel["entity"].astype(object).where(sel["entity"].notna(), "(none)")
    last = sel.assign(_e=entity.to_numpy()).sort_values("ts_ns", kind="stable") \
        .groupby("_e", sort=True)["value"].last()
    return last.astype(np.float64)


def h2d_bandwidth_low(ctx: Context) -> Finding | NotEvaluated | None:
    """Achieved host-to-device copy bandwidth far below the PCIe link's data rate."""
    rule = "h2d_bandwidth_low"
    cfg = ctx.config
    spans = ctx.spans
    how: str
    act = F.rows(spans, F.equals(spans["kind"], "activity") & F.equals(spans["name"], "h2d"),
                 ("bytes", "start_ns", "end_ns")) \
        if len(spans) and "bytes" in spans else spans.iloc[:0]
    nbytes_col = F.ints(act["bytes"], 0) if len(act) else np.zeros(0, np.int64)
    with_bytes = nbytes_col > 0
    if with_bytes.any():
        start = F.ints(act["start_ns"], 0)[with_bytes]
        end = F.ints(act["end_ns"], 0)[with_bytes]
        nbytes, busy_ns = int(nbytes_col[with_bytes].sum()), union_length(start, end)
        copies = int(with_bytes.sum())
        how = (f"{copies:,} h2d copies: {size_bytes(nbytes)} over {dur(busy_ns)} with at least "
               "one copy in flight")
    else:
        known = ctx.known(("h2d_bytes",))
        h2d_ns = ctx.ns("h2d_ns")
        use = known & (h2d_ns > 0)
        if not use.any():
            return NotEvaluated(rule, "no H2D copy with both bytes and time in this run")
        nbytes, busy_ns = int(ctx.tokens("h2d_bytes")[use].sum()), int(h2d_ns[use].sum())
        copies = int(use.sum())
        how = (f"{size_bytes(nbytes)} of h2d_bytes over {dur(busy_ns)} of h2d stage time "
               f"({copies:,} requests; no per-copy spans)")
    if nbytes < cfg.h2d_min_bytes:
        return NotEvaluated(rule, f"only {size_bytes(nbytes)} copied host to device; at least "
                                  f"{size_bytes(cfg.h2d_min_bytes)} needed to judge bandwidth")
    if busy_ns <= 0:
        return NotEvaluated(rule, "H2D copies have no duration")
    smp = ctx.samples
    if smp is None or not len(smp) or not {"source", "metric", "value", "ts_ns"} <= set(smp):
        return NotEvaluated(rule, "no NVML samples (PCIe link generation and width unknown)")
    gen = _latest(smp, "nvml", f"{NVML_GEN}_current")
    width = _latest(smp, "nvml", f"{NVML_WIDTH}_current")
    link = pd.concat({"gen": gen, "width": width}, axis=1).dropna()
    link = link.loc[link["gen"].isin(list(PCIE_GT_PER_S)) & (link["width"] >= 1)]
    if not len(link):
        return NotEvaluated(rule, "no NVML PCIe link generation/width samples")
    cap = np.array([pcie_bytes_per_s(int(g), int(w))
                    for g, w in zip(link["gen"], link["width"], strict=True)])
    # Copies are not attributed to a GPU: judge against the slowest link (the most lenient).
    i = int(np.argmin(cap))
    gpu, g, w, capacity = str(link.index[i]), int(link["gen"].iloc[i]), \
        int(link["width"].iloc[i]), float(cap[i])
    achieved = nbytes / (busy_ns / 1e9)
    frac = achieved / capacity
    if frac >= cfg.h2d_link_fraction:
        return None
    enc, eff = PCIE_ENCODING[g]
    evidence = [
        f"achieved: {how} = {rate_bytes(achieved)}",
        f"link ({gpu}): PCIe gen {g} x{w} = {PCIE_GT_PER_S[g]:g} GT/s per lane x {w} lanes x "
        f"{enc} ({eff:.4f}) / 8 = {rate_bytes(capacity)} per direction",
        f"achieved / link: {rate_bytes(achieved)} / {rate_bytes(capacity)} "
        f"({pct(achieved, capacity)})",
        f"mean copy size: {size_bytes(nbytes / copies)}",
    ]
    gmax = _latest(smp, "nvml", f"{NVML_GEN}_max").get(gpu)
    wmax = _latest(smp, "nvml", f"{NVML_WIDTH}_max").get(gpu)
    downtrained = (gmax is not None and gmax > g) or (wmax is not None and wmax > w)
    if downtrained:
        evidence.append(f"{gpu} link runs below its maximum (gen {int(gmax or g)} "
                        f"x{int(wmax or w)}): idle links downtrain; recheck under load")
    return Finding(
        rule=rule,
        severity="critical" if frac < cfg.h2d_link_fraction_critical else "warning",
        title=f"H2D copies reach {pct(achieved, capacity)} of the PCIe link's data rate",
        evidence=evidence,
        next_step=("Copy from pinned host memory (page-locked staging buffers; pageable memory "
                   "goes through a bounce buffer), batch a request's blocks into few large "
                   "copies instead of one per block, and check the link with `nvidia-smi -q -d "
                   "PCIE`" + (" (it is downtrained)" if downtrained else "") + "."),
        metrics={"h2d_bytes": nbytes, "h2d_busy_ns": busy_ns, "copies": copies,
                 "achieved_bytes_per_s": achieved, "link_bytes_per_s": capacity,
                 "pcie_generation": g, "pcie_width": w, "gpu": gpu, "fraction": frac},
        requests=ctx.examples(ctx.known(("h2d_bytes",)) & (ctx.ns("h2d_ns") > 0),
                              ctx.ns("h2d_ns")),
    )


def _read_windows(spans: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Remote-read time as sorted, disjoint [start, end) intervals (a merged union)."""
    sel = F.rows(spans, spans["name"].isin(REMOTE_READ_SPANS), ("start_ns", "end_ns")) \
        if len(spans) else spans
    if not len(sel):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return merge_intervals(F.ints(sel["start_ns"], 0), F.ints(sel["end_ns"], 0))


def nic_imbalance(ctx: Context) -> Finding | NotEvaluated | None:
    """Per-NIC receive rates during remote reads that differ by more than a factor."""
    rule = "nic_imbalance"
    cfg = ctx.config
    w_start, w_end = _read_windows(ctx.spans)
    if not len(w_start):
        return NotEvaluated(rule, "no remote reads in this run")
    smp = ctx.samples
    if smp is None or not len(smp) or not {"source", "metric", "value", "ts_ns",
                                           "entity"} <= set(smp):
        return NotEvaluated(rule, "no NIC or RDMA samples")
    for source, metric in NIC_RX:
        sel = smp.loc[(smp["source"] == source) & (smp["metric"] == metric)
                      & smp["entity"].notna() & (smp["entity"] != "lo")]
        if len(sel):
            break
    else:
        return NotEvaluated(rule, "no NIC or RDMA receive-rate samples")
    ent = sel["entity"].astype(object).to_numpy()
    ts = F.ints(sel["ts_ns"], 0)
    val = sel["value"].to_numpy(np.float64)
    order = np.lexsort((ts, ent))
    ent, ts, val = ent[order], ts[order], val[order]
    # A rate sample at ts covers (previous sample of the same device, ts]; the first has none.
    prev = np.r_[0, ts[:-1]]
    has_prev = np.r_[False, ent[1:] == ent[:-1]]
    k = np.searchsorted(w_start, ts, side="left") - 1
    overlaps = has_prev & (k >= 0) & (w_end[np.maximum(k, 0)] > prev)
    busy = pd.Series(val).groupby(ent).max()
    active = busy.index[busy.to_numpy() >= cfg.nic_min_bytes_per_s]
    during = pd.Series(val[overlaps]).groupby(ent[overlaps]).mean().reindex(active)
    counts = pd.Series(np.ones(int(overlaps.sum()), np.int64)).groupby(ent[overlaps]).sum()
    during = during.dropna()
    if len(during) < 2:
        return NotEvaluated(rule, f"fewer than 2 active {source} devices sampled during remote "
                                  "reads")
    hi_dev, lo_dev = str(during.idxmax()), str(during.idxmin())
    hi, lo = float(during.max()), float(during.min())
    ratio = hi / lo if lo > 0 else float("inf")
    if ratio < cfg.nic_imbalance_ratio:
        return None
    total = float(during.sum())
    ratio_txt = f"{ratio:,.1f}x" if np.isfinite(ratio) else "unbounded (one device idle)"
    evidence = [
        "mean receive rate during remote reads: " + ", ".join(
            f"{d} {rate_bytes(v)} ({int(counts.get(d, 0))} samples)" for d, v in during.items()),
        f"max / min: {rate_bytes(hi)} ({hi_dev}) / {rate_bytes(lo)} ({lo_dev}) = {ratio_txt}",
        f"{hi_dev} carried {rate_bytes(hi)} / {rate_bytes(total)} of the summed receive rate "
        f"({pct(hi, total)})",
        f"remote reads were open for {dur(int((w_end - w_start).sum()))} in "
        f"{len(w_start):,} stretches",
    ]
    return Finding(
        rule=rule, severity="warning",
        title=f"NIC imbalance during remote reads: {hi_dev} receives {ratio_txt} what "
              f"{lo_dev} does",
        evidence=evidence,
        next_step=("Spread the remote tier's connections over every NIC: for RDMA list each "
                   "HCA in UCX_NET_DEVICES / NCCL_IB_HCA; for TCP open one connection per NIC "
                   "or bond them with xmit_hash_policy=layer3+4."),
        metrics={"source": source, "devices": {str(d): float(v) for d, v in during.items()},
                 "max_device": hi_dev, "min_device": lo_dev, "ratio": ratio,
                 "remote_read_ns": int((w_end - w_start).sum())},
    )


def gpu_xid_errors(ctx: Context) -> Finding | NotEvaluated | None:
    """The GPU raised XID errors during the run (KvscopeGPUXidError): a driver-reported fault
    (memory errors, fallen off the bus, a hung engine)."""
    rule = "gpu_xid_errors"
    ev = ctx.events
    smp = ctx.samples
    nvml_seen = smp is not None and len(smp) and "source" in smp and (smp["source"] ==
                                                                      "nvml").any()
    if ev is None or "name" not in ev:
        return NotEvaluated(rule, "no events in this source (XIDs are events)")
    xid = ev.loc[(ev["name"] == "xid")]
    if not len(xid):
        if not nvml_seen:
            return NotEvaluated(rule, "no NVML samples: the GPU was not watched")
        return None
    counts: dict[tuple[str, str], int] = {}
    for d in xid["detail"].tolist() if "detail" in xid else []:
        try:
            obj = json.loads(d) if isinstance(d, str) else {}
        except ValueError:
            obj = {}
        key = (str(obj.get("gpu", "?")), str(obj.get("xid", "?")))
        counts[key] = counts.get(key, 0) + 1
    first = (int(F.ints(xid["ts_ns"]).min()) - ctx.origin_ns) / 1e9
    listed = ", ".join(f"GPU {g} XID {x} x{n}" for (g, x), n in sorted(counts.items()))
    return Finding(
        rule=rule, severity="critical",
        title=f"GPU XID errors: {len(xid)} during the run ({listed})",
        evidence=[f"{len(xid)} XID event(s) from NVML: {listed}",
                  f"the first at {first:,.3f} s after the run's start"],
        next_step=("Look the XID up in NVIDIA's XID catalogue (e.g. 79: fallen off the bus, "
                   "48/63/64: memory errors, 13/31/43: an application or engine fault); drain "
                   "the node and run `nvidia-smi -q` and the DCGM diagnostics before it serves "
                   "again; compare its TTFT before and after the first XID."),
        metrics={"xid_events": len(xid), "by_gpu_xid": {f"{g}:{x}": n for (g, x), n in
                                                         counts.items()}},
    )


def nic_errors(ctx: Context) -> Finding | NotEvaluated | None:
    """A NIC counted receive or transmit errors during the run (KvscopeNICErrors)."""
    rule = "nic_errors"
    smp = ctx.samples
    if smp is None or not len(smp) or not {"source", "metric", "value", "entity"} <= set(smp):
        return NotEvaluated(rule, "no NIC samples in this source")
    sel = smp.loc[(smp["source"] == "nic") & smp["metric"].isin(
        ("nic_receive_errors_per_second", "nic_transmit_errors_per_second"))]
    if not len(sel):
        return NotEvaluated(rule, "no NIC error counters sampled")
    bad = sel.loc[sel["value"].astype("float64") > 0]
    if not len(bad):
        return None
    per = bad.groupby(["entity", "metric"])["value"].agg(["max", "size"])
    listed = "; ".join(f"{dev} {m.removeprefix('nic_').removesuffix('_per_second')}: up to "
                       f"{r['max']:,.2f}/s in {int(r['size'])} sample(s)"
                       for (dev, m), r in per.iterrows())
    n_samples = int(sel.groupby("entity").size().max())
    return Finding(
        rule=rule, severity="warning",
        title=f"NIC errors on {', '.join(sorted(map(str, bad['entity'].unique())))}",
        evidence=[listed, f"out of {n_samples:,} samples per device"],
        next_step=("Errors on the link the remote tier reads through: check the cable / "
                   "transceiver and the switch port (`ethtool -S DEVICE`, the port's error "
                   "counters), and whether remote_read time rose with them."),
        metrics={"devices": sorted(map(str, bad["entity"].unique())),
                 "error_samples": len(bad)},
    )
