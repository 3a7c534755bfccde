#!/usr/bin/env python3
"""Read bandwidth against the buffer footprint: aiokv's io_uring backend alone
(no aiokv code above it: no verification, no index, no per-block Python)
reading one file into K distinct huge-page staging slots, next to fio on the
same file, same block size, same depth.

    PYTHONPATH=. .venv/bin/python tools/bench_footprint.py [--mib 384] [--size 256K] [--depth 16]
        [--footprints 16,64,256,all] [--rounds 3] [--dir PATH] [--json]

Why: fio reads into its `iodepth` buffers again and again (a few MiB, hot in
the caches), aiokv into staging slots that each hold a block until it is
copied into the KV cache (tools/bench_store.py gives every block its own slot,
as a large load does). On a virtual disk the device's "DMA" is a copy made by
the host, and its speed depends on where it writes. This tool separates that
effect from aiokv's own code: same backend, footprints from fio's (16 slots)
to one slot per block ("all").

Per round, interleaved: fio (io_uring, direct=1, bs = block, iodepth = depth,
huge-page buffers where nr_hugepages can be raised) writes the file and reads
it; then the backend reads it once per footprint (slot i of the read goes to
buffer i mod K; buffers are touched before, so no page faults are timed).
Medians of the rounds.
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_store as bs  # noqa: E402

from aiokv.io.backend import OP_READ, open_backend  # noqa: E402
from aiokv.io.buffers import Arena  # noqa: E402


async def backend_read(path: str, block: int, n: int, depth: int, footprint: int) -> float:
    """GB/s of one read of the n-block file into `footprint` buffers used in turn."""
    arena = Arena(footprint * block)
    ctypes.memset(arena.addr, 0x5A, footprint * block)  # touched: no page faults in the timing
    be = open_backend(asyncio.get_running_loop(), "uring", depth=depth)
    if hasattr(be, "min_bytes"):
        be.min_bytes = 0  # exactly `depth` operations in flight, as fio's iodepth
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        ops = [(OP_READ, fd, arena.addr + (i % footprint) * block, block, i * block) for i in range(n)]
        t = time.perf_counter()
        res = await be.run(ops)
        dt = time.perf_counter() - t
        if any(r != block for r in res):
            raise RuntimeError(f"short or failed reads: {set(res)}")
        return n * block / dt / 1e9
    finally:
        be.close()
        os.close(fd)
        arena.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=384)
    ap.add_argument("--size", default="256K", help="block size (the slot: payload + 4 KiB in aiokv)")
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--footprints", default="16,64,256,all", help="buffers read into, in turn ('all': one per block)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    block = bs.parse_size(args.size) + 4096
    n = (args.mib << 20) // block
    fps = [n if f == "all" else int(f) for f in args.footprints.split(",") if f]
    base = args.dir or tempfile.mkdtemp(prefix="aiokv-footprint-")
    os.makedirs(base, exist_ok=True)
    path = os.path.join(base, "fio.dat")
    rounds: dict[str, list[float]] = {"fio": [], **{f"backend_{k}": [] for k in fps}}
    try:
        with bs.HugePages(-(-args.depth * block // bs.HUGE) + 4) as hp:
            mem = "mmaphuge" if hp.ok else "malloc"
            for _ in range(args.rounds):
                rounds["fio"].append(bs.fio_round(path, block, n, args.depth, mem)["read_gbps"])
                with open(path, "wb") as f:  # fio_round removed it after its run: write it again, once
                    chunk = os.urandom(1 << 20)
                    for _ in range(-(-n * block // len(chunk))):
                        f.write(chunk)
                    f.flush()
                    os.fsync(f.fileno())
                for k in fps:
                    import uvloop

                    rounds[f"backend_{k}"].append(uvloop.run(backend_read(path, block, n, args.depth, k)))
                os.unlink(path)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in rounds.items()}
    doc = {"block_bytes": block, "blocks": n, "depth": args.depth, "fio_mem": mem, "rounds": rounds, "median": med,
           "machine": bs.machine(tempfile.gettempdir())}

    def render(d: dict) -> str:
        lines = [f"read GB/s, block {d['block_bytes'] >> 10} KiB, depth {d['depth']}, {d['blocks']} blocks, "
                 f"median of {args.rounds} rounds (fio buffers: {d['fio_mem']})", "",
                 "| reader | buffers | GB/s | vs fio |", "|---|---|---|---|",
                 f"| fio | {d['depth']} (its iodepth) | {d['median']['fio']:.2f} | 1.00 |"]
        for k in fps:
            v = d["median"][f"backend_{k}"]
            lines.append(f"| aiokv backend alone | {k}{' (one per block)' if k == n else ''} | {v:.2f} | "
                         f"{v / d['median']['fio']:.2f} |")
        return "\n".join(lines)

    return bs.emit(doc, args, render)


if __name__ == "__main__":
    raise SystemExit(main())
