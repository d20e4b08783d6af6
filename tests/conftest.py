"""Shared test helpers: third-party data from ../shared/data and local services.

Tests that need a service binary (redis-server, promtool, chromium) skip with a reason when it is
missing on a developer's machine; with KVSCOPE_REQUIRE_SERVICES=1 (set by .ci/run) they fail
instead, so CI never passes by skipping.
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
GOLDEN_RUN = REPO / "tests" / "golden" / "run"


def shared_data(rel: str) -> Path:
    """A file under ../shared/data; skips the test when the shared folder is absent."""
    p = SHARED_DATA / rel
    if not p.exists():
        if os.environ.get("KVSCOPE_REQUIRE_SERVICES"):
            pytest.fail(f"shared data file missing: {p}")
        pytest.skip(f"shared data not available ({p})")
    return p


def require_binary(name: str) -> str:
    """Path of a service binary; skips (or fails under CI) when it is not installed."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("KVSCOPE_REQUIRE_SERVICES"):
            pytest.fail(f"{name} is required in CI but not installed")
        pytest.skip(f"{name} not installed")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def real_nvtx_annotator() -> Any:
    """An `NvtxAnnotator` on the real `nvtx.Domain` although no tool is attached: what
    `nvtx.get_domain` returns under Nsight Systems, minus its "is a tool attached" check (the C
    calls are then no-ops). Tests and benchmarks run the profiler's code path with it."""
    from nvtx._lib import Domain
    from nvtx._lib.lib import DomainHandle

    from agent.schema import STATES, STEP_PHASES
    from agent.telemetry.annotate import NVTX_DOMAIN, NvtxAnnotator

    dom = object.__new__(Domain)
    dom.handle = DomainHandle(NVTX_DOMAIN)
    dom.__init__(NVTX_DOMAIN)
    return NvtxAnnotator((*STATES, *STEP_PHASES), domain=dom)
