"""CollectorRunner: own schedules per collector, failures counted, sinks, the Recorder hand-off."""

from __future__ import annotations

import threading
import time

import pytest

from agent.telemetry import Recorder
from collectors.base import BaseCollector, Collection, CounterTracker, Emitter
from collectors.runner import CollectorRunner, default_collectors, recorder_sink
from tests.collectors.fake_nvml import FakeGpu, FakeNvml
from tests.collectors.trees import FakeRoot


class Counting(BaseCollector):
    source = "host"

    def __init__(self, name: str, gate: threading.Event | None = None,
                 fail: bool = False) -> None:
        super().__init__()
        self.name = name
        self.gate = gate
        self.fail = fail
        self.runs = 0
        self.counters = CounterTracker()

    def collect(self) -> Collection:
        self.runs += 1
        if self.gate is not None:
            self.gate.wait(30)
        if self.fail:
            raise OSError("sysfs went away")
        em = Emitter(self.source, time.monotonic_ns(), self.counters, self.keep_samples)
        em.gauge("kvscope_host_memory_used_bytes", (), self.runs, "host")
        return em.out


def _wait_until(pred, timeout_s: float = 20.0) -> None:
    end = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > end:
            raise AssertionError("condition not reached")
        time.sleep(0.005)


def test_a_slow_collector_does_not_delay_the_others():
    gate = threading.Event()
    slow, fast = Counting("slow", gate=gate), Counting("fast")
    runner = CollectorRunner([slow, fast], interval_s=0.01)
    runner.start()
    try:
        _wait_until(lambda: fast.runs >= 5)
        assert slow.runs == 1  # still inside its first run
        gate.set()
        _wait_until(lambda: slow.runs >= 2)
    finally:
        runner.stop()
    # Five fast runs on a 10 ms cadence took >= 40 ms, so the slow one skipped starts.
    assert runner.health["slow"].missed >= 1
    assert {t.name for t in threading.enumerate()}.isdisjoint(
        {"kvscope-collector-slow", "kvscope-collector-fast"})


def test_failures_are_counted_and_delivered_as_events():
    got: list[tuple[str, Collection]] = []
    bad, good = Counting("bad", fail=True), Counting("good")
    runner = CollectorRunner([bad, good], on_samples=lambda n, c: got.append((n, c)))
    runner.collect_once()
    runner.collect_once()
    assert runner.health["bad"].errors == 2
    assert runner.health["bad"].last_success_ns is None
    assert runner.health["good"].runs == 2
    ev = [c.events[0] for n, c in got if n == "bad"]
    assert [e.name for e in ev] == ["collector_error", "collector_error"]
    assert "sysfs went away" in ev[0].detail["error"]
    health = {(r.name, r.labels): r.value for r in runner.health_readings()}
    assert health[("kvscope_collector_errors_total", ("bad",))] == 2
    assert ("kvscope_collector_last_success_timestamp_seconds", ("bad",)) not in health
    ts = health[("kvscope_collector_last_success_timestamp_seconds", ("good",))]
    assert abs(ts - time.time()) < 60


def test_sink_drops_and_sink_failures_count_as_dropped_samples():
    c = Counting("c")
    runner = CollectorRunner([c], on_samples=lambda n, col: len(col.samples))
    runner.collect_once()
    assert runner.health["c"].dropped == 1

    def broken(_n, _col):
        raise RuntimeError("disk on fire")

    runner2 = CollectorRunner([Counting("d")], on_samples=broken)
    runner2.collect_once()
    runner2.collect_once()
    assert runner2.health["d"].dropped == 2
    assert runner2.health["d"].errors == 0


def test_unavailable_collectors_are_announced_once_and_not_scheduled(tmp_path):
    events = []
    nvml = FakeNvml([], init_error=__import__("pynvml").NVMLError_DriverNotLoaded())
    cols = default_collectors(sys_root=str(tmp_path), proc_root="/proc", nvml=nvml,
                              disable=("nic", "host"))
    runner = CollectorRunner(cols, on_samples=lambda n, c: events.extend(c.events))
    runner.start()
    runner.stop()
    runner.collect_once()
    assert sorted((e.detail["collector"], e.name) for e in events) == [
        ("nvml", "collector_unavailable"), ("rdma", "collector_unavailable")]
    assert runner.collectors == [] and runner.health == {}


