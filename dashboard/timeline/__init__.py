"""A run store as a Chrome / Perfetto trace (JSON Trace Event Format) for postmortems.

Layout (open the file in https://ui.perfetto.dev or chrome://tracing):

- process "kvscope requests": one thread per request (thread name = request id, ordered by
  arrival); its state spans (the TTFT stages, then decode) are complete `X` events, which never
  overlap on one thread because the states partition the request's life. A `first_token`
  instant marks the end of TTFT.
- process "kvscope engine": thread "steps" holds the step phases (`X`), thread "events" the
  discrete events (eviction, preemption, fault, ...) as instants.
- process "kvscope transfers": activity spans (KV transfers, stores, tier lookups) as `X`
  slices on lanes, threads "<tier> #k": transfers overlap freely, so each tier gets as many lanes
  as its deepest overlap and slices on one lane never touch. `args.transfer_id` is the run
  store's transfer id.
- flows (`s` -> `f`, category `kvscope.waits_on`), one per (transfer, request state span that
  lists it in `waits_on`): viewers bind v1 flow events only to thread slices, so `s` sits 1 ns
  after the transfer's start on its lane and `f` (`"bp": "e"`, the enclosing slice) inside the
  waiting state's slice, at the transfer's end clipped 1 ns inside the span.
- process "kvscope counters": every collector series (NVML, NIC, RDMA, host, block pool, agent)
  as `C` counter events, one counter per (source, metric), one series per entity.
- merged files (`merge=`, format detected by content): a Kineto trace's events as they are; an
  Nsight Systems SQLite export as NVTX and GPU processes (see `dashboard.timeline.nsys`).

Clock: `ts` is in microseconds (floats with ns precision) since `otherData.origin_epoch_ns`,
the run's start (run.json `start_ns`, or the earliest recorded time when that is earlier).
Merged traces are moved onto the same clock: a Kineto trace's `ts` is µs relative to
`baseTimeNanoseconds` when present, else µs since the Unix epoch; nsys times are ns since
`TARGET_INFO_SESSION_START_TIME.utcEpochNs`.
"""

from dashboard.timeline.base import (
    PID_COUNTERS,
    PID_ENGINE,
    PID_MERGE_BASE,
    PID_REQUESTS,
    PID_TRANSFERS,
    TID_EVENTS,
    TID_STEPS,
    Clock,
    Window,
    run_origin_ns,
)
from dashboard.timeline.kineto import load_kineto, merge_events
from dashboard.timeline.lanes import assign_lanes
from dashboard.timeline.nsys import nsys_events
from dashboard.timeline.run_tracks import TRANSFER_TIERS
from dashboard.timeline.trace import TraceSummary, build_trace, merge_format, write_trace

__all__ = [
    "PID_COUNTERS", "PID_ENGINE", "PID_MERGE_BASE", "PID_REQUESTS", "PID_TRANSFERS",
    "TID_EVENTS", "TID_STEPS", "TRANSFER_TIERS", "Clock", "TraceSummary", "Window",
    "assign_lanes", "build_trace", "load_kineto", "merge_events", "merge_format",
    "nsys_events", "run_origin_ns", "write_trace",
]
