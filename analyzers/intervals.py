"""Vectorised interval arithmetic per group (request): union lengths and the priority sweep line.

The trick that keeps this free of per-request loops: every group's window ``[origin, origin +
width]`` is moved onto its own disjoint stretch of one shared axis (group g starts where group
g-1 ended, plus one), so a single sort and a single running maximum sweep every group at once,
and the running maximum of one group can never reach into the next.
"""

from __future__ import annotations

import numpy as np

from agent.schema import STAGE_PRIORITY, TTFT_STAGES

#: Sweep-line rank of each TTFT stage (0 = highest priority, DESIGN.md section 2), indexed like
#: `TTFT_STAGES`; `other` ranks last and is what no span covers.
STAGE_RANK: np.ndarray = np.array([STAGE_PRIORITY.index(s) for s in TTFT_STAGES], dtype=np.int64)
#: `TTFT_STAGES` index of the stage at each rank.
RANK_STAGE: np.ndarray = np.array([TTFT_STAGES.index(s) for s in STAGE_PRIORITY], dtype=np.int64)
OTHER_RANK = STAGE_PRIORITY.index("other")

# The shared axis must stay clear of int64 overflow; larger inputs are processed in slices.
_AXIS_LIMIT = 1 << 62


def clip_to_window(
    group: np.ndarray, start: np.ndarray, end: np.ndarray, lo: np.ndarray, hi: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Clip intervals to their group's window ``[lo[g], hi[g]]``; empty ones become zero-length.

    Returns:
        (start, end) with ``lo <= start <= end <= hi`` per interval.
    """
    g_lo = lo[group]
    g_hi = hi[group]
    s = np.clip(start, g_lo, g_hi)
    e = np.clip(end, g_lo, g_hi)
    return s, np.maximum(e, s)


def nested_union_lengths(
    group: np.ndarray,
    start: np.ndarray,
    end: np.ndarray,
    level: np.ndarray,
    origin: np.ndarray,
    width: np.ndarray,
    n_levels: int,
) -> np.ndarray:
    """Per group and level k, the length of the union of the group's intervals of level <= k.

    Args:
        group: group id of each interval, in ``[0, len(origin))``.
        start, end: interval bounds (int64 ns), already clipped to the group's window
            ``[origin[g], origin[g] + width[g]]`` with ``start <= end``.
        level: level of each interval, in ``[0, n_levels)``.
        origin, width: each group's window (int64 ns, ``width >= 0``).
        n_levels: number of levels.

    Returns:
        int64 array of shape ``(n_levels, n_groups)``; row k is non-decreasing in k.
    """
    n_groups = len(origin)
    out = np.zeros((n_levels, n_groups), dtype=np.int64)
    if len(group) == 0 or n_groups == 0:
        return out
    span = width.astype(np.float64) + 1.0
    if float(span.sum()) >= _AXIS_LIMIT:
        # Split the groups in two halves and recurse: each half fits the axis on its own.
        half = n_groups // 2
        if half == 0:
            raise ValueError(f"window of {int(width[0])} ns is too large for the interval axis")
        lower = group < half
        ids = np.arange(n_groups)
        for sel, g0 in ((lower, 0), (~lower, half)):
            keep = ids[g0:half] if g0 == 0 else ids[half:]
            out[:, keep] = nested_union_lengths(
                group[sel] - g0, start[sel], end[sel], level[sel], origin[keep], width[keep],
                n_levels,
            )
        return out
    offset = np.zeros(n_groups, dtype=np.int64)
    np.cumsum(width[:-1] + 1, out=offset[1:])
    shift = offset[group] - origin[group]
    key = start + shift
    order = np.argsort(key, kind="stable")
    key = key[order]
    stop = (end + shift)[order]
    grp = group[order]
    lev = level[order]
    for k in range(n_levels):
        sel = lev <= k
        if sel.all():
            ks, es, gs = key, stop, grp
        else:
            ks, es, gs = key[sel], stop[sel], grp[sel]
        if len(ks) == 0:
            continue
        reach = np.empty_like(es)
        reach[0] = -1
        np.maximum.accumulate(es[:-1], out=reach[1:])
        # NOTE: `reach` at a group's first interval belongs to an earlier group and lies below
        # this group's stretch of the axis, so the union restarts at every group boundary.
        contrib = np.maximum(es - np.maximum(ks, reach), 0)
        np.add.at(out[k], gs, contrib)
    return out


def priority_partition(
    group: np.ndarray,
    start: np.ndarray,
    end: np.ndarray,
    stage: np.ndarray,
    origin: np.ndarray,
    width: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Split each group's window among stages by the sweep-line priority of DESIGN.md.

    At every instant the highest-priority stage with a span covering it owns the instant;
    instants no span covers are ``other``. The result partitions each window exactly.

    Args:
        group, start, end: intervals clipped to their group's window (see `clip_to_window`).
        stage: `TTFT_STAGES` index of each interval.
        origin, width: each group's window.

    Returns:
        ``(stage_ns, covered_ns)``: int64 ``(n_groups, len(TTFT_STAGES))`` time per stage, and
        the length of the union of all the group's intervals (including explicit ``other``).
    """
    rank = STAGE_RANK[stage]
    n_levels = len(STAGE_PRIORITY)
    unions = nested_union_lengths(group, start, end, rank, origin, width, n_levels)
    by_rank = np.diff(unions, axis=0, prepend=0)  # time first claimed at each rank
    stage_ns = np.zeros((len(origin), len(TTFT_STAGES)), dtype=np.int64)
    stage_ns[:, RANK_STAGE[:OTHER_RANK]] = by_rank[:OTHER_RANK].T
    stage_ns[:, TTFT_STAGES.index("other")] = width - unions[OTHER_RANK - 1]
    return stage_ns, unions[n_levels - 1]
