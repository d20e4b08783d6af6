"""What every page shares: which runs were given, which one is shown, and how it is labelled.

The runs come from the command line (``streamlit run streamlit_app.py -- RUN ...``, which
`kvscope dashboard` builds) or, in tests, from ``st.session_state["kvscope_runs"]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import streamlit as st

from agent.errors import InputError
from dashboard import data

RUNS_KEY = "kvscope_runs"
SELECTED_KEY = "kvscope_selected_run"


@dataclass(slots=True, frozen=True)
class Selected:
    """The run a page shows: its path, version (cache key) and data."""

    path: str
    version: int
    run: data.RunData


def init_runs(argv: Sequence[str]) -> list[str]:
    """The run paths of this session: session state if a test set it, else `argv`."""
    if RUNS_KEY not in st.session_state:
        st.session_state[RUNS_KEY] = [str(a) for a in argv]
    return list(st.session_state[RUNS_KEY])


def runs() -> list[str]:
    """The run paths given to the dashboard (possibly empty)."""
    return list(st.session_state.get(RUNS_KEY, []))


def open_path(path: str) -> Selected | None:
    """Load `path`; on failure show one error line and return None."""
    try:
        version = data.run_version(path)
        return Selected(path, version, data.load_run(path, version))
    except FileNotFoundError:
        st.error(f"{path}: no such run directory or file")
    except InputError as exc:
        st.error(str(exc))
    return None


def selected_run() -> Selected | None:
    """The run chosen in the sidebar (the only one when one was given), loaded.

    Shows the run's missing-data notes under the page; returns None (after saying why) when
    no run was given or it cannot be read.
    """
    paths = runs()
    if not paths:
        st.error("No run given. Start the dashboard with `kvscope dashboard RUN [RUN ...]`.")
        return None
    path = paths[0]
    if len(paths) > 1:
        path = pick_run(st.sidebar, "Run", key=SELECTED_KEY)
    sel = open_path(path)
    if sel is not None:
        st.caption(f"{label_of(sel.path)} · {sel.run.source} · "
                   f"{len(sel.run.requests):,} requests")
    return sel


def pick_run(where: Any, label: str, *, key: str, index: int = 0) -> str:
    """A selectbox of the runs by their labels (`data.run_labels`); returns the chosen run's
    path."""
    paths = runs()
    labels = data.run_labels(tuple(paths))
    chosen = where.selectbox(label, labels, index=index, key=key)
    return paths[labels.index(chosen)]


def label_of(path: str) -> str:
    """The one label a run goes by on every page, in selectors and legends alike
    (`data.run_labels`: its run id, or its path where two runs share one)."""
    paths = runs()
    return data.run_labels(tuple(paths))[paths.index(path)] if path in paths else path


def echart(chart: Any, *, key: str) -> None:
    """Draw a `dashboard.echarts.Chart` (SVG: drawn at once, text selectable and readable by
    the browser tests)."""
    st.echarts_chart(chart.option, height=chart.height, key=key, renderer="svg")


def markdown_table(frame: Any) -> str:
    """`frame` as a Markdown table (Streamlit draws it as static HTML, without the data-grid
    component a ``st.dataframe`` loads): for the few-row tables of the Overview."""
    def cell(v: Any) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")

    cols = [str(c) for c in frame.columns]
    lines = ["| " + " | ".join(map(cell, cols)) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(map(cell, row)) + " |"
              for row in frame.itertuples(index=False, name=None)]
    return "\n".join(lines)


def show_notes(run: data.RunData) -> None:
    """What the run lacks or could not tell, in an expander (nothing when complete)."""
    if run.notes:
        with st.expander(f"What this run is missing ({len(run.notes)})", expanded=False):
            for note in run.notes:
                st.markdown(f"- {note}")


def missing(what: str, run: data.RunData) -> None:
    """Say that `what` is absent from this run, and why that may be."""
    why = ("imported traces carry no such table" if not run.is_store
           else "nothing was recorded for it in this run")
    st.info(f"No {what} in this run ({why}).")
