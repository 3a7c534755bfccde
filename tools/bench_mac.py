#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""What a `secret` costs: aiokv's data path with and without the slot MAC, side by side,
and against another tree's build of aiokv in the same run.

    PYTHONPATH=. .venv/bin/python tools/bench_mac.py [--sizes 256K,1M,2M] [--depth 32] [--mib 256]
        [--threads 0,2] [--rounds 3] [--dir PATH] [--baseline TREE] [--json] [--out FILE]

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
--baseline TREE: the same contenders again with another checkout's aiokv (its
extension built in place: e.g. `git worktree add /tmp/base main`, then in it
`python setup.py build_ext --inplace`), each round running both trees in turn. Each
tree runs in a process of its own (this file, with --serve, importing that tree's
aiokv), kept for the whole run, one at a time.
CRC modes: "copy" is the CPU build's path (the payload CRC32C is computed by the
device copy, so without a secret the stamp and check read no payload: the
hardest case for the MAC, which must read it); "pass" is the CUDA path (a CRC32C
pass in the stamp and check, beside the MAC's).
GB/s are slot bytes moved per second (GB = 1e9); CPU is process CPU seconds per GB.
The secret's cost: its CPU seconds per GB beyond the plain path's, and its GB/s
over the plain path's; with a baseline, this tree's cost over the baseline's.
Also one core's rate over one payload, in cache and not: CRC32C, the keyed BLAKE3
MAC, and Python's keyed BLAKE2b (the MAC before BLAKE3), per tree; and GB of payload
per CPU-second of each tree's stamp and check calls with the MAC over 256 MiB of
slots, without and with the payload CRC in them (the calls alone, no BlockIO).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TREE = os.environ.get("AIOKV_BENCH_TREE") or ROOT  # --serve: the tree whose aiokv this process measures
sys.path.insert(0, TREE)

NSID = bytes.fromhex("3ac0" * 8)
SECRET = "bench-secret-0123456789"


# ---------------- the measuring process (--serve), one per tree ----------------
async def _round(pool, payload: int, n: int, job: dict) -> dict:
    import asyncio
    import concurrent.futures
    import ctypes
    import time

    from aiokv import _native
    from aiokv.data import format as fmt
    from aiokv.data.blockio import BlockIO
    from tools.bench_store import NullBackend

    try:
        from aiokv.data.choice import open_backend
    except ImportError:  # a tree from before aiokv/data/choice.py
        from aiokv.data.backend import open_backend

    root = job["dir"]
    shutil.rmtree(root, ignore_errors=True)
    d = os.path.join(root, "ns", NSID.hex())
    os.makedirs(d)
    loop = asyncio.get_running_loop()
    backend = NullBackend(loop) if job["null_io"] else open_backend(loop, depth=job["depth"])
    if hasattr(backend, "min_bytes"):
        backend.min_bytes = 0  # exactly `depth` operations in flight
    threads, crc_in_copy = job["threads"], job["crc_in_copy"]
    cpu = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="aiokv-crc") if threads else None
    io = BlockIO(backend, d, NSID, 0, payload, secret=SECRET if job["secret"] else None, cpu=cpu)
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


def _keyed_blake3():
    """This tree's keyed BLAKE3: the blake3 package's (aiokv/data/mac.py), or the native one of earlier trees."""
    try:
        from aiokv.data import mac

        return mac.keyed
    except ImportError:
        from aiokv import _native

        return _native.blake3_keyed


def _slot_calls():
    """This tree's stamp and check calls over many slots, with a MAC key: format's (the
    blake3 package's MAC after the native call), or the native ones of earlier trees."""
    from aiokv import _native
    from aiokv.data import format as fmt

    if hasattr(fmt, "stamp_slots"):
        return fmt.stamp_slots, fmt.verify_slots
    return _native.stamp_slots, _native.verify_slots


