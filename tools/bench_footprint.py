#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Read bandwidth against the buffer footprint: aiokv's io_uring backend alone
(no aiokv code above it: no verification, no index, no per-block Python)
reading one file into K distinct huge-page staging buffers, next to fio on the
same file, same block size, same depth.

    PYTHONPATH=. .venv/bin/python tools/bench_footprint.py [--mib 384] [--size 256K] [--depth 16]
        [--footprints 16,64,256,all] [--op read|write] [--groups 2,0] [--merge-control] [--rounds 3]
        [--dir PATH] [--json]

Why: fio reads into its `iodepth` buffers again and again (a few MiB, hot in
the caches), aiokv into staging buffers that each hold a block until it is
copied into the KV cache (tools/bench_store.py gives every block its own slot,
as a large load does). On a virtual disk the device's "DMA" is a copy made by
the host, and its speed depends on where it writes. This tool separates that
effect from aiokv's own code: same backend, footprints from fio's (16 slots)
to one slot per block ("all").

Per round, interleaved: fio (io_uring, direct=1, bs = block, iodepth = depth,
huge-page buffers where nr_hugepages can be raised) writes the file and reads
it; then the backend reads it once per footprint (slot i of the read goes to
buffer i mod K; buffers are touched before, so no page faults are timed) and
per submission group (--groups: operations per io_uring_enter, the ring's
`submit_group`; 0: every prepared operation in one call, as before 2026-12-01).
--merge-control (root) adds group 0 with the disk's request merging turned off
(/sys/block/DEV/queue/nomerges = 2 for that read, set back after): whether what
separates the groups is the block layer merging adjacent requests submitted
together. Medians of the rounds.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from aiokv.config import parse_size  # noqa: E402
from aiokv.data.backend import OP_READ, OP_WRITE  # noqa: E402
from aiokv.data.buffers import Arena  # noqa: E402
from aiokv.data.choice import open_backend  # noqa: E402
from tools import harness  # noqa: E402
from tools.bench_store import fio_round  # noqa: E402


