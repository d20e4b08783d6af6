"""RDMA collector on a fixture /sys/class/infiniband tree."""

from __future__ import annotations

import shutil

from collectors.rdma import RdmaCollector
from tests.collectors.trees import FakeRoot, StepClock

BASE = {"port_rcv_data": 1000, "port_xmit_data": 250, "port_rcv_packets": 7,
        "port_rcv_errors": 1, "link_downed": 0, "port_xmit_wait": 40}


def test_no_infiniband_dir_is_unavailable(tmp_path):
    c = RdmaCollector(sys_root=str(tmp_path))
    assert not c.available
    assert "class/infiniband does not exist" in c.unavailable_reason


def test_data_counters_are_4_byte_words_and_hw_counters_become_rates(tmp_path):
    root = FakeRoot(tmp_path)
    clock = StepClock()
    root.set_rdma("mlx5_0", "1", BASE, {"out_of_buffer": 3, "lifespan": 12})
    c = RdmaCollector(sys_root=str(root.sys), clock=clock)
    assert c.available
    r = {(x.name, x.labels): x.value for x in c.collect().readings}
    lab = ("mlx5_0", "1")
    assert r == {
        ("kvscope_rdma_receive_bytes_total", lab): 4000,
        ("kvscope_rdma_transmit_bytes_total", lab): 1000,
        ("kvscope_rdma_receive_errors_total", lab): 1,
        ("kvscope_rdma_link_downed_total", lab): 0,
        ("kvscope_rdma_transmit_wait_total", lab): 40,
    }
    clock.advance(2.0)
    root.set_rdma("mlx5_0", "1", {**BASE, "port_rcv_data": 1500, "port_rcv_packets": 17},
                  {"out_of_buffer": 9, "lifespan": 12})
    col = c.collect()
    s = {s.metric: (s.entity, s.value, s.unit) for s in col.samples}
    assert s["rdma_receive_bytes_per_second"] == ("mlx5_0/1", 1000.0, "bytes_per_second")
    assert s["rdma_port_rcv_packets_per_second"] == ("mlx5_0/1", 5.0, "per_second")
    assert s["rdma_hw_out_of_buffer_per_second"] == ("mlx5_0/1", 3.0, "per_second")
    assert "rdma_hw_lifespan_per_second" not in s


def test_port_that_vanishes_and_unreadable_counter(tmp_path):
    root = FakeRoot(tmp_path)
    root.set_rdma("mlx5_0", "1", BASE)
    root.set_rdma("mlx5_1", "1", BASE)
    (root.sys / "class/infiniband/mlx5_0/ports/1/counters/port_xmit_discards").write_text("n/a\n")
    c = RdmaCollector(sys_root=str(root.sys), exclude=("mlx5_9",))
    col = c.collect()
    assert {x.labels for x in col.readings} == {("mlx5_0", "1"), ("mlx5_1", "1")}
    shutil.rmtree(root.sys / "class/infiniband/mlx5_1")
    col = c.collect()
    assert {x.labels for x in col.readings} == {("mlx5_0", "1")}
    assert [(e.name, e.detail) for e in col.events] == [
        ("rdma_port_vanished", {"device": "mlx5_1", "port": "1"})]
