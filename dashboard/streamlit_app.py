"""The kvscope dashboard: `streamlit run dashboard/streamlit_app.py -- RUN [RUN ...]`.

`kvscope dashboard` starts it (headless, 127.0.0.1). Pages: Overview, Requests, KV cache,
Hardware, and Compare when two or more runs are given. Every number comes from `analyzers`
through `dashboard.data`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import streamlit as st

from dashboard import data
from dashboard.views import common

PAGES = Path(__file__).resolve().parent / "views"

st.set_page_config(page_title="kvscope", layout="wide")
paths = common.init_runs(sys.argv[1:])
overview = st.Page(PAGES / "overview.py", title="Overview", url_path="overview")


def _home() -> None:
    """The root URL: Streamlit serves its default page at ``/`` whatever that page's own
    ``url_path``, so ``/overview`` would be "Page not found". The default page is this hidden
    one, which opens the Overview at its own URL; every page loads by its URL path."""
    st.switch_page(overview)


pages = [
    st.Page(_home, title="kvscope", url_path="home", default=True, visibility="hidden"),
    overview,
    st.Page(PAGES / "requests.py", title="Requests", url_path="requests"),
    st.Page(PAGES / "kv_cache.py", title="KV cache", url_path="kv_cache"),
    st.Page(PAGES / "hardware.py", title="Hardware", url_path="hardware"),
]
if len(paths) >= 2:
    pages.append(st.Page(PAGES / "compare.py", title="Compare", url_path="compare"))
st.navigation(pages).run()
data.FIRST_PAGE_SENT.set()  # the warm-up's second phase may start (`dashboard.serve`)
