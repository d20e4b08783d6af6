"""NIC collector on fixture sysfs/procfs trees (wrap, reset, vanishing interface, fallback)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from collectors.nic import NIC_COUNTERS, NicCollector, parse_proc_net_dev
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


def _both(root, nics: dict[str, dict[str, int]], missed: int = 0,
          speed: str | None = None) -> None:
    """Each interface in sysfs and in /proc/net/dev as the kernel prints it: the `drop` column
    is rx_dropped + rx_missed_errors."""
    rows = {}
    for dev, c in nics.items():
        root.set_nic(dev, speed=speed, **c)
        g = c.get
        rows[dev] = [g("rx_bytes", 0), g("rx_packets", 0), g("rx_errors", 0),
                     g("rx_dropped", 0) + missed, 0, 0, 0, 0,
                     g("tx_bytes", 0), g("tx_packets", 0), g("tx_errors", 0),
                     g("tx_dropped", 0), 0, 0, 0, 0]
    root.write_proc_net_dev(rows)


def test_counters_from_proc_net_dev_and_receive_drops_from_sysfs(root):
    """One /proc/net/dev read for the counters; receive drops stay sysfs rx_dropped (the
    catalogue's meaning), not /proc/net/dev's rx_dropped + rx_missed_errors."""
    _both(root, {"eth0": {"rx_bytes": 5000, "rx_packets": 50, "rx_errors": 1, "rx_dropped": 2,
                          "tx_bytes": 700, "tx_packets": 7, "tx_errors": 4, "tx_dropped": 5}},
          missed=40, speed="100")
    # The statistics files disagree with /proc/net/dev on purpose: the counters must come
    # from the one read of /proc/net/dev (bytes), the receive drops from sysfs.
    (root.sys / "class" / "net" / "eth0" / "statistics" / "rx_bytes").write_text("1\n")
    c = NicCollector(sys_root=str(root.sys), proc_root=str(root.proc))
    r = _readings(c.collect())
    assert r[("kvscope_nic_receive_bytes_total", ("eth0",))] == 5000
    assert r[("kvscope_nic_receive_packets_total", ("eth0",))] == 50
    assert r[("kvscope_nic_receive_errors_total", ("eth0",))] == 1
    assert r[("kvscope_nic_receive_drop_total", ("eth0",))] == 2
    assert r[("kvscope_nic_transmit_bytes_total", ("eth0",))] == 700
    assert r[("kvscope_nic_transmit_packets_total", ("eth0",))] == 7
    assert r[("kvscope_nic_transmit_errors_total", ("eth0",))] == 4
    assert r[("kvscope_nic_transmit_drop_total", ("eth0",))] == 5
    assert r[("kvscope_nic_speed_bytes", ("eth0",))] == 100 * 125_000
    c.close()


def test_kept_open_files_follow_an_interface_replaced_under_the_same_name(root):
    """rx_dropped and speed stay open between runs; an interface removed and created again
    (or another one renamed into its name) between two runs is read afresh, not through the
    old descriptors."""
    clock = StepClock()
    _both(root, {"veth0": {"rx_dropped": 100}}, speed="1000")
    c = NicCollector(sys_root=str(root.sys), proc_root=str(root.proc), clock=clock)
    c.collect()
    _both(root, {"veth0": {"rx_dropped": 250}}, speed="1000")  # rewritten in place
    clock.advance(1.0)
    assert _readings(c.collect())[("kvscope_nic_receive_drop_total", ("veth0",))] == 250
    root.remove_nic("veth0")
    _both(root, {"veth0": {"rx_dropped": 7}}, speed="2000")  # a new directory, no run between
    clock.advance(1.0)
    r = _readings(c.collect())
    assert r[("kvscope_nic_receive_drop_total", ("veth0",))] == 257  # reset rule: 250 + 7
    assert r[("kvscope_nic_speed_bytes", ("veth0",))] == 2000 * 125_000
    assert list(c._open) == ["veth0"]
    c.close()
    assert c._open == {}


def test_interfaces_beyond_the_open_file_cap_are_read_by_path(root, monkeypatch):
    import collectors.nic as nic

    monkeypatch.setattr(nic, "MAX_OPEN_INTERFACES", 1)
    _both(root, {"eth0": {"rx_dropped": 1}, "eth1": {"rx_dropped": 2}}, speed="200")
    c = NicCollector(sys_root=str(root.sys), proc_root=str(root.proc))
    for _ in range(2):
        r = _readings(c.collect())
        assert r[("kvscope_nic_receive_drop_total", ("eth0",))] == 1
        assert r[("kvscope_nic_receive_drop_total", ("eth1",))] == 2
        assert r[("kvscope_nic_speed_bytes", ("eth1",))] == 200 * 125_000
    assert list(c._open) == ["eth0"]
    root.remove_nic("eth0")
    c.collect()
    assert c._open == {}  # a vanished interface's files are closed
    c.close()


def test_the_real_host_agrees_with_sysfs():
    """On this host: the counters of /proc/net/dev and sysfs rx_dropped match the statistics
    files of every interface (loopback's bytes move, so within what a scrape adds)."""
    c = NicCollector()
    r = _readings(c.collect())
    base = Path("/sys/class/net")
    for dev in os.listdir(base):
        for f, _, metric in NIC_COUNTERS:
            want = int((base / dev / "statistics" / f).read_text())
            got = r[(metric, (dev,))]
            assert want - 1_000_000 <= got <= want, (dev, f)
    c.close()


def test_another_namespaces_sysfs_is_read_from_its_own_statistics(root):
    """A container with the host's /sys: /proc/net/dev lists the container's interfaces,
    sysfs the host's. A same-named interface there is another device, so every counter comes
    from sysfs statistics files, none from /proc/net/dev."""
    _both(root, {"eth0": {"rx_bytes": 5000, "tx_bytes": 700}, "docker0": {"rx_bytes": 9}})
    # The container's /proc/net/dev: its own eth0 (other counters) and lo; no docker0.
    root.write_proc_net_dev({"eth0": [123] + [0] * 7 + [45] + [0] * 7, "lo": [1] * 16})
    c = NicCollector(sys_root=str(root.sys), proc_root=str(root.proc))
    r = _readings(c.collect())
    assert r[("kvscope_nic_receive_bytes_total", ("eth0",))] == 5000
    assert r[("kvscope_nic_transmit_bytes_total", ("eth0",))] == 700
    assert r[("kvscope_nic_receive_bytes_total", ("docker0",))] == 9
    assert ("kvscope_nic_receive_bytes_total", ("lo",)) not in r
    c.close()


def test_the_sysfs_listing_is_kept_while_proc_net_dev_lists_the_same(root, monkeypatch):
    """sysfs is listed once while /proc/net/dev lists the same interfaces; an interface
    that appears in both is read at the next run; a rename (the same names in another
    order) or `RELIST_NS` lists it again."""
    import collectors.nic as nic

    listed: list[str] = []
    real = os.listdir

    def counting(path):
        listed.append(str(path))
        return real(path)

    monkeypatch.setattr(nic.os, "listdir", counting)
    clock = StepClock()
    _both(root, {"eth0": {"rx_bytes": 1}, "lo": {"rx_bytes": 2}})
    c = NicCollector(sys_root=str(root.sys), proc_root=str(root.proc), clock=clock)
    for _ in range(3):
        clock.advance(1.0)
        r = _readings(c.collect())
    assert len(listed) == 1
    assert r[("kvscope_nic_receive_bytes_total", ("lo",))] == 2
    _both(root, {"eth0": {"rx_bytes": 1}, "lo": {"rx_bytes": 2}, "veth9": {"rx_bytes": 9}})
    clock.advance(1.0)
    assert _readings(c.collect())[("kvscope_nic_receive_bytes_total", ("veth9",))] == 9
    assert len(listed) == 2
    # The same names in another order: interfaces were renamed, list again.
    _both(root, {"lo": {"rx_bytes": 2}, "veth9": {"rx_bytes": 9}, "eth0": {"rx_bytes": 1}})
    clock.advance(1.0)
    c.collect()
    assert len(listed) == 3
    clock.advance(1.0)
    c.collect()
    assert len(listed) == 3
    # An interface only sysfs shows (another namespace's /sys) is found within RELIST_NS.
    root.set_nic("docker0", rx_bytes=5)
    clock.advance(nic.RELIST_NS / 1e9)
    r = _readings(c.collect())
    assert len(listed) == 4
    assert r[("kvscope_nic_receive_bytes_total", ("docker0",))] == 5
    c.close()


def test_an_interface_gone_from_sysfs_under_a_kept_listing_is_listed_again(root):
    clock = StepClock()
    _both(root, {"eth0": {"rx_bytes": 1}, "eth1": {"rx_bytes": 2}})
    c = NicCollector(sys_root=str(root.sys), proc_root=str(root.proc), clock=clock)
    c.collect()
    root.remove_nic("eth1")  # /proc/net/dev still lists it
    clock.advance(1.0)
    col = c.collect()
    assert {r.labels for r in col.readings} == {("eth0",)}
    assert [e.name for e in col.events] == ["interface_vanished"]
    assert c._open.keys() == {"eth0"}  # eth1's files are closed
    c.close()
