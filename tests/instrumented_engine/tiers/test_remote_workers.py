"""The remote tier's worker threads (`remote._Workers`) and the deadline built on them: a call
whose deadline passes before it starts is cancelled, one still running completes a future
later, shutdown cancels queued calls (their callers see an error, never a hang), and a read
after close fails as `error` instead of raising."""

from __future__ import annotations

import gc
import threading
from concurrent.futures import CancelledError
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import pytest
import torch

from instrumented_engine.tiers import format as fmt
from instrumented_engine.tiers.format import BlockLayout
from instrumented_engine.tiers.remote import ResilienceConfig, ResilientRemote, _Workers
from instrumented_engine.tiers.stores.file import FileStore
from tests.instrumented_engine.tiers.conftest import NS, chain, payload


def test_value_and_exception_reach_the_caller() -> None:
    w = _Workers(2, "t-workers")
    assert w.wait(w.submit(lambda: 41 + 1), 10) == 42

    def boom() -> None:
        raise ValueError("x")

    with pytest.raises(ValueError, match="x"):
        w.wait(w.submit(boom), 10)
    w.shutdown()


def test_threads_start_on_demand_up_to_the_limit() -> None:
    w = _Workers(3, "t-demand")
    for _ in range(20):  # one caller at a time: one thread does it all
        w.wait(w.submit(lambda: None), 10)
    names = {t.name for t in threading.enumerate() if t.name.startswith("t-demand")}
    assert names == {"t-demand_0"}
    gate = threading.Event()
    calls = [w.submit(lambda: gate.wait(10)) for _ in range(5)]
    names = {t.name for t in threading.enumerate() if t.name.startswith("t-demand")}
    assert names == {"t-demand_0", "t-demand_1", "t-demand_2"}
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("t-demand"))
    gate.set()
    assert [w.wait(c, 10) for c in calls] == [True] * 5
    w.shutdown()


def test_a_call_past_its_deadline_is_cancelled_or_completes_a_future() -> None:
    w = _Workers(1, "t-deadline")
    gate, started = threading.Event(), threading.Event()
    ran: list[str] = []
    running = w.submit(lambda: (started.set(), gate.wait(10), ran.append("a"), "late")[-1])
    assert started.wait(10)
    queued = w.submit(lambda: ran.append("b"))
    with pytest.raises(FutureTimeout):
        w.wait(running, 0.02)
    with pytest.raises(FutureTimeout):
        w.wait(queued, 0.02)
    assert w.abandon(queued) is None  # not started: it never will
    fut = w.abandon(running)
    assert fut is not None and fut.running() and not fut.cancel()
    gate.set()
    assert fut.result(timeout=10) == "late"
    w.wait(w.submit(lambda: None), 10)  # the worker went past the cancelled call
    assert ran == ["a"]
    # Abandoned after it finished: the future is done at once.
    done = w.submit(lambda: 7)
    w.wait(done, 10)
    fut = w.abandon(done)
    assert fut is not None and fut.done() and fut.result() == 7
    w.shutdown()


def test_an_exception_after_the_deadline_reaches_the_future() -> None:
    w = _Workers(1, "t-late-error")
    gate, started = threading.Event(), threading.Event()

    def fail_late() -> None:
        started.set()
        gate.wait(10)
        raise OSError("late")

    call = w.submit(fail_late)
    assert started.wait(10)
    with pytest.raises(FutureTimeout):
        w.wait(call, 0.02)
    fut = w.abandon(call)
    assert fut is not None
    gate.set()
    with pytest.raises(OSError, match="late"):
        fut.result(timeout=10)
    w.shutdown()


def test_shutdown_cancels_queued_calls_and_later_submits() -> None:
    w = _Workers(1, "t-shutdown")
    gate, started = threading.Event(), threading.Event()
    running = w.submit(lambda: (started.set(), gate.wait(10))[-1])
    assert started.wait(10)  # (a call still queued at shutdown would be cancelled too)
    queued = w.submit(lambda: "never")
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            w.wait(queued, 10)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    w.shutdown()
    t.join(10)
    assert not t.is_alive() and len(errors) == 1 and isinstance(errors[0], CancelledError)
    with pytest.raises(CancelledError):
        w.wait(w.submit(lambda: "after"), 10)
    gate.set()
    assert w.wait(running, 10) is True  # a running call finishes
    for th in threading.enumerate():
        if th.name.startswith("t-shutdown"):
            th.join(10)
            assert not th.is_alive()


