"""The dashboard's server process (`dashboard.serve`): the command line `kvscope dashboard` runs,
and the warm-up that computes every page's first results before the first session."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import streamlit as st

from dashboard import data, serve
from kvscope.cli import main
from kvscope.commands.dashboard import server_argv, streamlit_argv
from tests.conftest import GOLDEN_RUN
from tests.dashboard.test_app import app, texts


def test_server_argv_is_streamlits_through_the_preloading_module(tmp_path: Path) -> None:
    runs = [tmp_path / "a", tmp_path / "b"]
    plain = streamlit_argv(runs, port=8123, address="127.0.0.1")
    argv = server_argv(runs, port=8123, address="127.0.0.1")
    assert argv[:3] == [sys.executable, "-m", "dashboard.serve"]
    assert argv[3:] == plain[3:]  # `run APP OPTIONS -- RUNS`, exactly as streamlit gets them
    assert serve.runs_of(argv[3:]) == [str(r.resolve()) for r in runs]
    assert serve.runs_of(["run", "app.py"]) == []


def test_kvscope_dashboard_execs_the_server_module(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    monkeypatch.setattr("os.execv", lambda path, argv: seen.append(argv))
    assert main(["dashboard", str(GOLDEN_RUN)]) == 0
    assert seen[0][1:3] == ["-m", "dashboard.serve"] and seen[0][3] == "run"
    assert seen[0][-2:] == ["--", str(GOLDEN_RUN.resolve())]


def _failing(name: str) -> Callable[..., None]:
    """A stand-in of any signature that fails the test when called."""
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"{name} called after the warm-up: a page missed the cache")
    return fail


@pytest.mark.parametrize("page", ["overview", "requests", "kv_cache", "hardware", "compare"])
def test_after_the_warm_up_no_page_recomputes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             page: str) -> None:
    """`data.warm` makes exactly the cached calls the pages make: with the run readers and
    the analyses replaced by functions that fail, every page still renders in full."""
    a, b = tmp_path / "a", tmp_path / "b"  # fresh paths: nothing cached from other tests
    shutil.copytree(GOLDEN_RUN, a)
    shutil.copytree(GOLDEN_RUN, b)
    st.cache_data.clear()
    st.cache_resource.clear()
    assert data.warm([str(a), str(b)]) == []
    for module, name in (("agent.runstore.reader", "open_run"),
                         ("analyzers.ttft", "partition"), ("analyzers.ttft", "summarize"),
                         ("analyzers.diagnose", "diagnose_report"),
                         ("analyzers.compare", "compare_frames"),
                         ("analyzers.accounting", "layer_table"),
                         ("analyzers.timebase", "run_origin_ns")):
        monkeypatch.setattr(f"{module}.{name}", _failing(f"{module}.{name}"))
    at = app([a, b], page)
    shown = texts(at)
    assert "missed the cache" not in shown and "diagnoses failed" not in shown
    if page == "overview":
        assert "Top findings" in shown


def test_warm_up_skips_what_it_cannot_read(tmp_path: Path) -> None:
    missing = tmp_path / "gone"
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "run.json").write_text("{")
    errors = data.warm([str(missing), str(tmp_path / "empty")])
    assert len(errors) == 2 and errors[0].startswith(f"{missing}: ")
    assert errors[1].startswith(f"{tmp_path / 'empty'}: ")


def test_the_read_ahead_is_the_store_open_run_reads(tmp_path: Path) -> None:
    """`dashboard.preread`: the tables the server reads while it starts are `open_run`'s; a
    run changed since (another version), a file and an unreadable run are left to
    `load_run`, which then reads (or refuses) it itself."""
    from agent.runstore import open_run
    from dashboard import preread

    run = tmp_path / "run"
    shutil.copytree(GOLDEN_RUN, run)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "run.json").write_text("{")
    preread.start([str(run), str(bad), str(tmp_path / "gone")]).join(30)
    version = preread.run_version(run)
    assert preread.take(str(bad), preread.run_version(bad)) is None
    store = preread.take(str(run), version)
    assert store is not None
    want = open_run(run)
    for name in want.tables:
        assert store.tables[name].equals(want.tables[name]), name
    assert preread.take(str(run), version) is None  # taken once
    preread.start([str(run)]).join(30)
    assert preread.take(str(run), version + 1) is None  # the run changed since: read again
    # load_run takes what was read, and gives the frames open_run gives.
    preread.start([str(run)]).join(30)
    loaded = data.load_run(str(run), version)
    assert loaded.spans.equals(want.spans) and loaded.requests.equals(want.requests)
    with pytest.raises(ValueError, match=r"run\.json"):
        data.load_run(str(bad), preread.run_version(bad))


def test_the_read_ahead_never_imports_pandas(tmp_path: Path) -> None:
    """The reading thread runs while the server's main thread imports pandas: it must not
    import it too (two threads importing one package can see it half initialised)."""
    import subprocess

    code = ("import sys; from dashboard import preread; "
            f"preread.start([{str(GOLDEN_RUN)!r}]).join(60); "
            f"assert preread.take({str(GOLDEN_RUN)!r}, preread.run_version({str(GOLDEN_RUN)!r}))"
            " is not None; print(sorted(m for m in sys.modules if m.split('.')[0] == 'pandas'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                         capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
