"""The dashboard's server process: Streamlit's command line, with the first render paid up front.

    python -m dashboard.serve run dashboard/streamlit_app.py [--server.* ...] -- RUN [RUN ...]

takes exactly the arguments of ``python -m streamlit`` (what `kvscope dashboard` builds with
`kvscope.commands.dashboard.streamlit_argv`) and, before the first browser session:

- reads the runs' Parquet parts on a thread (`dashboard.preread`) while it imports;

- imports what every page needs (pandas, pyarrow, Plotly, the analyzers, `dashboard.figures`,
  Streamlit's server) before the server starts listening, so no session waits for them;
- from the moment Streamlit's runtime exists (just before the server listens), loads each run
  and runs the Overview's analyses (`dashboard.data.warm_overview`) on a background thread,
  filling the process-wide caches the pages read. A session that asks for a result being computed
  waits for it (Streamlit holds a lock per cached value), never computes it twice; a run that
  cannot be read is skipped here and the page says why, as without the warm-up;
- then waits until a first page has been sent (`dashboard.data.FIRST_PAGE_SENT`) and its
  browser has had `SETTLE_S` to fetch the page's components from this process and draw, or
  `FIRST_PAGE_WAIT_S` when nobody comes, before the other pages' results
  (`dashboard.data.warm_rest`): computed earlier, they would compete with that first page for
  this process (the GIL the static files are sent under) and the machine's cores.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Sequence

#: How long the warm-up thread waits for Streamlit's runtime before giving up (the pages then
#: compute everything on first use, as they would without it).
RUNTIME_WAIT_S = 120.0
#: How long the second phase of the warm-up waits for a first page to be sent.
FIRST_PAGE_WAIT_S = 30.0
#: After that first page is sent, how long its browser is left to fetch and draw it.
SETTLE_S = 3.0

_LOG = logging.getLogger("kvscope.dashboard")


def runs_of(argv: Sequence[str]) -> list[str]:
    """The run paths of a ``streamlit run APP [OPTIONS] -- RUN ...`` command line: what
    follows the first ``--`` (nothing when there is none)."""
    args = list(argv)
    return args[args.index("--") + 1:] if "--" in args else []


def preload() -> None:
    """Import the modules the pages and their analyses use (seconds on a cold start)."""
    import numpy  # noqa: F401
    import pandas  # noqa: F401
    import plotly.graph_objects  # noqa: F401
    import pyarrow  # noqa: F401

    import analyzers.accounting
    import analyzers.compare
    import analyzers.diagnose
    import analyzers.ttft  # noqa: F401
    import dashboard.figures  # noqa: F401


def _wait_for_runtime(timeout_s: float) -> bool:
    from streamlit import runtime

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if runtime.exists():
            return True
        time.sleep(0.02)
    return False


def _warm(paths: list[str]) -> None:
    """Warm every run's caches once Streamlit's runtime exists (the caches then attach to its
    storage, as a session's would): `dashboard.data.warm_overview` at once, then
    `dashboard.data.warm_rest` once a first page is sent and drawn (see the module's text)."""
    if not _wait_for_runtime(RUNTIME_WAIT_S):
        _LOG.warning("Streamlit's runtime did not start within %.0f s: no warm-up",
                     RUNTIME_WAIT_S)
        return
    # Cached functions called off a session warn that there is no script context; harmless.
    logging.getLogger("streamlit.runtime.scriptrunner_utils.script_run_context").setLevel(
        logging.ERROR)
    from dashboard import data  # every module it imports is loaded: no concurrent import

    for why in data.warm_overview(paths):
        _LOG.info("warm-up: %s", why)
    if data.FIRST_PAGE_SENT.wait(FIRST_PAGE_WAIT_S):
        time.sleep(SETTLE_S)
    for why in data.warm_rest(paths):
        _LOG.info("warm-up: %s", why)


def main(argv: Sequence[str] | None = None) -> None:
    """Preload, start the warm-up thread, then run Streamlit's CLI with `argv` (default:
    this process's arguments).

    Everything is imported on this thread before the warm-up starts: two threads importing
    the same package at once can see it half initialised (pandas' ``Series`` missing)."""
    args = list(sys.argv[1:] if argv is None else argv)
    paths = runs_of(args)
    if paths and args[:1] == ["run"]:
        from dashboard import preread  # pyarrow only: the thread imports nothing more

        preread.start(paths)
    preload()
    from streamlit.web import cli

    if paths and args[:1] == ["run"]:
        threading.Thread(target=_warm, args=(paths,), name="kvscope-warm-up",
                         daemon=True).start()
    sys.argv = ["streamlit", *args]
    cli.main()


if __name__ == "__main__":
    main()
