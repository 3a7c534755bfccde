#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""What a `secret` costs: aiokv's data path with and without the slot MAC, side by side.

    PYTHONPATH=. .venv/bin/python tools/bench_mac.py [--sizes 256K,1M,2M] [--depth 32] [--mib 256]
        [--threads 0,2] [--rounds 3] [--dir PATH] [--json] [--out FILE]

For each payload size, checksum-thread count (0: every check on the loop thread, the
CPU build's default; 2: the CUDA default) and CRC mode, a round runs these
contenders one after another on one directory, the order alternating between
rounds, medians of the rounds reported:
- plain / secret: BlockIO (aiokv/data/blockio.py, what each vLLM worker uses) writes
  N slots in one call (headers stamped: CRC32C, and with the secret the keyed
  BLAKE3 MAC), then reads and checks them in one call, `depth` operations in
  io_uring, O_DIRECT, on the real file system;
- the same two again over a backend that completes every operation at once (null
  I/O): the CPU's ceiling for that path, no disk.
CRC modes: "copy" is the CPU build's path (the payload CRC32C is computed by the
device copy, so without a secret the stamp and check read no payload: the
hardest case for the MAC, which must read it); "pass" is the CUDA path (a CRC32C
pass in the stamp and check, which the MAC then shares or replaces).
GB/s are slot bytes moved per second (GB = 1e9); CPU is process CPU seconds per GB.
Also one core's rate over one payload, in cache and not: CRC32C, the native keyed
BLAKE3 MAC, and Python's keyed BLAKE2b (the MAC before it was native).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import ctypes
import hashlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aiokv import _native  # noqa: E402
from aiokv.config import parse_size  # noqa: E402
from aiokv.data import format as fmt  # noqa: E402
from aiokv.data.blockio import BlockIO  # noqa: E402
from aiokv.data.buffers import BufferPool  # noqa: E402
from aiokv.data.choice import open_backend  # noqa: E402
from tools.bench_store import NullBackend  # noqa: E402

NSID = bytes.fromhex("3ac0" * 8)
SECRET = "bench-secret-0123456789"


async def _round(
    root: str,
    pool: BufferPool,
    payload: int,
    n: int,
    depth: int,
    secret,
    threads: int,
    crc_in_copy: bool,
    null_io: bool,
) -> dict:
    shutil.rmtree(root, ignore_errors=True)
    d = os.path.join(root, "ns", NSID.hex())
    os.makedirs(d)
    loop = asyncio.get_running_loop()
    backend = NullBackend(loop) if null_io else open_backend(loop, depth=depth)
    if hasattr(backend, "min_bytes"):
        backend.min_bytes = 0  # exactly `depth` operations in flight
    cpu = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="aiokv-crc") if threads else None
    io = BlockIO(backend, d, NSID, 0, payload, secret=secret, cpu=cpu)
    keys = [i.to_bytes(16, "little") * 2 for i in range(n)]
    items = [(i, keys[i], pool.addr(i)) for i in range(n)]
    try:
        if crc_in_copy:  # what the device copy leaves in each header: its payload's CRC32C
            for _, _, a in items:
                ctypes.memmove(a + 36, _native.crc32c(a + fmt.HEADER_BYTES, payload).to_bytes(4, "little"), 4)
        out = {}
        for name, call in (("write", io.write), ("read", io.read)):
            p0, t0 = time.process_time(), time.perf_counter()
            res = await call(items, crc_in_copy=crc_in_copy)
            dt, cpu_s = time.perf_counter() - t0, time.process_time() - p0
            if any(res):
                raise RuntimeError(f"bench_mac: {name} failed: {sorted(set(res))}")
            nbytes = n * fmt.slot_bytes(payload)
            out[f"{name}_gbps"], out[f"{name}_cpu_s_per_gb"] = nbytes / dt / 1e9, cpu_s / (nbytes / 1e9)
        return out
    finally:
        io.close()
        backend.close()
        if cpu:
            cpu.shutdown()
        shutil.rmtree(root, ignore_errors=True)


