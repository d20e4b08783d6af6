"""IntervalTimer: the CPU fallback, and the CUDA-event logic driven by a fake shaped like
`torch.cuda` (this machine has no GPU)."""

from __future__ import annotations

from typing import Any

import pytest

from agent.telemetry import CLOCK_CPU, CLOCK_CUDA, IntervalTimer, Mark


class Ticks:
    """A clock the test steps by hand."""

    def __init__(self, t: int) -> None:
        self.t = t

    def __call__(self) -> int:
        return self.t


# --------------------------------------------------------------------------- CPU
def test_cpu_fallback_is_resolved_at_once_on_the_monotonic_clock() -> None:
    mono, perf = Ticks(1_000_000), Ticks(400)
    timer = IntervalTimer("cpu", monotonic=mono, perf_counter=perf)
    assert not timer.is_cuda and timer.clock == CLOCK_CPU
    perf.t = 500
    m = timer.begin("copy")
    perf.t = 750
    assert timer.end(m) is m
    # perf 500 → monotonic 1_000_100 (offset measured at construction: 1_000_000 - 400)
    assert (m.start_ns, m.end_ns, m.duration_ns) == (1_000_100, 1_000_350, 250)
    assert m.resolved and m.clock == CLOCK_CPU and m.payload == "copy"
    assert timer.poll() == [m]
    assert timer.poll() == []
    assert timer.finish() == []


def test_cpu_fallback_with_the_real_clocks_lands_between_monotonic_reads() -> None:
    import time

    timer = IntervalTimer()
    before = time.monotonic_ns()
    m = timer.end(timer.begin())
    after = time.monotonic_ns()
    # Linux: perf_counter and monotonic are one clock; the offset is measured to within a few
    # hundred ns, far below the 1 ms slack allowed here.
    assert before - 1_000_000 <= m.start_ns <= m.end_ns <= after + 1_000_000


def test_cuda_device_without_cuda_falls_back_to_the_cpu() -> None:
    fake = FakeTorch(available=False)
    timer = IntervalTimer("cuda:0", torch_module=fake)
    assert not timer.is_cuda and timer.clock == CLOCK_CPU
    assert fake.cuda.synchronize_calls == 0


# --------------------------------------------------------------------------- a fake torch.cuda
class FakeStream:
    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu
        self.tail_ms = 0.0  # when the work enqueued so far completes

    def enqueue(self, ms: float) -> None:
        self.tail_ms = max(self.tail_ms, self.gpu.now_ms) + ms


class FakeGpu:
    """Device time in ms; work completes when `now_ms` reaches its stream's tail."""

    def __init__(self) -> None:
        self.now_ms = 0.0
        self.default = FakeStream(self)


