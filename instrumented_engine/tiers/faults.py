"""Fault injection for the remote tier (tests and demos; off by default).

`kvscope run --fault remote-latency=50ms --fault remote-error-rate=0.1
--fault remote-corrupt-rate=0.05 --fault remote-down-after=5s` parses into one `FaultSpec`
(`remote-latency` delays every operation; `remote-read-latency`, `remote-lookup-latency` and
`remote-write-latency` delay one kind only, e.g. reads slower than their deadline while lookups
stay fast; `remote-concurrency=N` makes the store serve N reads at a time, the others waiting
their turn, as a load path that serialises requests does);
`FaultyRemote` applies it around a raw store, below the resilience layer, so injected faults
travel the same classification, retry and breaker paths as real ones. It exposes only the
batched `read_many`, so reads under injection take the copy path even for a file store (the
in-place `read_into_many` path would bypass corruption).
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from agent.errors import InputError
from instrumented_engine.tiers.format import HEADER_SIZE
from instrumented_engine.tiers.stats import OpStats
from instrumented_engine.tiers.stores import RemoteError, RemoteStore, chain_lookup

_UNITS_S = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}
_DURATION = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(ns|us|ms|s|m)$")
_KEYS = {
    "remote-latency": "latency_s",
    "remote-read-latency": "read_latency_s",
    "remote-lookup-latency": "lookup_latency_s",
    "remote-write-latency": "write_latency_s",
    "remote-error-rate": "error_rate",
    "remote-corrupt-rate": "corrupt_rate",
    "remote-down-after": "down_after_s",
    "remote-concurrency": "read_concurrency",
}


class InjectedFault(RemoteError):
    """A failure made up by `FaultyRemote` (classified like a real backend error)."""


@dataclass(slots=True, frozen=True)
class FaultSpec:
    """Remote faults to inject.

    Attributes:
        latency_s: added before every backend operation (>= 0).
        read_latency_s, lookup_latency_s, write_latency_s: added before operations of that
            kind only, after `latency_s` (>= 0).
        error_rate: probability that an operation fails, in [0, 1].
        corrupt_rate: probability that each object read comes back with a flipped byte, [0, 1].
        down_after_s: every operation fails from this many seconds after start on (None: never).
        read_concurrency: reads served at once (None: no limit); a read beyond it waits for a
            slot, inside its deadline (the injected read latency is served in the slot).
        seed: seeds the RNG so a run's faults repeat exactly.
    """

    latency_s: float = 0.0
    read_latency_s: float = 0.0
    lookup_latency_s: float = 0.0
    write_latency_s: float = 0.0
    error_rate: float = 0.0
    corrupt_rate: float = 0.0
    down_after_s: float | None = None
    read_concurrency: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for flag, v in (("remote-latency", self.latency_s),
                        ("remote-read-latency", self.read_latency_s),
                        ("remote-lookup-latency", self.lookup_latency_s),
                        ("remote-write-latency", self.write_latency_s)):
            if not 0 <= v <= 3600:
                raise InputError(f"--fault {flag} must be 0 to 1 h, got {v:g} s")
        for flag, v in (("remote-error-rate", self.error_rate),
                        ("remote-corrupt-rate", self.corrupt_rate)):
            if not 0.0 <= v <= 1.0:
                raise InputError(f"--fault {flag} must be in [0, 1], got {v}")
        if self.down_after_s is not None and not self.down_after_s >= 0:
            raise InputError(f"--fault remote-down-after must be >= 0, got {self.down_after_s}")
        if self.read_concurrency is not None and not 1 <= self.read_concurrency <= 4096:
            raise InputError(f"--fault remote-concurrency must be 1 to 4096 reads, got "
                             f"{self.read_concurrency}")

    @property
    def active(self) -> bool:
        return bool(self.latency_s or self.read_latency_s or self.lookup_latency_s
                    or self.write_latency_s or self.error_rate or self.corrupt_rate
                    or self.down_after_s is not None or self.read_concurrency is not None)

    def latency_of(self, op: str) -> float:
        """Seconds injected before one operation of kind `op` (lookup, read, write)."""
        extra = {"read": self.read_latency_s, "lookup": self.lookup_latency_s,
                 "write": self.write_latency_s}.get(op, 0.0)
        return self.latency_s + extra


def _duration(flag: str, text: str) -> float:
    m = _DURATION.match(text.strip())
    if m is None:
        raise InputError(f"--fault {flag}={text}: expected a duration like 50ms, 5s, 200us")
    return float(m.group(1)) * _UNITS_S[m.group(2)]


def _rate(flag: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise InputError(f"--fault {flag}={text}: expected a number in [0, 1]") from None


def parse_faults(flags: Sequence[str], seed: int = 0) -> FaultSpec:
    """Parse repeatable `--fault NAME=VALUE` flags (a later flag overrides an earlier one).

    Args:
        flags: e.g. ["remote-latency=50ms", "remote-error-rate=0.1"].
        seed: the RNG seed.

    Raises:
        InputError: an unknown name or a bad value, naming the flag.
    """
    spec = FaultSpec(seed=seed)
    for flag in flags:
        name, sep, value = flag.partition("=")
        name = name.strip()
        if not sep or name not in _KEYS:
            raise InputError(f"--fault {flag!r}: expected NAME=VALUE with NAME one of "
                             f"{', '.join(_KEYS)}")
        parsed: float | int
        if name.endswith("-latency") or name == "remote-down-after":
            parsed = _duration(name, value)
        elif name == "remote-concurrency":
            try:
                parsed = int(value)
            except ValueError:
                raise InputError(f"--fault {flag}: expected a whole number of reads") from None
        else:
            parsed = _rate(name, value)
        spec = replace(spec, **{_KEYS[name]: parsed})
    return spec


class FaultyRemote:
    """A `RemoteStore` that injects `spec`'s faults around `inner`.

    Args:
        inner: the raw store.
        spec: what to inject.
        clock: monotonic seconds (down-after counts from construction).
        sleep: the sleep function for injected latency (injectable for tests).
        recorder: optional agent.telemetry.Recorder: a `fault` event (source `remote`) for each
            injected error and corruption, and once when the store goes down.
    """

    name = "remote"

    def __init__(self, inner: RemoteStore, spec: FaultSpec, *,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, lookup_batch: int = 64,
                 recorder: Any = None) -> None:
        self.inner = inner
        self.spec = spec
        self.clock = clock
        self.sleep = sleep
        self.started = clock()
        self.lookup_batch = lookup_batch
        self.stats = OpStats()
        self.recorder = recorder
        self._down_reported = False
        self._rng = random.Random(spec.seed)
        self._lock = threading.Lock()
        self._slots = (threading.BoundedSemaphore(spec.read_concurrency)
                       if spec.read_concurrency is not None else None)

    def _before(self, op: str) -> None:
        s = self.spec
        if s.down_after_s is not None and self.clock() - self.started >= s.down_after_s:
            self.stats.add("injected_down")
            if not self._down_reported:
                self._down_reported = True
                self._event("down")
            raise InjectedFault("injected: remote down")
        latency = s.latency_of(op)
        if latency:
            self.stats.add("injected_latency")
            self.sleep(latency)
        if s.error_rate:
            with self._lock:
                fail = self._rng.random() < s.error_rate
            if fail:
                self.stats.add("injected_errors")
                self._event("error")
                raise InjectedFault("injected: remote error")

    def _event(self, kind: str) -> None:
        if self.recorder is not None:
            self.recorder.event("fault", source="remote", detail={"kind": kind})

    def exists_many(self, block_hashes: Sequence[bytes]) -> list[bool]:
        self._before("lookup")
        return self.inner.exists_many(block_hashes)

    def lookup(self, block_hashes: Sequence[bytes], start: int = 0) -> int:
        return chain_lookup(self, block_hashes, start, self.lookup_batch)

    def read_many(self, block_hashes: Sequence[bytes]) -> list[bytes | None]:
        if self._slots is None:
            return self._read(block_hashes)
        self.stats.add("injected_queued_reads")
        with self._slots:  # one of N reads in service; the rest queue here
            return self._read(block_hashes)

    def _read(self, block_hashes: Sequence[bytes]) -> list[bytes | None]:
        self._before("read")
        out = self.inner.read_many(block_hashes)
        if not self.spec.corrupt_rate:
            return out
        for i, data in enumerate(out):
            if data is None:
                continue
            with self._lock:
                hit = self._rng.random() < self.spec.corrupt_rate
                pos = self._rng.randrange(min(HEADER_SIZE, len(data) - 1), len(data))
            if hit:
                b = bytearray(data)
                b[pos] ^= 0xFF
                out[i] = bytes(b)
                self.stats.add("injected_corrupt")
                self._event("corrupt")
        return out

    def write(self, block_hash: bytes, data: bytes) -> None:
        self._before("write")
        self.inner.write(block_hash, data)

    def check(self) -> None:
        self.inner.check()

    def close(self) -> None:
        self.inner.close()