def queue_dir(path: str) -> str:
    """/sys/block/DEV/queue of the disk that holds `path` (the whole disk for a partition)."""
    st = os.stat(path)
    d = os.path.realpath(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    return os.path.join(d if os.path.isdir(os.path.join(d, "queue")) else os.path.dirname(d), "queue")


class NoMerges:
    """Request merging off for the disk of `path` while inside (nomerges = 2), set back after."""

    def __init__(self, path: str):
        self.file = os.path.join(queue_dir(path), "nomerges")

    def __enter__(self):
        with open(self.file) as f:
            self.old = f.read().strip()
        with open(self.file, "w") as f:
            f.write("2")
        return self

    def __exit__(self, *exc):
        with open(self.file, "w") as f:
            f.write(self.old)


async def backend_read(
    path: str, block: int, n: int, depth: int, footprint: int, group: int | None = None, op: int = OP_READ
) -> float:
    """GB/s of one read of the n-block file into `footprint` buffers used in turn
    (op OP_WRITE: one write of a new n-block file from them), `group` operations
    per io_uring_enter (None: the ring's default)."""
    arena = Arena(footprint * block)
    ctypes.memset(arena.addr, 0x5A, footprint * block)  # touched: no page faults in the timing
    be = open_backend(asyncio.get_running_loop(), "uring", depth=depth)
    if hasattr(be, "min_bytes"):
        be.min_bytes = 0  # exactly `depth` operations in flight, as fio's iodepth
    if group is not None:
        be.ring.submit_group = group
    if op == OP_WRITE:
        if os.path.exists(path):
            os.unlink(path)  # a new file, as fio writes one
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
        os.posix_fallocate(fd, 0, n * block)  # as fio does (fallocate=native) and aiokv's data files are
    else:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        ops = [(op, fd, arena.addr + (i % footprint) * block, block, i * block) for i in range(n)]
        t = time.perf_counter()
        res = await be.run(ops)
        dt = time.perf_counter() - t
        if any(r != block for r in res):
            raise RuntimeError(f"short or failed I/O: {set(res)}")
        return n * block / dt / 1e9
    finally:
        be.close()
        os.close(fd)
        arena.close()


def main() -> int:
    ap = harness.parser(__doc__, rounds=3)
    ap.add_argument("--mib", type=int, default=384)
    ap.add_argument("--size", default="256K", help="block size (the slot: payload + 4 KiB in aiokv)")
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--footprints", default="16,64,256,all", help="buffers read into, in turn ('all': one per block)")
    ap.add_argument("--op", choices=("read", "write"), default="read")
    ap.add_argument("--groups", default="2,0", help="operations per io_uring_enter, comma separated (0: all at once)")
    ap.add_argument(
        "--merge-control", action="store_true", help="also read with group 0 and the disk's request merging off (root)"
    )
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    block = parse_size(args.size) + 4096
    n = (args.mib << 20) // block
    fps = [n if f == "all" else int(f) for f in args.footprints.split(",") if f]
    base = args.dir or tempfile.mkdtemp(prefix="aiokv-footprint-")
    os.makedirs(base, exist_ok=True)
    path = os.path.join(base, "fio.dat")
    groups = [int(g) for g in args.groups.split(",") if g]
    op = OP_WRITE if args.op == "write" else OP_READ
    runs = [(f"backend_{k}_g{g}", k, g, False) for k in fps for g in groups]
    if args.merge_control:
        runs += [(f"backend_{k}_g0_nomerges", k, 0, True) for k in fps]
    rounds: dict[str, list[float]] = {"fio": [], **{name: [] for name, _, _, _ in runs}}
    try:
        with harness.HugePages(harness.huge_pages(args.depth * block)) as hp:
            mem = hp.mem
            for _ in range(args.rounds):
                rounds["fio"].append(fio_round(path, block, n, args.depth, mem)[f"{args.op}_gbps"])
                with open(path, "wb") as f:  # fio_round removed it after its run: write it again, once
                    chunk = os.urandom(1 << 20)
                    for _ in range(-(-n * block // len(chunk))):
                        f.write(chunk)
                    f.flush()
                    os.fsync(f.fileno())
                import contextlib

                import uvloop

                for name, k, g, nomerge in runs:
                    with NoMerges(path) if nomerge else contextlib.nullcontext():
                        rounds[name].append(uvloop.run(backend_read(path, block, n, args.depth, k, g, op)))
                os.unlink(path)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in rounds.items()}
    doc = {
        "op": args.op,
        "block_bytes": block,
        "blocks": n,
        "depth": args.depth,
        "fio_mem": mem,
        "rounds": rounds,
        "median": med,
        "runs": [[name, k, g, nm] for name, k, g, nm in runs],
        "machine": harness.machine(tempfile.gettempdir()),
    }

    def render(d: dict) -> str:
        lines = [
            f"{d['op']} GB/s, block {d['block_bytes'] >> 10} KiB, depth {d['depth']}, {d['blocks']} blocks, "
            f"median of {args.rounds} rounds (fio buffers: {d['fio_mem']})",
            "",
            "| reader | buffers | operations per enter | GB/s | vs fio |",
            "|---|---|---|---|---|",
            f"| fio | {d['depth']} (its iodepth) | 1 | {d['median']['fio']:.2f} | 1.00 |",
        ]
        for name, k, g, nm in d["runs"]:
            v = d["median"][name]
            lines.append(
                f"| aiokv backend alone{' (merging off)' if nm else ''} | "
                f"{k}{' (one per block)' if k == n else ''} | {g or 'all'} | {v:.2f} | "
                f"{v / d['median']['fio']:.2f} |"
            )
        return "\n".join(lines)

    return harness.emit(doc, args, render)


if __name__ == "__main__":
    raise SystemExit(main())
