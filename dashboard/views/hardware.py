"""Hardware: NVML, NIC, RDMA and host series on the same time axis as TTFT."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import data, figures
from dashboard.views import common

#: Collectors whose absence the page explains (source → what it watches).
_WATCHED = {"nvml": "GPU (NVML)", "nic": "NIC", "rdma": "RDMA"}


def _absent(sel: common.Selected, series: pd.DataFrame) -> None:
    """Say which collectors recorded nothing, and why when the run says so."""
    have = set(series["source"].unique()) if len(series) else set()
    why = data.collector_notes(sel.path, sel.version)
    for source, what in _WATCHED.items():
        if source in have:
            continue
        reason = why.get(source)
        if source == "nvml":
            st.info(f"No GPU series: there are no NVML samples in this run, so the GPU was not "
                    f"watched ({reason or 'no NVML collector ran'}).")
        elif reason:
            st.caption(f"No {what} series: {reason}.")


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
    elif run.is_store:
        _absent(sel, series)
    metrics = sorted(series["metric"].unique()) if len(series) else []
    chosen = st.multiselect("Series", metrics, default=data.default_hardware_metrics(series),
                            key="hardware_metrics",
                            help="By default: utilisation, then bandwidth, then other rates; "
                                 "series that never change (a memory total) are left out.") \
        if metrics else []
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
