"""The remote tier as the engine sees it: any `RemoteStore` (tiers.stores) behind timeouts,
retries, circuit breakers, and every failure classified by reason (agent.schema.LOAD_FAIL_REASONS).

Each backend operation runs on a small worker pool and is awaited with a deadline (one lock
handed between caller and worker: `_Workers`). The one exception is work that cannot wait on
the backend: a store's `read_cached` (files: the head of a looked-up chain whose bytes are all
in the page cache, read with RWF_NOWAIT) runs on the calling thread, and the rest of the chain
goes to a worker under the deadline as before. A read decodes into caller-owned destination
tensors *inside* the worker, so after a timeout the worker may still write into them: the
result then carries the pending future, and the caller must not reuse those buffers until
`ReadResult.when_buffers_free` fires (the read completed late — counted as
`late_completions` — or was cancelled before it started). A timed-out read is therefore not
retried into the same buffers; backend errors are retried up to `retries` times.

Each operation kind (lookup, read, write) has its own circuit breaker, judged only by its own
operations: fast lookups cannot keep the breaker of timing-out reads closed, and a failing
write path does not stop reads that work.

Failures per block: `evicted` (promised by the lookup but gone at read time), `checksum` (the
object is damaged or forged: format.check), `mismatch` (an intact object stored under another
key, or of the old format), and for a whole operation `timeout`, `error`, `circuit_open`.
Timeouts and errors feed the breaker; unusable objects do not (the backend is up).

Counters (`stats`): `failures` are failed backend *attempts* by reason (timeout, error,
circuit_open: what the op counters and breakers see); `blocks_failed_<reason>` counts blocks not
loaded by reason (every LOAD_FAIL_REASON); `corrupt_<field>` says which check failed;
`outcomes` counts each lookup/read/write once by its outcome (agent.schema.REMOTE_OP_OUTCOMES),
which the engine reports in its `EngineStatus` (the exporters name them).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from queue import Empty, SimpleQueue
from typing import Any

import numpy as np
import torch

from instrumented_engine.tiers import format as fmt
from instrumented_engine.tiers.breaker import CLOSED, OPEN, BreakerConfig, CircuitBreaker
from instrumented_engine.tiers.stats import OpStats
from instrumented_engine.tiers.stores import RemoteError, RemoteStore, RemoteTimeout

log = logging.getLogger(__name__)

#: The status of a block that loaded.
LOADED = None


@dataclass(slots=True, frozen=True)
class ResilienceConfig:
    """Attributes:
        timeout_s: deadline of one backend operation (> 0).
        retries: extra attempts after a backend error (>= 0; timeouts are not retried).
        breaker: circuit breaker thresholds.
        workers: threads running backend operations (>= 1).
    """

    timeout_s: float = 0.5
    retries: int = 1
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    workers: int = 4

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"ResilienceConfig.timeout_s must be > 0, got {self.timeout_s!r}")
        if not isinstance(self.retries, int) or not 0 <= self.retries <= 10:
            raise ValueError(f"ResilienceConfig.retries must be an int in [0, 10], "
                             f"got {self.retries!r}")
        if not isinstance(self.workers, int) or not 1 <= self.workers <= 64:
            raise ValueError(f"ResilienceConfig.workers must be an int in [1, 64], "
                             f"got {self.workers!r}")


@dataclass(slots=True)
class ReadResult:
    """The outcome of `ResilientRemote.read_into`.

    Attributes:
        statuses: per block, None when loaded into its destination, else the failure reason
            (evicted, checksum, timeout, error, circuit_open).
        nbytes: object bytes read from the backend.
        transfer_id: the id of the `remote_read` activity span (-1 without a recorder).
        start_ns, end_ns: the operation's interval on the monotonic clock.
        staged: blocks this read wrote into their destinations (for a prefetch, blocks that
            were already in the host pool are loaded but not staged).
        pinned: (prefetches) the loaded blocks held in the host pool against eviction until
            the requests that need them have taken them (`Prefetcher.unpin`).
    """

    statuses: list[str | None]
    nbytes: int = 0
    transfer_id: int = -1
    start_ns: int = 0
    end_ns: int = 0
    pending: Future[Any] | None = field(default=None, repr=False)
    staged: int = 0
    pinned: list[bytes] = field(default_factory=list, repr=False)

    @property
    def loaded(self) -> int:
        """Blocks loaded."""
        return sum(s is LOADED for s in self.statuses)

    def failed_by_reason(self) -> dict[str, int]:
        """Failed blocks by reason."""
        out: dict[str, int] = {}
        for s in self.statuses:
            if s is not None:
                out[s] = out.get(s, 0) + 1
        return out

    def buffers_free(self) -> bool:
        """Whether the destination tensors may be reused now."""
        return self.pending is None or self.pending.done()

    def when_buffers_free(self, callback: Callable[[], None]) -> None:
        """Call `callback` (possibly on a worker thread) once no read writes the destinations."""
        if self.pending is None:
            callback()
        else:
            self.pending.add_done_callback(lambda _f: callback())


OPS: tuple[str, ...] = ("lookup", "read", "write")

_U8 = np.dtype(np.uint8)


class _Call:
    """One operation handed to a worker (`_Workers`).

    `claim` is taken by whoever gets to decide first: the worker when it starts the call, or
    the caller cancelling it at its deadline before it started. `done` is held until the call
    finished (or was cancelled by `shutdown`); `future` is set by a caller that stopped
    waiting while the call runs, and completed by the worker when it finishes; `cancelled` is
    set (under the pool's lock) when `shutdown` cancels the call before it started."""

    __slots__ = ("cancelled", "claim", "done", "error", "finished", "fn", "future", "value")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn: Callable[[], Any] | None = fn
        self.claim = threading.Lock()
        self.done = threading.Lock()
        self.done.acquire()
        self.value: Any = None
        self.error: BaseException | None = None
        self.finished = False
        self.cancelled = False
        self.future: Future[Any] | None = None


class _Workers:
    """The worker threads of `ResilientRemote`: what it used of a ThreadPoolExecutor (threads
    started on demand up to `n`, a call cancelled if its deadline passes before it starts, a
    future for one still running, queued calls cancelled at shutdown) with less per
    operation: the caller waits on one lock the worker releases, and a future is made only for
    a call its caller stopped waiting for. Threads are daemons: a call hung in the kernel does
    not hold up the interpreter's exit."""

    def __init__(self, n: int, name: str) -> None:
        self._max = n
        self._name = name
        self._queue: SimpleQueue[_Call | None] = SimpleQueue()
        #: One token per call a worker finished (a worker free or about to be: no new thread).
        self._idle: list[None] = []
        self._threads = 0
        self._lock = threading.Lock()
        self._closed = False
        weakref.finalize(self, _stop, self._queue, n)

    def submit(self, fn: Callable[[], Any]) -> _Call:
        call = _Call(fn)
        if self._closed:  # shut down: cancelled at once, as a queued call is at shutdown
            call.claim.acquire()
            call.cancelled = True
            self._cancel(call)
            return call
        try:
            self._idle.pop()
        except IndexError:
            self._spawn()
        self._queue.put(call)  # last: the worker it wakes finds the caller about to wait
        return call

    def _spawn(self) -> None:
        with self._lock:
            if self._closed or self._threads >= self._max:
                return
            i = self._threads
            self._threads += 1
        # The thread holds the queue, not the pool: a pool never shut down that goes away
        # stops its threads (its finalizer), as a ThreadPoolExecutor's do.
        threading.Thread(target=_work, args=(self._queue, self._idle, self._lock),
                         name=f"{self._name}_{i}", daemon=True).start()

    @staticmethod
    def _cancel(call: _Call) -> None:
        """Cancel a call whose `claim` the caller holds: it never runs."""
        call.fn = None
        call.error = CancelledError()
        call.done.release()

    @staticmethod
    def wait(call: _Call, timeout: float) -> Any:
        """The call's value, or its exception raised; `FutureTimeout` when it has not
        finished within `timeout` seconds (then `abandon` it)."""
        if not call.done.acquire(True, timeout):
            raise FutureTimeout()
        if call.error is not None:
            raise call.error
        return call.value

    def abandon(self, call: _Call) -> Future[Any] | None:
        """The caller stops waiting: None when the call had not started (it never will),
        else a future that completes when it finishes (now, if it already has)."""
        if call.claim.acquire(False):
            call.fn = None
            return None
        fut: Future[Any] = Future()
        fut.set_running_or_notify_cancel()
        with self._lock:
            if call.cancelled:  # `shutdown` claimed it first: it never runs either
                return None
            if not call.finished:
                call.future = fut
                return fut
        if call.error is None:
            fut.set_result(call.value)
        else:
            fut.set_exception(call.error)
        return fut

    def shutdown(self) -> None:
        """Cancel the queued calls and stop the threads once their running calls finish."""
        with self._lock:
            self._closed = True
            n = self._threads
        while True:
            try:
                call = self._queue.get_nowait()
            except Empty:
                break
            if call is not None and call.claim.acquire(False):
                with self._lock:
                    call.cancelled = True
                    # An `abandon` between our claim and this lock saw neither flag and
                    # handed its caller a future: it completes here (as cancelled).
                    fut = call.future
                self._cancel(call)
                if fut is not None:
                    fut.set_exception(CancelledError())
        _stop(self._queue, n)


def _work(queue: SimpleQueue[_Call | None], idle: list[None], lock: threading.Lock) -> None:
    """A worker thread of `_Workers`: runs calls until it takes a None."""
    while True:
        call = queue.get()
        if call is None:
            return
        if call.claim.acquire(False):  # else cancelled before it started
            _finish(call, idle, lock)
        else:
            idle.append(None)
        del call


def _finish(call: _Call, idle: list[None], lock: threading.Lock) -> None:
    fn, call.fn = call.fn, None
    try:
        call.value = fn()  # type: ignore[misc]
    except BaseException as e:
        call.error = e
    with lock:
        call.finished = True
        fut = call.future
    idle.append(None)  # before the caller wakes: its next call needs no new thread
    call.done.release()
    if fut is not None:
        if call.error is None:
            fut.set_result(call.value)
        else:
            fut.set_exception(call.error)


def _stop(queue: SimpleQueue[_Call | None], n: int) -> None:
    for _ in range(n):
        queue.put(None)


class ResilientRemote:
    """Wraps a raw `RemoteStore`; never raises backend failures, returns them classified.

    Args:
        store: the raw (possibly fault-injecting) store.
        layout: the engine's block layout (objects are checked against it).
        config: timeouts, retries, breakers.
        key: the shared secret that authenticates objects (writes are MACed, reads must
            carry a valid MAC); None: an unauthenticated remote (integrity only).
        recorder: optional agent.telemetry.Recorder: activity spans (`remote_lookup`,
            `remote_read`, `remote_write`) and breaker events (`circuit_open`,
            `circuit_close`, detail `op`).
        on_breaker_change: extra callback (op, old, new, t_ns) on breaker transitions.
        clock: monotonic ns (the breakers' cool-down and the spans).
    """

    name = "remote"

    def __init__(self, store: RemoteStore, layout: fmt.BlockLayout,
                 config: ResilienceConfig = ResilienceConfig(), *,
                 key: fmt.ObjectKey | None = None, recorder: Any = None,
                 on_breaker_change: Callable[[str, str, str, int], None] | None = None,
                 clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.store = store
        self.layout = layout
        self.config = config
        self.key = key
        self.recorder = recorder
        self.clock = clock
        self.stats = OpStats()
        self._user_on_change = on_breaker_change
        #: One breaker per operation kind.
        self.breakers: dict[str, CircuitBreaker] = {
            op: CircuitBreaker(config.breaker, clock=clock,
                               on_change=lambda o, n, t, op=op: self._breaker_changed(op, o, n, t))
            for op in OPS}
        self._pool = _Workers(config.workers, "kvscope-remote")
        self._closed = threading.Event()

    def breaker_states(self) -> dict[str, str]:
        """Each operation kind's breaker state (closed, open, half_open)."""
        return {op: b.state for op, b in self.breakers.items()}

    def breaker_open_ns(self) -> dict[str, int]:
        """How long each breaker has been open in all (including an open period now)."""
        return {op: b.open_time_ns() for op, b in self.breakers.items()}

    # ------------------------------------------------------------------ breaker plumbing
    def _breaker_changed(self, op: str, old: str, new: str, t_ns: int) -> None:
        self.stats.add(f"breaker_{op}_{new}")
        if self.recorder is not None:
            # Events pair up as open/close intervals; a failed half-open probe (half_open →
            # open) keeps the circuit open and is only counted (`breaker_<op>_open`).
            if new == OPEN and old == CLOSED:
                self.recorder.event(
                    "circuit_open", t=t_ns, source="remote",
                    detail={"op": op, "failures": self.breakers[op].consecutive_failures})
            elif new == CLOSED:
                self.recorder.event("circuit_close", t=t_ns, source="remote",
                                    detail={"op": op})
        if self._user_on_change is not None:
            self._user_on_change(op, old, new, t_ns)

    @staticmethod
    def _reason(e: BaseException) -> str:
        return "timeout" if isinstance(e, (RemoteTimeout, FutureTimeout)) else "error"

    def _run(self, op: str, fn: Callable[[], Any], first: Callable[[], Any] | None = None
             ) -> tuple[Any, str | None, Future[Any] | None]:
        """Run `fn` on the pool under the breaker, deadline and retries.

        Args:
            first: run on the calling thread before `fn`, for work that never waits on the
                backend (reads served from memory without blocking): it returns the
                operation's value when it did all of it, else None and `fn` does the rest on
                the pool, under the deadline.

        Returns:
            (value, None, None) on success, or (None, reason, still-running future or None).
        """
        if self._closed.is_set():
            self.stats.fail("error")
            return None, "error", None
        breaker = self.breakers[op]
        if not breaker.allow():
            self.stats.fail("circuit_open")
            return None, "circuit_open", None
        if first is not None:
            t0 = self.clock()
            try:
                value = first()
            except (RemoteError, OSError):  # a worker does it all again, under the deadline
                value = None
            except Exception:  # as below: a bug, not a backend failure
                log.exception("remote %s failed unexpectedly", op)
                self.stats.fail("error")
                self.stats.add("unexpected_errors")
                breaker.record_failure()
                return None, "error", None
            if value is not None:
                self.stats.op(op, self.clock() - t0)
                breaker.record_success()
                return value, None, None
        reason = "error"
        for attempt in range(self.config.retries + 1):
            if attempt:
                self.stats.add("retries")
            t0 = self.clock()
            call = self._pool.submit(fn)
            try:
                value = self._pool.wait(call, self.config.timeout_s)
            except FutureTimeout:
                fut = self._pool.abandon(call)
                if fut is None:
                    self.stats.add("cancelled")
                else:
                    fut.add_done_callback(self._late)
                self.stats.fail("timeout")
                breaker.record_failure()
                return None, "timeout", fut
            except (RemoteError, OSError, CancelledError) as e:
                reason = self._reason(e)
                self.stats.fail(reason)
                if reason == "timeout":  # a socket timeout: the backend is slow, do not pile on
                    break
                continue
            except Exception:
                # A bug below us (not a backend failure): the engine recomputes instead of
                # crashing, and the traceback is logged for whoever reads the logs.
                log.exception("remote %s failed unexpectedly", op)
                self.stats.fail("error")
                self.stats.add("unexpected_errors")
                reason = "error"
                break
            self.stats.op(op, self.clock() - t0)
            breaker.record_success()
            return value, None, None
        breaker.record_failure()
        return None, reason, None

    def _late(self, fut: Future[Any]) -> None:
        # A call `shutdown` cancelled before it started completes its future with
        # CancelledError: it never ran, so it is no late completion.
        if not fut.cancelled() and not isinstance(fut.exception(), CancelledError):
            self.stats.add("late_completions")

    def _span(self, name: str, t0: int, t1: int, tokens: int, nbytes: int,
              transfer_id: int, request_num: int = -1) -> None:
        if self.recorder is not None:
            self.recorder.activity(name, t0, t1, request_num=request_num, tier="remote",
                                   tokens=tokens, nbytes=nbytes, transfer_id=transfer_id)

    # ------------------------------------------------------------------ operations
    def lookup(self, block_hashes: Sequence[bytes], start: int = 0) -> int:
        """Contiguous blocks the remote holds from `start` on; 0 on any failure or while the
        breaker is open (the request then recomputes: a promise the tier cannot keep is worse
        than none)."""
        if start >= len(block_hashes):
            return 0
        t0 = self.clock()
        n, reason, _ = self._run("lookup", lambda: self.store.lookup(block_hashes, start))
        self.stats.outcome("lookup", reason or "ok")
        if reason is not None:
            self.stats.add(f"lookup_failed_{reason}")
            return 0
        self.stats.add("lookup_blocks", len(block_hashes) - start)
        self.stats.add("lookup_hit_blocks", n)
        if self.recorder is not None:
            self._span("remote_lookup", t0, self.clock(), n * self.layout.block_size, -1,
                       self.recorder.new_transfer_id())
        return int(n)

    def read_into(self, block_hashes: Sequence[bytes], namespace: bytes,
                  dests: Sequence[torch.Tensor | np.ndarray], *,
                  transfer_id: int | None = None, request_num: int = -1) -> ReadResult:
        """Read, check and copy blocks into `dests` (one payload-shaped CPU tensor each).

        Args:
            block_hashes: the digests to load, in chain order.
            namespace: the request's namespace digest (each object must carry it, and the
                digest it is read for).
            dests: destination blocks: payload-shaped contiguous CPU tensors (host pool slots,
                staging blocks) or their `format.byte_view`s (cheaper per block).
            transfer_id: the id for the activity span (a new one when None and a recorder is
                set), so the caller can list it in `waits_on` before the read ends.

        Returns:
            A `ReadResult`; when it is not `buffers_free()`, `dests` must not be reused until
            `when_buffers_free` fires.
        """
        if len(dests) != len(block_hashes):
            raise ValueError("read_into needs one destination per block hash")
        # Misuse raises here, not later. Byte rows of the layout (what host pools hand out)
        # are taken as they are, as fmt.dest_bytes would; anything else goes through it.
        row = (self.layout.payload_bytes,)
        rows = [d if type(d) is np.ndarray and d.dtype is _U8 and d.shape == row
                else fmt.dest_bytes(d, self.layout) for d in dests]
        if transfer_id is None:
            transfer_id = -1 if self.recorder is None else self.recorder.new_transfer_id()
        t0 = self.clock()
        layout = self.layout
        key = self.key

        read_in_place = getattr(self.store, "read_into_many", None)
        read_views = getattr(self.store, "read_views", None)
        read_cached = getattr(self.store, "read_cached", None)
        #: (files) the chain's head read on this thread from the page cache: its statuses
        #: and bytes; the workers read the rest.
        head: tuple[list[str | None], int] = ([], 0)

        def cached() -> tuple[list[str | None], int] | None:
            nonlocal head
            statuses, nbytes, k = self._read_in_place(read_cached, block_hashes, namespace,
                                                      rows)
            if k == len(block_hashes):
                return statuses, nbytes
            head = (statuses[:k], nbytes)
            return None

        def op() -> tuple[list[str | None], int]:
            if read_in_place is not None:  # files, Redis: payloads land in `rows` directly
                k = len(head[0])
                if not k:
                    return self._read_in_place(read_in_place, block_hashes, namespace, rows)[:2]
                statuses, nbytes, _ = self._read_in_place(read_in_place, block_hashes[k:],
                                                          namespace, rows[k:])
                return head[0] + statuses, head[1] + nbytes
            objs: Sequence[bytes | memoryview | None]
            if read_views is not None:  # views of the store's read buffer (Mooncake)
                objs = read_views(block_hashes, layout.object_bytes)
            else:
                objs = self.store.read_many(block_hashes)
            statuses: list[str | None] = []
            nbytes = 0
            for h, data, dest in zip(block_hashes, objs, rows, strict=True):
                if data is None:
                    statuses.append("evicted")
                    continue
                nbytes += len(data)
                try:
                    fmt.decode_into(data, layout, h, namespace, dest, key)
                except fmt.CorruptObject as e:
                    self.stats.add(f"corrupt_{e.reason}")
                    statuses.append(e.failure)
                    continue
                statuses.append(LOADED)
            return statuses, nbytes

        value, reason, pending = self._run(
            "read", op, cached if read_cached is not None and read_in_place is not None
            else None)
        t1 = self.clock()
        if reason is not None:
            res = ReadResult([reason] * len(block_hashes), 0, transfer_id, t0, t1, pending)
            loaded = 0
        else:
            statuses, nbytes = value
            loaded = statuses.count(LOADED)
            res = ReadResult(statuses, nbytes, transfer_id, t0, t1, staged=loaded)
        # A read that reached the backend but returned an unusable object is a `checksum` (or,
        # for intact objects of another key, `mismatch`) outcome; a promised object that is
        # gone (`evicted`) is not a backend failure.
        if reason is None and loaded == len(res.statuses):
            outcome = "ok"
        else:
            outcome = reason or next(
                (o for o in ("checksum", "mismatch") if o in res.statuses), "ok")
            for r, n in res.failed_by_reason().items():
                self.stats.add(f"blocks_failed_{r}", n)
        self.stats.outcome("read", outcome)
        self.stats.add("bytes_read", res.nbytes)
        self.stats.add("blocks_loaded", loaded)
        # A failed read is a transfer too (it is what a `remote_read` state waited on).
        self._span("remote_read", t0, t1, loaded * layout.block_size, res.nbytes,
                   transfer_id, request_num)
        return res

    def _read_in_place(self, read_in_place: Callable[..., Any],
                       block_hashes: Sequence[bytes], namespace: bytes,
                       dests: Sequence[np.ndarray]) -> tuple[list[str | None], int, Any]:
        """Stores that read into caller buffers (`read_into_many`: files, Redis): the whole
        chain in one call, each payload straight into its destination with no intermediate
        copy, and each object checked against its key and tag as soon as it is read (its
        bytes still in cache). A failed block's destination then holds whatever was read (the
        caller discards failed blocks anyway).

        Returns:
            (statuses, object bytes read, what `read_in_place` returned: for `read_cached`
            how many blocks of the chain's head it read).
        """
        header = memoryview(bytearray(fmt.HEADER_SIZE))  # one: each is checked before the next
        check = fmt.ChainCheck(self.layout, namespace, self.key)
        statuses: list[str | None] = ["evicted"] * len(block_hashes)
        cap = self.layout.object_bytes
        nbytes = 0

        def on_read(i: int, total: int | None) -> None:
            nonlocal nbytes
            if total is None:
                return
            nbytes += min(total, cap)
            bad = check(header, dests[i], total, block_hashes[i])
            if bad is None:
                statuses[i] = LOADED
            else:
                self.stats.add(f"corrupt_{bad.reason}")
                statuses[i] = bad.failure

        got = read_in_place(block_hashes, [header] * len(block_hashes), dests, on_read)
        return statuses, nbytes, got

    def write(self, block_hash: bytes, namespace: bytes, payload: torch.Tensor) -> str | None:
        """Encode and store one block.

        Returns:
            None when stored, else the failure reason (timeout, error, circuit_open).
        """
        data = fmt.encode(self.layout, block_hash, namespace, payload, self.key)
        return self.write_object(block_hash, data)

    def write_object(self, block_hash: bytes, data: bytes) -> str | None:
        """Store already-encoded object bytes; returns None or the failure reason."""
        t0 = self.clock()
        _, reason, _ = self._run("write", lambda: self.store.write(block_hash, data))
        self.stats.outcome("write", reason or "ok")
        if reason is not None:
            self.stats.add(f"write_failed_{reason}")
            return reason
        self.stats.add("bytes_written", len(data))
        if self.recorder is not None:
            self._span("remote_write", t0, self.clock(), self.layout.block_size, len(data),
                       self.recorder.new_transfer_id())
        return None

    def close(self) -> None:
        """Stop the workers (running operations finish in the background) and the store."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._pool.shutdown()
        self.store.close()
