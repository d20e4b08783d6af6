"""`kvscope analyze` lets Arrow allocate from malloc (which it told to keep freed memory) only
while it makes the report, and leaves a pool the user named alone."""

from __future__ import annotations

import pyarrow as pa
import pytest

from kvscope.commands import analyze as cmd


def test_arrow_allocates_from_malloc_only_during_the_report(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ARROW_DEFAULT_MEMORY_POOL", raising=False)
    before = pa.default_memory_pool().backend_name
    with cmd._arrow_from_malloc(True):
        assert pa.default_memory_pool().backend_name == "system"
        kept = pa.array(list(range(1000)))  # allocated from the system pool
    assert pa.default_memory_pool().backend_name == before
    assert kept.sum().as_py() == sum(range(1000))
    with pytest.raises(RuntimeError), cmd._arrow_from_malloc(True):
        raise RuntimeError("the report failed")
    assert pa.default_memory_pool().backend_name == before


def test_nothing_changes_without_malloc_or_with_a_named_pool(
        monkeypatch: pytest.MonkeyPatch) -> None:
    before = pa.default_memory_pool().backend_name
    monkeypatch.delenv("ARROW_DEFAULT_MEMORY_POOL", raising=False)
    with cmd._arrow_from_malloc(False):
        assert pa.default_memory_pool().backend_name == before
    monkeypatch.setenv("ARROW_DEFAULT_MEMORY_POOL", before)
    with cmd._arrow_from_malloc(True):
        assert pa.default_memory_pool().backend_name == before
