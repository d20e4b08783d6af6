"""A real Mooncake Store on loopback for the tier tests: a master and one holder of the bytes
(`mooncake_client` with a global segment), on free ports, stopped at teardown.

Skips when the package (kvscope[mooncake]) or the libibverbs library it links is missing; with
KVSCOPE_REQUIRE_SERVICES=1 (.ci/run) it fails instead, so CI never passes by skipping.
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import free_port

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")


def mooncake_bin() -> Path:
    """The package's folder of binaries; skips (fails under CI) when it cannot be used."""
    try:
        import mooncake as pkg
        import mooncake.store  # links libibverbs: the real availability check
    except ImportError as e:
        if os.environ.get("KVSCOPE_REQUIRE_SERVICES"):
            pytest.fail(f"mooncake is required in CI but cannot be imported: {e}")
        pytest.skip(f"mooncake not usable (pip install 'kvscope[mooncake]', apt-get install "
                    f"libibverbs1): {e}")
    folder = Path(pkg.__file__).parent
    for b in ("mooncake_master", "mooncake_client"):
        if not os.access(folder / b, os.X_OK):
            pytest.fail(f"{folder / b} is missing or not executable")
    return folder


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


@dataclass
class MooncakeCluster:
    """One master and one holder on 127.0.0.1.

    Attributes:
        segment: the holder's global segment size (Mooncake's syntax, e.g. 64MB).
        master_flags: extra master flags (e.g. a short --client_ttl for holder-loss tests).
    """

    bindir: Path
    logdir: Path
    segment: str = "64MB"
    master_flags: tuple[str, ...] = ()
    rpc_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    holder_port: int = field(default_factory=free_port)
    master: subprocess.Popen[bytes] | None = None
    holder: subprocess.Popen[bytes] | None = None
    _starts: int = 0

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def url(self) -> str:
        return f"mooncake://{self.master_address}?metrics={self.metrics_url}"

    def metrics(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=2) as r:
            return str(r.read().decode())

    def metric(self, name: str) -> float | None:
        return _metric(self.metrics(), name)

    def _popen(self, what: str, args: list[str]) -> subprocess.Popen[bytes]:
        self._starts += 1
        log = open(self.logdir / f"{what}.{self._starts}.log", "wb")  # noqa: SIM115 - child's
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
        try:
            return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        finally:
            log.close()

    def start_master(self) -> None:
        self.master = self._popen("master", [
            str(self.bindir / "mooncake_master"), f"--rpc_port={self.rpc_port}",
            "--rpc_address=127.0.0.1", "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics_port}", "--logtostderr", *self.master_flags])
        self._wait(lambda: self.metric("master_key_count") is not None, self.master, "master")

    def start_holder(self) -> None:
        self.holder = self._popen("holder", [
            str(self.bindir / "mooncake_client"), f"--master_server_address={self.master_address}",
            "--metadata_server=P2PHANDSHAKE", f"--global_segment_size={self.segment}",
            "--host=127.0.0.1", f"--port={self.holder_port}", "--protocol=tcp"])
        self.wait_mounted()

    def wait_mounted(self) -> None:
        """Until the master sees the holder's segment."""
        self._wait(lambda: (self.metric("master_total_capacity_bytes") or 0) > 0, self.holder,
                   "holder")

    def _wait(self, ready: object, proc: subprocess.Popen[bytes] | None, what: str) -> None:
        deadline = time.monotonic() + 15
        while True:
            try:
                if ready():  # type: ignore[operator]
                    return
            except OSError:
                pass
            if proc is None or proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"mooncake {what} did not start (logs in {self.logdir})")
            time.sleep(0.02)

    def kill_master(self) -> None:
        _kill(self.master)

    def kill_holder(self) -> None:
        _kill(self.holder)

    def restart_master(self) -> None:
        """A fresh master on the same ports (empty: the index lived in the old one); the
        holder mounts its segment again by itself."""
        self.kill_master()
        self.start_master()
        self.wait_mounted()

    def stop(self) -> None:
        _kill(self.holder)
        _kill(self.master)


def _kill(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


def start_cluster(tmp_path: Path, segment: str = "64MB",
                  master_flags: tuple[str, ...] = ()) -> MooncakeCluster:
    logdir = tmp_path / "mooncake-logs"
    logdir.mkdir(exist_ok=True)
    c = MooncakeCluster(mooncake_bin(), logdir, segment, master_flags)
    c.start_master()
    c.start_holder()
    return c


@pytest.fixture(name="mooncake")
def mooncake_fixture(tmp_path: Path) -> Iterator[MooncakeCluster]:
    """A master and a 64 MB holder on free loopback ports; stopped at teardown."""
    c = start_cluster(tmp_path)
    try:
        yield c
    finally:
        c.stop()