class FakeEvent:
    """`torch.cuda.Event(enable_timing=True)`: record(stream=None), query(),
    elapsed_time(end) in ms, synchronize()."""

    def __init__(self, gpu: FakeGpu, enable_timing: bool = False) -> None:
        self.gpu = gpu
        self.timing = enable_timing
        self.at_ms: float | None = None
        self.query_calls = 0

    def record(self, stream: FakeStream | None = None) -> None:
        s = stream or self.gpu.default
        self.at_ms = max(s.tail_ms, self.gpu.now_ms)

    def query(self) -> bool:
        self.query_calls += 1
        return self.at_ms is not None and self.at_ms <= self.gpu.now_ms

    def synchronize(self) -> None:
        if self.at_ms is not None:
            self.gpu.now_ms = max(self.gpu.now_ms, self.at_ms)

    def elapsed_time(self, end_event: FakeEvent) -> float:
        if not (self.timing and end_event.timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'")
        if not (self.query() and end_event.query()):
            raise RuntimeError("CUDA error: device not ready")
        return end_event.at_ms - self.at_ms


class FakeCuda:
    def __init__(self, gpu: FakeGpu, available: bool) -> None:
        self.gpu = gpu
        self.available = available
        self.synchronize_calls = 0

    def is_available(self) -> bool:
        return self.available

    def synchronize(self) -> None:
        self.synchronize_calls += 1
        self.gpu.now_ms = max(self.gpu.now_ms, self.gpu.default.tail_ms)

    def Event(self, enable_timing: bool = False) -> FakeEvent:  # torch's name
        return FakeEvent(self.gpu, enable_timing)


class FakeTorch:
    def __init__(self, available: bool = True) -> None:
        self.gpu = FakeGpu()
        self.cuda = FakeCuda(self.gpu, available)


# --------------------------------------------------------------------------- CUDA logic
def cuda_timer(anchor_mono: int = 5_000_000) -> tuple[IntervalTimer, FakeTorch, Ticks]:
    fake = FakeTorch()
    fake.gpu.now_ms = 10.0  # the device clock has its own origin
    mono = Ticks(anchor_mono)
    timer = IntervalTimer("cuda", torch_module=fake, monotonic=mono)
    return timer, fake, mono


def test_cuda_intervals_resolve_only_when_complete_and_never_block() -> None:
    timer, fake, _ = cuda_timer()
    assert timer.is_cuda and timer.clock == CLOCK_CUDA
    assert fake.cuda.synchronize_calls == 1  # once, to take the anchor on an idle device
    s = fake.gpu.default
    s.enqueue(0.25)  # work queued ahead of the copy
    a = timer.begin("copy-a")
    s.enqueue(1.5)  # the copy
    timer.end(a)
    b = timer.begin("copy-b")
    s.enqueue(0.5)
    timer.end(b)
    assert a.clock == CLOCK_CUDA and not a.resolved
    assert timer.poll() == []  # nothing done: no wait, no synchronize
    assert fake.cuda.synchronize_calls == 1
    fake.gpu.now_ms = 11.75  # a's end event has completed, b's has not
    assert timer.poll() == [a]
    # Anchor at device 10.0 ms == monotonic 5_000_000 ns.
    assert (a.start_ns, a.end_ns) == (5_000_000 + 250_000, 5_000_000 + 1_750_000)
    assert a.ev_start is None and a.ev_end is None  # events released once resolved
    fake.gpu.now_ms = 100.0
    assert timer.poll() == [b]
    assert (b.start_ns, b.end_ns) == (5_000_000 + 1_750_000, 5_000_000 + 2_250_000)
    assert timer.poll() == []
    assert fake.cuda.synchronize_calls == 1


def test_cuda_mark_waits_for_both_events_on_different_streams() -> None:
    timer, fake, _ = cuda_timer()
    other = FakeStream(fake.gpu)
    other.enqueue(5.0)  # a busy side stream
    m = timer.begin("x", stream=other)  # starts after 5 ms of side-stream work
    timer.end(m)  # ends on the idle default stream: its event completes at once
    assert timer.poll() == []  # the start event is still in flight
    fake.gpu.now_ms = 15.0
    assert timer.poll() == [m]
    assert (m.start_ns, m.end_ns) == (5_000_000 + 5_000_000, 5_000_000)


def test_finish_resolves_everything_pending() -> None:
    timer, fake, _ = cuda_timer()
    marks = []
    for _ in range(3):
        m = timer.begin()
        fake.gpu.default.enqueue(2.0)
        marks.append(timer.end(m))
    assert timer.poll() == []
    assert timer.finish() == marks
    assert [(m.start_ns - 5_000_000, m.end_ns - 5_000_000) for m in marks] == [
        (0, 2_000_000), (2_000_000, 4_000_000), (4_000_000, 6_000_000)]


def test_reanchor_places_later_and_earlier_marks() -> None:
    timer, fake, mono = cuda_timer()
    early = timer.begin()
    fake.gpu.default.enqueue(1.0)
    timer.end(early)
    fake.gpu.now_ms = 20.0  # device idle again at 20 ms; the CPU reads 9_000_000 then
    mono.t = 9_000_000
    timer.reanchor()
    late = timer.begin()
    fake.gpu.default.enqueue(0.5)
    timer.end(late)
    fake.gpu.now_ms = 30.0
    done = timer.poll()
    assert done == [early, late]
    # Both placed through the new anchor (device 20 ms == 9_000_000 ns), the early one at a
    # negative offset from it.
    assert (early.start_ns, early.end_ns) == (9_000_000 - 10_000_000, 9_000_000 - 9_000_000)
    assert (late.start_ns, late.end_ns) == (9_000_000, 9_500_000)


def test_an_unresolvable_mark_is_counted_and_dropped() -> None:
    timer, fake, _ = cuda_timer()
    bad = Mark("bad", clock=CLOCK_CUDA, ev_start=FakeEvent(fake.gpu, enable_timing=False),
                ev_end=FakeEvent(fake.gpu, enable_timing=False))
    bad.ev_start.record()
    bad.ev_end.record()
    timer._pending.append(bad)
    good = timer.end(timer.begin())
    assert timer.poll() == [good]
    assert timer.errors == 1


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_non_cuda_devices_never_touch_torch(device: Any) -> None:
    class Exploding:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"torch.{name} used for a {device} timer")

    timer = IntervalTimer(device, torch_module=Exploding())
    assert not timer.is_cuda


def test_real_torch_on_this_cpu_only_machine_falls_back() -> None:
    import torch

    timer = IntervalTimer(torch.device("cuda") if torch.cuda.is_available() else "cuda")
    assert timer.is_cuda == torch.cuda.is_available()
