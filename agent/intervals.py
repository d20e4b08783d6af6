"""The interval algebra of the TTFT partition, vectorised per group (request): the one module
every layer uses for it (docs/DESIGN.md, "TTFT stages").

    merge_intervals       sorted, disjoint union of intervals; `union_length` its length
    group_running_max     running maximum restarting at each group (the tiling check's reach)
    clip_to_window        intervals clipped to their group's window
    nested_union_lengths  per group and level k, the union length of levels <= k
    priority_partition    each group's window split among stages by the sweep-line priority
                          (time per stage)
    priority_spans        the same split as state spans (what imported traces become)

The trick that keeps this free of per-request loops: every group's window ``[origin, origin +
width]`` is moved onto its own disjoint stretch of one shared axis (group g starts where group
g-1 ended, plus one), so a single sort and a single running maximum sweep every group at once,
and the running maximum of one group can never reach into the next.

Part of the contract (numpy and agent.schema only): the engine's tiling check, the analyzers'
partition and the importers' derived partitions all resolve overlaps the same way.
"""

from __future__ import annotations

import numpy as np

from agent.schema import STAGE_PRIORITY, TTFT_STAGES

#: Sweep-line rank of each TTFT stage (0 = highest priority), indexed like
#: `TTFT_STAGES`; `other` ranks last and is what no span covers.
STAGE_RANK: np.ndarray = np.array([STAGE_PRIORITY.index(s) for s in TTFT_STAGES], dtype=np.int64)
#: `TTFT_STAGES` index of the stage at each rank.
RANK_STAGE: np.ndarray = np.array([TTFT_STAGES.index(s) for s in STAGE_PRIORITY], dtype=np.int64)
OTHER_RANK = STAGE_PRIORITY.index("other")

# The shared axis must stay clear of int64 overflow; larger inputs are processed in slices.
_AXIS_LIMIT = 1 << 62