def _filled(tmp_path: Path, layout: BlockLayout, n: int) -> tuple[FileStore, list[bytes]]:
    store = FileStore(tmp_path)
    hs = chain(n)
    for i, h in enumerate(hs):
        store.write(h, fmt.encode(layout, h, NS, payload(layout, i)))
    return store, hs


def test_read_after_close_is_an_error_not_a_crash(layout: BlockLayout, tmp_path: Path) -> None:
    store, hs = _filled(tmp_path, layout, 2)
    remote = ResilientRemote(store, layout, ResilienceConfig(retries=1))
    dests = [torch.zeros(layout.payload_shape, dtype=layout.dtype) for _ in hs]
    assert remote.read_into(hs, NS, dests).statuses == [None, None]
    remote.close()
    assert remote.read_into(hs, NS, dests).statuses == ["error", "error"]
    # Racing close (the check passed, the workers are gone): an error too.
    remote._closed.clear()
    assert remote.read_into(hs, NS, dests).statuses == ["error", "error"]
    assert remote.lookup(hs, 0) == 0


def test_byte_rows_and_tensors_are_accepted_alike_and_misuse_raises(
        layout: BlockLayout, tmp_path: Path) -> None:
    store, hs = _filled(tmp_path, layout, 3)
    remote = ResilientRemote(store, layout)
    block = torch.zeros((3, *layout.payload_shape), dtype=layout.dtype)
    rows = list(fmt.byte_view(block).reshape(3, -1))
    tensors = [torch.zeros(layout.payload_shape, dtype=layout.dtype) for _ in hs]
    mixed = [rows[0], tensors[1], fmt.byte_view(tensors[2])]
    for dests in (rows, tensors, mixed):
        remote.lookup(hs, 0)
        res = remote.read_into(hs, NS, dests)
        assert res.statuses == [None, None, None] and res.staged == 3
    for i in range(3):
        assert torch.equal(block[i], payload(layout, i))
        assert torch.equal(tensors[i], payload(layout, i))
    with pytest.raises(ValueError):
        remote.read_into(hs[:1], NS, [rows[0][:-1]])
    with pytest.raises(ValueError):
        remote.read_into(hs[:1], NS, [rows[0].view("int8")])
    remote.close()


def test_a_pool_never_shut_down_stops_its_threads_when_it_goes() -> None:
    w = _Workers(2, "t-dropped")
    w.wait(w.submit(lambda: None), 10)
    threads = [t for t in threading.enumerate() if t.name.startswith("t-dropped")]
    assert len(threads) == 1
    del w
    gc.collect()
    threads[0].join(10)
    assert not threads[0].is_alive()


def _queued_past_deadline() -> tuple[_Workers, threading.Event, Any]:
    """A one-thread pool busy until the event is set, and a call queued behind it whose
    caller's deadline has passed."""
    w = _Workers(1, "t")
    gate = threading.Event()
    w.submit(gate.wait)
    queued = w.submit(lambda: 42)
    with pytest.raises(FutureTimeout):
        w.wait(queued, 0.01)
    return w, gate, queued


def test_a_call_cancelled_by_shutdown_is_abandoned_without_a_future() -> None:
    """A caller whose deadline passed on a queued call that `shutdown` then cancelled gets no
    future (the call never runs, so no future would ever complete), as a call cancelled at
    its deadline does."""
    w, gate, queued = _queued_past_deadline()
    w.shutdown()
    assert w.abandon(queued) is None
    gate.set()


def test_a_future_handed_out_before_shutdown_cancels_the_call_completes() -> None:
    """The window between `shutdown` claiming a queued call and marking it cancelled: an
    `abandon` in it hands out a future, which `shutdown` completes as cancelled (buffers
    free, no late completion)."""
    w, gate, queued = _queued_past_deadline()
    queued.claim.acquire()  # as shutdown's claim, just before it marks the call
    fut = w.abandon(queued)
    assert fut is not None and not fut.done()
    queued.claim.release()
    w.shutdown()
    assert fut.done() and isinstance(fut.exception(), CancelledError)
    gate.set()
