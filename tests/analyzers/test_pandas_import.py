"""The analyzers' modules load without waiting for pandas: it is imported on a thread while the
caller goes on (e.g. reading a run), and every use of it waits for that import; a fork waits
for it too, so that a child never inherits a half-done import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_the_analyzers_import_pandas_on_a_thread_and_use_it_whole() -> None:
    code = """
import threading
from analyzers import frames
from analyzers.accounting import token_accounting
from analyzers.ttft import partition, summarize
import pandas
assert frames.PANDAS.DataFrame is pandas.DataFrame
assert frames._pandas_import is not None  # started, since pandas was not imported before
frames._pandas_import.join()
import sys
print(sorted(m for m in ("pandas", "pandas.core.frame") if m in sys.modules))
"""
    assert _run(code) == "['pandas', 'pandas.core.frame']"


def test_no_thread_when_pandas_is_imported_already() -> None:
    assert _run("import pandas\nfrom analyzers import frames\n"
                "print(frames._pandas_import is None)") == "True"


def test_a_fork_waits_for_the_import() -> None:
    code = """
import os, sys
from analyzers import frames
pid = os.fork()
if pid == 0:
    done = "pandas" in sys.modules and not getattr(sys.modules["pandas"].__spec__,
                                                    "_initializing", False)
    os._exit(0 if done and frames.PANDAS.DataFrame is not None else 3)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
"""
    assert _run(code) == "0"
