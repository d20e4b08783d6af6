"""`kvscope run --engine vllm`'s entry: a clear error when vLLM is not installed, then the
session (`kvscope.vllm.session`, which imports vLLM)."""

from __future__ import annotations

import importlib.util
from typing import Any

from agent.errors import InputError


def run_vllm_session(opts: Any, **kwargs: Any) -> Any:
    """`kvscope.vllm.session.run_vllm_session`, or InputError for an option vLLM cannot take
    or when vLLM is missing."""
    from kvscope.vllm.session import check_options

    check_options(opts)
    if importlib.util.find_spec("vllm") is None:
        raise InputError("--engine vllm: vLLM is not installed in this environment; run "
                         "scripts/setup-vllm and use .venv-vllm/bin/kvscope")
    from kvscope.vllm.session import run_vllm_session as run

    return run(opts, **kwargs)
