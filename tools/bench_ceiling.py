#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""How many GB/s one worker's event loop can move when the disk is not the limit,
with the checksums on the loop thread (checksum_threads 0) and on 1 or 2 threads.

    PYTHONPATH=. .venv/bin/python tools/bench_ceiling.py [--gib 1] [--sizes 256K,1M,2M]
        [--threads 0,1,2] [--depth 32] [--rounds 3] [--json]

A GPU node's NVMe drives deliver 25-50 GB/s; this machine's virtual disk about 3,
so the disk hides any ceiling aiokv's own CPU work sets. Here the disk is taken
away: BlockIO (the worker's data path: stamp + write, read + verify, pipelined in
chunks of depth/4 blocks, as TransferWorker drives it) over a backend that
completes every operation at once (bench_store.NullBackend), on uvloop. Every
byte is cold: --gib of slots, written once per pass (the payload CRC reads each
payload from memory, as it would after the device's DMA or the disk's).

Per size and thread count, medians of --rounds: wall GB/s of payload per
direction, process CPU core-s per GB (every thread), and the loop thread's own
CPU core-s per GB (time.thread_time on the loop). The wall GB/s is the ceiling
of one worker: with 0 threads the loop's CPU is the bound; with threads, the
loop only submits and reaps while the threads checksum.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import uvloop  # noqa: E402

from aiokv.config import parse_size  # noqa: E402
from aiokv.data import format as fmt  # noqa: E402
from aiokv.data.blockio import BlockIO  # noqa: E402
from aiokv.data.buffers import BufferPool  # noqa: E402
from aiokv.store.store import ns_dir  # noqa: E402
from tools import bench_store as bs  # noqa: E402
from tools import harness  # noqa: E402


async def one_pass(io: BlockIO, pool: BufferPool, n: int, salt: int) -> dict:
    payload = io.payload_bytes
    keys = bs._keys(n, salt)
    items = [(i, keys[i], pool.addr(i)) for i in range(n)]
    for i in range(n):  # new bytes each pass (and out of the caches by the time they are stamped)
        ctypes.memset(pool.addr(i) + fmt.HEADER_BYTES, (salt * 31 + i) % 251, payload)
    out = {}
    for name, call in (("write", io.write), ("read", io.read)):
        c0, l0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
        res = await call(items)
        t1, l1, c1 = time.perf_counter(), time.thread_time(), time.process_time()
        if any(res):
            raise RuntimeError(f"{name}: {sum(1 for r in res if r)} blocks failed")
        gb = n * payload / 1e9
        out[name] = {"gbps": gb / (t1 - t0), "cpu_s_per_gb": (c1 - c0) / gb, "loop_s_per_gb": (l1 - l0) / gb}
    return out


async def measure(size: int, threads: int, depth: int, gib: float, rounds: int, root: str) -> dict:
    slot = fmt.slot_bytes(size)
    n = max(8, int(gib * (1 << 30)) // slot)
    pool = BufferPool(slot, n, populate=True)
    backend = bs.NullBackend(asyncio.get_running_loop())
    backend.depth = depth  # BlockIO's chunk: depth / 4 blocks per batch, as on io_uring
    cpu = concurrent.futures.ThreadPoolExecutor(threads, "crc") if threads else None
    os.makedirs(ns_dir(root, bs.NSID), exist_ok=True)  # the data file is opened, never written
    io = BlockIO(backend, ns_dir(root, bs.NSID), bs.NSID, 0, size, cpu=cpu)
    runs = [await one_pass(io, pool, n, salt) for salt in range(rounds)]
    if cpu is not None:
        cpu.shutdown()
    pool.close()
    return {d: harness.medians([r[d] for r in runs]) for d in ("write", "read")}


def main() -> int:
    ap = harness.parser(__doc__, rounds=3)
    ap.add_argument("--gib", type=float, default=1.0, help="GiB of slots per pass")
    ap.add_argument("--sizes", default="256K,1M,2M")
    ap.add_argument("--threads", default="0,1,2")
    ap.add_argument("--depth", type=int, default=32)
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    root = tempfile.mkdtemp(prefix="aiokv-ceiling-")
    results = []
    try:
        for size in sizes:
            for t in threads:
                r = uvloop.run(measure(size, t, args.depth, args.gib, args.rounds, root))
                results.append({"payload": size, "threads": t, **r})
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    doc = harness.document(cpus=os.cpu_count(), depth=args.depth, rounds=args.rounds, results=results)
    return harness.emit(doc, args, render)


def render(doc: dict) -> str:
    lines = [
        f"one worker's ceiling, null I/O, depth {doc['depth']}, {doc['cpus']} CPUs, medians of {doc['rounds']}",
        "| payload | checksum threads | write GB/s | read GB/s | CPU s/GB W/R | loop thread s/GB W/R |",
        "|---|---|---|---|---|---|",
    ]
    for r in doc["results"]:
        w, rd = r["write"], r["read"]
        lines.append(
            f"| {r['payload'] >> 10} KiB | {r['threads']} | {w['gbps']:.1f} | {rd['gbps']:.1f} | "
            f"{w['cpu_s_per_gb']:.3f} / {rd['cpu_s_per_gb']:.3f} | {w['loop_s_per_gb']:.3f} / {rd['loop_s_per_gb']:.3f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