def call_rates(payload: int) -> dict:
    """One core: GB of payload per CPU-second of the stamp and check calls with the secret's
    MAC over 256 MiB of slots (cold), with the payload CRC (crc_in_copy False) and without;
    the median of three calls each."""
    import ctypes
    import time

    from aiokv.data import format as fmt
    from aiokv.data.buffers import BufferPool

    n = max(8, (256 << 20) // payload)
    pool = BufferPool(fmt.slot_bytes(payload), n)
    out = {}
    try:
        addrs = [pool.addr(s) for s in pool.acquire(n)]
        rand = os.urandom(payload)
        for a in addrs:
            ctypes.memmove(a + fmt.HEADER_BYTES, rand, payload)
        keys = [i.to_bytes(16, "little") * 2 for i in range(n)]
        mk = fmt.mac_key(SECRET)
        stamp, verify = _slot_calls()
        for in_copy in (True, False):
            for name, fn in (("stamp", stamp), ("verify", verify)):
                rates = []
                for _ in range(3):  # the median of three calls
                    t0 = time.process_time()
                    got = fn(addrs, keys, NSID, 0, payload, 0, in_copy, mk)
                    rates.append(n * payload / (time.process_time() - t0) / 1e9)
                    if name == "verify" and any(got):
                        raise RuntimeError("bench_mac: slots stamped here did not verify")
                out[f"{name}_{'mac' if in_copy else 'crc_mac'}_gb_per_cpu_s"] = statistics.median(rates)
    finally:
        pool.close()
    return out


def core_rates(payload: int) -> dict:
    """One core, one payload: GB/s of CRC32C, the MAC's keyed BLAKE3 and Python's keyed BLAKE2b;
    then call_rates."""
    import hashlib
    import time

    from aiokv import _native
    from aiokv.data import format as fmt

    out = {}
    keyed = _keyed_blake3()
    for where, nbuf in (("in_cache", 1), ("from_memory", max(1, (512 << 20) // payload))):
        bufs = [os.urandom(payload) for _ in range(min(nbuf, 8))] if nbuf == 1 else None
        big = bytearray(payload * nbuf) if bufs is None else None
        views = bufs or [memoryview(big)[i * payload : (i + 1) * payload] for i in range(nbuf)]
        k = fmt.mac_key(SECRET)
        for name, fn in (
            ("crc32c", _native.crc32c_bytes),
            ("mac_blake3", lambda b, k=k: keyed(k, b)),
            ("python_blake2b", lambda b, k=k: hashlib.blake2b(b, key=k, digest_size=32).digest()),
        ):
            reps = max(len(views), (256 << 20) // payload)
            t0 = time.perf_counter()
            for i in range(reps):
                fn(views[i % len(views)])
            out[f"{name}_{where}_gbps"] = reps * payload / (time.perf_counter() - t0) / 1e9
    return {**out, **call_rates(payload)}


def serve() -> int:
    """Jobs from stdin (one JSON object a line), results to stdout (one a line)."""
    import ctypes

    import uvloop

    from aiokv.data import format as fmt
    from aiokv.data.buffers import BufferPool

    pool, have = None, None
    for line in sys.stdin:
        job = json.loads(line)
        size = job["payload"]
        if job.get("core"):
            print(json.dumps(core_rates(size)), flush=True)
            continue
        n = job["n"]
        if have != (size, n):  # a pool per payload size, filled once
            if pool is not None:
                pool.close()
            pool = BufferPool(fmt.slot_bytes(size), n)
            pool.acquire(n)
            rand = os.urandom(size)
            for i in range(n):
                ctypes.memmove(pool.addr(i) + fmt.HEADER_BYTES, rand, size)
            have = (size, n)
        print(json.dumps(uvloop.run(_round(pool, size, n, job))), flush=True)
    return 0


class Tree:
    """A --serve process measuring one tree's aiokv."""

    def __init__(self, name: str, path: str):
        self.name, self.path = name, path
        env = dict(os.environ, AIOKV_BENCH_TREE=path, PYTHONPATH=path)
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=path,
        )

    def ask(self, job: dict) -> dict:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"bench_mac: the process measuring {self.path} ended (exit {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _row_text(row: dict, trees: list[str]) -> str:
    head = f"{row['payload'] >> 10:>5} KiB t={row['threads']} crc={row['crc']:<4} {row['io']:<4}"
    parts = []
    for t in trees:
        parts.append(
            f"{t}: write {row[f'{t}_plain_write_gbps']:6.2f} -> {row[f'{t}_secret_write_gbps']:6.2f} GB/s "
            f"(+{row[f'{t}_write_cost']:.3f} s/GB) read {row[f'{t}_plain_read_gbps']:6.2f} -> "
            f"{row[f'{t}_secret_read_gbps']:6.2f} GB/s (+{row[f'{t}_read_cost']:.3f} s/GB)"
        )
    return head + "  " + "  |  ".join(parts)


def main() -> int:
    if "--serve" in sys.argv:
        return serve()
    from aiokv.config import parse_size
    from aiokv.data import format as fmt
    from tools import harness  # (here: a --serve process may run another tree's aiokv, without it)

    ap = harness.parser(__doc__, rounds=3)
    ap.add_argument("--sizes", default="256K,1M,2M")
    ap.add_argument("--depth", type=int, default=32)
    ap.add_argument("--mib", type=int, default=256, help="MiB written and read per contender and round")
    ap.add_argument("--threads", default="0,2", help="checksum-thread counts, comma separated")
    ap.add_argument("--modes", default="copy,pass", help="CRC modes: copy (CPU build), pass (CUDA)")
    ap.add_argument("--io", default="disk,null", help="disk (the real file system), null (no I/O), or both")
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--baseline", default=None, help="another tree (its extension built in place) to run alongside")
    args = ap.parse_args()
    log = harness.say(args)
    base = tempfile.mkdtemp(prefix="aiokv-bench-mac-", dir=args.dir)
    trees = [Tree("new" if args.baseline else "this", ROOT)]
    if args.baseline:
        trees.append(Tree("base", os.path.abspath(args.baseline)))
    names = [t.name for t in trees]
    doc = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "loadavg_start": os.getloadavg(),
        },
        "trees": {t.name: t.path for t in trees},
        "depth": args.depth,
        "rounds": args.rounds,
        "rows": [],
        "core": {},
    }
    try:
        for size in [parse_size(s) for s in args.sizes.split(",")]:
            n = max(8, (args.mib << 20) // fmt.slot_bytes(size))
            for threads in [int(t) for t in args.threads.split(",")]:
                for mode in args.modes.split(","):
                    for io in args.io.split(","):
                        got: dict[tuple[str, bool], list[dict]] = {(t.name, s): [] for t in trees for s in (0, 1)}
                        for r in range(args.rounds):
                            order = [(t, s) for t in trees for s in (False, True)]
                            if r % 2:
                                order.reverse()
                            for tree, secret in order:
                                job = {
                                    "payload": size,
                                    "n": n,
                                    "depth": args.depth,
                                    "secret": secret,
                                    "threads": threads,
                                    "crc_in_copy": mode == "copy",
                                    "null_io": io == "null",
                                    "dir": os.path.join(base, "d"),
                                }
                                got[(tree.name, secret)].append(tree.ask(job))
                        row = {"payload": size, "threads": threads, "crc": mode, "io": io}
                        for (t, s), rs in got.items():
                            who = f"{t}_{'secret' if s else 'plain'}"
                            row.update({f"{who}_{k}": v for k, v in harness.medians(rs).items()})
                        for t in names:
                            for d in ("write", "read"):
                                row[f"{t}_{d}_ratio"] = row[f"{t}_secret_{d}_gbps"] / row[f"{t}_plain_{d}_gbps"]
                                row[f"{t}_{d}_cost"] = (
                                    row[f"{t}_secret_{d}_cpu_s_per_gb"] - row[f"{t}_plain_{d}_cpu_s_per_gb"]
                                )
                        if args.baseline:
                            for d in ("write", "read"):
                                row[f"{d}_cost_new_over_base"] = row[f"new_{d}_cost"] / max(row[f"base_{d}_cost"], 1e-9)
                        doc["rows"].append(row)
                        log(_row_text(row, names))
            doc["core"][size] = {t.name: t.ask({"payload": size, "core": True}) for t in trees}
    finally:
        for t in trees:
            t.close()
        shutil.rmtree(base, ignore_errors=True)
    doc["machine"]["loadavg_end"] = os.getloadavg()
    return harness.emit(doc, args, lambda d: json.dumps(d["core"], indent=1))


if __name__ == "__main__":
    sys.exit(main())
