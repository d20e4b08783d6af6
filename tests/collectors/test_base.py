"""Counter arithmetic, name filters and sample naming shared by every collector."""

from __future__ import annotations

import pytest

from agent.schema import COLLECTOR_METRICS, METRICS_BY_NAME
from collectors.base import CounterTracker, NameFilter, sample_metric, sample_unit

S = 1_000_000_000


def test_first_read_is_the_baseline_and_the_total_equals_raw_before_any_wrap():
    c = CounterTracker()
    assert c.update("k", 1000, 0) == (1000, None)
    assert c.update("k", 1500, 2 * S) == (1500, 250.0)


def test_32bit_wrap_adds_the_wrapped_delta():
    c = CounterTracker()
    c.update("k", 2**32 - 100, 0)
    total, rate = c.update("k", 50, S)
    assert total == 2**32 - 100 + 150
    assert rate == 150.0


def test_64bit_wrap():
    c = CounterTracker()
    c.update("k", 2**64 - 10, 0)
    assert c.update("k", 5, S) == (2**64 - 10 + 15, 15.0)


def test_reset_counts_the_new_value_as_the_increase():
    c = CounterTracker()
    c.update("k", 1000, 0)
    # 1000 -> 10 cannot be a 32-bit wrap (the wrapped delta would exceed half the range).
    assert c.update("k", 10, S) == (1010, 10.0)
    assert c.update("k", 30, 2 * S) == (1030, 20.0)


def test_float_counter_decrease_is_a_reset():
    c = CounterTracker()
    c.update("cpu", 5.5, 0)
    assert c.update("cpu", 0.25, S) == (5.75, 0.25)


def test_zero_interval_gives_no_rate():
    c = CounterTracker()
    c.update("k", 1, S)
    assert c.update("k", 2, S) == (2, None)


def test_end_cycle_forgets_counters_not_updated():
    c = CounterTracker()
    c.update("a", 1, 0)
    c.update("b", 1, 0)
    assert c.end_cycle() == []
    c.update("a", 2, S)
    assert c.end_cycle() == ["b"]
    # "b" comes back: a new baseline, no rate from a stale value.
    assert c.update("b", 100, 2 * S) == (100, None)
    assert len(c) == 2


def test_name_filter_include_exclude():
    f = NameFilter(include=("eth*", "lo"), exclude=("eth9",))
    assert f.filter(["lo", "eth0", "eth9", "docker0"]) == ["eth0", "lo"]
    assert NameFilter().filter(["b", "a"]) == ["a", "b"]
    assert NameFilter(exclude=("veth*",)).filter(["veth1a", "eth0"]) == ["eth0"]


@pytest.mark.parametrize(
    ("name", "metric", "unit"),
    [
        ("kvscope_nic_receive_bytes_total", "nic_receive_bytes_per_second", "bytes_per_second"),
        ("kvscope_nic_receive_packets_total", "nic_receive_packets_per_second", "per_second"),
        ("kvscope_gpu_power_watts", "gpu_power_watts", "watts"),
        ("kvscope_process_cpu_seconds_total", "process_cpu_seconds_per_second",
         "seconds_per_second"),
        ("kvscope_gpu_pcie_link_width", "gpu_pcie_link_width", None),
    ],
)
def test_sample_names_and_units(name, metric, unit):
    assert sample_metric(name) == metric
    assert sample_unit(METRICS_BY_NAME[name]) == unit


def test_every_collector_metric_is_catalogued_in_its_group():
    groups = {m.group for m in COLLECTOR_METRICS}
    assert groups == {"collector", "agent"}


def test_read_text_reads_files_larger_than_one_read(tmp_path):
    from collectors.base import read_int, read_text

    p = tmp_path / "big"
    p.write_text("x" * 200_000 + "\n")
    assert len(read_text(str(p))) == 200_001
    (tmp_path / "n").write_text("42\n")
    assert read_int(str(tmp_path / "n")) == 42
