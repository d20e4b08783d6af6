"""Findings as text (terminal) and Markdown; JSON is `DiagnoseReport.to_dict`."""

from __future__ import annotations

from analyzers.diagnose.rules import DiagnoseReport

_MARK = {"critical": "CRITICAL", "warning": "WARNING", "info": "INFO"}


def render_text(report: DiagnoseReport, *, show_skipped: bool = True) -> str:
    """Plain text for the terminal, after the TTFT breakdown.

    Args:
        report: the diagnoses.
        show_skipped: list the rules that could not be evaluated, with their reasons.
    Returns:
        Lines joined by newlines (ends with a newline).
    """
    out = ["Diagnoses"]
    if not report.findings:
        out.append(f"  no findings ({len(report.passed)} rules evaluated clean)")
    for f in report.findings:
        out.append(f"  [{_MARK[f.severity]}] {f.title}  ({f.rule})")
        out += [f"    - {e}" for e in f.evidence]
        out.append(f"    next: {f.next_step}")
        if f.requests:
            out.append(f"    e.g. requests {', '.join(f.requests)}")
    if show_skipped and report.not_evaluated:
        out.append("  not evaluated:")
        out += [f"    {n.rule}: {n.reason}" for n in report.not_evaluated]
    return "\n".join(out) + "\n"


def render_markdown(report: DiagnoseReport, *, show_skipped: bool = True) -> str:
    """A Markdown section (``## Diagnoses``) for reports and PR comments.

    Args:
        report: the diagnoses.
        show_skipped: add a table of rules that could not be evaluated.
    Returns:
        Markdown text ending with a newline.
    """
    out = ["## Diagnoses", ""]
    if not report.findings:
        out += [f"No findings ({len(report.passed)} rules evaluated clean).", ""]
    for f in report.findings:
        out += [f"### {_MARK[f.severity]}: {_md(f.title)}", "", f"`{f.rule}`", ""]
        out += [f"- {_md(e)}" for e in f.evidence]
        out += ["", f"**Next step:** {_md(f.next_step)}", ""]
        if f.requests:
            out += ["Example requests: " + ", ".join(f"`{r}`" for r in f.requests), ""]
    if show_skipped and report.not_evaluated:
        out += ["| not evaluated | why |", "|---|---|"]
        out += [f"| `{n.rule}` | {_md(n.reason).replace('|', '/')} |"
                for n in report.not_evaluated]
        out.append("")
    return "\n".join(out)


def _md(text: str) -> str:
    # Evidence is plain text; keep Markdown from reading `*` or `_` in it as emphasis.
    return text.replace("*", r"\*").replace("_", r"\_") if "`" not in text else text