def core_rates(payload: int) -> dict:
    """One core, one payload: GB/s of CRC32C, the native MAC and Python's keyed BLAKE2b."""
    out = {}
    for where, nbuf in (("in_cache", 1), ("from_memory", max(1, (512 << 20) // payload))):
        bufs = [os.urandom(payload) for _ in range(min(nbuf, 8))] if nbuf == 1 else None
        big = bytearray(payload * nbuf) if bufs is None else None
        views = bufs or [memoryview(big)[i * payload : (i + 1) * payload] for i in range(nbuf)]
        k = fmt.mac_key(SECRET)
        for name, fn in (
            ("crc32c", _native.crc32c_bytes),
            ("mac_blake3", lambda b, k=k: _native.blake3_keyed(k, b)),
            ("python_blake2b", lambda b, k=k: hashlib.blake2b(b, key=k, digest_size=32).digest()),
        ):
            reps = max(len(views), (256 << 20) // payload)
            t0 = time.perf_counter()
            for i in range(reps):
                fn(views[i % len(views)])
            out[f"{name}_{where}_gbps"] = reps * payload / (time.perf_counter() - t0) / 1e9
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="256K,1M,2M")
    ap.add_argument("--depth", type=int, default=32)
    ap.add_argument("--mib", type=int, default=256, help="MiB written and read per contender and round")
    ap.add_argument("--threads", default="0,2", help="checksum-thread counts, comma separated")
    ap.add_argument("--modes", default="copy,pass", help="CRC modes: copy (CPU build), pass (CUDA)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="aiokv-bench-mac-", dir=args.dir)
    doc = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "loadavg_start": os.getloadavg(),
        },
        "depth": args.depth,
        "rounds": args.rounds,
        "rows": [],
    }
    import uvloop

    try:
        for size in [parse_size(s) for s in args.sizes.split(",")]:
            n = max(8, (args.mib << 20) // fmt.slot_bytes(size))
            pool = BufferPool(fmt.slot_bytes(size), n)
            pool.acquire(n)
            rand = os.urandom(size)
            for i in range(n):
                ctypes.memmove(pool.addr(i) + fmt.HEADER_BYTES, rand, size)
            try:
                for threads in [int(t) for t in args.threads.split(",")]:
                    for mode in args.modes.split(","):
                        for null_io in (False, True):
                            got = {"plain": [], "secret": []}
                            for r in range(args.rounds):
                                order = ("plain", "secret") if r % 2 == 0 else ("secret", "plain")
                                for who in order:
                                    got[who].append(
                                        uvloop.run(
                                            _round(
                                                os.path.join(base, "d"),
                                                pool,
                                                size,
                                                n,
                                                args.depth,
                                                SECRET if who == "secret" else None,
                                                threads,
                                                mode == "copy",
                                                null_io,
                                            )
                                        )
                                    )
                            row = {
                                "payload": size,
                                "threads": threads,
                                "crc": mode,
                                "io": "null" if null_io else "disk",
                            }
                            for who, rs in got.items():
                                for k in rs[0]:
                                    row[f"{who}_{k}"] = statistics.median(x[k] for x in rs)
                            for d in ("write", "read"):
                                row[f"{d}_ratio"] = row[f"secret_{d}_gbps"] / row[f"plain_{d}_gbps"]
                            doc["rows"].append(row)
                            if not args.json:
                                print(
                                    f"{size >> 10:>5} KiB t={threads} crc={mode:<4} {row['io']:<4} "
                                    f"write {row['plain_write_gbps']:6.2f} -> {row['secret_write_gbps']:6.2f} GB/s "
                                    f"({row['write_ratio']:.2f})  read {row['plain_read_gbps']:6.2f} -> "
                                    f"{row['secret_read_gbps']:6.2f} GB/s ({row['read_ratio']:.2f})",
                                    flush=True,
                                )
                doc.setdefault("core", {})[size] = core_rates(size)
            finally:
                pool.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    doc["machine"]["loadavg_end"] = os.getloadavg()
    text = json.dumps(doc, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.json:
        print(text)
    else:
        print(json.dumps(doc["core"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
