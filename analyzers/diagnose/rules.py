"""The rule registry and the entry points: `diagnose` and `diagnose_report`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pandas as pd

from analyzers.diagnose.capacity import (
    cache_thrash,
    preemption_thrash,
    tenant_collapse,
    token_hit_share_drop,
    ttft_slo_burn,
)
from analyzers.diagnose.hardware import (
    gpu_xid_errors,
    h2d_bandwidth_low,
    nic_errors,
    nic_imbalance,
)
from analyzers.diagnose.latency import (
    other_share_high,
    queue_dominated_p99,
    remote_load_slower_than_recompute,
    sync_stalls,
)
from analyzers.diagnose.model import SEVERITIES, Context, DiagnoseConfig, Finding, NotEvaluated
from analyzers.diagnose.remote import (
    load_serialisation,
    remote_breaker_open,
    remote_failures_sustained,
)
from analyzers.diagnose.tokens import (
    hit_rate_high_by_requests_low_by_tokens,
    promised_hits_evicted,
    recompute_storm,
)

Rule = Callable[[Context], "Finding | NotEvaluated | None"]

#: Every rule, by stable id, in the order findings of equal severity are reported.
RULES: dict[str, Rule] = {
    "gpu_xid_errors": gpu_xid_errors,
    "ttft_slo_burn": ttft_slo_burn,
    "remote_failures_sustained": remote_failures_sustained,
    "remote_breaker_open": remote_breaker_open,
    "remote_load_slower_than_recompute": remote_load_slower_than_recompute,
    "recompute_storm": recompute_storm,
    "load_serialisation": load_serialisation,
    "queue_dominated_p99": queue_dominated_p99,
    "preemption_thrash": preemption_thrash,
    "cache_thrash": cache_thrash,
    "sync_stalls": sync_stalls,
    "h2d_bandwidth_low": h2d_bandwidth_low,
    "nic_errors": nic_errors,
    "nic_imbalance": nic_imbalance,
    "promised_hits_evicted": promised_hits_evicted,
    "tenant_collapse": tenant_collapse,
    "token_hit_share_drop": token_hit_share_drop,
    "hit_rate_high_by_requests_low_by_tokens": hit_rate_high_by_requests_low_by_tokens,
    "other_share_high": other_share_high,
}

#: Rules that read only the hardware's records (samples, events): they run on a store without
#: requests too (a node agent's).
HARDWARE_ONLY: frozenset[str] = frozenset({"gpu_xid_errors", "nic_errors"})

#: The diagnosis that fires on the same condition as each alert of dashboard/rules/ (the
#: runbook entry of the alert names it; tests/dashboard/test_alerts_vs_findings.py checks a
#: real Prometheus against `kvscope analyze` of the same run).
ALERT_RULES: dict[str, str] = {
    "KvscopeTTFTSLOFastBurn": "ttft_slo_burn",
    "KvscopeTTFTSLOSlowBurn": "ttft_slo_burn",
    "KvscopeRemoteReadFailureRatioHigh": "remote_failures_sustained",
    "KvscopeRemoteOperationsFailing": "remote_failures_sustained",
    "KvscopeRemoteBreakerOpen": "remote_breaker_open",
    "KvscopeRecomputeStorm": "recompute_storm",
    "KvscopeTokenHitShareDrop": "token_hit_share_drop",
    "KvscopeBlockPoolExhausted": "preemption_thrash",
    "KvscopePreemptionRateHigh": "preemption_thrash",
    "KvscopeGPUXidError": "gpu_xid_errors",
    "KvscopeNICErrors": "nic_errors",
}


@dataclass(slots=True, frozen=True)
class DiagnoseReport:
    """What `diagnose_report` returns.

    Attributes:
        findings: rules that fired, most severe first (then in `RULES` order).
        not_evaluated: rules the run lacks the data for, each with its reason.
        passed: rules evaluated that found nothing.
        config: the thresholds used.
    """

    findings: tuple[Finding, ...]
    not_evaluated: tuple[NotEvaluated, ...]
    passed: tuple[str, ...]
    config: DiagnoseConfig

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{findings: [Finding.to_dict], not_evaluated: [{rule, reason}],
        passed: [rule], config: {...}}``."""
        return {"findings": [f.to_dict() for f in self.findings],
                "not_evaluated": [n.to_dict() for n in self.not_evaluated],
                "passed": list(self.passed), "config": self.config.to_dict()}


