"""Remote read throughput through kvscope vs the raw backend doing the same work.

    .venv/bin/python benchmarks/bench_remote_read.py               # ~1 min
    .venv/bin/python benchmarks/bench_remote_read.py --backend both --reps 9 --layers 2 8

For each backend (a `redis-server` started on a free loopback port, a Mooncake Store — a
`mooncake_master` and one `mooncake_client` holder with a 512 MB segment on free loopback
ports, kvscope a pure client over TCP — and a `file://` store in a temporary directory —
page-cache reads) and each object size (`--layers` 2, 8, 16 with 2 x 16
tokens x 4 KV heads x 128 x bf16: 64, 256 and 512 KiB objects), one iteration loads the same
chain of `--blocks` (64) block objects, written under a remote key (keyed BLAKE3 MAC; `--no-mac`:
unkeyed objects and xxh3, the tier without `--remote-key-file`):

- kvscope: `ResilientRemote.lookup` (the arrival lookup along the chain), then `read_into`
  (each object checked against its key — header, digest, namespace, key id — and its MAC, the
  payload in a preallocated destination block: Redis and files read it there in place, Mooncake
  copies it from the registered buffer `batch_get_into` filled), each operation under the
  deadline/breaker machinery on its worker thread (files: the read of objects whose bytes are
  all in the page cache — preadv2 RWF_NOWAIT, which never waits on the device — runs on the
  calling thread, as the raw read does; the lookup's opens stay on a worker).
- raw, the same work with the backend's own client and no kvscope code: every object's bytes
  into the same destination blocks, its header compared with the one its key must have, its
  MAC (or xxh3) computed over header and payload and compared. Redis: one redis-py `MGET` of
  the chain, then a copy of each value's payload into its block. Files: `open` + `readinto`
  of the header and of the payload into its block. Mooncake: `batch_is_exist`, then
  `batch_get_into` into one registered buffer, then a copy into each block (what kvscope does).
- beside it (not a baseline): the raw read without the checks (Redis: `MGET` alone; files:
  `readinto` alone; Mooncake: `get_batch`), to show what the checks cost.

Throughput counts object bytes. All paths run in every repetition in alternating order; the
ratio is raw time / kvscope time within a repetition (paired; = kvscope throughput / raw
throughput, > 1 means kvscope is faster), and its median is reported with a distribution-free
~95 % confidence interval (benchstats); the verdict uses that median. The ratio of the fastest
repetitions (best-of-reps) is printed beside it, and the load average before each backend.
Goals: >= 1.0x for Redis, >= 0.8x for files, >= 0.7x for Mooncake. `--backend mooncake` needs
kvscope[mooncake] and libibverbs1.
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

import blake3  # noqa: E402
import numpy as np  # noqa: E402
import redis  # noqa: E402
import torch  # noqa: E402
import xxhash  # noqa: E402
from benchstats import load_average, median_ci  # noqa: E402

from instrumented_engine.core.block_hash import hash_block, namespace_digest  # noqa: E402
from instrumented_engine.tiers import format as fmt  # noqa: E402
from instrumented_engine.tiers.remote import ResilienceConfig, ResilientRemote  # noqa: E402
from instrumented_engine.tiers.stores import RemoteStore  # noqa: E402
from instrumented_engine.tiers.stores.file import FileStore  # noqa: E402
from instrumented_engine.tiers.stores.redis import RedisStore  # noqa: E402
from instrumented_engine.tiers.stores.redis import key as redis_key  # noqa: E402

TARGETS = {"redis": 1.0, "file": 0.8, "mooncake": 0.7}
#: The remote key of the MAC runs (any 16+ bytes; the tier derives its MAC key from it).
SECRET = b"kvscope bench_remote_read secret"


class RawCheck:
    """What a raw reader must do with each object to use it safely, written from the format's
    description with no kvscope code: its header equal to the one its key must have (layout,
    key id, digest, namespace: every object of the chain shares all but the digest), and its
    tag — keyed BLAKE3 over the header's first 160 bytes and the payload, or xxh3 unkeyed —
    equal to the stored one."""

    def __init__(self, sample: bytes, mac_key: bytes | None) -> None:
        self.lead, self.tail = sample[:64], sample[96:160]
        self.mac_key = mac_key
        self.size = len(sample)

    def __call__(self, digest: bytes, header: memoryview | bytes, payload: memoryview) -> None:
        if header[:160] != b"".join((self.lead, digest, self.tail)):
            raise AssertionError("object of another key")
        if self.mac_key is not None:
            h = blake3.blake3(header[:160], key=self.mac_key)
            h.update(payload)
            tag = h.digest()
        else:
            x = xxhash.xxh3_64(header[:160])
            x.update(payload)
            tag = x.digest()[::-1] + bytes(24)
        if tag != header[160:192]:
            raise AssertionError("tag mismatch")


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


def run_backend(name: str, store: RemoteStore, raw: Callable[[list[np.ndarray]], int],
                hashes: list[bytes], ns: bytes, layout: fmt.BlockLayout, reps: int,
                key: fmt.ObjectKey | None,
                extra: dict[str, Callable[[list[np.ndarray]], int]] | None = None) -> None:
    print(f"  load average {load_average()}")
    remote = ResilientRemote(store, layout, ResilienceConfig(timeout_s=30.0), key=key)
    dest = torch.empty((len(hashes), *layout.payload_shape), dtype=layout.dtype)
    # (blocks, L, 2, bs, nkv, hd): one preallocated slot per block, passed as byte rows (what
    # HostKVPool.slot_bytes hands out), the cheapest destination form per block; the raw
    # readers fill the same rows.
    dests = list(fmt.byte_view(dest).reshape(len(hashes), -1))
    total = len(hashes) * layout.object_bytes
    fns: dict[str, Callable[[], int]] = {}

    def kvscope() -> int:
        n = remote.lookup(hashes, 0)
        res = remote.read_into(hashes[:n], ns, dests[:n])
        assert res.loaded == len(hashes), res.failed_by_reason()
        return res.nbytes

    fns["kvscope"] = kvscope
    fns["raw"] = lambda: raw(dests)
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
          f"raw time / kvscope time {med:.2f}x (95% CI {lo:.2f}-{hi:.2f}, {reps} paired reps; "
          f"best-of-reps {best:.2f}x)   goal >= {TARGETS[name]}x: {verdict}")
    for label in extra or {}:
        m, a, b = median_ci([x / k for x, k in zip(secs[label], secs["kvscope"], strict=True)])
        print(f"       {label}: {rates[label]:6.2f} GB/s; its time / kvscope time = {m:.2f}x "
              f"(95% CI {a:.2f}-{b:.2f})")


def bench_layout(layout: fmt.BlockLayout, args: argparse.Namespace) -> None:
    """Both backends for one block object size."""
    ns = namespace_digest({"model": "bench"})
    hashes, parent = [], None
    for i in range(args.blocks):
        parent = hash_block(parent, list(range(i * args.block_size, (i + 1) * args.block_size)),
                            ns)
        hashes.append(parent)
    key = None if args.no_mac else fmt.ObjectKey.from_secret(SECRET, "bench")
    g = torch.Generator().manual_seed(0)
    objects = [fmt.encode(layout, h, ns, torch.randn(layout.payload_shape, generator=g)
                          .to(layout.dtype), key) for h in hashes]
    check = RawCheck(objects[0], None if key is None else key.mac_key)
    print(f"\nblock object {layout.object_bytes / 1024:.0f} KiB "
          f"({layout.num_layers} layers x 2 x {layout.block_size} tokens x "
          f"{layout.num_kv_heads} kv heads x {layout.head_dim} x bf16 + "
          f"{fmt.HEADER_SIZE} B header), {args.blocks} blocks = "
          f"{args.blocks * layout.object_bytes / 2**20:.1f} MiB per chain, "
          f"{'unkeyed (xxh3)' if key is None else 'keyed BLAKE3 MAC'}")

    if args.backend in ("redis", "both", "all"):
        proc, port = start_redis()
        try:
            store = RedisStore("127.0.0.1", port, 0, timeout_s=30.0)
            for h, o in zip(hashes, objects, strict=True):
                store.write(h, o)
            client = redis.Redis(port=port)
            keys = [redis_key(h) for h in hashes]

            def raw_redis(dests: list[np.ndarray]) -> int:
                n = 0
                for h, v, d in zip(hashes, client.mget(keys), dests, strict=True):
                    mv = memoryview(v)
                    body = mv[fmt.HEADER_SIZE:]
                    check(h, mv, body)
                    np.copyto(d, np.frombuffer(body, dtype=np.uint8))
                    n += len(v)
                return n

            def raw_mget(_dests: list[np.ndarray]) -> int:
                return sum(len(v) for v in client.mget(keys))

            run_backend("redis", store, raw_redis, hashes, ns, layout, args.reps, key,
                        {"raw MGET alone (no checks, no copy)": raw_mget})
            client.close()
        finally:
            proc.kill()
            proc.wait()

    if args.backend in ("mooncake", "all"):
        bench_mooncake(hashes, objects, ns, layout, args, key, check)

    if args.backend in ("file", "both", "all"):
        with tempfile.TemporaryDirectory(prefix="kvscope-bench-") as tmp:
            fstore = FileStore(tmp)
            for h, o in zip(hashes, objects, strict=True):
                fstore.write(h, o)
            paths = [fstore.path(h) for h in hashes]
            header = bytearray(fmt.HEADER_SIZE)
            hview = memoryview(header)

            def raw_files(dests: list[np.ndarray]) -> int:
                n = 0
                for h, p, d in zip(hashes, paths, dests, strict=True):
                    with open(p, "rb", buffering=0) as f:
                        n += f.readinto(header) + f.readinto(d)
                    check(h, hview, memoryview(d))
                return n

            def raw_into_dest(dests: list[np.ndarray]) -> int:
                n = 0
                for p, d in zip(paths, dests, strict=True):
                    with open(p, "rb", buffering=0) as f:
                        n += f.readinto(header) + f.readinto(d)
                return n

            run_backend("file", fstore, raw_files, hashes, ns, layout, args.reps, key,
                        {"raw readinto alone (no checks)": raw_into_dest})


def bench_mooncake(hashes: list[bytes], objects: list[bytes], ns: bytes,
                   layout: fmt.BlockLayout, args: argparse.Namespace,
                   okey: fmt.ObjectKey | None, check: RawCheck) -> None:
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
        view = memoryview(buf)

        def raw_mooncake(dests: list[np.ndarray]) -> int:
            assert min(client.batch_is_exist(keys)) == 1
            n = sum(client.batch_get_into(keys, ptrs, [size] * len(keys)))
            for i, (h, d) in enumerate(zip(hashes, dests, strict=True)):
                obj = view[i * size:(i + 1) * size]
                check(h, obj, obj[fmt.HEADER_SIZE:])
                np.copyto(d, buf[i * size + fmt.HEADER_SIZE:(i + 1) * size])
            return n

        def raw_get_batch(_dests: list[np.ndarray]) -> int:
            return sum(len(v) for v in client.get_batch(keys))

        # (closes the client: its registered buffers go with it)
        run_backend("mooncake", store, raw_mooncake, hashes, ns, layout, args.reps, okey,
                    {"raw get_batch alone (bytes objects, no checks)": raw_get_batch})
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
    ap.add_argument("--no-mac", action="store_true",
                    help="unkeyed objects (xxh3) instead of a keyed BLAKE3 MAC")
    args = ap.parse_args(argv)
    print(f"load average {load_average()}")
    torch.set_num_threads(1)
    for layers in args.layers:
        bench_layout(fmt.BlockLayout(layers, args.block_size, args.kv_heads, args.head_dim,
                                     torch.bfloat16), args)
    print(f"\nload average {load_average()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
