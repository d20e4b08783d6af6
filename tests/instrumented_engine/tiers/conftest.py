"""Fixtures for the tier tests: a small block layout, payloads, and a real redis-server."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis
import torch

from instrumented_engine.core.block_hash import hash_block, namespace_digest
from instrumented_engine.tiers.format import BlockLayout
from tests.conftest import free_port, require_binary

NS = namespace_digest({"model": "tiny", "revision": "1", "dtype": "bfloat16"})


@pytest.fixture
def layout() -> BlockLayout:
    return BlockLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8,
                       dtype=torch.bfloat16)


def chain(n: int, ns: bytes = NS, seed: int = 0) -> list[bytes]:
    """`n` chained block digests of made-up tokens (block size 4)."""
    out: list[bytes] = []
    parent = None
    for i in range(n):
        parent = hash_block(parent, [seed, i, i + 1, i + 2], ns)
        out.append(parent)
    return out


def payload(layout: BlockLayout, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.payload_shape, generator=g).to(layout.dtype)


@dataclass
class RedisServer:
    proc: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)

    def wait_ready(self) -> None:
        """Poll PING until the server answers (fails the test after 10 s or if it exited)."""
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client().ping()
                return
            except redis.exceptions.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.kill()
                    pytest.fail(f"redis-server did not start on port {self.port}")
                time.sleep(0.02)

    def restart(self) -> None:
        """Start a fresh (empty) server on the same port after `kill`."""
        self.proc = subprocess.Popen(self.proc.args, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        self.wait_ready()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A redis-server on a free loopback port, no persistence; stopped at teardown."""
    binary = require_binary("redis-server")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = RedisServer(proc, port)
    server.wait_ready()
    try:
        yield server
    finally:
        server.kill()