def diagnose_report(
    requests: pd.DataFrame,
    spans: pd.DataFrame,
    *,
    layers: pd.DataFrame | None = None,
    samples: pd.DataFrame | None = None,
    events: pd.DataFrame | None = None,
    config: DiagnoseConfig | None = None,
    part: pd.DataFrame | None = None,
    rules: tuple[str, ...] | None = None,
    run_config: Mapping[str, Any] | None = None,
    cost: Any = None,
    origin_ns: int | None = None,
    run_path: str | None = None,
    spans_end_ns: int | None = None,
) -> DiagnoseReport:
    """Run the rules over a run and say what each found, or why it could not look.

    Args:
        requests, spans: run-store frames (`agent.runstore.open_run`) or an `ImportedRun`'s;
            accounting columns may be <NA> (unknown), which the rules that need them report
            as not evaluated.
        layers, samples, events: the optional run-store frames.
        config: thresholds (default `DiagnoseConfig()`).
        part: ``analyzers.ttft.partition(requests, spans)`` when the caller has it already.
        rules: ids of the rules to run (default: all of `RULES`).
        run_config: run.json's ``config`` (``RunStore.meta["config"]``), so next steps name
            the run's current flag values; None for imports.
        cost: the run's `analyzers.costmodel.StepCost` when the caller has it already.
        origin_ns: the run's time origin (`analyzers.timebase.run_origin_ns`); windows and
            ``--window`` arguments count from it (default: the first arrival).
        run_path: the run directory, named in next-step commands (default ``RUN``).
        spans_end_ns: the run's latest span end when `spans` holds only some of its spans
            (the step spans left out); default: from `spans`.

    Returns:
        a `DiagnoseReport`.

    Raises:
        InputError: a frame lacks required columns or has duplicate request ids.
        ValueError: an unknown rule id, or a `part` that does not match `requests`.
    """
    names = tuple(RULES) if rules is None else rules
    unknown = [r for r in names if r not in RULES]
    if unknown:
        raise ValueError(f"rules: unknown rule(s) {', '.join(unknown)}; expected some of "
                         f"{', '.join(RULES)}")
    cfg = config or DiagnoseConfig()
    if not len(requests):
        # Aggregate-only sources (Prometheus), traces without kvscope ranges and a node
        # agent's store have none: only the rules on the hardware's own records can look.
        why = "no per-request data in this source"
        hw = tuple(r for r in names if r in HARDWARE_ONLY)
        skipped_all = tuple(NotEvaluated(r, why) for r in names if r not in HARDWARE_ONLY)
        if not hw or (samples is None and events is None):
            return DiagnoseReport((), tuple(NotEvaluated(r, why) for r in names), (), cfg)
        names, pre_skipped = hw, skipped_all
    else:
        pre_skipped = ()
    ctx = Context(requests, spans, layers=layers, samples=samples, events=events,
                  config=cfg, part=part, run_config=run_config, cost=cost,
                  origin_ns=origin_ns, run_path=run_path, spans_end_ns=spans_end_ns)
    found: list[Finding] = []
    skipped: list[NotEvaluated] = list(pre_skipped)
    passed: list[str] = []
    for name in names:
        out = RULES[name](ctx)
        if isinstance(out, Finding):
            found.append(out)
        elif isinstance(out, NotEvaluated):
            skipped.append(out)
        else:
            passed.append(name)
    order = list(RULES)
    found.sort(key=lambda f: (SEVERITIES.index(f.severity), order.index(f.rule)))
    return DiagnoseReport(tuple(found), tuple(skipped), tuple(passed), ctx.config)


def diagnose(
    requests: pd.DataFrame,
    spans: pd.DataFrame,
    *,
    layers: pd.DataFrame | None = None,
    samples: pd.DataFrame | None = None,
    events: pd.DataFrame | None = None,
    config: DiagnoseConfig | None = None,
    part: pd.DataFrame | None = None,
    run_config: Mapping[str, Any] | None = None,
) -> list[Finding]:
    """The findings of `diagnose_report`, most severe first (see it for the arguments)."""
    return list(diagnose_report(requests, spans, layers=layers, samples=samples,
                                events=events, config=config, part=part,
                                run_config=run_config).findings)