def merge_intervals(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of intervals [start, end) as sorted, disjoint intervals (touching ones merge).

    An interval with end < start counts as empty at its start.
    """
    s = np.asarray(start, dtype=np.int64)
    e = np.maximum(np.asarray(end, dtype=np.int64), s)
    if not len(s):
        return s.copy(), e.copy()
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    reach = np.maximum.accumulate(e)
    new = np.r_[True, s[1:] > reach[:-1]]
    idx = np.flatnonzero(new)
    return s[idx], np.maximum.reduceat(e, idx)


def union_length(start: np.ndarray, end: np.ndarray) -> int:
    """Length of the union of intervals (the time at least one was open)."""
    s, e = merge_intervals(start, end)
    return int((e - s).sum())


def group_running_max(group: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Running maximum of `values` restarting at each group (`group` sorted ascending).

    Vectorised: rank the values, offset each group's ranks past every earlier group's, take one
    global maximum.accumulate and map ranks back to values.
    """
    n = len(values)
    by_rank = np.argsort(values, kind="stable")
    rank = np.empty(n, dtype=np.int64)
    rank[by_rank] = np.arange(n, dtype=np.int64)
    # group * n + rank < (group + 1) * n, so earlier groups never win the maximum
    key = group.astype(np.int64) * n + rank
    return values[by_rank][np.maximum.accumulate(key) - group * n]


def clip_to_window(
    group: np.ndarray, start: np.ndarray, end: np.ndarray, lo: np.ndarray, hi: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Clip intervals to their group's window ``[lo[g], hi[g]]``; empty ones become zero-length.

    Returns:
        (start, end) with ``lo <= start <= end <= hi`` per interval.
    """
    g_lo = lo.take(group)
    g_hi = hi.take(group)
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
    shift = offset.take(group) - origin.take(group)
    key = start + shift
    order = np.argsort(key, kind="stable")
    key = key.take(order)
    stop = (end + shift).take(order)
    grp = group.take(order)
    lev = level.take(order)
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
    """Split each group's window among stages by the sweep-line priority (`STAGE_PRIORITY`).

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


def priority_spans(
    group: np.ndarray,
    stage: np.ndarray,
    start: np.ndarray,
    end: np.ndarray,
    origin: np.ndarray,
    stop: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int, int]:
    """Each group's window [origin, stop] split into state spans by the sweep-line priority.

    At every instant the highest-priority stage (`STAGE_PRIORITY`) with an interval covering it
    owns the instant; instants no interval covers are `other`. Per stage, the spans' lengths
    equal `priority_partition` of the same intervals.

    Args:
        group: group index of each interval (into `origin`/`stop`).
        stage: `TTFT_STAGES` index of each interval.
        start, end: the intervals (clipped to their group's window here).
        origin, stop: each group's window; groups with stop <= origin get no spans.

    Returns:
        ``(group, stage, start, end, overlap_ns, other_ns)``: the spans sorted by group then
        time (adjacent spans of one stage merged, `stage` as `TTFT_STAGES` indices), the time
        where more than one stage was open (resolved by priority) and the time none was
        (`other`).

    Raises:
        ValueError: the windows are too wide to share one int64 axis.
    """
    g = np.asarray(group, dtype=np.int64)
    n_grp = len(origin)
    origin = np.asarray(origin, dtype=np.int64)
    stop = np.asarray(stop, dtype=np.int64)
    width_g = stop - origin
    live = width_g > 0
    s = np.clip(np.asarray(start, dtype=np.int64), origin[g], stop[g])
    e = np.clip(np.asarray(end, dtype=np.int64), origin[g], stop[g])
    keep = (e > s) & live[g]
    g, s, e = g[keep], s[keep], e[keep]
    rank = STAGE_RANK[np.asarray(stage, dtype=np.int64)[keep]]

    # Times relative to each group's origin, offset by group so one sorted key orders
    # (group, time) for every group at once.
    width = int(width_g[live].max()) + 1 if live.any() else 1
    if width * max(n_grp, 1) >= _AXIS_LIMIT:
        raise ValueError("priority_spans: time range too wide to vectorise")
    base = np.arange(n_grp, dtype=np.int64) * width
    live_idx = np.flatnonzero(live)
    ks, ke = base[g] + (s - origin[g]), base[g] + (e - origin[g])
    bounds = np.unique(np.concatenate([ks, ke, base[live_idx],
                                       base[live_idx] + width_g[live_idx]]))
    # Elementary intervals [bounds[i], bounds[i+1]) that lie inside one group's window.
    lo, hi = bounds[:-1], bounds[1:]
    igrp = lo // width
    inside = ((igrp == (hi - 1) // width)
              & ((lo - igrp * width) < width_g[np.minimum(igrp, max(n_grp - 1, 0))]))
    si, ei = np.searchsorted(bounds, ks), np.searchsorted(bounds, ke)
    n_lvl = len(STAGE_PRIORITY)
    cover = np.zeros((n_lvl, len(bounds)), dtype=np.int64)
    np.add.at(cover, (rank, si), 1)
    np.add.at(cover, (rank, ei), -1)
    active = np.cumsum(cover, axis=1)[:, :-1] > 0
    # argmax picks the first (highest-priority) open stage; no open stage → `other`.
    any_open = active.any(axis=0)
    chosen = np.where(any_open, active.argmax(axis=0), OTHER_RANK)
    dur = hi - lo
    overlap_ns = int(dur[inside & (active.sum(axis=0) > 1)].sum())
    other_ns = int(dur[inside & ~any_open].sum())

    lo, hi, igrp, chosen = lo[inside], hi[inside], igrp[inside], chosen[inside]
    if not len(lo):  # every window is empty
        z = np.zeros(0, dtype=np.int64)
        return z, z, z, z, overlap_ns, other_ns
    # Merge runs of the same stage inside one group.
    new = np.ones(len(lo), dtype=bool)
    new[1:] = (igrp[1:] != igrp[:-1]) | (chosen[1:] != chosen[:-1]) | (lo[1:] != hi[:-1])
    starts = np.flatnonzero(new)
    ends = np.r_[starts[1:], len(lo)] - 1
    out_g = igrp[starts]
    return (out_g, RANK_STAGE[chosen[starts]], lo[starts] - out_g * width + origin[out_g],
            hi[ends] - out_g * width + origin[out_g], overlap_ns, other_ns)
