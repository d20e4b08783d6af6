"""NVML collector on a fake built from pynvml itself, and on the real pynvml of this host."""

from __future__ import annotations

import inspect
import logging

import pynvml
import pytest

from collectors.nvml import ALL_FIELDS, NvmlCollector
from collectors.runner import CollectorRunner
from tests.collectors.fake_nvml import FakeGpu, FakeNvml, fake_api_names
from tests.collectors.trees import StepClock


def _readings(col):
    return {(r.name, r.labels): r.value for r in col.readings}


def test_fake_uses_real_pynvml_names_signatures_and_structs():
    for name in fake_api_names():
        real = getattr(pynvml, name)  # AttributeError = the fake invented an API
        want = [p for p in inspect.signature(real).parameters]
        got = [p for p in inspect.signature(getattr(FakeNvml, name)).parameters][1:]
        assert got == want, name
    fields = {f for f, _ in pynvml.c_nvmlEventData_t._fields_}
    assert {"device", "eventType", "eventData"} <= fields
    assert issubclass(pynvml.NVMLError_GpuIsLost, pynvml.NVMLError)


def test_every_field_in_base_units():
    nv = FakeNvml([FakeGpu(), FakeGpu(util_pct=100)])
    clock = StepClock()
    c = NvmlCollector(nvml=nv, clock=clock)
    assert c.available
    col = c.collect()
    r = _readings(col)
    g = ("0",)
    assert r[("kvscope_gpu_utilization_ratio", g)] == 0.37
    assert r[("kvscope_gpu_utilization_ratio", ("1",))] == 1.0
    assert r[("kvscope_gpu_memory_used_bytes", g)] == 20 << 30
    assert r[("kvscope_gpu_memory_total_bytes", g)] == 80 << 30
    assert r[("kvscope_gpu_pcie_transmit_bytes_per_second", g)] == 1000 * 1024
    assert r[("kvscope_gpu_pcie_receive_bytes_per_second", g)] == 2000 * 1024
    assert r[("kvscope_gpu_pcie_link_generation", ("0", "current"))] == 4
    assert r[("kvscope_gpu_pcie_link_generation", ("0", "max"))] == 5
    assert r[("kvscope_gpu_pcie_link_width", ("0", "current"))] == 8
    assert r[("kvscope_gpu_pcie_link_width", ("0", "max"))] == 16
    assert r[("kvscope_gpu_pcie_replay_total", g)] == 3
    assert r[("kvscope_gpu_sm_clock_hertz", g)] == 1980e6
    assert r[("kvscope_gpu_memory_clock_hertz", g)] == 2619e6
    assert r[("kvscope_gpu_power_watts", g)] == 312.5
    assert r[("kvscope_gpu_energy_joules_total", g)] == 5000.0
    assert r[("kvscope_gpu_temperature_celsius", g)] == 61
    # NVLink is cumulative KiB: a rate needs two reads.
    assert ("kvscope_gpu_nvlink_transmit_bytes_per_second", g) not in r
    info = [e.detail for e in col.events if e.name == "gpu_info"]
    assert info[0] == {"gpu": 0, "name": "NVIDIA H100 80GB HBM3",
                       "uuid": "GPU-00000000-0000-0000-0000-000000000000"}

    clock.advance(2.0)
    nv.gpus[0].nvlink_tx_kib += 4096
    nv.gpus[0].energy_mj += 700_000
    col = c.collect()
    r = _readings(col)
    assert r[("kvscope_gpu_nvlink_transmit_bytes_per_second", g)] == 2048 * 1024
    assert r[("kvscope_gpu_nvlink_receive_bytes_per_second", g)] == 0.0
    assert r[("kvscope_gpu_energy_joules_total", g)] == 5700.0
    s = {(x.entity, x.metric): (x.value, x.unit) for x in col.samples}
    assert s[("gpu0", "gpu_energy_joules_per_second")] == (350.0, "joules_per_second")
    assert s[("gpu0", "gpu_pcie_link_generation_current")] == (4.0, None)
    assert s[("gpu0", "gpu_power_watts")] == (312.5, "watts")
    assert {x.source for x in col.samples} == {"nvml"}


def test_not_supported_is_skipped_for_that_gpu_only_and_remembered():
    nv = FakeNvml([FakeGpu(not_supported={"nvmlDeviceGetPcieReplayCounter",
                                          "nvmlDeviceGetTotalEnergyConsumption"}, nvlink=False),
                   FakeGpu()])
    c = NvmlCollector(nvml=nv)
    for _ in range(3):
        r = _readings(c.collect())
    assert ("kvscope_gpu_pcie_replay_total", ("0",)) not in r
    assert ("kvscope_gpu_energy_joules_total", ("0",)) not in r
    assert r[("kvscope_gpu_pcie_replay_total", ("1",))] == 3
    assert r[("kvscope_gpu_energy_joules_total", ("1",))] == 5000.0
    assert r[("kvscope_gpu_power_watts", ("0",))] == 312.5
    assert ("kvscope_gpu_nvlink_transmit_bytes_per_second", ("1",)) in r
    # Asked once, never again on GPU 0; every run on GPU 1.
    assert nv.calls[("nvmlDeviceGetPcieReplayCounter", 0)] == 1
    assert nv.calls[("nvmlDeviceGetPcieReplayCounter", 1)] == 3
    assert nv.calls[("nvmlDeviceGetFieldValues", 0)] == 1
    assert {"pcie_replay", "energy", "nvlink_tx", "nvlink_rx"} == c.gpus[0].unsupported
    assert c.gpus[1].unsupported == set()


