"""The executable form of docs/DESIGN.md: enums, Arrow schemas and the metric catalogue.

Every other part of kvscope names stages, tiers, columns and metrics through this module. When
this file and docs/DESIGN.md disagree, fix one of them in the same change.

Run ``python -m agent.schema --metrics-md`` to regenerate ``docs/METRICS.md`` (CI checks that the
checked-in file matches).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Literal

#: Bumped on any incompatible change to a table schema or run.json. Readers accept
#: `READABLE_SCHEMA_VERSIONS` (older stores are upgraded on read) and refuse any other.
SCHEMA_VERSION = 2
#: 1: the first release. 2: requests gain `load_failed_mismatch_tokens`, `host_found_tokens`,
#: `remote_found_tokens`, `preempted_loaded_tokens`, `output_digest`, `output_token_ids`, and
#: `lookup_tokens` becomes block-aligned; spans gain `block` and `ledger` rows; layers gain
#: `skipped_tokens` (0 when read from a store written without it).
READABLE_SCHEMA_VERSIONS: tuple[int, ...] = (1, 2)

# --------------------------------------------------------------------------------------------
# Vocabulary (docs/DESIGN.md, "Vocabulary")
# --------------------------------------------------------------------------------------------

#: TTFT stages: together they partition [arrival, first_token] of every request exactly.
TTFT_STAGES: tuple[str, ...] = ("lookup", "queue", "remote_read", "h2d", "sync", "prefill", "other")
#: The state after the first token until the request finishes (ITL / e2e).
DECODE_STAGE = "decode"
#: Every state a request span can carry; the index is the stage's code on the hot path.
STATES: tuple[str, ...] = (*TTFT_STAGES, DECODE_STAGE)
STATE_CODE: dict[str, int] = {s: i for i, s in enumerate(STATES)}

#: Sweep-line priority for traces that only have overlapping activity spans (highest first).
STAGE_PRIORITY: tuple[str, ...] = (
    "prefill", "sync", "h2d", "queue", "remote_read", "lookup", "other",
)

#: `ledger` rows record the physical operations behind a request's accounting (each lookup,
#: load, failure, computed chunk and write, with its tier, tokens, bytes and chain position), so
#: the accounting can be recomputed from them (analyzers.consistency).
SPAN_KINDS: tuple[str, ...] = ("state", "activity", "step", "ledger")
#: Names of ledger rows; `failed_<reason>` for each of LOAD_FAIL_REASONS.
#: `group_limited`: tokens of a device hit that one layer group (a sliding window that no
#: longer held the blocks before the hit's end) kept every group from using; its `layer` is
#: the first layer of that group and `block` the chain position where the usable hit ended.
LEDGER_OPS: tuple[str, ...] = ("lookup", "device_hit", "load", "preempted", "abandoned",
                               "write", "evicted_again", "evicted_reloaded", "group_limited")
STEP_PHASES: tuple[str, ...] = ("schedule", "prepare", "forward", "sample")
TIERS: tuple[str, ...] = ("device", "host", "remote")
STATUSES: tuple[str, ...] = ("ok", "error", "aborted")
CLOCKS: tuple[str, ...] = ("cpu", "cuda_event")
SAMPLE_SOURCES: tuple[str, ...] = ("nvml", "nic", "rdma", "host", "pool", "agent")
#: Why a promised block was not used: `mismatch` is an object whose embedded key (block digest,
#: namespace, MAC key) is not the key it was fetched for, or an object of an older format.
LOAD_FAIL_REASONS: tuple[str, ...] = ("timeout", "checksum", "mismatch", "error",
                                      "circuit_open", "evicted")
#: Remote tier operations and their outcomes (labels of kvscope_remote_operations_total).
REMOTE_OPS: tuple[str, ...] = ("lookup", "read", "write")
REMOTE_OP_OUTCOMES: tuple[str, ...] = ("ok", "timeout", "checksum", "mismatch", "error",
                                       "circuit_open")
#: Outcomes only a read can have (it is the operation that checks objects).
READ_ONLY_OUTCOMES: tuple[str, ...] = ("checksum", "mismatch")
BLOCK_STATES: tuple[str, ...] = ("in_use", "cached_free", "empty")
#: Where a prompt token's KV came from; the four terms of the accounting identity.
TOKEN_SOURCES: tuple[str, ...] = ("device_hit", "host_loaded", "remote_loaded", "recomputed")
#: Well-known event names (the events table accepts others).
EVENT_NAMES: tuple[str, ...] = (
    "eviction",
    "preemption",
    "fault",
    "circuit_open",
    "circuit_close",
    "load_failed",
    "collector_error",
    "gpu_lost",
    "xid",
    "gap",
    "gpu_info",
    "interface_vanished",
    "rdma_port_vanished",
    "process_exited",
    "collector_unavailable",
    "unauthenticated_remote",
)

# --------------------------------------------------------------------------------------------
# Run-store tables (docs/DESIGN.md, "The run store")
# --------------------------------------------------------------------------------------------

#: The accounting columns of the requests table, all int64 and non-negative.
TOKEN_COLUMNS: tuple[str, ...] = (
    "prompt_tokens",
    "output_tokens",
    "lookup_tokens",
    "device_hit_tokens",
    "host_hit_tokens",
    "remote_hit_tokens",
    "host_found_tokens",
    "remote_found_tokens",
    "host_loaded_tokens",
    "remote_loaded_tokens",
    "recomputed_tokens",
    "preempted_tokens",
    "preempted_loaded_tokens",
    "load_failed_tokens",
    *(f"load_failed_{r}_tokens" for r in LOAD_FAIL_REASONS),
)
BYTE_COLUMNS: tuple[str, ...] = (
    "host_read_bytes",
    "remote_read_bytes",
    "h2d_bytes",
    "host_written_bytes",
    "remote_written_bytes",
)
COUNT_COLUMNS: tuple[str, ...] = ("num_preemptions",)
ACCOUNTING_COLUMNS: tuple[str, ...] = TOKEN_COLUMNS + BYTE_COLUMNS + COUNT_COLUMNS

#: The run-store tables' Arrow schemas: built on first use (module `__getattr__`), so what
#: imports the contract without writing or reading a store (the node agent without --out, the
#: CLI's help) never imports pyarrow.
_ARROW_NAMES = frozenset(("REQUESTS_SCHEMA", "SPANS_SCHEMA", "LAYERS_SCHEMA", "SAMPLES_SCHEMA",
                          "EVENTS_SCHEMA", "TABLES"))
_arrow: dict[str, Any] = {}


def _arrow_schemas() -> dict[str, Any]:
    if _arrow:
        return _arrow
    import pyarrow as pa

    _I64 = pa.int64()
    _I32 = pa.int32()
    _STR = pa.string()

    REQUESTS_SCHEMA = pa.schema(
        [
            pa.field("request_id", _STR, nullable=False),
            pa.field("request_num", _I64, nullable=False),
            pa.field("tenant", _STR),
            pa.field("workload_class", _STR),
            pa.field("arrival_ns", _I64, nullable=False),
            pa.field("first_token_ns", _I64),  # null when the request failed before its first token
            pa.field("finish_ns", _I64),
            pa.field("status", _STR, nullable=False),
            *(pa.field(c, _I64, nullable=False) for c in ACCOUNTING_COLUMNS),
            # A digest of the output token ids (hex BLAKE2b-128 over them as little-endian int64):
            # "faults and tiers change no output" is checked from two run stores with it.
            pa.field("output_digest", _STR),
            pa.field("output_token_ids", pa.list_(_I64)),  # only under --record-output-ids
        ]
    )

    SPANS_SCHEMA = pa.schema(
        [
            pa.field("request_id", _STR),  # null for step spans and unattributed activity
            pa.field("request_num", _I64),
            pa.field("kind", _STR, nullable=False),
            pa.field("name", _STR, nullable=False),
            pa.field("start_ns", _I64, nullable=False),
            pa.field("end_ns", _I64, nullable=False),
            pa.field("tier", _STR),
            pa.field("layer", _I32),
            pa.field("tokens", _I64),
            pa.field("bytes", _I64),
            pa.field("step_id", _I64),
            pa.field("transfer_id", _I64),
            pa.field("waits_on", pa.list_(_I64)),
            pa.field("clock", _STR, nullable=False),
            pa.field("batch_requests", _I32),  # step spans: requests in the batch
            pa.field("block", _I32),  # ledger rows: the first chain position (block index) covered
        ]
    )

    LAYERS_SCHEMA = pa.schema(
        [
            pa.field("request_id", _STR, nullable=False),
            pa.field("layer", _I32, nullable=False),
            pa.field("hit_tokens", _I64, nullable=False),
            pa.field("loaded_tokens", _I64, nullable=False),
            pa.field("recomputed_tokens", _I64, nullable=False),
            pa.field("prompt_tokens", _I64, nullable=False),
            pa.field("load_ns", _I64, nullable=False),
            pa.field("wait_ns", _I64, nullable=False),
            # Prompt tokens outside a sliding-window layer's window: neither read nor recomputed
            # by that layer (hit + loaded + recomputed + skipped = prompt, per layer).
            pa.field("skipped_tokens", _I64, nullable=False),
        ]
    )

    SAMPLES_SCHEMA = pa.schema(
        [
            pa.field("ts_ns", _I64, nullable=False),
            pa.field("source", _STR, nullable=False),
            pa.field("entity", _STR),
            pa.field("metric", _STR, nullable=False),
            pa.field("value", pa.float64(), nullable=False),
            pa.field("unit", _STR),
        ]
    )

    EVENTS_SCHEMA = pa.schema(
        [
            pa.field("ts_ns", _I64, nullable=False),
            pa.field("source", _STR, nullable=False),
            pa.field("name", _STR, nullable=False),
            pa.field("request_id", _STR),
            pa.field("detail", _STR),  # JSON text
        ]
    )

    TABLES: dict[str, pa.Schema] = {
        "requests": REQUESTS_SCHEMA,
        "spans": SPANS_SCHEMA,
        "layers": LAYERS_SCHEMA,
        "samples": SAMPLES_SCHEMA,
        "events": EVENTS_SCHEMA,
    }

    _arrow.update(REQUESTS_SCHEMA=REQUESTS_SCHEMA, SPANS_SCHEMA=SPANS_SCHEMA,
                  LAYERS_SCHEMA=LAYERS_SCHEMA, SAMPLES_SCHEMA=SAMPLES_SCHEMA,
                  EVENTS_SCHEMA=EVENTS_SCHEMA, TABLES=TABLES)
    return _arrow


def __getattr__(name: str) -> Any:
    if name in _ARROW_NAMES:
        return _arrow_schemas()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: Required keys of run.json.
RUN_JSON_KEYS: tuple[str, ...] = ("schema_version", "kvscope_version", "run_id", "clock", "config")

# --------------------------------------------------------------------------------------------
# Metric catalogue (docs/DESIGN.md, "Names")
# --------------------------------------------------------------------------------------------

MetricType = Literal["counter", "gauge", "histogram", "info"]

#: Histogram buckets for TTFT and stage times, 1 ms to 60 s.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
    0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0,
)  # fmt: skip
#: Inter-token latency buckets, 0.5 ms to 5 s.
ITL_BUCKETS_S: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
)  # fmt: skip
#: KV transfer buckets, 50 µs to 10 s.
TRANSFER_BUCKETS_S: tuple[float, ...] = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


@dataclass(slots=True, frozen=True)
class MetricSpec:
    """One catalogued Prometheus metric. `name` is the full exposition name (with `_total`)."""

    name: str
    type: MetricType
    unit: str
    labels: tuple[str, ...]
    help: str
    buckets: tuple[float, ...] = field(default=())
    group: str = "engine"

    def __post_init__(self) -> None:
        if not self.name.startswith("kvscope_"):
            raise ValueError(f"metric {self.name}: must start with kvscope_")
        if ":" in self.name:
            raise ValueError(f"metric {self.name}: ':' is reserved for recording rules")
        if self.type == "counter" and not self.name.endswith("_total"):
            raise ValueError(f"metric {self.name}: counters end in _total")
        if self.type != "counter" and self.name.endswith("_total"):
            raise ValueError(f"metric {self.name}: only counters end in _total")
        if self.type == "histogram" and not self.buckets:
            raise ValueError(f"metric {self.name}: histogram without buckets")
        for bad in ("request_id", "prompt", "token_ids", "trace_id"):
            if bad in self.labels:
                raise ValueError(f"metric {self.name}: label {bad!r} is unbounded or private")

    @property
    def family(self) -> str:
        """The name prometheus-client wants (counters without `_total`, info without `_info`)."""
        if self.type == "counter":
            return self.name[: -len("_total")]
        if self.type == "info":
            return self.name[: -len("_info")]
        return self.name

    @property
    def series_names(self) -> tuple[str, ...]:
        """Every series name this metric exposes (what a PromQL query may reference)."""
        if self.type == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count",
                    f"{self.name}_created")
        if self.type == "counter":
            return (self.name, f"{self.family}_created")
        return (self.name,)


_M = "model"

ENGINE_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("kvscope_build_info", "info", "", ("version", "schema_version", "python"),
               "kvscope build information, exported by `kvscope run` and `kvscope agent` "
               "alike (tell them apart by scrape job); the value is always 1.", group="meta"),
    MetricSpec("kvscope_requests_total", "counter", "", (_M, "status"),
               "Finished requests by final status (ok, error, aborted)."),
    MetricSpec("kvscope_request_ttft_seconds", "histogram", "seconds", (_M,),
               "Time to first token, arrival to first sampled token.", LATENCY_BUCKETS_S),
    MetricSpec("kvscope_request_stage_seconds", "histogram", "seconds", (_M, "stage"),
               "Per-request time spent in each TTFT stage; the stages of a request sum to its "
               "TTFT.", LATENCY_BUCKETS_S),
    MetricSpec("kvscope_request_inter_token_latency_seconds", "histogram", "seconds", (_M,),
               "Mean time between output tokens after the first, per request.", ITL_BUCKETS_S),
    MetricSpec("kvscope_request_e2e_seconds", "histogram", "seconds", (_M,),
               "End-to-end request latency, arrival to finish.", LATENCY_BUCKETS_S),
    MetricSpec("kvscope_prompt_tokens_total", "counter", "tokens", (_M,),
               "Prompt tokens of finished requests (denominator of token-level shares)."),
    MetricSpec("kvscope_generation_tokens_total", "counter", "tokens", (_M,),
               "Output tokens of finished requests."),
    MetricSpec("kvscope_lookup_tokens_total", "counter", "tokens", (_M,),
               "Per request the largest multiple of the block size that is <= prompt_tokens "
               "- 1 (the most a prefix cache can supply): the denominator of every KV hit "
               "ratio, so a prompt whose every reachable block hit counts 100 %. Changed in "
               "run-store schema 2 (before: full-block tokens capped at prompt_tokens - 1, "
               "which counted a fully cached multiple-of-the-block prompt below 100 %). Unlike "
               "vLLM's prefix_cache_queries, which counts every prompt token."),
    MetricSpec("kvscope_prompt_tokens_by_source_total", "counter", "tokens", (_M, "source"),
               "Prompt tokens by where their KV came from (device_hit, host_loaded, "
               "remote_loaded, recomputed); the sources sum to kvscope_prompt_tokens_total."),
    MetricSpec("kvscope_kv_hit_tokens_total", "counter", "tokens", (_M, "tier"),
               "Prompt tokens promised by a tier, counted when their load is planned (remote: "
               "at arrival, its prefetch; host: at admission) beyond the device hits found "
               "at admission; device: its hits. Loaded minus found tokens never exceed it."),
    MetricSpec("kvscope_kv_found_tokens_total", "counter", "tokens", (_M, "tier"),
               "Prompt tokens loaded from a tier (host, remote) at chain positions no lookup "
               "promised it; included in kvscope_prompt_tokens_by_source_total's loads."),
    MetricSpec("kvscope_kv_load_failed_tokens_total", "counter", "tokens", (_M, "reason"),
               "Promised prompt tokens that were not used and were recomputed, by reason."),
    MetricSpec("kvscope_preempted_tokens_total", "counter", "tokens", (_M,),
               "Tokens computed and then thrown away by preemption (waste)."),
    MetricSpec("kvscope_preemptions_total", "counter", "", (_M,),
               "Requests preempted (by recompute) because KV blocks ran out."),
    MetricSpec("kvscope_kv_read_bytes_total", "counter", "bytes", (_M, "tier"),
               "KV bytes read from a tier (host, remote)."),
    MetricSpec("kvscope_kv_written_bytes_total", "counter", "bytes", (_M, "tier"),
               "KV bytes written to a tier (host, remote)."),
    MetricSpec("kvscope_h2d_bytes_total", "counter", "bytes", (_M,),
               "KV bytes copied from host memory into device blocks."),
    MetricSpec("kvscope_kv_transfer_seconds", "histogram", "seconds", (_M, "tier", "name"),
               "Duration of KV transfers (activity spans) by tier and transfer name.",
               TRANSFER_BUCKETS_S),
    MetricSpec("kvscope_step_phase_seconds", "histogram", "seconds", (_M, "phase"),
               "Engine step phases (schedule, prepare, forward, sample).", TRANSFER_BUCKETS_S),
    MetricSpec("kvscope_events_total", "counter", "", (_M, "source", "name"),
               "Discrete engine events (eviction, preemption, fault, circuit_open, ...)."),
    MetricSpec("kvscope_block_pool_blocks", "gauge", "", (_M, "tier", "state"),
               "KV blocks per pool state (in_use, cached_free, empty)."),
    MetricSpec("kvscope_requests_running", "gauge", "", (_M,),
               "Requests currently scheduled (running)."),
    MetricSpec("kvscope_requests_waiting", "gauge", "", (_M,),
               "Requests waiting for admission."),
    MetricSpec("kvscope_remote_breaker_open", "gauge", "", (_M, "op"),
               "1 while the remote tier's circuit breaker for this operation kind (lookup, "
               "read, write) is open, else 0; each kind is judged by its own operations."),
    MetricSpec("kvscope_remote_operations_total", "counter", "", (_M, "op", "outcome"),
               "Remote tier operations (lookup, read, write) by outcome (ok, timeout, checksum, "
               "mismatch, error, circuit_open); a read is `checksum` when any object failed "
               "its integrity check, else `mismatch` when any object was not bound to the key "
               "it was read for. Retries inside one operation are not counted separately."),
)

TELEMETRY_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("kvscope_telemetry_dropped_records_total", "counter", "", ("table",),
               "Telemetry records dropped because a buffer or the export queue was full.",
               group="telemetry"),
    MetricSpec("kvscope_telemetry_export_errors_total", "counter", "", ("exporter",),
               "Exporter failures (each counted and logged; recording carries on).",
               group="telemetry"),
    MetricSpec("kvscope_telemetry_recording_errors_total", "counter", "", (),
               "Recording calls that failed internally and were swallowed (never raised).",
               group="telemetry"),
    MetricSpec("kvscope_telemetry_records_total", "counter", "", ("table",),
               "Telemetry rows drained from the recorder, by table.", group="telemetry"),
)

_G = "gpu"
_D = "device"
COLLECTOR_METRICS: tuple[MetricSpec, ...] = (
    # NVML (dcgm-exporter analogues)
    MetricSpec("kvscope_gpu_utilization_ratio", "gauge", "ratio", (_G,),
               "GPU utilization over the last sample period, 0-1 (DCGM_FI_DEV_GPU_UTIL / 100).",
               group="collector"),
    MetricSpec("kvscope_gpu_memory_used_bytes", "gauge", "bytes", (_G,),
               "GPU framebuffer memory used (DCGM_FI_DEV_FB_USED).", group="collector"),
    MetricSpec("kvscope_gpu_memory_total_bytes", "gauge", "bytes", (_G,),
               "GPU framebuffer memory total.", group="collector"),
    MetricSpec("kvscope_gpu_pcie_transmit_bytes_per_second", "gauge", "bytes_per_second", (_G,),
               "PCIe TX throughput (NVML KB/s x 1024; DCGM_FI_PROF_PCIE_TX_BYTES).",
               group="collector"),
    MetricSpec("kvscope_gpu_pcie_receive_bytes_per_second", "gauge", "bytes_per_second", (_G,),
               "PCIe RX throughput (NVML KB/s x 1024; DCGM_FI_PROF_PCIE_RX_BYTES).",
               group="collector"),
    MetricSpec("kvscope_gpu_pcie_link_generation", "gauge", "", (_G, "kind"),
               "PCIe link generation, kind=current|max.", group="collector"),
    MetricSpec("kvscope_gpu_pcie_link_width", "gauge", "", (_G, "kind"),
               "PCIe link width in lanes, kind=current|max.", group="collector"),
    MetricSpec("kvscope_gpu_pcie_replay_total", "counter", "", (_G,),
               "PCIe replay counter.", group="collector"),
    MetricSpec("kvscope_gpu_sm_clock_hertz", "gauge", "hertz", (_G,),
               "SM clock.", group="collector"),
    MetricSpec("kvscope_gpu_memory_clock_hertz", "gauge", "hertz", (_G,),
               "Memory clock.", group="collector"),
    MetricSpec("kvscope_gpu_power_watts", "gauge", "watts", (_G,),
               "Power draw (NVML mW / 1000).", group="collector"),
    MetricSpec("kvscope_gpu_energy_joules_total", "counter", "joules", (_G,),
               "Energy consumed since driver load (NVML mJ / 1000).", group="collector"),
    MetricSpec("kvscope_gpu_temperature_celsius", "gauge", "celsius", (_G,),
               "GPU core temperature.", group="collector"),
    MetricSpec("kvscope_gpu_nvlink_transmit_bytes_per_second", "gauge", "bytes_per_second",
               (_G,), "NVLink TX throughput (field values).", group="collector"),
    MetricSpec("kvscope_gpu_nvlink_receive_bytes_per_second", "gauge", "bytes_per_second",
               (_G,), "NVLink RX throughput (field values).", group="collector"),
    MetricSpec("kvscope_gpu_xid_errors_total", "counter", "", (_G, "xid"),
               "XID critical errors seen (DCGM_FI_DEV_XID_ERRORS).", group="collector"),
    # NIC (node_exporter analogues)
    MetricSpec("kvscope_nic_receive_bytes_total", "counter", "bytes", (_D,),
               "Bytes received (node_network_receive_bytes_total).", group="collector"),
    MetricSpec("kvscope_nic_transmit_bytes_total", "counter", "bytes", (_D,),
               "Bytes transmitted (node_network_transmit_bytes_total).", group="collector"),
    MetricSpec("kvscope_nic_receive_packets_total", "counter", "", (_D,),
               "Packets received.", group="collector"),
    MetricSpec("kvscope_nic_transmit_packets_total", "counter", "", (_D,),
               "Packets transmitted.", group="collector"),
    MetricSpec("kvscope_nic_receive_errors_total", "counter", "", (_D,),
               "Receive errors.", group="collector"),
    MetricSpec("kvscope_nic_transmit_errors_total", "counter", "", (_D,),
               "Transmit errors.", group="collector"),
    MetricSpec("kvscope_nic_receive_drop_total", "counter", "", (_D,),
               "Received packets dropped.", group="collector"),
    MetricSpec("kvscope_nic_transmit_drop_total", "counter", "", (_D,),
               "Transmitted packets dropped.", group="collector"),
    MetricSpec("kvscope_nic_speed_bytes", "gauge", "bytes", (_D,),
               "Link speed in bytes per second (sysfs Mb/s x 125000), when readable.",
               group="collector"),
    # RDMA
    MetricSpec("kvscope_rdma_receive_bytes_total", "counter", "bytes", (_D, "port"),
               "RDMA bytes received (port_rcv_data x 4).", group="collector"),
    MetricSpec("kvscope_rdma_transmit_bytes_total", "counter", "bytes", (_D, "port"),
               "RDMA bytes transmitted (port_xmit_data x 4).", group="collector"),
    MetricSpec("kvscope_rdma_receive_errors_total", "counter", "", (_D, "port"),
               "RDMA receive errors (port_rcv_errors).", group="collector"),
    MetricSpec("kvscope_rdma_link_downed_total", "counter", "", (_D, "port"),
               "RDMA link down events (link_downed).", group="collector"),
    MetricSpec("kvscope_rdma_transmit_wait_total", "counter", "", (_D, "port"),
               "RDMA transmit wait ticks (port_xmit_wait).", group="collector"),
    # Host
    MetricSpec("kvscope_host_cpu_utilization_ratio", "gauge", "ratio", (),
               "Host CPU utilization, 0-1.", group="collector"),
    MetricSpec("kvscope_host_memory_used_bytes", "gauge", "bytes", (),
               "Host memory in use.", group="collector"),
    MetricSpec("kvscope_host_memory_total_bytes", "gauge", "bytes", (),
               "Host memory total.", group="collector"),
    MetricSpec("kvscope_process_resident_memory_bytes", "gauge", "bytes", ("process",),
               "Resident memory of a watched process (the engine).", group="collector"),
    MetricSpec("kvscope_process_cpu_seconds_total", "counter", "seconds", ("process",),
               "CPU time of a watched process.", group="collector"),
    # The agent's own health
    MetricSpec("kvscope_collector_duration_seconds", "gauge", "seconds", ("collector",),
               "Duration of the collector's last run.", group="agent"),
    MetricSpec("kvscope_collector_errors_total", "counter", "", ("collector",),
               "Collector runs that failed.", group="agent"),
    MetricSpec("kvscope_collector_dropped_samples_total", "counter", "", ("collector",),
               "Samples dropped (queue full or store over its disk bound).", group="agent"),
    MetricSpec("kvscope_collector_last_success_timestamp_seconds", "gauge", "seconds",
               ("collector",), "Unix time of the collector's last successful run.",
               group="agent"),
)

METRICS: tuple[MetricSpec, ...] = ENGINE_METRICS + TELEMETRY_METRICS + COLLECTOR_METRICS
METRICS_BY_NAME: dict[str, MetricSpec] = {m.name: m for m in METRICS}
if len(METRICS_BY_NAME) != len(METRICS):  # pragma: no cover - caught at import in every test
    raise RuntimeError("duplicate metric name in the catalogue")


def catalogued_series() -> set[str]:
    """Every series name (including _bucket/_sum/_count/_created) a query may reference."""
    return {s for m in METRICS for s in m.series_names}


def metrics_markdown() -> str:
    """docs/METRICS.md, generated from the catalogue."""
    out = [
        "# kvscope metric catalogue",
        "",
        "Generated from `agent/schema.py` by `python -m agent.schema --metrics-md`; do not edit.",
        "Units are base units; counters end in `_total`; ratios are never exported as gauges",
        "when a numerator and a denominator can be (hit shares are computed in PromQL from",
        "`kvscope_prompt_tokens_by_source_total` over `kvscope_lookup_tokens_total`).",
        "",
    ]
    titles = {
        "meta": "Build",
        "engine": "Engine (from the hot-path recorder)",
        "telemetry": "Telemetry pipeline health",
        "collector": "Collectors (NVML, NIC, RDMA, host)",
        "agent": "Node agent health",
    }
    for group, title in titles.items():
        rows = [m for m in METRICS if m.group == group]
        if not rows:
            continue
        out += [f"## {title}", "", "| name | type | unit | labels | help |",
                "|---|---|---|---|---|"]
        for m in rows:
            labels = ", ".join(f"`{lbl}`" for lbl in m.labels) or "—"
            out.append(f"| `{m.name}` | {m.type} | {m.unit or '—'} | {labels} | {m.help} |")
        out.append("")
    return "\n".join(out)


def _main(argv: list[str]) -> int:
    if argv == ["--metrics-md"]:
        sys.stdout.write(metrics_markdown())
        return 0
    print("usage: python -m agent.schema --metrics-md", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
