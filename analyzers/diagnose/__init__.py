"""Diagnoses: rules that turn a run's numbers into findings with evidence and a next step.

Entry points: `diagnose(requests, spans, ...) -> list[Finding]` and `diagnose_report(...)`
(findings, plus the rules not evaluated and why, plus those that passed); `render_text` and
`render_markdown` format a report, `DiagnoseReport.to_dict` is its JSON. Rules live by family:
`latency` (TTFT stages), `tokens` (KV sources), `remote` (the remote tier failing or
serialising), `capacity` (preemption, SLO burn, hit-share drops, tenants, thrash), `hardware`
(PCIe, NICs, GPU XIDs). `ALERT_RULES` maps each Prometheus alert of dashboard/rules/ to the
rule that fires on the same condition.
"""

from analyzers.diagnose.hardware import PCIE_ENCODING, PCIE_GT_PER_S, pcie_bytes_per_s
from analyzers.diagnose.model import SEVERITIES, DiagnoseConfig, Finding, NotEvaluated
from analyzers.diagnose.render import render_markdown, render_text
from analyzers.diagnose.rules import (
    ALERT_RULES,
    RULES,
    DiagnoseReport,
    diagnose,
    diagnose_report,
)

__all__ = [
    "ALERT_RULES",
    "PCIE_ENCODING",
    "PCIE_GT_PER_S",
    "RULES",
    "SEVERITIES",
    "DiagnoseConfig",
    "DiagnoseReport",
    "Finding",
    "NotEvaluated",
    "diagnose",
    "diagnose_report",
    "pcie_bytes_per_s",
    "render_markdown",
    "render_text",
]
