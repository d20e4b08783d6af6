"""The /metrics exposition of collector readings: catalogue names, promtool-clean."""

from __future__ import annotations

import subprocess

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.schema import catalogued_series
from collectors.base import Reading
from collectors.exposition import CollectorExposition, TextRenderer
from collectors.runner import CollectorRunner, default_collectors
from tests.collectors.fake_nvml import FakeGpu, FakeNvml
from tests.collectors.trees import FakeRoot
from tests.conftest import require_binary


def _exposition(tmp_path) -> tuple[str, CollectorRunner]:
    root = FakeRoot(tmp_path)
    root.set_nic("eth0", speed="100000", rx_bytes=5)
    root.set_nic("lo", rx_bytes=1)
    root.set_rdma("mlx5_0", "1", {"port_rcv_data": 3, "port_xmit_data": 4, "link_downed": 0})
    root.set_stat(user=1, system=1, idle=10)
    root.set_meminfo(total_kb=100, available_kb=40)
    nv = FakeNvml([FakeGpu(), FakeGpu(nvlink=False)])
    runner = CollectorRunner(default_collectors(sys_root=str(root.sys), proc_root=str(root.proc),
                                                nvml=nv, watch={"engine": 1}))
    runner.collect_once()
    nv.inject_xid(0, 79)
    root.set_stat(user=3, system=3, idle=14)  # +4 busy, +4 idle
    runner.collect_once()
    reg = CollectorRegistry(auto_describe=False)
    reg.register(CollectorExposition(runner))
    return generate_latest(reg).decode(), runner


def test_exposition_passes_promtool_with_no_output(tmp_path):
    promtool = require_binary("promtool")
    text, _ = _exposition(tmp_path)
    res = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                         text=True, timeout=60)
    assert (res.returncode, res.stdout, res.stderr) == (0, "", "")


def test_every_series_is_catalogued_and_labels_are_bounded(tmp_path):
    text, _ = _exposition(tmp_path)
    names = set()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            names.add(s.name)
            assert not set(s.labels) & {"request_id", "prompt", "token_ids"}
    assert names <= catalogued_series()
    for want in ("kvscope_gpu_utilization_ratio", "kvscope_nic_receive_bytes_total",
                 "kvscope_rdma_receive_bytes_total", "kvscope_host_memory_used_bytes",
                 "kvscope_gpu_xid_errors_total", "kvscope_collector_duration_seconds",
                 "kvscope_collector_last_success_timestamp_seconds"):
        assert want in names


def test_values_on_the_wire(tmp_path):
    text, _ = _exposition(tmp_path)
    lines = set(text.splitlines())
    assert 'kvscope_gpu_utilization_ratio{gpu="0"} 0.37' in lines
    assert 'kvscope_gpu_xid_errors_total{gpu="0",xid="79"} 1.0' in lines
    assert 'kvscope_rdma_receive_bytes_total{device="mlx5_0",port="1"} 12.0' in lines
    assert 'kvscope_nic_speed_bytes{device="eth0"} 1.25e+10' in lines
    assert 'kvscope_host_memory_used_bytes 61440.0' in lines
    assert 'kvscope_host_cpu_utilization_ratio 0.5' in lines
    # GPU 1 has no NVLink: no series for it, GPU 0 has one.
    assert not [x for x in lines if x.startswith('kvscope_gpu_nvlink') and 'gpu="1"' in x]
    assert [x for x in lines if x.startswith('kvscope_gpu_nvlink_transmit') and 'gpu="0"' in x]


def test_text_renderer_is_byte_identical_to_prometheus_client(tmp_path):
    text, runner = _exposition(tmp_path)
    renderer = TextRenderer()
    assert renderer.render(runner.readings()).decode() == text
    # Cached prefixes are reused, and label values that need escaping are escaped like the
    # reference does.
    assert renderer.render(runner.readings()).decode() == text
    odd = {"kvscope_nic_receive_bytes_total": [Reading("kvscope_nic_receive_bytes_total",
                                                       ('we"ird\\dev\n',), 1.0)]}
    reg = CollectorRegistry(auto_describe=False)

    class Fixed:
        def readings(self):
            return odd

    reg.register(CollectorExposition(Fixed()))
    assert renderer.render(odd) == generate_latest(reg)


def test_text_renderer_cache_is_bounded():
    r = TextRenderer(max_cached=10)
    for i in range(50):
        r.render({"kvscope_nic_receive_bytes_total": [
            Reading("kvscope_nic_receive_bytes_total", (f"veth{i}",), 1.0)]})
    assert len(r._prefix) <= 11
