"""Per-GPU readings through NVML (nvidia-ml-py, module `pynvml`), named like dcgm-exporter's.

Units are converted to base units on the way in: PCIe throughput KB/s x 1024 → bytes/s, power
mW → W, energy mJ → J, clocks MHz → Hz, utilization % → 0-1. NVLink throughput comes from the
field-value API (`NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX/RX`, cumulative KiB summed over links,
scope UINT_MAX), so it is a rate between two runs.

Failure model (the agent must keep running on any node):
- no driver (`nvmlInit` raises, e.g. NVMLError_LibraryNotFound): one warning, `available` is
  False, the runner never schedules this collector and records why once;
- a field a GPU does not support (NotSupported, NoPermission, FunctionNotFound): skipped for
  that GPU from then on; other GPUs still report it;
- a GPU lost mid-run (GpuIsLost): a `gpu_lost` event, the GPU is dropped, the others continue;
- any other NVMLError on a field: logged once per GPU and field, the run carries on.

XID critical errors: one event set for all GPUs, drained with `nvmlEventSetWait_v2(set, 0)`
(a zero timeout never blocks; NVMLError_Timeout means "nothing pending") on every run, so XID
polling cannot delay the other collectors, which run on their own threads anyway.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from agent.clock import now_ns
from collectors.base import BaseCollector, Collection, CounterTracker, Emitter, sample_metric

log = logging.getLogger(__name__)

_UINT_MAX = 0xFFFFFFFF  # field-value scope: sum over all NVLinks
_MAX_EVENTS_PER_RUN = 256

Reader = Callable[[Any, Any], float]

#: (field key, catalogued gauge, extra label value or None, reader returning base units).
GAUGE_FIELDS: tuple[tuple[str, str, str | None, Reader], ...] = (
    ("utilization", "kvscope_gpu_utilization_ratio", None,
     lambda nv, h: nv.nvmlDeviceGetUtilizationRates(h).gpu / 100.0),
    ("pcie_tx", "kvscope_gpu_pcie_transmit_bytes_per_second", None,
     lambda nv, h: nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_TX_BYTES) * 1024.0),
    ("pcie_rx", "kvscope_gpu_pcie_receive_bytes_per_second", None,
     lambda nv, h: nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_RX_BYTES) * 1024.0),
    ("pcie_gen_current", "kvscope_gpu_pcie_link_generation", "current",
     lambda nv, h: nv.nvmlDeviceGetCurrPcieLinkGeneration(h)),
    ("pcie_gen_max", "kvscope_gpu_pcie_link_generation", "max",
     lambda nv, h: nv.nvmlDeviceGetMaxPcieLinkGeneration(h)),
    ("pcie_width_current", "kvscope_gpu_pcie_link_width", "current",
     lambda nv, h: nv.nvmlDeviceGetCurrPcieLinkWidth(h)),
    ("pcie_width_max", "kvscope_gpu_pcie_link_width", "max",
     lambda nv, h: nv.nvmlDeviceGetMaxPcieLinkWidth(h)),
    ("sm_clock", "kvscope_gpu_sm_clock_hertz", None,
     lambda nv, h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM) * 1e6),
    ("memory_clock", "kvscope_gpu_memory_clock_hertz", None,
     lambda nv, h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM) * 1e6),
    ("power", "kvscope_gpu_power_watts", None,
     lambda nv, h: nv.nvmlDeviceGetPowerUsage(h) / 1000.0),
    ("temperature", "kvscope_gpu_temperature_celsius", None,
     lambda nv, h: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
)
#: (field key, catalogued counter, scale to base units, reader returning the raw counter).
COUNTER_FIELDS: tuple[tuple[str, str, float, Reader], ...] = (
    ("pcie_replay", "kvscope_gpu_pcie_replay_total", 1.0,
     lambda nv, h: nv.nvmlDeviceGetPcieReplayCounter(h)),
    ("energy", "kvscope_gpu_energy_joules_total", 1e-3,
     lambda nv, h: nv.nvmlDeviceGetTotalEnergyConsumption(h)),
)
#: (field key, field id constant, catalogued gauge): cumulative KiB turned into bytes/s.
NVLINK_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("nvlink_tx", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX",
     "kvscope_gpu_nvlink_transmit_bytes_per_second"),
    ("nvlink_rx", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX",
     "kvscope_gpu_nvlink_receive_bytes_per_second"),
)
ALL_FIELDS: tuple[str, ...] = (
    *(k for k, *_ in GAUGE_FIELDS), "memory", *(k for k, *_ in COUNTER_FIELDS),
    *(k for k, *_ in NVLINK_FIELDS),
)


class _Gpu:
    __slots__ = ("entity", "handle", "index", "label", "lost", "unsupported")

    def __init__(self, index: int, handle: Any) -> None:
        self.index = index
        self.handle = handle
        self.label = str(index)
        self.entity = f"gpu{index}"
        self.unsupported: set[str] = set()
        self.lost = False


class NvmlCollector(BaseCollector):
    """Reads every GPU NVML can see.

    Args:
        nvml: the NVML binding (the `pynvml` module by default; a fake with pynvml's function
            names and error classes in tests).
        xid: watch XID critical errors through an event set.
        clock: monotonic ns clock.
    """

    name = "nvml"
    source = "nvml"

    def __init__(self, *, nvml: Any = None, xid: bool = True, clock=now_ns) -> None:
        super().__init__()
        self.clock = clock
        self.counters = CounterTracker()
        self.gpus: list[_Gpu] = []
        self.xid_counts: dict[tuple[str, int], int] = {}
        self._evset: Any = None
        self._logged: set[tuple[int, str]] = set()
        self._pending: list[tuple[str, dict[str, Any]]] = []
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError as exc:  # pragma: no cover - nvidia-ml-py is a core dependency
                self._unavailable(f"nvidia-ml-py is not installed ({exc})")
                return
        self.nv = nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            self._unavailable(f"NVML unavailable: {exc} (no usable NVIDIA driver on this host)")
            return
        try:
            self._open_devices(xid)
        except nvml.NVMLError as exc:
            self._unavailable(f"NVML unavailable: listing GPUs failed: {exc}")
            try:
                nvml.nvmlShutdown()
            except nvml.NVMLError:
                pass

    def _unavailable(self, reason: str) -> None:
        self.available = False
        self.unavailable_reason = reason
        log.warning("kvscope collectors: %s; GPU metrics are off, the other collectors carry on",
                    reason)

    def _open_devices(self, xid: bool) -> None:
        nv = self.nv
        count = nv.nvmlDeviceGetCount()
        for i in range(count):
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(i)
            except nv.NVMLError as exc:
                self._pending.append(("gpu_lost", {"gpu": i, "error": str(exc)}))
                continue
            gpu = _Gpu(i, handle)
            self.gpus.append(gpu)
            info: dict[str, Any] = {"gpu": i}
            for key, fn in (("name", nv.nvmlDeviceGetName), ("uuid", nv.nvmlDeviceGetUUID)):
                try:
                    v = fn(handle)
                    info[key] = v.decode() if isinstance(v, bytes) else str(v)
                except nv.NVMLError:
                    pass
            self._pending.append(("gpu_info", info))
        if xid and self.gpus:
            self._open_xid()

    def _open_xid(self) -> None:
        nv = self.nv
        try:
            self._evset = nv.nvmlEventSetCreate()
        except nv.NVMLError as exc:
            log.info("kvscope collectors: NVML event sets unavailable (%s); XIDs not watched", exc)
            return
        for gpu in self.gpus:
            try:
                nv.nvmlDeviceRegisterEvents(gpu.handle, nv.nvmlEventTypeXidCriticalError,
                                            self._evset)
            except nv.NVMLError as exc:
                gpu.unsupported.add("xid")
                log.info("kvscope collectors: GPU %d: XID events not available (%s)",
                         gpu.index, exc)

    # ------------------------------------------------------------------ collection
    def collect(self) -> Collection:
        em = Emitter(self.source, self.clock(), self.counters, self.keep_samples)
        for name, detail in self._pending:
            em.event(name, detail)
        self._pending = []
        nv = self.nv
        for gpu in self.gpus:
            if gpu.lost:
                continue
            try:
                self._read_gpu(gpu, em)
            except nv.NVMLError_GpuIsLost as exc:
                gpu.lost = True
                em.event("gpu_lost", {"gpu": gpu.index, "error": str(exc)})
                log.error("kvscope collectors: GPU %d is lost (%s); the other GPUs carry on",
                          gpu.index, exc)
        if self._evset is not None:
            self._drain_xid(em)
        for (label, xid), n in sorted(self.xid_counts.items()):
            em.reading("kvscope_gpu_xid_errors_total", (label, str(xid)), n)
        self.counters.end_cycle()
        return em.out

    def _read_gpu(self, gpu: _Gpu, em: Emitter) -> None:
        labels, ent = (gpu.label,), gpu.entity
        skip = gpu.unsupported
        for key, metric, kind, read in GAUGE_FIELDS:
            if key in skip:
                continue
            value = self._field(gpu, key, read)
            if value is not None:
                if kind is None:
                    em.gauge(metric, labels, value, ent)
                else:
                    em.gauge(metric, (gpu.label, kind), value, ent,
                             metric=f"{sample_metric(metric)}_{kind}")
        if "memory" not in skip:
            mem = self._field(gpu, "memory", lambda nv_, h_: nv_.nvmlDeviceGetMemoryInfo(h_))
            if mem is not None:
                em.gauge("kvscope_gpu_memory_used_bytes", labels, mem.used, ent)
                em.gauge("kvscope_gpu_memory_total_bytes", labels, mem.total, ent)
        for key, metric, scale, read in COUNTER_FIELDS:
            if key in skip:
                continue
            raw = self._field(gpu, key, read)
            if raw is not None:
                em.counter(metric, labels, raw, ent, scale=scale)
        todo = [f for f in NVLINK_FIELDS if f[0] not in skip]
        if todo:
            self._read_nvlink(gpu, em, todo)

    def _field(self, gpu: _Gpu, key: str, read: Reader) -> Any:
        """One NVML call for one field; None when it failed (and was dealt with)."""
        nv = self.nv
        try:
            return read(nv, gpu.handle)
        except (nv.NVMLError_NotSupported, nv.NVMLError_NoPermission,
                nv.NVMLError_FunctionNotFound) as exc:
            gpu.unsupported.add(key)
            log.info("kvscope collectors: GPU %d: %s not available (%s); skipped from now on",
                     gpu.index, key, exc)
        except nv.NVMLError_GpuIsLost:
            raise
        except nv.NVMLError as exc:
            self._log_once(gpu, key, exc)
        return None

    def _read_nvlink(self, gpu: _Gpu, em: Emitter,
                     todo: list[tuple[str, str, str]]) -> None:
        nv = self.nv
        ids = [(getattr(nv, const), _UINT_MAX) for _, const, _ in todo]
        values = self._field(gpu, "nvlink", lambda nv_, h_: nv_.nvmlDeviceGetFieldValues(h_, ids))
        if values is None:
            if "nvlink" in gpu.unsupported:
                gpu.unsupported.update(k for k, _, _ in todo)
            return
        for (key, _, metric), fv in zip(todo, values, strict=True):
            ret = fv.nvmlReturn
            if ret != nv.NVML_SUCCESS:
                err = nv.NVMLError(ret)
                if isinstance(err, nv.NVMLError_GpuIsLost):
                    raise err
                if isinstance(err, nv.NVMLError_NotSupported | nv.NVMLError_NoPermission):
                    gpu.unsupported.add(key)
                else:
                    self._log_once(gpu, key, err)
                continue
            kib = _field_value(nv, fv)
            _, rate = self.counters.update((metric, gpu.label), kib, em.ts)
            if rate is not None:
                em.gauge(metric, (gpu.label,), rate * 1024.0, gpu.entity)

    def _drain_xid(self, em: Emitter) -> None:
        nv = self.nv
        for _ in range(_MAX_EVENTS_PER_RUN):
            try:
                data = nv.nvmlEventSetWait_v2(self._evset, 0)
            except nv.NVMLError_Timeout:
                return
            except nv.NVMLError as exc:
                if ("xid", -1) not in self._logged:
                    self._logged.add(("xid", -1))
                    log.warning("kvscope collectors: NVML event wait failed: %s", exc)
                return
            if not data.eventType & nv.nvmlEventTypeXidCriticalError:
                continue
            try:
                label = str(nv.nvmlDeviceGetIndex(data.device))
            except nv.NVMLError:
                label = "unknown"
            xid = int(data.eventData)
            key = (label, xid)
            self.xid_counts[key] = self.xid_counts.get(key, 0) + 1
            em.event("xid", {"gpu": label, "xid": xid})

    def _log_once(self, gpu: _Gpu, key: str, exc: Exception) -> None:
        if (gpu.index, key) not in self._logged:
            self._logged.add((gpu.index, key))
            log.warning("kvscope collectors: GPU %d: reading %s failed: %s (logged once)",
                        gpu.index, key, exc)

    def close(self) -> None:
        if not self.available:
            return
        nv = self.nv
        try:
            if self._evset is not None:
                nv.nvmlEventSetFree(self._evset)
                self._evset = None
            nv.nvmlShutdown()
        except nv.NVMLError as exc:
            log.debug("NVML shutdown: %s", exc)
        self.available = False


def _field_value(nv: Any, fv: Any) -> float:
    """The value of an `nvmlFieldValue_t` according to its `valueType`."""
    t = fv.valueType
    v = fv.value
    if t == nv.NVML_VALUE_TYPE_DOUBLE:
        return float(v.dVal)
    return {
        nv.NVML_VALUE_TYPE_UNSIGNED_INT: v.uiVal,
        nv.NVML_VALUE_TYPE_UNSIGNED_LONG: v.ulVal,
        nv.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: v.ullVal,
        nv.NVML_VALUE_TYPE_SIGNED_LONG_LONG: v.sllVal,
        nv.NVML_VALUE_TYPE_SIGNED_INT: v.siVal,
        nv.NVML_VALUE_TYPE_UNSIGNED_SHORT: v.usVal,
    }.get(t, v.ullVal)