def test_gpu_lost_mid_run_is_reported_and_the_others_continue(caplog):
    nv = FakeNvml([FakeGpu(), FakeGpu(), FakeGpu()])
    c = NvmlCollector(nvml=nv)
    c.collect()
    nv.gpus[1].lost = True
    with caplog.at_level(logging.ERROR, logger="collectors.nvml"):
        col = c.collect()
    assert [(e.name, e.detail["gpu"]) for e in col.events] == [("gpu_lost", 1)]
    assert "GPU 1 is lost" in caplog.text
    assert {r.labels[0] for r in col.readings} == {"0", "2"}
    calls = dict(nv.calls)
    col = c.collect()
    assert col.events == []
    assert {r.labels[0] for r in col.readings} == {"0", "2"}
    # The lost GPU is not asked again.
    assert {k for k, v in nv.calls.items() if k[1] == 1 and v != calls.get(k)} == set()


def test_gpu_lost_before_the_first_run():
    nv = FakeNvml([FakeGpu(lost=True), FakeGpu()])
    c = NvmlCollector(nvml=nv)
    col = c.collect()
    lost = [e.detail for e in col.events if e.name == "gpu_lost"]
    assert lost == [{"gpu": 0, "error": "GPU is lost"}]
    assert {r.labels[0] for r in col.readings} == {"1"}


def test_library_not_found_at_init(caplog):
    nv = FakeNvml([], init_error=pynvml.NVMLError_LibraryNotFound())
    with caplog.at_level(logging.WARNING, logger="collectors.nvml"):
        c = NvmlCollector(nvml=nv)
    assert not c.available
    assert "NVML Shared Library Not Found" in c.unavailable_reason
    assert len([r for r in caplog.records if "NVML unavailable" in r.message]) == 1
    c.close()  # nothing to shut down
    assert not nv.shutdown_called


def test_device_listing_failure_makes_nvml_unavailable_not_fatal():
    class Broken(FakeNvml):
        def nvmlDeviceGetCount(self) -> int:
            raise pynvml.NVMLError_Unknown()

    nv = Broken([FakeGpu()])
    c = NvmlCollector(nvml=nv)
    assert not c.available
    assert c.unavailable_reason == "NVML unavailable: listing GPUs failed: Unknown Error"
    assert nv.shutdown_called


def test_xid_events_polled_without_blocking():
    nv = FakeNvml([FakeGpu(), FakeGpu()])
    c = NvmlCollector(nvml=nv)
    assert nv.registered == {0, 1}
    c.collect()
    nv.inject_xid(1, 79)
    nv.inject_xid(1, 79)
    nv.inject_xid(0, 48)
    col = c.collect()
    assert [(e.name, e.detail) for e in col.events] == [
        ("xid", {"gpu": "1", "xid": 79}), ("xid", {"gpu": "1", "xid": 79}),
        ("xid", {"gpu": "0", "xid": 48})]
    r = _readings(col)
    assert r[("kvscope_gpu_xid_errors_total", ("1", "79"))] == 2
    assert r[("kvscope_gpu_xid_errors_total", ("0", "48"))] == 1
    assert set(nv.wait_timeouts) == {0}  # never a blocking wait
    assert _readings(c.collect())[("kvscope_gpu_xid_errors_total", ("1", "79"))] == 2
    c.close()
    assert nv.shutdown_called


def test_xid_registration_not_supported_on_one_gpu():
    nv = FakeNvml([FakeGpu(not_supported={"nvmlDeviceRegisterEvents"}), FakeGpu()])
    c = NvmlCollector(nvml=nv)
    assert nv.registered == {1}
    assert "xid" in c.gpus[0].unsupported
    assert ("kvscope_gpu_utilization_ratio", ("0",)) in _readings(c.collect())


def test_all_fields_listed():
    assert len(ALL_FIELDS) == len(set(ALL_FIELDS)) == 16


def test_real_pynvml_on_this_host_reports_no_driver_without_failing(caplog):
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:  # pragma: no cover - a host with a driver
        pynvml.nvmlShutdown()
        pytest.skip("this host has an NVIDIA driver")
    events = []
    with caplog.at_level(logging.WARNING, logger="collectors.nvml"):
        c = NvmlCollector()
        runner = CollectorRunner([c], on_samples=lambda name, col: events.extend(col.events))
        runner.collect_once()
        runner.collect_once()
    assert not c.available
    assert runner.collectors == []
    assert [e.name for e in events] == ["collector_unavailable"]
    assert "NVML" in events[0].detail["reason"]
    assert len([r for r in caplog.records if "NVML unavailable" in r.message]) == 1
