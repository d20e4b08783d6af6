"""Compare: two runs side by side with the verdict of `analyzers.compare`."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from analyzers.ratios import Ratio
from analyzers.units import fmt_ns
from dashboard import data, figures
from dashboard.views import common


def _delta(row: pd.Series, q: str) -> str:
    return (f"{fmt_ns(row[f'delta_{q}_ns'], signed=True)} "
            f"[{fmt_ns(row[f'delta_{q}_low_ns'], signed=True)}, "
            f"{fmt_ns(row[f'delta_{q}_high_ns'], signed=True)}]")


def _ratio(num: int, den: int, unit: str, delta_unit: str) -> str:
    """A `Comparison.accounting` side printed as `Ratio` prints it (``n / d unit (x %)``)."""
    per = None if delta_unit == "pts" else delta_unit.removesuffix(" each")
    return str(Ratio("", "", int(num), int(den), unit, "token", numerator_unit=per))


def main() -> None:
    st.title("Compare")
    paths = common.runs()
    if len(paths) < 2:
        st.info("Compare needs two runs: `kvscope dashboard RUN_A RUN_B`.")
        return
    left, right = st.columns(2)
    path_a = common.pick_run(left, "A (baseline)", index=0, key="compare_a")
    path_b = common.pick_run(right, "B", index=1, key="compare_b")
    a, b = common.open_path(path_a), common.open_path(path_b)
    if a is None or b is None:
        return
    for col, sel in ((left, a), (right, b)):
        col.caption(f"{common.label_of(sel.path)} · {sel.run.source} · "
                    f"{len(sel.run.requests):,} requests")
        for note in sel.run.notes:
            col.caption(f"⚠ {note}")
    if not len(a.run.requests) or not len(b.run.requests):
        st.warning("Both runs need requests to be compared.")
        return
    cmp = data.comparison(a.path, a.version, b.path, b.version)
    st.subheader("Verdict")
    st.info(cmp.verdict)
    st.caption(f"{cmp.requests_a:,} vs {cmp.requests_b:,} requests with a first token; "
               f"{100 * cmp.level:.0f} % bootstrap intervals in brackets.")
    st.plotly_chart(figures.compare_stages(cmp.stages, cmp.a_label, cmp.b_label),
                    key="compare_chart")
    s = cmp.stages
    # The verdict attributes the change on one basis (tail mean, or mean when the tail did not
    # move beyond noise); the table shows the same one.
    basis = getattr(cmp, "basis", "tail_mean")
    # Two tables of five columns: one table of nine cut its last columns off.
    st.caption(f"Stage percentiles, A = {cmp.a_label}, B = {cmp.b_label}; Δ = B - A with its "
               f"{100 * cmp.level:.0f} % interval ({data.N_BOOT:,} bootstrap resamples, as "
               "`kvscope compare`).")
    wide = st.column_config.TextColumn(width="large")
    st.dataframe(pd.DataFrame({
        "stage": s["stage"],
        "A p50": s["a_p50_ns"].map(fmt_ns), "B p50": s["b_p50_ns"].map(fmt_ns),
        "Δ p50 [CI]": [_delta(r, "p50") for _, r in s.iterrows()],
    }), hide_index=True, key="compare_stages_p50", width="stretch",
        column_config={"Δ p50 [CI]": wide})
    # No "explains N %" beside the percentiles: a share of a mean change next to a p50 change
    # read as the p50's; the mean column adds up to the TTFT change stage by stage.
    basis_col = f"Δ {basis.replace('_', ' ')} [CI]"
    st.dataframe(pd.DataFrame({
        "stage": s["stage"],
        "A p99": s["a_p99_ns"].map(fmt_ns), "B p99": s["b_p99_ns"].map(fmt_ns),
        "Δ p99 [CI]": [_delta(r, "p99") for _, r in s.iterrows()],
        basis_col: [_delta(r, basis) for _, r in s.iterrows()],
    }), hide_index=True, key="compare_stages", width="stretch",
        column_config={"Δ p99 [CI]": wide, basis_col: wide})
    if a.run.accounting_known and b.run.accounting_known:
        acc = cmp.accounting
        st.subheader("Token accounting, A vs B")
        st.dataframe(pd.DataFrame({
            "measure": acc["label"],
            **{side.upper(): [_ratio(*row) for row in zip(
                acc[f"{side}_numerator"], acc[f"{side}_denominator"], acc["unit"],
                acc["delta_unit"], strict=True)] for side in ("a", "b")},
            "Δ": [("-" if pd.isna(d) else f"{d:+.1f} {u}")
                  for d, u in zip(acc["delta"], acc["delta_unit"], strict=True)],
        }), hide_index=True, key="compare_accounting", width="stretch")
    else:
        st.info("Token accounting is missing from at least one run; only stages are compared.")


main()
