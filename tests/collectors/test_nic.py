"""NIC collector on fixture sysfs/procfs trees (wrap, reset, vanishing interface, fallback)."""

from __future__ import annotations

import pytest

from collectors.nic import NicCollector, parse_proc_net_dev
from tests.collectors.trees import FakeRoot, StepClock


@pytest.fixture
def root(tmp_path):
    return FakeRoot(tmp_path)


def _readings(col):
    return {(r.name, r.labels): r.value for r in col.readings}


def _samples(col):
    return {(s.entity, s.metric): (s.value, s.unit) for s in col.samples}


def test_counters_speed_and_rates(root):
    clock = StepClock()
    root.set_nic("eth0", speed="25000", rx_bytes=1000, tx_bytes=500, rx_packets=10,
                 rx_dropped=1)
    root.set_nic("lo", speed=None, rx_bytes=7)
    c = NicCollector(sys_root=str(root.sys), proc_root=str(root.proc), clock=clock)
    first = c.collect()
    r = _readings(first)
    assert r[("kvscope_nic_receive_bytes_total", ("eth0",))] == 1000
    assert r[("kvscope_nic_transmit_bytes_total", ("eth0",))] == 500
    assert r[("kvscope_nic_receive_drop_total", ("eth0",))] == 1
    assert r[("kvscope_nic_speed_bytes", ("eth0",))] == 25000 * 125_000
    assert ("kvscope_nic_speed_bytes", ("lo",)) not in r
    assert r[("kvscope_nic_receive_bytes_total", ("lo",))] == 7
    # First run: gauges only (speed), no rates yet.
    assert {s.metric for s in first.samples} == {"nic_speed_bytes"}

    clock.advance(2.0)
    root.set_nic("eth0", speed="25000", rx_bytes=3000, tx_bytes=500, rx_packets=30,
                 rx_dropped=1)
    s = _samples(c.collect())
    assert s[("eth0", "nic_receive_bytes_per_second")] == (1000.0, "bytes_per_second")
    assert s[("eth0", "nic_receive_packets_per_second")] == (10.0, "per_second")
    assert s[("eth0", "nic_transmit_bytes_per_second")] == (0.0, "bytes_per_second")
    assert {x.ts_ns for x in c.collect().samples} == {clock.t}


def test_counter_wrap_keeps_the_exposed_counter_monotonic(root):
    clock = StepClock()
    root.set_nic("eth0", rx_bytes=2**32 - 1000)
    c = NicCollector(sys_root=str(root.sys), proc_root=str(root.proc), clock=clock)
    c.collect()
    clock.advance(1.0)
    root.set_nic("eth0", rx_bytes=500)  # a 32-bit driver counter wrapped
    col = c.collect()
    assert _readings(col)[("kvscope_nic_receive_bytes_total", ("eth0",))] == 2**32 + 500
    assert _samples(col)[("eth0", "nic_receive_bytes_per_second")][0] == 1500.0


def test_counter_reset_is_not_a_negative_rate(root):
    clock = StepClock()
    root.set_nic("eth0", rx_bytes=10_000)
    c = NicCollector(sys_root=str(root.sys), proc_root=str(root.proc), clock=clock)
    c.collect()
    clock.advance(1.0)
    root.set_nic("eth0", rx_bytes=300)  # driver reloaded
    col = c.collect()
    assert _readings(col)[("kvscope_nic_receive_bytes_total", ("eth0",))] == 10_300
    assert _samples(col)[("eth0", "nic_receive_bytes_per_second")][0] == 300.0


