"""Hardware: NVML, NIC, RDMA and host series on the same time axis as TTFT."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import data, figures
from dashboard.views import common

_DEFAULT_METRICS = 4


def main() -> None:
    st.title("Hardware")
    sel = common.selected_run()
    if sel is None:
        return
    run = sel.run
    common.show_notes(run)
    series = data.hardware_series(sel.path, sel.version)
    windows = (data.ttft_summary(sel.path, sel.version).windows if len(run.requests)
               else None)
    if not len(series):
        common.missing("hardware samples (NVML, NIC, RDMA, host)", run)
    metrics = sorted(series["metric"].unique()) if len(series) else []
    chosen = st.multiselect("Series", metrics, default=metrics[:_DEFAULT_METRICS],
                            key="hardware_metrics") if metrics else []
    if windows is None and not chosen:
        return
    st.plotly_chart(figures.hardware(windows if windows is not None else pd.DataFrame(),
                                     series, chosen,
                                     origin_ns=data.origin_ns(sel.path, sel.version)),
                    key="hardware_chart")
    if len(series):
        sources = ", ".join(sorted(series["source"].unique()))
        st.caption(f"{len(series):,} samples from {sources}. Counters (`*_total`) are drawn "
                   "as per-second rates between consecutive samples.")


main()
