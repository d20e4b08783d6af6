"""The real-time driver: arrivals on their own thread, lookups off the engine loop."""

from __future__ import annotations

import threading
import time

import pytest

from agent.errors import InputError
from agent.telemetry import Recorder, check_partition
from instrumented_engine.driver import RealTimeDriver
from instrumented_engine.engine import LLMEngine
from instrumented_engine.workloads.base import Arrival
from tests.instrumented_engine.helpers import tiny_config, tokens


class FakeTime:
    """Pacing clock whose sleep advances it at once (the engine keeps its real clock)."""

    def __init__(self) -> None:
        self.t = 100.0
        self.lock = threading.Lock()

    def monotonic(self) -> float:
        with self.lock:
            return self.t

    def sleep(self, s: float) -> None:
        with self.lock:
            self.t += s


def _arrivals(n: int, gap_s: float) -> list[Arrival]:
    shared = tokens(0, 64)
    return [Arrival(at_s=i * gap_s, request_id=f"a{i}", prompt_token_ids=shared + tokens(i, 20),
                    max_tokens=3, tenant="t", workload_class="test") for i in range(n)]


def test_runner_replays_every_arrival_with_an_exact_partition() -> None:
    rec = Recorder()
    eng = LLMEngine(tiny_config(), recorder=rec)
    ft = FakeTime()
    arrivals = _arrivals(6, gap_s=2.0)
    res = RealTimeDriver(eng, list(reversed(arrivals)), monotonic=ft.monotonic,
                         sleep=ft.sleep).run()
    assert not res.interrupted
    assert sorted(o.request_id for o in res.outputs) == [f"a{i}" for i in range(6)]
    assert ft.t >= 100.0 + 10.0  # the pacing clock waited for the last arrival
    tables = rec.drain()
    assert check_partition(tables["spans"], tables["requests"]) == []
    req = tables["requests"].to_pylist()
    assert [r["request_id"] for r in sorted(req, key=lambda r: r["arrival_ns"])] == [
        f"a{i}" for i in range(6)]
    assert all(r["workload_class"] == "test" for r in req)
    # Later arrivals reuse the 64-token shared prefix (4 blocks).
    assert sum(r["device_hit_tokens"] for r in req) >= 4 * 16


def test_invalid_arrival_fails_before_the_run_naming_its_source() -> None:
    eng = LLMEngine(tiny_config(num_blocks=4))
    bad = Arrival(at_s=0, request_id="x", prompt_token_ids=[1] * 100, max_tokens=1,
                  tenant=None, workload_class="trace", source="t.jsonl:7")
    with pytest.raises(InputError, match=r"^t.jsonl:7: a request of 101 tokens needs 7 blocks"):
        RealTimeDriver(eng, [bad])


def test_interrupt_aborts_unfinished_requests() -> None:
    rec = Recorder()
    eng = LLMEngine(tiny_config(max_num_seqs=1), recorder=rec)

    def stop(_out: object) -> None:
        # All four arrive at 0 s; on a loaded machine the arrival thread may still be behind
        # when the first request ends: give it (boundedly) the time to submit two more.
        deadline = time.monotonic() + 10
        while rec.open_requests() < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        raise KeyboardInterrupt

    res = RealTimeDriver(eng, _arrivals(4, gap_s=0.0), on_finished=stop).run()
    assert res.interrupted and len(res.outputs) == 1
    status = sorted(r["status"] for r in rec.drain()["requests"].to_pylist())
    # All four arrive at 0 s, long before the first request's three steps end (the last could
    # in principle still be unsubmitted when the interrupt stops the arrival thread).
    assert status[-1] == "ok" and set(status[:-1]) == {"aborted"} and len(status) >= 3
    assert rec.open_requests() == 0
