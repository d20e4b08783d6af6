"""Remote read throughput through kvscope vs the raw backend reading the same bytes.

    .venv/bin/python benchmarks/bench_remote_read.py               # ~1 min
    .venv/bin/python benchmarks/bench_remote_read.py --reps 5 --blocks 32

For each backend (a `redis-server` started on a free loopback port, a Mooncake Store — a
`mooncake_master` and one `mooncake_client` holder with a 512 MB segment on free loopback
ports, kvscope a pure client over TCP — and a `file://` store in a temporary directory —
page-cache reads) and each object size (`--layers` 2, 8, 16 with 2 x 16
tokens x 4 KV heads x 128 x bf16: 64, 256 and 512 KiB objects), one iteration loads the same
chain of `--blocks` (64) block objects:

- kvscope: `ResilientRemote.lookup` (batched existence along the chain), `read_into` (batched
  read, header validation, xxh3 checksum, the payload into a preallocated destination block
  tensor: Redis copies from the MGET reply, Mooncake copies from its registered read buffer
  that `batch_get_into` filled, files readv straight into the block), all through the
  timeout/breaker machinery and its worker thread.
- raw: redis-py `MGET` of the same keys in one call; Mooncake's own client, `batch_is_exist`
  then `batch_get_into` of the same keys into one registered buffer (its fastest read, and
  the same round trips kvscope makes); plain `open().read()` of each file (the bytes are
  dropped at once, so the reads land in one cache-hot buffer that malloc reuses).
- files also: plain `readinto` of each file into the same destination blocks (no lookup, no
  checks, no thread): what any reader that keeps the bytes pays; kvscope / it isolates
  kvscope's own cost (lookup, header, checksum, worker thread) from the memory traffic.

Throughput counts object bytes. Both paths run in every repetition in alternating order; the
ratio kvscope/raw is taken within a repetition (paired), and medians are reported with a
distribution-free ~95 % confidence interval; the verdict uses that median. The ratio of the
fastest repetitions (best-of-reps) is printed beside it: on a shared machine it shows what the
paths cost when neither waited for a core. Targets: >= 0.7x for Redis and Mooncake, >= 0.5x
for files. `--backend mooncake` needs kvscope[mooncake] and libibverbs1.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a source checkout without installing
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import redis  # noqa: E402
import torch  # noqa: E402
from benchstats import median_ci  # noqa: E402

from instrumented_engine.core.block_hash import hash_block, namespace_digest  # noqa: E402
from instrumented_engine.tiers import format as fmt  # noqa: E402
from instrumented_engine.tiers.remote import ResilienceConfig, ResilientRemote  # noqa: E402
from instrumented_engine.tiers.stores import RemoteStore  # noqa: E402
from instrumented_engine.tiers.stores.file import FileStore  # noqa: E402
from instrumented_engine.tiers.stores.redis import RedisStore, key  # noqa: E402

TARGETS = {"redis": 0.7, "file": 0.5, "mooncake": 0.7}


def start_redis() -> tuple[subprocess.Popen[bytes], int]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server not installed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(500):
        try:
            client.ping()
            return proc, port
        except redis.exceptions.ConnectionError:
            time.sleep(0.01)
    proc.kill()
    raise SystemExit("redis-server did not start")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_mooncake(segment: str = "512MB") -> tuple[list[subprocess.Popen[bytes]], str]:
    """A master and one holder on loopback; returns them and the `mooncake://` URL."""
    import urllib.request

    import mooncake

    folder = Path(mooncake.__file__).parent
    rpc, metrics, holder = free_port(), free_port(), free_port()
    env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    procs = [subprocess.Popen(
        [str(folder / "mooncake_master"), f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
         "--metrics_host=127.0.0.1", f"--metrics_port={metrics}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)]
    url = f"http://127.0.0.1:{metrics}/metrics"

    def capacity() -> float:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                for line in r.read().decode().splitlines():
                    if line.startswith("master_total_capacity_bytes "):
                        return float(line.split()[1])
        except OSError:
            pass
        return -1.0

    for i in range(1000):
        c = capacity()
        if c >= 0 and len(procs) == 1:
            procs.append(subprocess.Popen(
                [str(folder / "mooncake_client"), f"--master_server_address=127.0.0.1:{rpc}",
                 "--metadata_server=P2PHANDSHAKE", f"--global_segment_size={segment}",
                 "--host=127.0.0.1", f"--port={holder}", "--protocol=tcp"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env))
        if c > 0:
            return procs, f"mooncake://127.0.0.1:{rpc}?metrics={url}"
        if i == 999 or any(p.poll() is not None for p in procs):
            break
        time.sleep(0.01)
    for p in procs:
        p.kill()
    raise SystemExit("mooncake master/holder did not start")


def run_backend(name: str, store: RemoteStore, raw: Callable[[], int], hashes: list[bytes],
                ns: bytes, layout: fmt.BlockLayout, reps: int,
                extra: dict[str, Callable[[list[np.ndarray]], int]] | None = None) -> None:
    remote = ResilientRemote(store, layout, ResilienceConfig(timeout_s=30.0))
    dest = torch.empty((len(hashes), *layout.payload_shape), dtype=layout.dtype)
    # (blocks, L, 2, bs, nkv, hd): one preallocated slot per block, passed as byte rows (what
    # HostKVPool.slot_bytes hands out), the cheapest destination form per block.
    dests = list(fmt.byte_view(dest).reshape(len(hashes), -1))
    total = len(hashes) * layout.object_bytes
    fns: dict[str, Callable[[], int]] = {}

    def kvscope() -> int:
        n = remote.lookup(hashes, 0)
        res = remote.read_into(hashes[:n], ns, dests[:n])
        assert res.loaded == len(hashes), res.failed_by_reason()
        return res.nbytes

    fns["kvscope"] = kvscope
    fns["raw"] = raw
    for label, fn in (extra or {}).items():
        fns[label] = lambda fn=fn: fn(dests)
    for fn in fns.values():  # warm-up: connections, page cache, allocator
        assert fn() == total
    secs: dict[str, list[float]] = {k: [] for k in fns}
    for rep in range(reps):
        order = list(fns.items())
        if rep % 2:
            order.reverse()
        for label, fn in order:
            t0 = time.perf_counter()
            n = fn()
            secs[label].append(time.perf_counter() - t0)
            assert n == total
    remote.close()
    rates = {k: statistics.median(total / x / 1e9 for x in v) for k, v in secs.items()}
    med, lo, hi = median_ci([r / k for r, k in zip(secs["raw"], secs["kvscope"], strict=True)])
    verdict = "PASS" if med >= TARGETS[name] else "BELOW TARGET"
    best = min(secs["raw"]) / min(secs["kvscope"])
    print(f"{name:5s}  kvscope {rates['kvscope']:6.2f} GB/s   raw {rates['raw']:6.2f} GB/s   "
          f"ratio {med:.2f}x (95% CI {lo:.2f}-{hi:.2f}, {reps} paired reps; best-of-reps "
          f"{best:.2f}x)   target >= {TARGETS[name]}x: {verdict}")
    for label in extra or {}:
        m, a, b = median_ci([x / k for x, k in zip(secs[label], secs["kvscope"], strict=True)])
        print(f"       {label}: {rates[label]:6.2f} GB/s; kvscope / it = {m:.2f}x "
              f"(95% CI {a:.2f}-{b:.2f})")


def bench_layout(layout: fmt.BlockLayout, args: argparse.Namespace) -> None:
    """Both backends for one block object size."""
    ns = namespace_digest({"model": "bench"})
    hashes, parent = [], None
    for i in range(args.blocks):
        parent = hash_block(parent, list(range(i * args.block_size, (i + 1) * args.block_size)),
                            ns)
        hashes.append(parent)
    g = torch.Generator().manual_seed(0)
    objects = [fmt.encode(layout, h, ns, torch.randn(layout.payload_shape, generator=g)
                          .to(layout.dtype)) for h in hashes]
    print(f"\nblock object {layout.object_bytes / 1024:.0f} KiB "
          f"({layout.num_layers} layers x 2 x {layout.block_size} tokens x "
          f"{layout.num_kv_heads} kv heads x {layout.head_dim} x bf16 + "
          f"{fmt.HEADER_SIZE} B header), {args.blocks} blocks = "
          f"{args.blocks * layout.object_bytes / 2**20:.1f} MiB per chain")

    if args.backend in ("redis", "both", "all"):
        proc, port = start_redis()
        try:
            store = RedisStore("127.0.0.1", port, 0, timeout_s=30.0)
            for h, o in zip(hashes, objects, strict=True):
                store.write(h, o)
            client = redis.Redis(port=port)
            keys = [key(h) for h in hashes]

            def raw_redis() -> int:
                return sum(len(v) for v in client.mget(keys))

            run_backend("redis", store, raw_redis, hashes, ns, layout, args.reps)
            client.close()
        finally:
            proc.kill()
            proc.wait()

    if args.backend in ("mooncake", "all"):
        bench_mooncake(hashes, objects, ns, layout, args)

    if args.backend in ("file", "both", "all"):
        with tempfile.TemporaryDirectory(prefix="kvscope-bench-") as tmp:
            fstore = FileStore(tmp)
            for h, o in zip(hashes, objects, strict=True):
                fstore.write(h, o)
            paths = [fstore.path(h) for h in hashes]

            def raw_files() -> int:
                n = 0
                for p in paths:
                    with open(p, "rb") as f:
                        n += len(f.read())
                return n

            header = bytearray(fmt.HEADER_SIZE)

            def raw_into_dest(dests: list[np.ndarray]) -> int:
                # Plain reads that keep the bytes: straight into the same destination blocks,
                # with no lookup, no checks and no worker thread.
                n = 0
                for p, d in zip(paths, dests, strict=True):
                    with open(p, "rb", buffering=0) as f:
                        n += f.readinto(header) + f.readinto(d)
                return n

            run_backend("file", fstore, raw_files, hashes, ns, layout, args.reps,
                        {"raw readinto the same destination": raw_into_dest})


def bench_mooncake(hashes: list[bytes], objects: list[bytes], ns: bytes,
                   layout: fmt.BlockLayout, args: argparse.Namespace) -> None:
    from instrumented_engine.tiers.stores.mooncake import MooncakeStore, key, parse_url

    procs, url = start_mooncake()
    try:
        store = MooncakeStore(parse_url(url), timeout_s=30.0)
        for h, o in zip(hashes, objects, strict=True):
            store.write(h, o)
        client = store.client  # the raw client: the same connection, its own buffer
        keys = [key(h) for h in hashes]
        size = layout.object_bytes
        buf = np.empty(len(keys) * size, dtype=np.uint8)
        assert client.register_buffer(buf.ctypes.data, buf.size) == 0
        ptrs = [buf.ctypes.data + i * size for i in range(len(keys))]

        def raw_mooncake() -> int:
            assert min(client.batch_is_exist(keys)) == 1
            return sum(client.batch_get_into(keys, ptrs, [size] * len(keys)))

        def raw_get_batch(_dests: list[np.ndarray]) -> int:
            return sum(len(v) for v in client.get_batch(keys))

        # (closes the client: its registered buffers go with it)
        run_backend("mooncake", store, raw_mooncake, hashes, ns, layout, args.reps,
                    {"raw get_batch (bytes objects)": raw_get_batch})
    finally:
        for p in procs:
            p.kill()
            p.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--blocks", type=int, default=64, help="blocks per chain")
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8, 16],
                    help="one object size per value (default: 64, 256, 512 KiB objects)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--backend", choices=("redis", "file", "mooncake", "both", "all"),
                    default="all", help="both: redis and file; all: the three")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    for layers in args.layers:
        bench_layout(fmt.BlockLayout(layers, args.block_size, args.kv_heads, args.head_dim,
                                     torch.bfloat16), args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
