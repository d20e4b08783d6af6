"""Drives an engine with real-time arrivals (what `kvscope run` runs).

An arrival thread sleeps until each request's time and hands it to a small pool of lookup
workers, which perform its lookup (hashing and tier probes: the request's `lookup` stage, off
the engine loop) and submit it (which starts the prefetch of its remote hits at once); the
calling thread runs the engine loop, stepping while there is work and blocking when idle.

A request's arrival is stamped at its scheduled time, not when a worker gets to it: if lookups
are slow (a remote probe hanging until its deadline), the wait shows as `lookup` in its TTFT
instead of disappearing before the request exists, and with several workers one slow probe
does not hold up the lookups of the requests behind it. Every request state transition after
the lookup stays on the engine loop's thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from agent.errors import InputError
from instrumented_engine.core.request import Request, RequestOutput
from instrumented_engine.engine import EngineStats, LLMEngine
from instrumented_engine.workloads.base import Arrival


@dataclass(slots=True)
class RunResult:
    """Outputs in finishing order, the engine's counts and the run's wall time."""

    outputs: list[RequestOutput] = field(default_factory=list)
    stats: EngineStats = field(default_factory=EngineStats)
    wall_s: float = 0.0
    interrupted: bool = False


def prepare_requests(engine: LLMEngine, arrivals: Sequence[Arrival]) -> list[Request]:
    """Validate every arrival up front, so a bad one fails the run before it starts.

    Raises:
        InputError: naming the arrival (trace line or request id) and what is wrong with it.
    """
    out = []
    for a in arrivals:
        try:
            out.append(engine.make_request(a.prompt_token_ids, a.max_tokens, tenant=a.tenant,
                                           request_id=a.request_id,
                                           workload_class=a.workload_class))
        except ValueError as exc:
            raise InputError(f"{a.source or a.request_id}: {exc}") from None
    return out


class RealTimeDriver:
    """Replays `arrivals` against `engine` at their times.

    Args:
        engine: the engine (its recorder, if any, must belong to the calling thread).
        arrivals: the workload, sorted by `at_s`.
        on_finished: called on the engine thread with each finished request's output.
        monotonic: seconds clock for pacing (injectable for tests).
        sleep: sleep function for pacing (injectable for tests).
    """

    def __init__(self, engine: LLMEngine, arrivals: Sequence[Arrival], *,
                 on_finished: Callable[[RequestOutput], None] | None = None,
                 monotonic: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 lookup_workers: int = 4) -> None:
        if not 1 <= lookup_workers <= 64:
            raise ValueError(f"lookup_workers: must be 1 to 64, got {lookup_workers}")
        self.engine = engine
        self.arrivals = sorted(arrivals, key=lambda a: a.at_s)
        self.requests = prepare_requests(engine, self.arrivals)
        self.on_finished = on_finished
        self.lookup_workers = lookup_workers
        self._mono = monotonic
        self._sleep = sleep
        self._stop = threading.Event()
        self._submitted = threading.Event()
        self._error: BaseException | None = None

    def _lookup(self, req: Request, due_ns: int) -> None:
        """(A lookup worker) the request's lookup from its scheduled arrival, then submit."""
        eng = self.engine
        try:
            if self._stop.is_set():
                return
            # min(): a pacing clock that runs ahead of the engine's (tests) never stamps an
            # arrival in the engine's future.
            eng.submit(req, eng.lookup(req, min(due_ns, eng.clock())))
        except BaseException as exc:  # surfaced on the engine thread
            self._error = exc
            self._stop.set()

    def _arrive(self, t0: float, t0_ns: int) -> None:
        eng = self.engine
        pool = ThreadPoolExecutor(self.lookup_workers, thread_name_prefix="kvscope-lookup")
        try:
            for a, req in zip(self.arrivals, self.requests, strict=True):
                while not self._stop.is_set():
                    wait = t0 + a.at_s - self._mono()
                    if wait <= 0:
                        break
                    self._sleep(min(wait, 0.1))
                if self._stop.is_set():
                    return
                pool.submit(self._lookup, req, t0_ns + round(a.at_s * 1e9))
        except BaseException as exc:  # surfaced on the engine thread
            self._error = exc
        finally:
            pool.shutdown(wait=True)  # every lookup submitted before the engine may finish
            self._submitted.set()
            eng.wake()

    def run(self) -> RunResult:
        """Run until every request finished (or Ctrl-C: then `interrupted` is set)."""
        eng = self.engine
        res = RunResult()
        t0, t0_ns = self._mono(), eng.clock()
        th = threading.Thread(target=self._arrive, args=(t0, t0_ns), name="kvscope-arrivals",
                              daemon=True)
        th.start()
        try:
            while True:
                if eng.has_unfinished():
                    for out in eng.step():
                        res.outputs.append(out)
                        if self.on_finished is not None:
                            self.on_finished(out)
                    if not eng.last_step_ran:  # all waiting on remote reads: do not spin
                        eng.wait_for_progress(0.1)
                elif self._submitted.is_set():
                    if not eng.has_unfinished():
                        break
                else:
                    eng.wait_for_arrival(0.1)
        except KeyboardInterrupt:
            res.interrupted = True
            self._stop.set()
            th.join()
            eng.abort_all()
        finally:
            self._stop.set()
            th.join()
            eng.close()
        if self._error is not None:
            raise self._error
        res.stats = eng.stats
        res.wall_s = self._mono() - t0
        return res