@pytest.mark.parametrize(
    ("kwargs", "msg"),
    [
        ({"interval_s": 0}, "interval_s: must be > 0"),
        ({"intervals": {"nope": 1.0}}, "intervals: unknown collector 'nope'"),
        ({"intervals": {"a": -1}}, r"intervals\['a'\]: must be > 0"),
    ],
)
def test_bad_intervals(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        CollectorRunner([Counting("a")], **kwargs)


def test_duplicate_names_and_unknown_disable():
    with pytest.raises(ValueError, match="duplicate"):
        CollectorRunner([Counting("a"), Counting("a")])
    with pytest.raises(ValueError, match="disable: unknown collector 'gpu'"):
        default_collectors(disable=("gpu",))


def test_per_collector_interval_override():
    runner = CollectorRunner([Counting("a"), Counting("b")], 1.0, intervals={"b": 5.0})
    assert runner.intervals == {"a": 1.0, "b": 5.0}


def test_recorder_sink_puts_hardware_samples_in_the_engine_run_store(tmp_path):
    root = FakeRoot(tmp_path)
    root.set_nic("eth0", rx_bytes=10)
    rec = Recorder(nvtx=False)
    nv = FakeNvml([FakeGpu()])
    cols = default_collectors(sys_root=str(root.sys), proc_root=str(root.proc), nvml=nv,
                              disable=("host", "rdma"))
    runner = CollectorRunner(cols, on_samples=recorder_sink(rec))
    runner.collect_once()
    root.set_nic("eth0", rx_bytes=110)
    runner.collect_once()
    out = rec.drain()
    s = out["samples"].to_pylist()
    nic = [r for r in s if r["source"] == "nic" and r["metric"] == "nic_receive_bytes_per_second"]
    assert len(nic) == 1 and nic[0]["entity"] == "eth0" and nic[0]["value"] > 0
    gpu = {r["metric"]: r["value"] for r in s if r["source"] == "nvml"}
    assert gpu["gpu_utilization_ratio"] == 0.37
    # Epoch ns through the recorder's anchor, like every other run-store time.
    assert abs(nic[0]["ts_ns"] - time.time_ns()) < 60 * 10**9
    assert "gpu_info" in out["events"].column("name").to_pylist()


class Where(Counting):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.threads: list[str] = []

    def collect(self) -> Collection:
        self.threads.append(threading.current_thread().name)
        return super().collect()


@pytest.mark.parametrize("inline_max_s", [1.0, 0.0])
def test_on_demand_runs_when_a_refresh_asks(inline_max_s):
    """A quick collector runs on the refreshing thread; one slower than `inline_max_s` on its
    own (0: always its own)."""
    c = Where("c")
    runner = CollectorRunner([c], interval_s=1.0, on_demand=True, idle_interval_s=3600,
                             inline_max_s=inline_max_s)
    runner.refresh(0.0)  # before start: nothing to wake
    runner.start()
    try:
        _wait_until(lambda: runner.health["c"].runs == 1)  # the first run is immediate
        runner.refresh(3600.0)  # fresh enough: no run
        assert c.runs == 1
        runner.refresh(0.0)  # stale: one run, waited for
        assert c.runs == 2
        assert runner.readings()["kvscope_host_memory_used_bytes"][0].value == 2
        assert runner.health["c"].runs == 2
        assert c.threads[0] == "kvscope-collector-c"
        assert c.threads[1] == ("kvscope-collector-c" if inline_max_s == 0
                                else threading.current_thread().name)
        assert not runner.latest()["c"].samples  # no sink: readings only
    finally:
        runner.stop()
    assert not runner._threads


def test_on_demand_idle_floor_keeps_counters_followed():
    c = Counting("c")
    runner = CollectorRunner([c], interval_s=1.0, on_demand=True, idle_interval_s=0.01)
    runner.start()
    try:
        _wait_until(lambda: c.runs >= 3)  # nobody refreshes; the idle floor runs it
    finally:
        runner.stop()


def test_on_demand_refresh_gives_up_on_a_slow_collector():
    gate = threading.Event()
    slow, fast = Counting("slow", gate=gate), Counting("fast")
    runner = CollectorRunner([slow, fast], interval_s=1.0, on_demand=True,
                             idle_interval_s=3600)
    runner.start()
    try:
        _wait_until(lambda: "fast" in runner.latest() and slow.runs == 1)
        runner.refresh(0.0, timeout_s=0.05)  # slow is still in its first run: served stale
        assert "slow" not in runner.latest()
        gate.set()
        _wait_until(lambda: "slow" in runner.latest() and runner.health["fast"].runs == 2)
        runner.refresh(0.0)
        assert runner.health["fast"].runs == 3  # one run per refresh
        assert slow.runs == 2  # the first refresh asked for none: one was in progress
    finally:
        runner.stop()


def test_on_demand_needs_a_positive_idle_interval():
    with pytest.raises(ValueError, match="idle_interval_s"):
        CollectorRunner([Counting("c")], on_demand=True, idle_interval_s=0)


def test_on_demand_idle_floor_counts_from_the_last_run_by_anyone():
    """Scrapes more often than the idle floor leave the collector's thread asleep."""
    c = Where("c")
    runner = CollectorRunner([c], interval_s=0.02, on_demand=True, idle_interval_s=1.0,
                             inline_max_s=10.0)
    runner.start()
    try:
        _wait_until(lambda: runner.health["c"].runs == 1)
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            runner.refresh(0.01)
            time.sleep(0.02)
    finally:
        runner.stop()
    assert c.threads.count("kvscope-collector-c") == 1  # only the immediate first run
    assert len(c.threads) > 10


def test_an_inline_run_does_not_wake_the_collectors_thread():
    """A scrape's run on its own thread notifies the collector's condition only when some
    thread waits for that run to finish: the collector's thread, waiting out its idle floor,
    is not woken at every scrape."""

    class CountingCondition(threading.Condition):
        notified = 0

        def notify_all(self) -> None:
            CountingCondition.notified += 1
            super().notify_all()

    c = Where("c")
    runner = CollectorRunner([c], interval_s=1.0, on_demand=True, idle_interval_s=3600,
                             inline_max_s=10.0)
    runner._demand["c"].cond = CountingCondition()
    runner.start()
    try:
        _wait_until(lambda: runner._demand["c"].completed == 1)  # its first run is over
        before = CountingCondition.notified
        for _ in range(20):
            runner.refresh(0.0)
        assert c.runs == 21
        assert CountingCondition.notified == before
        assert runner._demand["c"].waiters == 0
    finally:
        runner.stop()
    assert c.threads.count("kvscope-collector-c") == 1
