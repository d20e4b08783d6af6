"""A fake NVML binding for tests, built on pynvml itself.

Every `nvml*` function here has the name and positional parameters of the real pynvml function
(tests/collectors/test_nvml.py checks this against the installed nvidia-ml-py); constants,
error classes and the returned ctypes structures are pynvml's own, so the collector under test
cannot tell the fake from a driver except by the values.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import pynvml


@dataclass
class FakeGpu:
    """One GPU's state; raw NVML units (%, bytes, KB/s, MHz, mW, mJ, C, KiB)."""

    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    util_pct: int = 37
    mem_used: int = 20 << 30
    mem_total: int = 80 << 30
    pcie_tx_kbs: int = 1000
    pcie_rx_kbs: int = 2000
    gen: tuple[int, int] = (4, 5)  # current, max
    width: tuple[int, int] = (8, 16)
    replay: int = 3
    sm_mhz: int = 1980
    mem_mhz: int = 2619
    power_mw: int = 312_500
    energy_mj: int = 5_000_000
    temp_c: int = 61
    nvlink_tx_kib: int = 1_000
    nvlink_rx_kib: int = 2_000
    nvlink: bool = True
    #: pynvml function names that raise NVMLError_NotSupported on this GPU.
    not_supported: set[str] = field(default_factory=set)
    lost: bool = False


class _Handle:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class FakeNvml:
    """Module-like NVML binding over a list of FakeGpu.

    Args:
        gpus: the GPUs.
        init_error: raised by nvmlInit (e.g. pynvml.NVMLError_LibraryNotFound()).
    """

    def __init__(self, gpus: list[FakeGpu], init_error: Exception | None = None) -> None:
        for n in dir(pynvml):
            if n.startswith(("NVML_", "NVMLError", "nvmlEventType")):
                setattr(self, n, getattr(pynvml, n))
        self.gpus = gpus
        self.init_error = init_error
        self.events: deque[tuple[int, int]] = deque()  # (gpu index, xid)
        self.calls: dict[tuple[str, int], int] = {}
        self.wait_timeouts: list[int] = []
        self.registered: set[int] = set()
        self.initialized = False
        self.shutdown_called = False

    # ------------------------------------------------------------------ helpers
    def _gpu(self, fn: str, handle: _Handle) -> FakeGpu:
        key = (fn, handle.index)
        self.calls[key] = self.calls.get(key, 0) + 1
        gpu = self.gpus[handle.index]
        if gpu.lost:
            raise pynvml.NVMLError_GpuIsLost()
        if fn in gpu.not_supported:
            raise pynvml.NVMLError_NotSupported()
        return gpu

    def inject_xid(self, index: int, xid: int) -> None:
        self.events.append((index, xid))

    # ------------------------------------------------------------------ pynvml API
    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self.shutdown_called = True

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        if self.gpus[index].lost:
            raise pynvml.NVMLError_GpuIsLost()
        return _Handle(index)

    def nvmlDeviceGetIndex(self, handle: _Handle) -> int:
        return handle.index

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        return self._gpu("nvmlDeviceGetName", handle).name

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        return self._gpu("nvmlDeviceGetUUID", handle).uuid

    def nvmlDeviceGetUtilizationRates(self, handle: _Handle) -> Any:
        g = self._gpu("nvmlDeviceGetUtilizationRates", handle)
        return pynvml.c_nvmlUtilization_t(gpu=g.util_pct, memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle, version: Any = None) -> Any:
        g = self._gpu("nvmlDeviceGetMemoryInfo", handle)
        return pynvml.c_nvmlMemory_t(total=g.mem_total, free=g.mem_total - g.mem_used,
                                     used=g.mem_used)

    def nvmlDeviceGetPcieThroughput(self, device: _Handle, counter: int) -> int:
        g = self._gpu("nvmlDeviceGetPcieThroughput", device)
        return g.pcie_tx_kbs if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES else g.pcie_rx_kbs

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: _Handle) -> int:
        return self._gpu("nvmlDeviceGetCurrPcieLinkGeneration", handle).gen[0]

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: _Handle) -> int:
        return self._gpu("nvmlDeviceGetMaxPcieLinkGeneration", handle).gen[1]

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: _Handle) -> int:
        return self._gpu("nvmlDeviceGetCurrPcieLinkWidth", handle).width[0]

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: _Handle) -> int:
        return self._gpu("nvmlDeviceGetMaxPcieLinkWidth", handle).width[1]

    def nvmlDeviceGetPcieReplayCounter(self, handle: _Handle) -> int:
        return self._gpu("nvmlDeviceGetPcieReplayCounter", handle).replay

    def nvmlDeviceGetClockInfo(self, handle: _Handle, type: int) -> int:
        g = self._gpu("nvmlDeviceGetClockInfo", handle)
        return g.sm_mhz if type == pynvml.NVML_CLOCK_SM else g.mem_mhz

    def nvmlDeviceGetPowerUsage(self, handle: _Handle) -> int:
        return self._gpu("nvmlDeviceGetPowerUsage", handle).power_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: _Handle) -> int:
        return self._gpu("nvmlDeviceGetTotalEnergyConsumption", handle).energy_mj

    def nvmlDeviceGetTemperature(self, handle: _Handle, sensor: int) -> int:
        return self._gpu("nvmlDeviceGetTemperature", handle).temp_c

    def nvmlDeviceGetFieldValues(self, handle: _Handle, fieldIds: list[Any]) -> Any:
        g = self._gpu("nvmlDeviceGetFieldValues", handle)
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        for i, fid in enumerate(fieldIds):
            field_id, scope = fid if isinstance(fid, tuple) else (fid, 0)
            values[i].fieldId = field_id
            values[i].scopeId = scope
            values[i].valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
            if not g.nvlink:
                values[i].nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
                continue
            values[i].nvmlReturn = pynvml.NVML_SUCCESS
            tx = field_id == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
            values[i].value.ullVal = g.nvlink_tx_kib if tx else g.nvlink_rx_kib
        return values

    def nvmlEventSetCreate(self) -> object:
        return object()

    def nvmlDeviceRegisterEvents(self, handle: _Handle, eventTypes: int,
                                 eventSet: object) -> None:
        self._gpu("nvmlDeviceRegisterEvents", handle)
        self.registered.add(handle.index)

    def nvmlEventSetWait_v2(self, eventSet: object, timeoutms: int) -> Any:
        self.wait_timeouts.append(timeoutms)
        if not self.events:
            raise pynvml.NVMLError_Timeout()
        index, xid = self.events.popleft()
        return _EventData(_Handle(index), pynvml.nvmlEventTypeXidCriticalError, xid)

    def nvmlEventSetFree(self, eventSet: object) -> None:
        pass


class _EventData:
    """The fields of `c_nvmlEventData_t` the collector reads (`device` is a fake handle, which a
    ctypes pointer field cannot hold)."""

    __slots__ = ("device", "eventData", "eventType")

    def __init__(self, device: _Handle, event_type: int, event_data: int) -> None:
        self.device = device
        self.eventType = event_type
        self.eventData = event_data


def fake_api_names() -> list[str]:
    """The pynvml functions the fake implements."""
    return sorted(n for n in vars(FakeNvml) if n.startswith("nvml"))