def test_interface_that_vanishes_and_returns(root):
    clock = StepClock()
    root.set_nic("eth0", rx_bytes=1)
    root.set_nic("veth1", rx_bytes=5000)
    c = NicCollector(sys_root=str(root.sys), proc_root=str(root.proc), clock=clock)
    c.collect()
    root.remove_nic("veth1")
    clock.advance(1.0)
    col = c.collect()
    assert {r.labels for r in col.readings} == {("eth0",)}
    assert [(e.name, e.detail) for e in col.events] == [
        ("interface_vanished", {"device": "veth1"})]
    # It comes back with a smaller counter: a new baseline, no rate, no bogus delta.
    root.set_nic("veth1", rx_bytes=20)
    clock.advance(1.0)
    col = c.collect()
    assert _readings(col)[("kvscope_nic_receive_bytes_total", ("veth1",))] == 20
    assert not [s for s in col.samples if s.entity == "veth1"]
    assert col.events == []


def test_include_exclude(root):
    for dev in ("lo", "eth0", "eth1", "docker0"):
        root.set_nic(dev)
    c = NicCollector(sys_root=str(root.sys), proc_root=str(root.proc),
                     include=("eth*", "lo"), exclude=("eth1",))
    assert sorted({r.labels[0] for r in c.collect().readings}) == ["eth0", "lo"]


def test_unreadable_speed_is_skipped(root):
    root.set_nic("eth0", speed="-1")
    root.set_nic("eth1", speed="garbage")
    c = NicCollector(sys_root=str(root.sys), proc_root=str(root.proc))
    assert not [r for r in c.collect().readings if r.name == "kvscope_nic_speed_bytes"]


def test_proc_net_dev_fallback_without_sysfs(tmp_path):
    root = FakeRoot(tmp_path)
    root.write_proc_net_dev({
        "lo": [100, 2, 0, 0, 0, 0, 0, 0, 100, 2, 0, 0, 0, 0, 0, 0],
        "eth0": [5000, 50, 1, 2, 0, 0, 0, 3, 700, 7, 4, 5, 0, 0, 0, 0],
    })
    c = NicCollector(sys_root=str(tmp_path / "nosys"), proc_root=str(root.proc))
    r = _readings(c.collect())
    assert r[("kvscope_nic_receive_bytes_total", ("eth0",))] == 5000
    assert r[("kvscope_nic_receive_packets_total", ("eth0",))] == 50
    assert r[("kvscope_nic_receive_errors_total", ("eth0",))] == 1
    assert r[("kvscope_nic_receive_drop_total", ("eth0",))] == 2
    assert r[("kvscope_nic_transmit_bytes_total", ("eth0",))] == 700
    assert r[("kvscope_nic_transmit_packets_total", ("eth0",))] == 7
    assert r[("kvscope_nic_transmit_errors_total", ("eth0",))] == 4
    assert r[("kvscope_nic_transmit_drop_total", ("eth0",))] == 5
    assert r[("kvscope_nic_receive_bytes_total", ("lo",))] == 100


def test_interface_without_statistics_dir_falls_back_to_proc(root):
    root.set_nic("eth0", rx_bytes=1)
    (root.sys / "class" / "net" / "odd0").mkdir()
    root.write_proc_net_dev({"odd0": [9] + [0] * 15})
    c = NicCollector(sys_root=str(root.sys), proc_root=str(root.proc))
    r = _readings(c.collect())
    assert r[("kvscope_nic_receive_bytes_total", ("odd0",))] == 9
    assert r[("kvscope_nic_receive_bytes_total", ("eth0",))] == 1


def test_parse_proc_net_dev_without_space_after_colon():
    text = "h1\nh2\n  eth0:12 3 0 0 0 0 0 0 45 6 0 0 0 0 0 0\nbogus line\n"
    assert parse_proc_net_dev(text) == {"eth0": [12, 3, 0, 0, 0, 0, 0, 0, 45, 6, 0, 0, 0, 0,
                                                 0, 0]}


def test_real_proc_net_dev_parses_and_agrees_with_sysfs_names():
    with open("/proc/net/dev") as fh:
        parsed = parse_proc_net_dev(fh.read())
    assert "lo" in parsed
    assert all(len(v) == 16 for v in parsed.values())
