#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Store save/load bandwidth against fio, LMCache's raw_block device and vLLM's own
file-system tier I/O, on the same directory, same block size, same queue depth, same bytes.

    PYTHONPATH=. .venv/bin/python tools/bench_store.py [--json] [--out FILE] [--plot DIR]
        [--sizes 64K,256K,1M,2M] [--depth 1,4,16,64] [--mib 64] [--rounds 3] [--dir PATH]

For each payload size B and queue depth D a round is, interleaved and on one
directory (medians of the rounds are reported):
- aiokv: a fresh Store in DIR, one namespace of B-byte payloads; N blocks saved
  with StoreIO.save, then loaded with StoreIO.load (tools/storeio.py: the
  index's calls around BlockIO's writes and reads; headers stamped, CRC32C
  computed on save and verified on load, index committed to the journal), on
  uvloop. Staging buffers come from one BufferPool (a huge-page-advised arena).
  --mode batch (default, a worker's pattern): one call of all N blocks, a buffer
  each, D operations in the kernel; its BlockIO calls are timed alone too (the
  data path, io_*: ratio_<peer>_data_path). --mode calls: D blocks in flight as
  W concurrent save()/load() loops (default W = D, one block per call).
  N = --mib MiB / slot. Checksums on the loop thread, or on --checksum-threads;
  --secret adds the MAC.
- raw_block: LMCache's RawBlockDevice (lmcache-rust-raw-block-io, installed by
  this tool with pip --target into .bench-peer/ when missing; --no-raw-block):
  the same slot images from a buffer per block, D per batch, each batch waited
  for whole (tools/peers.py).
- fio: io_uring, direct=1, bs = the slot size (B + 4096 header), iodepth=D,
  a fresh file of N slots written then read: the same I/Os as aiokv. Buffers
  are huge pages (--mem=mmaphuge) when /proc/sys/vm/nr_hugepages can be raised
  (root): raised for the run and set back after.
- vllm-fs: vLLM's file-system tier I/O (vllm/v1/kv_offload/tiering/fs/io.py:
  batch_store_block / batch_load_block over its C helper vllm.fs_io_C: a file
  per block, O_DIRECT, written to a temp file then renamed; read whole) driven
  by its DualQueueThreadPool with D threads (D - D//2 load-priority, D//2
  store-priority), one block per task, all N tasks queued at once: D blocks in
  flight. Buffers: one huge-page-advised arena holding all N blocks (the
  primary KV view it copies from in vLLM). It moves B bytes per block (no
  header), so the vLLM ratio compares payload (KV) bytes per second.

Every timed phase starts after os.sync() (and --settle seconds): on a file system
mounted with `discard` a previous round's deletes are otherwise discarded inside
the next phase. Ratios (ratio_fio, ratio_raw_block, ...) are the median of each
round's aiokv / peer ratio. GB/s columns are bytes moved to/from the disk by each contender; payload GB/s
is that x B / bytes per block (B / slot for aiokv and fio, 1 for vllm-fs).
CPU is process CPU time (user + system, all threads: core-seconds) per GB
(1e9 bytes) of payload moved, per direction (aiokv's JSON also has the system
part alone, *_sys_cpu_us per block: the kernel's share, which fio pays too):
time.process_time() over the phase for aiokv and vllm-fs (run in this
process), (usr_cpu + sys_cpu) x job_runtime for fio (from its JSON).
"null I/O" re-runs aiokv's save/load with a backend that completes every
operation at once: the CPU aiokv spends per block outside the kernel's I/O;
"crc" is CRC32C of one payload.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import ctypes
import datetime
import errno
import functools
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aiokv import _native  # noqa: E402
from aiokv.config import parse_size  # noqa: E402
from aiokv.data import blockio  # noqa: E402
from aiokv.data import format as fmt  # noqa: E402
from aiokv.data.backend import IOBackend  # noqa: E402
from aiokv.data.buffers import BufferPool  # noqa: E402
from aiokv.data.choice import open_backend  # noqa: E402
from aiokv.data.window import read_through, shape  # noqa: E402
from tools.storeio import StoreIO  # noqa: E402

NSID = bytes.fromhex("be0c" * 8)
HUGE = 2 << 20
NR_HUGE = "/proc/sys/vm/nr_hugepages"
SUBMIT_GROUP = None  # --submit-group (None: the ring's default)
# --settle: before every timed phase of every contender the file system is synced (on a file system mounted
# with `discard` a delete's discards are issued when the journal commits: a previous round's files, freed
# just before, otherwise land in the next phase), then this many seconds of quiet
SETTLE = 0.0
# the optional extra `peers` (pyproject.toml), installed without its dependencies (tools/peers.py)
PEERS_INSTALL = "pip install --no-deps 'lmcache-rust-raw-block-io==0.5.7rc2' 'lmcache==0.5.7rc2'"


# ------------------------------------------------------------------ aiokv side


class NullBackend(IOBackend):
    """Completes every operation with its full length on the loop's next
    iteration, as real completions arrive (no I/O): for CPU overhead."""

    name = "null"

    def _start(self, batch, ops) -> None:
        self.loop.call_soon(self._done, batch, ops)

    @staticmethod
    def _done(batch, ops) -> None:
        for i, op in enumerate(ops):
            batch.complete(i, op[3])

    def _cancel(self, batch) -> None:
        pass

    @property
    def in_flight(self) -> int:
        return 0


def _sys_s() -> float:
    """System (kernel) CPU seconds of this process so far (getrusage: finer than os.times' ticks)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


def _keys(n: int, salt: int) -> list[bytes]:
    return [salt.to_bytes(16, "little") + i.to_bytes(16, "little") for i in range(n)]


def _anon_huge_kb() -> int:
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


async def _aiokv_round(
    root: str,
    payload: int,
    n: int,
    depth: int,
    workers: int,
    salt: int,
    null_io: bool = False,
    mode: str = "calls",
    secret: str | None = None,
    cpu=None,
    reads: str = "window",
    crc: bool = True,
) -> dict:
    shutil.rmtree(root, ignore_errors=True)
    batch = mode == "batch" and not null_io
    per = n if batch else max(1, depth // workers)
    if batch:
        workers = 1
    if null_io:  # one staging buffer per key, so a "load" finds the header its save stamped
        n = min(n, 128)
    slot = fmt.slot_bytes(payload)
    # batch mode: the size's pool, made once and held for every round, as a worker holds its arena
    held = batch and slot in POOLS
    pool = POOLS[slot] if held else BufferPool(slot, n if (null_io or batch) else per * workers)
    st = StoreIO(root, secret=secret, cpu=cpu)
    try:
        if null_io:
            st._backend = NullBackend(asyncio.get_running_loop())  # bench only: no I/O at all
        elif batch:  # bench only: the worker's pattern, one call of all blocks, `depth` in the kernel
            st._backend = open_backend(asyncio.get_running_loop(), depth=depth)
            if hasattr(st._backend, "min_bytes"):
                st._backend.min_bytes = 0  # exactly `depth` operations in flight, as fio's iodepth
            if SUBMIT_GROUP is not None and hasattr(st._backend, "ring"):
                st._backend.ring.submit_group = SUBMIT_GROUP  # --submit-group: operations per io_uring_enter
        ns = st.namespace(NSID, payload, fields={"bench": "bench_store"})
        if not held:  # random payloads (written once; save stamps only the header of each slot)
            _fill(pool, payload)
        keys = _keys(n, salt)
        thp = _anon_huge_kb()
        # BlockIO's own calls, timed (reads through a window: timed whole, by _load_through)
        io = st.blockio(ns)
        if not crc:  # bench only: no payload CRC pass (each header holds its payload's CRC already)
            for i, k in enumerate(keys[: pool.count]):
                io.stamp(k, pool.addr(i))
        spent = _time_data_path(io, reads=reads != "window", crc=crc) if batch else None
        if batch and reads == "window":
            st.load = functools.partial(_load_through, st, pool, spent, crc)  # bench only: a worker's load

        async def phase(call) -> tuple[float, float]:
            it = iter(range(0, n, per))

            async def loop(w: int) -> None:
                addrs = [pool.addr(w * per + j) for j in range(per)]
                for start in it:
                    ks = keys[start : start + per]
                    if null_io:
                        addrs = [pool.addr(start + j) for j in range(len(ks))]
                    res = await call(ns, list(zip(ks, addrs)))
                    if any(res):
                        raise RuntimeError(f"aiokv: {getattr(call, '__name__', 'load')} failed: {res}")

            _phase_sync(SETTLE)
            p0, s0, t0 = time.process_time(), _sys_s(), time.perf_counter()
            await asyncio.gather(*(loop(w) for w in range(workers)))
            return time.perf_counter() - t0, time.process_time() - p0, _sys_s() - s0

        wt, wc, ws = await phase(st.save)
        rt, rc, rs = await phase(st.load)
        nbytes = n * fmt.slot_bytes(payload)  # bytes the disk moved, as fio counts them
        return {
            "write_gbps": nbytes / wt / 1e9,
            "read_gbps": nbytes / rt / 1e9,
            "write_cpu_us": wc / n * 1e6,
            "read_cpu_us": rc / n * 1e6,
            "write_sys_cpu_us": ws / n * 1e6,
            "read_sys_cpu_us": rs / n * 1e6,
            "write_s": wt,
            "read_s": rt,
            "staging_anon_huge_kb": thp,
            **(
                {
                    f"io_{rw}_{k}": v
                    for rw in ("write", "read")
                    for k, v in (
                        ("gbps", nbytes / spent[rw][0] / 1e9),
                        ("cpu_us", spent[rw][1] / n * 1e6),
                        ("s", spent[rw][0]),
                    )
                }
                if spent
                else {}
            ),
        }
    finally:
        st.close()
        if not held:
            pool.close()
        shutil.rmtree(root, ignore_errors=True)


# batch mode's staging pools, by slot size: made (populated, a random payload in each) once per size
# and held for all its rounds and contenders, as a worker holds its arena (docs/benchmarks-history.md 11.4)
POOLS: dict[int, BufferPool] = {}


def _fill(pool: BufferPool, payload: int) -> None:
    rand = os.urandom(payload)
    for s in range(pool.count):
        ctypes.memmove(pool.addr(s) + fmt.HEADER_BYTES, rand, payload)


async def _load_through(st, pool: BufferPool, spent: dict, crc: bool, ns, items) -> list[int]:
    """StoreIO.load as a worker loads (worker/loads.py): pin, then read through a window of
    the pool's buffers (data/window.py: each chunk read, verified and its buffers given back;
    nothing to copy out here), unpin. The reads through the window are the data path (`spent`)."""
    keys = [k for k, _ in items]
    slots = st.pin(ns, keys)
    io = st.blockio(ns)
    out = [-errno.ENOENT] * len(keys)
    freed = asyncio.Event()

    async def take(k: int) -> list[int]:
        while not pool.available:
            freed.clear()
            await freed.wait()
        return pool.acquire(min(k, pool.available))

    def give(bufs) -> None:
        pool.release(bufs)
        freed.set()

    async def run(part, bufs) -> None:
        try:
            res = await io.read([(s, k, pool.addr(b)) for (_, s, k), b in zip(part, bufs)], not crc)
            for (i, _, _), r in zip(part, res):
                out[i] = r
        finally:
            give(bufs)

    try:
        todo = [(i, s, k) for i, (s, k) in enumerate(zip(slots, keys)) if s is not None]
        p0, t0 = time.process_time(), time.perf_counter()
        await read_through(todo, take, give, run, *shape(io))
        spent["read"][0] += time.perf_counter() - t0
        spent["read"][1] += time.process_time() - p0
    finally:
        st.unpin(ns, [k for k, s in zip(keys, slots) if s is not None])
    return out


def _time_data_path(io, reads: bool = True, crc: bool = True) -> dict:
    """Wraps BlockIO `io`'s write and read (the data path a worker runs: stamp, write; read,
    verify) so each call adds its wall and process CPU seconds to the returned
    {"write": [s, cpu_s], "read": [...]}: with one call per phase (batch mode), the data
    path's share of the store's save and load (which add reserve and commit, pin and unpin)."""
    spent = {"write": [0.0, 0.0], "read": [0.0, 0.0]}

    def timed(rw: str, fn):
        async def call(items, crc_in_copy: bool = False):
            p0, t0 = time.process_time(), time.perf_counter()
            try:
                return await fn(items, crc_in_copy or not crc)  # not crc: as if a device copy had made it
            finally:
                spent[rw][0] += time.perf_counter() - t0
                spent[rw][1] += time.process_time() - p0

        return call

    io.write = timed("write", io.write)
    if reads:
        io.read = timed("read", io.read)
    return spent


def aiokv_round(*a, **kw) -> dict:
    import uvloop

    return uvloop.run(_aiokv_round(*a, **kw))


def crc_us(payload: int, reps: int = 50) -> float:
    pool = BufferPool(fmt.slot_bytes(payload), 1)
    try:
        a = pool.addr(0)
        t = time.perf_counter()
        for _ in range(reps):
            _native.crc32c(a, payload)
        return (time.perf_counter() - t) / reps * 1e6
    finally:
        pool.close()


# ------------------------------------------------------------------ fio side


def fio_round(path: str, slot: int, n: int, depth: int, mem: str, fixedbufs: bool = False) -> dict:
    out = {}
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    try:
        for rw, key in (("write", "write"), ("read", "read")):
            cmd = [
                "fio",
                "--name=bench",
                f"--filename={path}",
                f"--size={n * slot}",
                f"--bs={slot}",
                f"--rw={rw}",
                "--ioengine=io_uring",
                "--direct=1",
                f"--iodepth={depth}",
                "--output-format=json",
            ]
            if mem == "mmaphuge":
                cmd += ["--mem=mmaphuge", "--hugepage-size=2M"]
            if fixedbufs:
                cmd += ["--fixedbufs"]
            _phase_sync(SETTLE)
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                raise RuntimeError(f"fio failed: {p.stderr.strip() or p.stdout.strip()}")
            j = json.loads(p.stdout[p.stdout.index("{") :])["jobs"][0]
            io = j[key]
            secs = io["runtime"] / 1000
            if io["io_bytes"] != n * slot:
                raise RuntimeError(f"fio moved {io['io_bytes']} bytes, not {n * slot}")
            out[f"{rw}_gbps"] = n * slot / secs / 1e9
            out[f"{rw}_cpu_us"] = (j["usr_cpu"] + j["sys_cpu"]) / 100 * j["job_runtime"] / 1000 / n * 1e6
            out[f"{rw}_s"] = secs
        return out
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class HugePages:
    """Raise nr_hugepages for fio's buffers, and set it back."""

    def __init__(self, pages: int):
        self.want, self.orig, self.ok, self.note = pages, None, False, ""

    def __enter__(self):
        try:
            with open(NR_HUGE) as f:
                self.orig = int(f.read())
            with open(NR_HUGE, "w") as f:
                f.write(str(self.orig + self.want))
            with open(NR_HUGE) as f:
                got = int(f.read())
            self.ok = got >= self.orig + self.want
            if not self.ok:
                self.note = f"asked for {self.want} huge pages, the kernel gave {got - self.orig}"
        except OSError as e:
            self.note = f"cannot raise {NR_HUGE} ({e.strerror}; needs root)"
        return self

    def __exit__(self, *exc):
        if self.orig is not None:
            with open(NR_HUGE, "w") as f:
                f.write(str(self.orig))


# ------------------------------------------------------------------ LMCache's raw_block side

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER_DIR = os.path.join(ROOT, ".bench-peer")  # ignored by git: the benchmark's own install of the peer
RAW_BLOCK_PKG = "lmcache-rust-raw-block-io==0.5.7rc2"


def raw_block_available(install: bool = True) -> str:
    """'' if LMCache's RawBlockDevice (lmcache_rust_raw_block_io) imports, from PEER_DIR
    (installed there with pip --target when missing), else why not."""
    if PEER_DIR not in sys.path:
        sys.path.append(PEER_DIR)
    try:
        import lmcache_rust_raw_block_io  # noqa: F401

        return ""
    except ImportError:
        pass
    if not install:
        return f"lmcache_rust_raw_block_io missing (pip install --target {PEER_DIR} {RAW_BLOCK_PKG})"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", PEER_DIR, RAW_BLOCK_PKG]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        return f"{' '.join(cmd[2:])} failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}"
    import importlib

    importlib.invalidate_caches()
    try:
        import lmcache_rust_raw_block_io  # noqa: F401, F811
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return ""


def raw_block_round(path: str, payload: int, n: int, depth: int) -> dict:
    """RawBlockDevice (tools/peers.py: depth-sized batches, each waited for whole) writing
    then reading n slot images, a staging buffer per block as aiokv's batch mode has
    (one arena, filled with a random payload the same way): the same I/Os, no checksum."""
    slot = fmt.slot_bytes(payload)
    held = slot in POOLS  # the size's pool, aiokv's (main)
    pool = POOLS[slot] if held else BufferPool(slot, n)
    try:
        if not held:
            _fill(pool, payload)
        got = _rbd_peer(path, slot, n, depth, pool, SETTLE)
    finally:
        if not held:
            pool.close()
    out = {}
    for rw in ("write", "read"):
        out[f"{rw}_gbps"] = n * slot / got[f"{rw}_s"] / 1e9
        out[f"{rw}_cpu_us"] = got[f"{rw}_cpu_s"] / n * 1e6
        out[f"{rw}_s"] = got[f"{rw}_s"]
    return out


# ------------------------------------------------------------------ vLLM fs tier side


def vllm_fs_available() -> str:
    """'' if vLLM's fs tier I/O imports here, else why not."""
    try:
        from vllm.v1.kv_offload.tiering.fs import io as fsio  # noqa: F401
        from vllm.v1.kv_offload.tiering.fs.thread_pool import DualQueueThreadPool  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "" if fsio._HAS_FSIO_C else "vllm.fs_io_C missing (pure-Python path)"


def vllm_fs_round(root: str, payload: int, n: int, depth: int, arena) -> dict:
    """vLLM's fs tier: one file per block, D pool threads, one block per task."""
    import functools
    import logging

    from vllm.v1.kv_offload.tiering.fs.io import batch_load_block, batch_store_block, probe_o_direct
    from vllm.v1.kv_offload.tiering.fs.thread_pool import DualQueueThreadPool

    logging.getLogger("vllm").setLevel(logging.CRITICAL)
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    direct = probe_o_direct(root)
    view = arena.view
    # vLLM's file mapper spreads blocks over subdirectories; one level of 256 here
    paths = [os.path.join(root, f"{i & 0xFF:02x}", f"{i:08x}.bin") for i in range(n)]
    for d in {os.path.dirname(p) for p in paths}:
        os.makedirs(d, exist_ok=True)
    pool = DualQueueThreadPool(depth - depth // 2, depth // 2, thread_name_prefix="bench_fs")
    out = {"o_direct": direct}
    try:
        for rw, fn in (("write", batch_store_block), ("read", batch_load_block)):
            tasks = [functools.partial(fn, [paths[i]], view, [i * payload], payload, direct) for i in range(n)]
            enqueue = pool.enqueue_store if rw == "write" else pool.enqueue_load
            p0, t0 = time.process_time(), time.perf_counter()
            for i, t in enumerate(tasks):
                enqueue(i, 1, [t])
            pool.wait_idle()
            dt, dc = time.perf_counter() - t0, time.process_time() - p0
            bad = [j for j, ok, _ in pool.get_finished() if not ok]
            if bad:
                raise RuntimeError(f"vllm-fs: {len(bad)} {rw} jobs failed")
            out[f"{rw}_gbps"] = n * payload / dt / 1e9
            out[f"{rw}_cpu_s_per_gb"] = dc / (n * payload / 1e9)
            out[f"{rw}_s"] = dt
    finally:
        pool.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    return out


# ------------------------------------------------------------------ peers (--peers)

# aiokv's payload CRC32C: on 2 checksum threads (a CUDA worker), in the device copy (the CPU build), on the loop
# thread; "before": on 2 checksum threads, scheduled as before issue 36 (chunks of CHUNK_MIN_BYTES, stamped or
# written within one queue depth: blockio.SPREAD_CHUNK_BYTES = STAMP_AHEAD_DEPTHS = 0)
PEER_CRC = ("threads", "copy", "loop", "before")


def _peer_fill(pool: BufferPool, payload: int) -> None:
    """A random payload in every buffer (each its own: no two slots alike)."""
    chunk = os.urandom(payload + 64 * 1024)
    for s in range(pool.count):
        off = (s * 4099) % (64 * 1024)
        ctypes.memmove(pool.addr(s) + fmt.HEADER_BYTES, chunk[off : off + payload], payload)


def _phase_sync(settle: float) -> None:
    """Before each timed phase of every contender: the file system synced, then `settle` s of quiet."""
    os.sync()
    if settle > 0:
        time.sleep(settle)


async def _aiokv_peer(root: str, payload: int, n: int, depth: int, salt: int, pool, crc: str, settle: float) -> dict:
    """aiokv's store and data path, one call of all n blocks (a buffer each, held): reserve
    (the scheduler's), BlockIO.write (the worker's), commit; pin, BlockIO.read, unpin.
    crc: "threads" (payload CRC32C stamped and verified on 2 checksum threads, as a CUDA
    worker) or "copy" (the CPU build: the device copy, not timed here, leaves each payload's
    CRC in its header and checks it on the way in; the data path stamps/checks the rest)."""
    shutil.rmtree(root, ignore_errors=True)
    cpu = concurrent.futures.ThreadPoolExecutor(2, "bench-crc") if crc in ("threads", "before") else None
    st = StoreIO(root, cpu=cpu)
    knobs = (blockio.SPREAD_CHUNK_BYTES, blockio.STAMP_AHEAD_DEPTHS)
    if crc == "before":
        blockio.SPREAD_CHUNK_BYTES = blockio.STAMP_AHEAD_DEPTHS = 0
    try:
        be = st._backend = open_backend(asyncio.get_running_loop(), depth=depth)
        if hasattr(be, "min_bytes"):
            be.min_bytes = 0  # exactly `depth` operations in flight
        ns = st.namespace(NSID, payload, fields={"bench": "bench_store peers"})
        keys = _keys(n, salt)
        io = st.blockio(ns)
        in_copy = crc == "copy"
        if in_copy:  # the device copy's part, before the timed phases: each header holds its payload's CRC
            for i, k in enumerate(keys):
                io.stamp(k, pool.addr(i))
        out = {}
        for rw in ("write", "read"):
            _phase_sync(settle)
            p0, t0 = time.process_time(), time.perf_counter()
            where = [st.reserve(ns, k) for k in keys] if rw == "write" else st.pin(ns, keys)
            if None in where:
                raise RuntimeError(f"aiokv: {'reserve' if rw == 'write' else 'pin'} refused a block")
            p1, t1 = time.process_time(), time.perf_counter()
            call = io.write if rw == "write" else io.read
            res = await call([(w, k, pool.addr(i)) for i, (w, k) in enumerate(zip(where, keys))], in_copy)
            p2, t2 = time.process_time(), time.perf_counter()
            if rw == "write":
                st.commit(ns, list(zip(keys, where)))
            else:
                st.unpin(ns, keys)
            p3, t3 = time.process_time(), time.perf_counter()
            if any(res):
                raise RuntimeError(f"aiokv: {rw} failed: {sorted(set(res))}")
            out[f"io_{rw}_s"], out[f"io_{rw}_cpu_s"] = t2 - t1, p2 - p1  # the data path (a worker's call)
            out[f"{rw}_s"], out[f"{rw}_cpu_s"] = t3 - t0, p3 - p0  # the store: with reserve/commit, pin/unpin
        return out
    finally:
        blockio.SPREAD_CHUNK_BYTES, blockio.STAMP_AHEAD_DEPTHS = knobs
        st.close()
        if cpu is not None:
            cpu.shutdown()
        shutil.rmtree(root, ignore_errors=True)


def _rbd_peer(path: str, slot: int, n: int, depth: int, pool, settle: float) -> dict:
    """RawBlockDevice: the same slot images (header + payload) from the same buffers to a
    fresh allocated file, depth-sized batches (tools/peers.py)."""
    from tools import peers

    peers.make_file(path, n * slot)
    dev = peers.open_device(path, depth)
    try:
        bufs = [peers.view(pool.addr(i), slot) for i in range(n)]
        offs = [i * slot for i in range(n)]
        out = {}
        for rw in ("write", "read"):
            _phase_sync(settle)
            p0, t0 = time.process_time(), time.perf_counter()
            ok = peers.device_io(dev, rw == "write", offs, bufs, slot, depth)
            out[f"{rw}_s"], out[f"{rw}_cpu_s"] = time.perf_counter() - t0, time.process_time() - p0
            if not all(ok):
                raise RuntimeError(f"RawBlockDevice: {ok.count(False)} {rw}s failed")
        return out
    finally:
        dev.close()
        os.unlink(path)


def _rbc_peer(path: str, payload: int, n: int, depth: int, salt: int, pool, settle: float, per_call: int) -> dict:
    """RawBlockCore: put_many / load_many_into of `per_call` keys a call (its header and
    payload writes, its index), payloads in place in the same buffers (tools/peers.py)."""
    from tools import peers

    slot = fmt.slot_bytes(payload)
    peers.make_file(path, peers.META_BYTES + n * slot)
    core = peers.open_core(path, slot, n, depth)
    try:
        keys = [peers.core_key(i, salt) for i in range(n)]
        objs = [peers.Obj(pool.addr(i) + fmt.HEADER_BYTES, payload) for i in range(n)]
        out = {}
        _phase_sync(settle)
        p0, t0 = time.process_time(), time.perf_counter()
        ok = []
        for i in range(0, n, per_call):
            ok += core.put_many(keys[i : i + per_call], objs[i : i + per_call]).results
        out["write_s"], out["write_cpu_s"] = time.perf_counter() - t0, time.process_time() - p0
        if not all(ok):
            raise RuntimeError(f"RawBlockCore: {ok.count(False)} puts failed")
        enc = [k.encoded for k in keys]
        _phase_sync(settle)
        p0, t0 = time.process_time(), time.perf_counter()
        ok = []
        for i in range(0, n, per_call):
            ok += core.load_many_into(enc[i : i + per_call], objs[i : i + per_call])
        out["read_s"], out["read_cpu_s"] = time.perf_counter() - t0, time.process_time() - p0
        if not all(ok):
            raise RuntimeError(f"RawBlockCore: {ok.count(False)} loads failed")
        return out
    finally:
        core.close()
        os.unlink(path)


def peers_main(args, sizes: list[int], depth: int, log) -> dict:
    """aiokv (CRC on checksum threads, and in the copy) against RawBlockDevice and
    RawBlockCore (and fio), interleaved rounds on one directory; see the module docstring."""
    import uvloop

    from tools import peers

    no_dev, no_core = peers.available()
    if no_dev:
        raise SystemExit(f"bench_store --peers: RawBlockDevice unavailable: {no_dev}")
    if no_core:
        raise SystemExit(f"bench_store --peers: RawBlockCore unavailable: {no_core}")
    base = args.dir or tempfile.mkdtemp(prefix="aiokv-bench-")
    os.makedirs(base, exist_ok=True)
    work = tempfile.mkdtemp(prefix="peers-", dir=base)
    modes = [c for c in args.peer_crc.split(",") if c]
    who = [f"aiokv_{c}" for c in modes] + ["rbd", "rbc"] + ([] if args.no_fio else ["fio"])
    per_call = args.peer_keys or depth
    results = []
    t_start = time.monotonic()
    mach = machine(base)
    hp = HugePages(max(-(-depth * fmt.slot_bytes(s) // HUGE) for s in sizes) + 4)
    fio_mem = "mmaphuge" if "fio" in who and hp.__enter__().ok else "malloc"
    try:
        for size in sizes:
            slot = fmt.slot_bytes(size)
            n = args.blocks or max(2 * depth, (args.mib << 20) // slot)
            pool = BufferPool(slot, n, populate=True)  # held for all rounds, as a worker's arena
            _peer_fill(pool, size)
            rounds = {w: [] for w in who}
            try:
                for r in range(args.rounds):
                    order = who[r % len(who) :] + who[: r % len(who)]  # each contender first in turn
                    for w in order:
                        if w.startswith("aiokv_"):
                            got = uvloop.run(
                                _aiokv_peer(os.path.join(work, "store"), size, n, depth, r, pool, w[6:], args.settle)
                            )
                        elif w == "rbd":
                            got = _rbd_peer(os.path.join(work, "rbd.dat"), slot, n, depth, pool, args.settle)
                        elif w == "rbc":
                            got = _rbc_peer(
                                os.path.join(work, "rbc.dat"), size, n, depth, r, pool, args.settle, per_call
                            )
                        else:
                            _phase_sync(args.settle)
                            f = fio_round(os.path.join(work, "fio.dat"), slot, n, depth, fio_mem)
                            got = {f"{rw}_s": f[f"{rw}_s"] for rw in ("write", "read")}
                            got.update({f"{rw}_cpu_s": f[f"{rw}_cpu_us"] * n / 1e6 for rw in ("write", "read")})
                        rounds[w].append(got)
                    log(
                        f"{size >> 10:>5} KiB round {r + 1}: "
                        + " | ".join(
                            f"{w} W {n * slot / rounds[w][-1][('io_' if w.startswith('aiokv') else '') + 'write_s'] / 1e9:.2f}"
                            f" R {n * slot / rounds[w][-1][('io_' if w.startswith('aiokv') else '') + 'read_s'] / 1e9:.2f}"
                            for w in who
                        )
                        + " GB/s"
                    )
            finally:
                pool.close()
            row = {"size": size, "slot_bytes": slot, "blocks": n, "depth": depth, "rounds": rounds}
            for w, rs in rounds.items():
                m = {}
                for k in rs[0]:
                    m[k] = statistics.median(x[k] for x in rs)
                for pre in ("", "io_"):
                    for rw in ("write", "read"):
                        if f"{pre}{rw}_s" in m:
                            m[f"{pre}{rw}_gbps"] = statistics.median(n * slot / x[f"{pre}{rw}_s"] / 1e9 for x in rs)
                            m[f"{pre}{rw}_cpu_s_per_gb"] = statistics.median(
                                x[f"{pre}{rw}_cpu_s"] / (n * size / 1e9) for x in rs
                            )
                row[w] = m

            # each round's aiokv run against the same round's peer run (the disk's speed drifts between
            # rounds by more than the differences measured): the median of those ratios
            def paired(a: str, b: str, ka: str, kb: str, rw: str, rounds=rounds) -> float:
                return statistics.median(y[f"{kb}{rw}_s"] / x[f"{ka}{rw}_s"] for x, y in zip(rounds[a], rounds[b]))

            row["paired"] = {
                c: {
                    "rbd": {rw: paired(f"aiokv_{c}", "rbd", "io_", "", rw) for rw in ("write", "read")},
                    "rbc": {rw: paired(f"aiokv_{c}", "rbc", "", "", rw) for rw in ("write", "read")},
                    **(
                        {"fio": {rw: paired(f"aiokv_{c}", "fio", "io_", "", rw) for rw in ("write", "read")}}
                        if "fio" in rounds
                        else {}
                    ),
                }
                for c in modes
            }
            # ratios of medians: aiokv's data path / RawBlockDevice, aiokv's store / RawBlockCore
            row["ratios"] = {
                c: {
                    "rbd": {
                        rw: row[f"aiokv_{c}"][f"io_{rw}_gbps"] / row["rbd"][f"{rw}_gbps"] for rw in ("write", "read")
                    },
                    "rbc": {rw: row[f"aiokv_{c}"][f"{rw}_gbps"] / row["rbc"][f"{rw}_gbps"] for rw in ("write", "read")},
                    **(
                        {
                            "fio": {
                                rw: row[f"aiokv_{c}"][f"io_{rw}_gbps"] / row["fio"][f"{rw}_gbps"]
                                for rw in ("write", "read")
                            }
                        }
                        if "fio" in row
                        else {}
                    ),
                }
                for c in modes
            }
            results.append(row)
    finally:
        hp.__exit__()
        shutil.rmtree(work, ignore_errors=True)
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    import importlib.metadata as md

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "peers": True,
        "params": {
            "mib": args.mib,
            "blocks": args.blocks,
            "sizes": sizes,
            "depth": depth,
            "rounds": args.rounds,
            "settle": args.settle,
            "rbc_keys_per_call": per_call,
            "fio_mem": fio_mem if "fio" in who else None,
            "dir": base,
        },
        "versions": {p: md.version(p) for p in ("lmcache", "lmcache-rust-raw-block-io")},
        "crc32c": _native_crc_note(),
        "machine": mach,
        "seconds": round(time.monotonic() - t_start, 1),
        "results": results,
    }


def _native_crc_note() -> dict:
    """The checksum speed this run had (the native CRC32C may change under this tool:
    compare within a run): GB/s of one thread over 256 MiB of 1 MiB payloads read once
    (cold, as the bench's), and over one 1 MiB payload again and again (hot)."""
    pool = BufferPool(1 << 20, 256, populate=True)
    try:
        addrs = [pool.addr(i) for i in range(pool.count)]
        t = time.perf_counter()
        for a in addrs:
            _native.crc32c(a, 1 << 20)
        cold = pool.count * (1 << 20) / (time.perf_counter() - t) / 1e9
    finally:
        pool.close()
    return {"cold_gbps": round(cold, 1), "hot_gbps": round((1 << 20) / crc_us(1 << 20) / 1e3, 1)}


def render_peers(doc: dict) -> str:
    p = doc["params"]
    res = doc["results"]
    modes = [w[6:] for w in res[0] if w.startswith("aiokv_")]
    fio = "fio" in res[0]
    wr = lambda x, k="": f"{x[k + 'write_gbps']:.2f} / {x[k + 'read_gbps']:.2f}"  # noqa: E731
    q2 = lambda x: f"{x['write']:.2f} / {x['read']:.2f}"  # noqa: E731
    cpu = lambda x, k="": f"{x[k + 'write_cpu_s_per_gb']:.3f} / {x[k + 'read_cpu_s_per_gb']:.3f}"  # noqa: E731
    head = (
        "| payload |" + "".join(f" aiokv {m}: data path | store |" for m in modes) + " RawBlockDevice | RawBlockCore |"
    )
    head += " fio |" if fio else ""
    rule = "|---|" + "---|---|" * len(modes) + "---|---|" + ("---|" if fio else "")
    lines = [
        f"aiokv vs LMCache raw_block ({', '.join(f'{k} {v}' for k, v in doc['versions'].items())}); depth {p['depth']}, "
        f"{p['mib']} MiB per phase, median of {p['rounds']} interleaved rounds; RawBlockCore {p['rbc_keys_per_call']} "
        f"keys a call; CRC32C one thread {doc['crc32c']['cold_gbps']} GB/s cold, {doc['crc32c']['hot_gbps']} hot",
        "",
        "GB/s write / read (slot bytes; aiokv's data path beside RawBlockDevice, its store beside RawBlockCore)",
        "",
        head,
        rule,
    ]
    for r in res:
        line = f"| {r['size'] >> 10} KiB |" + "".join(
            f" {wr(r['aiokv_' + m], 'io_')} | {wr(r['aiokv_' + m])} |" for m in modes
        )
        line += f" {wr(r['rbd'])} | {wr(r['rbc'])} |" + (f" {wr(r['fio'])} |" if fio else "")
        lines.append(line)
    lines += [
        "",
        "Ratios, write / read: aiokv's data path / RawBlockDevice, aiokv's store / RawBlockCore"
        + (", aiokv's data path / fio" if fio else ""),
        "",
        "| payload |" + "".join(f" {m} / RBD | {m} store / RBC |" + (f" {m} / fio |" if fio else "") for m in modes),
        "|---|" + ("---|---|" + ("---|" if fio else "")) * len(modes),
    ]
    for key, what in (("ratios", "ratio of the medians"), ("paired", "median of each round's ratio")):
        for r in res:
            q = r[key]
            lines.append(
                f"| {r['size'] >> 10} KiB, {what} |"
                + "".join(
                    f" {q2(q[m]['rbd'])} | {q2(q[m]['rbc'])} |" + (f" {q2(q[m]['fio'])} |" if fio else "")
                    for m in modes
                )
            )
    lines += ["", "CPU core-s per GB of payload, write / read (process CPU, all threads)", "", head, rule]
    for r in res:
        line = f"| {r['size'] >> 10} KiB |" + "".join(
            f" {cpu(r['aiokv_' + m], 'io_')} | {cpu(r['aiokv_' + m])} |" for m in modes
        )
        line += f" {cpu(r['rbd'])} | {cpu(r['rbc'])} |" + (f" {cpu(r['fio'])} |" if fio else "")
        lines.append(line)
    return "\n".join(lines)


# ------------------------------------------------------------------ machine


def _sh(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def machine(path: str) -> dict:
    mem = ""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem = f"{int(line.split()[1]) / 2**20:.1f} GiB"
    df = _sh(["df", "-hT", path]).splitlines()
    dev = df[-1].split()[0] if len(df) > 1 else ""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().strip()
    except OSError:
        thp = "?"
    return {
        "nproc": os.cpu_count(),
        "memory": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "fio": _sh(["fio", "--version"]),
        "df": df[-1] if df else "",
        "lsblk": _sh(["lsblk", "-dno", "NAME,SIZE,ROTA,MODEL", dev]) if dev else "",
        "thp": thp,
    }


# ------------------------------------------------------------------ main


def _sizes(text: str) -> list[int]:
    return [parse_size(x) for x in text.split(",") if x]


def _rounds(args, work, size, n, depth, workers, mem, arena, peers, log) -> dict:
    """One size and depth: args.rounds rounds of every contender (`peers`: aiokv, fio,
    raw_block, vllm_fs, fio_fixedbufs, those run), each round in another order."""
    rounds: dict[str, list] = {w: [] for w in peers}
    # a CUDA worker's checksum threads (worker/device.py: 2), or None: every checksum on the loop thread
    cpu = concurrent.futures.ThreadPoolExecutor(args.checksum_threads, "bench-crc") if args.checksum_threads else None
    try:
        return _rounds_run(args, work, size, n, depth, workers, mem, arena, peers, log, rounds, cpu)
    finally:
        if cpu is not None:
            cpu.shutdown()


def _rounds_run(args, work, size, n, depth, workers, mem, arena, peers, log, rounds, cpu) -> dict:
    """_rounds' rounds, aiokv with the checksum threads `cpu`."""
    slot = fmt.slot_bytes(size)
    for r in range(args.rounds):
        for who in peers[r % len(peers) :] + peers[: r % len(peers)]:
            if who in ("aiokv", "aiokv_blocks", "aiokv_nocrc"):
                got = aiokv_round(
                    os.path.join(work, "store"),
                    size,
                    n,
                    depth,
                    workers,
                    r,
                    mode=args.mode,
                    secret=args.secret,
                    cpu=cpu,
                    reads="block" if who == "aiokv_blocks" else "window",
                    crc=who != "aiokv_nocrc",
                )
            elif who == "fio":
                got = fio_round(os.path.join(work, "fio.dat"), slot, n, depth, mem)
            elif who == "fio_fixedbufs":
                got = fio_round(os.path.join(work, "fio.dat"), slot, n, depth, mem, fixedbufs=True)
            elif who == "raw_block":
                got = raw_block_round(os.path.join(work, "rbd.dat"), size, n, depth)
            else:
                got = vllm_fs_round(os.path.join(work, "vllmfs"), size, n, depth, arena)
            rounds[who].append(got)
        log(
            f"{size >> 10:>5} KiB depth {depth:>2} round {r + 1}: "
            + " | ".join(f"{w} W {rs[-1]['write_gbps']:.2f} R {rs[-1]['read_gbps']:.2f}" for w, rs in rounds.items())
            + " GB/s"
        )
    return rounds


# aiokv and its variants (--per-block-reads, --no-crc-too), and the prefix of their ratios in a row
MINE = {"aiokv": "", "aiokv_blocks": "blocks_", "aiokv_nocrc": "nocrc_"}


def _row(size: int, n: int, depth: int, workers: int, rounds: dict) -> dict:
    """The medians of one size and depth, and aiokv's ratios to the others: the median of
    each round's ratio (the disk's speed drifts between rounds by more than the differences)."""
    slot = fmt.slot_bytes(size)
    med = {
        who: {
            k: statistics.median(x[k] for x in rs)
            for k in rs[0]
            if isinstance(rs[0][k], (int, float)) and not isinstance(rs[0][k], bool)
        }
        for who, rs in rounds.items()
    }
    for who, m in med.items():
        for rw in ("write", "read"):
            if who == "vllm_fs":  # moves payloads only; its CPU per GB comes with it
                m[f"{rw}_payload_gbps"] = m[f"{rw}_gbps"]
                continue
            for pre in ("", "io_") if f"io_{rw}_gbps" in m else ("",):  # io_: aiokv's data path alone
                m[f"{pre}{rw}_payload_gbps"] = m[f"{pre}{rw}_gbps"] * size / slot  # disk bytes are slots
                m[f"{pre}{rw}_cpu_s_per_gb"] = m[f"{pre}{rw}_cpu_us"] * 1e-6 / (size / 1e9)  # per GB of payload
    row = {"size": size, "slot_bytes": slot, "depth": depth, "blocks": n, "workers": workers, **med, "rounds": rounds}
    # aiokv's ratios (ratio_<peer>, ratio_<peer>_data_path), and its variants' (blocks_ratio_<peer>, ...)
    for mine, head in MINE.items():
        for who in rounds.keys() - MINE.keys() if mine in rounds else ():
            scale = size / slot if who == "vllm_fs" else 1.0  # aiokv's payload bytes against vLLM's
            for pre, suffix in (("", ""), ("io_", "_data_path")):
                if f"{pre}write_gbps" not in rounds[mine][0]:
                    continue
                row[f"{head}ratio_{who}{suffix}"] = {
                    rw: statistics.median(
                        a[f"{pre}{rw}_gbps"] * scale / b[f"{rw}_gbps"] for a, b in zip(rounds[mine], rounds[who])
                    )
                    for rw in ("write", "read")
                }
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    ap.add_argument("--out", default=None, help="also write the JSON document to this file")
    ap.add_argument("--plot", default=None, help="write PNG plots into this directory (needs matplotlib)")
    ap.add_argument("--mib", type=int, default=64, help="MiB moved per phase (write, then read) and contender")
    ap.add_argument("--blocks", type=int, default=None, help="blocks per phase (overrides --mib)")
    ap.add_argument("--sizes", default="64K,256K,1M,2M", help="payload sizes, comma separated")
    ap.add_argument("--depth", default="1,4,16,64", help="queue depths, comma separated")
    ap.add_argument(
        "--mode",
        choices=("batch", "calls"),
        default="batch",
        help="aiokv: batch = one save()/load() call of all N blocks with `depth` operations in the "
        "kernel (how the vLLM worker drives BlockIO); calls = `workers` concurrent loops of "
        "depth/workers blocks per call",
    )
    ap.add_argument(
        "--workers",
        type=int,
        default=None,
        help="aiokv: concurrent save()/load() loops sharing the depth (default: depth, one block "
        "per call; see docs/benchmarks-history.md, section 1)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--no-null", action="store_true", help="skip the null-I/O overhead runs")
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM's fs tier")
    ap.add_argument(
        "--no-raw-block",
        action="store_true",
        help=f"skip LMCache's RawBlockDevice (by default installed with pip --target into {PEER_DIR} if missing)",
    )
    ap.add_argument("--only", default=None, help="run only these contenders: aiokv,fio,raw_block,vllm_fs (for tracing)")
    ap.add_argument("--secret", default=None, help="aiokv: a secret, so every slot carries the MAC and is checked")
    ap.add_argument(
        "--checksum-threads",
        type=int,
        default=0,
        help="aiokv: checksum (and MAC) threads, as a CUDA worker's checksum_threads (2); 0: on the loop thread",
    )
    ap.add_argument(
        "--submit-group",
        type=int,
        default=None,
        help="aiokv's operations per io_uring_enter (0: all at once; default: the ring's, 2)",
    )
    ap.add_argument(
        "--per-block-reads",
        action="store_true",
        help="also run aiokv reading each block into a buffer of its own (the memory tier's pattern: "
        "aiokv_blocks) beside its reads through a window of a few buffers (a worker with memory 0)",
    )
    ap.add_argument(
        "--no-crc-too",
        action="store_true",
        help="also run aiokv without its payload CRC32C pass (aiokv_nocrc; benchmark only: each header "
        "holds its payload's CRC already, as the CPU build's device copy leaves it): what the checksum costs",
    )
    ap.add_argument(
        "--fixedbufs",
        action="store_true",
        help="also run fio with registered buffers (--fixedbufs): what registering would gain",
    )
    ap.add_argument(
        "--peers",
        action="store_true",
        help="aiokv (CRC on 2 checksum threads, and in the copy) against LMCache's RawBlockDevice and "
        "RawBlockCore (and fio) at one depth (default 16), sizes default 256K,1M,2M,4M, 5 rounds "
        f"(needs the optional extra: {PEERS_INSTALL})",
    )
    ap.add_argument("--no-fio", action="store_true", help="--peers: leave fio out")
    ap.add_argument(
        "--peer-crc",
        default="threads,copy",
        help="--peers: aiokv's runs, where the payload CRC32C is computed: threads (2 checksum threads, "
        "a CUDA worker), copy (in the device copy, the CPU build), loop (on the loop thread)",
    )
    ap.add_argument("--settle", type=float, default=0.0, help="seconds of quiet after the sync before each phase")
    ap.add_argument(
        "--peer-keys", type=int, default=None, help="--peers: RawBlockCore keys per call (default: the depth)"
    )
    args = ap.parse_args()
    if args.peers:
        if "--sizes" not in sys.argv:
            args.sizes = "256K,1M,2M,4M"
        if "--rounds" not in sys.argv:
            args.rounds = 5
        if "--mib" not in sys.argv:
            args.mib = 384
        depths = [int(x) for x in (args.depth if "--depth" in sys.argv else "16").split(",") if x]
        if len(depths) != 1:
            ap.error("--peers takes one --depth")
        if not args.no_fio and shutil.which("fio") is None:
            ap.error("fio is not installed (or --no-fio)")
        log = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
        doc = peers_main(args, _sizes(args.sizes), depths[0], log)
        return emit(doc, args, render_peers)
    global SUBMIT_GROUP, SETTLE
    SUBMIT_GROUP = args.submit_group
    SETTLE = args.settle
    sizes = _sizes(args.sizes)
    depths = [int(x) for x in args.depth.split(",") if x]
    if any(s % 4096 for s in sizes):
        ap.error("sizes must be multiples of 4 KiB")
    if args.workers is not None and (args.workers < 1 or args.workers > min(depths)):
        ap.error("--workers must be between 1 and the smallest --depth")
    if shutil.which("fio") is None:
        ap.error("fio is not installed")
    only = [w for w in args.only.split(",") if w] if args.only else None
    vllm_note = "skipped" if args.no_vllm or (only and "vllm_fs" not in only) else vllm_fs_available()
    use_vllm = not vllm_note
    want_rb = not args.no_raw_block and (only is None or "raw_block" in only)
    rb_note = raw_block_available() if want_rb else "skipped"
    peers = ["aiokv", "fio"] + (["raw_block"] if not rb_note else []) + (["vllm_fs"] if use_vllm else [])
    peers += ["aiokv_blocks"] if args.per_block_reads else []
    peers += ["aiokv_nocrc"] if args.no_crc_too else []
    peers += ["fio_fixedbufs"] if args.fixedbufs else []
    if only is not None:
        peers = [w for w in peers if w in only]
    base = args.dir or tempfile.mkdtemp(prefix="aiokv-bench-")
    os.makedirs(base, exist_ok=True)
    work = tempfile.mkdtemp(prefix="run-", dir=base)
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    backend_name = asyncio.run(_backend_name())
    pages = max(-(-d * fmt.slot_bytes(s) // HUGE) for s in sizes for d in depths) + 4
    results = []
    overhead = []
    t_start = time.monotonic()
    mach = machine(base)
    try:
        with HugePages(pages) as hp:
            mem = "mmaphuge" if hp.ok else "malloc"
            for size in sizes:
                slot = fmt.slot_bytes(size)
                n = args.blocks or max(16, (args.mib << 20) // slot)
                arena = None
                if use_vllm:
                    from aiokv.data.buffers import Arena

                    arena = Arena(n * size)  # touched: vLLM's KV view is live memory, not fresh pages
                    ctypes.memset(arena.addr, 0x5A, n * size)
                    k = min(n * size, 1 << 20)
                    ctypes.memmove(arena.addr, os.urandom(k), k)
                if args.mode == "batch":  # aiokv's and raw_block's staging, held for the size's rounds
                    POOLS[slot] = BufferPool(slot, n, populate=True)
                    _fill(POOLS[slot], size)
                try:
                    for depth in depths:
                        workers = args.workers or depth
                        rounds = _rounds(args, work, size, n, depth, workers, mem, arena, peers, log)
                        results.append(_row(size, n, depth, workers, rounds))
                finally:
                    if arena is not None:
                        arena.close()
                    if slot in POOLS:
                        POOLS.pop(slot).close()
            if not args.no_null:
                for size in sizes:
                    d = 16
                    nul = aiokv_round(os.path.join(work, "store"), size, 128, d, d, 99, null_io=True)
                    overhead.append(
                        {
                            "size": size,
                            "depth": d,
                            "write_cpu_us": nul["write_cpu_us"],
                            "read_cpu_us": nul["read_cpu_us"],
                            "crc_us": crc_us(size),
                        }
                    )
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    doc = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "params": {
            "mib": args.mib,
            "blocks": args.blocks,
            "sizes": sizes,
            "depths": depths,
            "workers": args.workers,
            "mode": args.mode,
            "rounds": args.rounds,
            "dir": base,
        },
        "aiokv_backend": backend_name,
        "fio_mem": mem,
        "fio_mem_note": hp.note or (f"nr_hugepages raised by {pages} for the run and set back" if hp.ok else ""),
        "vllm_fs": vllm_note or "vllm.fs_io_C (C helper), DualQueueThreadPool",
        "raw_block": rb_note or f"{RAW_BLOCK_PKG}: RawBlockDevice, batches of depth waited for whole",
        "contenders": peers,
        "secret": bool(args.secret),
        "checksum_threads": args.checksum_threads,
        "machine": mach,
        "seconds": round(time.monotonic() - t_start, 1),
        "results": results,
        "overhead": overhead,
    }
    return emit(doc, args, render, plot)


async def _backend_name() -> str:
    b = open_backend(asyncio.get_running_loop())
    try:
        return b.name
    finally:
        b.close()


NAMES = {
    "fio": "fio",
    "raw_block": "raw_block",
    "vllm_fs": "vLLM fs",
    "fio_fixedbufs": "fio --fixedbufs",
    "aiokv_blocks": "aiokv, a buffer per block",
    "aiokv_nocrc": "aiokv without the CRC",
}


def render(doc: dict) -> str:
    p = doc["params"]
    res = doc["results"]
    others = [w for w in doc.get("contenders", ["aiokv", "fio"]) if w not in MINE]
    has_aiokv = "aiokv" in doc.get("contenders", ["aiokv"])
    q2 = lambda x, k: f"{x[f'write_{k}']:.2f} / {x[f'read_{k}']:.2f}"  # noqa: E731
    lines = [
        f"aiokv {doc['aiokv_backend']} (mode {p.get('mode', 'calls')}"
        f"{', with a secret: CRC32C and MAC' if doc.get('secret') else ', CRC32C'}"
        f" on {doc.get('checksum_threads') or 'no'} checksum threads) against "
        + ", ".join(NAMES[w] for w in others)
        + f"; {p['mib']} MiB per phase, median of {p['rounds']} interleaved rounds; fio buffers: {doc['fio_mem']}"
        f"{' (' + doc['fio_mem_note'] + ')' if doc['fio_mem_note'] else ''}; raw_block: {doc.get('raw_block', '-')}",
        "",
    ]
    dp = has_aiokv and "io_write_gbps" in res[0]["aiokv"]  # aiokv's data path timed alone (batch mode)
    rq = lambda q: f"{q['write']:.2f} / {q['read']:.2f}"  # noqa: E731
    head = "| payload | depth |" + (" aiokv store W/R GB/s |" if has_aiokv else "") + (" data path |" if dp else "")
    for w in others:
        head += f" {NAMES[w]} W/R GB/s |" + (f" store/{NAMES[w]} |" if has_aiokv else "")
        head += f" data path/{NAMES[w]} |" if dp else ""
    cpus = (["aiokv"] if has_aiokv else []) + (["io"] if dp else []) + [w for w in others if w != "vllm_fs"]
    head += " CPU s/GB W/R:" + "".join(f" {'data path' if w == 'io' else w} |" for w in cpus)
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for r in res:
        line = f"| {r['size'] >> 10} KiB | {r['depth']} |" + (f" {q2(r['aiokv'], 'gbps')} |" if has_aiokv else "")
        line += f" {r['aiokv']['io_write_gbps']:.2f} / {r['aiokv']['io_read_gbps']:.2f} |" if dp else ""
        for w in others:
            line += f" {q2(r[w], 'gbps')} |" + (f" {rq(r[f'ratio_{w}'])} |" if has_aiokv else "")
            line += f" {rq(r[f'ratio_{w}_data_path'])} |" if dp else ""
        for w in cpus:
            x, pre = (r["aiokv"], "io_") if w == "io" else (r[w], "")
            line += f" {x[pre + 'write_cpu_s_per_gb']:.3f} / {x[pre + 'read_cpu_s_per_gb']:.3f} |"
        lines.append(line)
    if "aiokv_blocks" in res[0]:
        lines += ["", "aiokv reading each block into a buffer of its own (aiokv_blocks), reads:", ""]
        peers = [w for w in others if f"blocks_ratio_{w}" in res[0]]
        head = "| payload | depth | store R GB/s | data path |" + "".join(f" store/{NAMES[w]} |" for w in peers)
        head += "".join(f" data path/{NAMES[w]} |" for w in peers) + " data path CPU s/GB |"
        lines += [head, "|" + "---|" * (head.count("|") - 1)]
        for r in res:
            b = r["aiokv_blocks"]
            line = f"| {r['size'] >> 10} KiB | {r['depth']} | {b['read_gbps']:.2f} | {b['io_read_gbps']:.2f} |"
            line += "".join(f" {r[f'blocks_ratio_{w}']['read']:.2f} |" for w in peers)
            line += "".join(f" {r[f'blocks_ratio_{w}_data_path']['read']:.2f} |" for w in peers)
            lines.append(line + f" {b['io_read_cpu_s_per_gb']:.3f} |")
    if "aiokv_nocrc" in res[0]:
        lines += ["", "aiokv without its payload CRC32C pass (aiokv_nocrc; benchmark only), data path:", ""]
        peers = [w for w in others if f"nocrc_ratio_{w}_data_path" in res[0]]
        head = "| payload | depth | W/R GB/s |" + "".join(f" /{NAMES[w]} W/R |" for w in peers)
        head += " CPU s/GB W/R | with the CRC | CRC's share |"
        lines += [head, "|" + "---|" * (head.count("|") - 1)]
        for r in res:
            b, a = r["aiokv_nocrc"], r["aiokv"]
            line = f"| {r['size'] >> 10} KiB | {r['depth']} | {b['io_write_gbps']:.2f} / {b['io_read_gbps']:.2f} |"
            line += "".join(f" {rq(r[f'nocrc_ratio_{w}_data_path'])} |" for w in peers)
            cpu = [(b[f"io_{rw}_cpu_s_per_gb"], a[f"io_{rw}_cpu_s_per_gb"]) for rw in ("write", "read")]
            line += f" {cpu[0][0]:.3f} / {cpu[1][0]:.3f} | {cpu[0][1]:.3f} / {cpu[1][1]:.3f} |"
            lines.append(line + f" {cpu[0][1] - cpu[0][0]:.3f} / {cpu[1][1] - cpu[1][0]:.3f} |")
    if doc.get("overhead"):
        lines += ["", "| payload | null-I/O CPU µs/block W/R (depth 16) | CRC32C µs |", "|---|---|---|"]
        for o in doc["overhead"]:
            lines.append(
                f"| {o['size'] >> 10} KiB | {o['write_cpu_us']:.0f} / {o['read_cpu_us']:.0f} | {o['crc_us']:.0f} |"
            )
    lines.append("")
    lines.append(
        "GB/s: bytes each contender moved to/from the disk (aiokv, fio, raw_block: slots of payload + 4 KiB "
        "header, the same I/Os; vLLM fs: the payload). store: aiokv's save and load (reserve, BlockIO, commit; pin, "
        "BlockIO, unpin); data path: its BlockIO calls alone (what a worker runs). A/X: the median of each round's "
        "ratio (aiokv/vLLM compares payload GB/s). CPU s/GB: process CPU seconds per GB of payload."
    )
    return "\n".join(lines)


def plot(doc: dict, outdir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(outdir, exist_ok=True)
    res = doc["results"]
    depths = sorted({r["depth"] for r in res})
    who = [
        ("aiokv", "aiokv", "o-"),
        ("fio", "fio io_uring", "s--"),
        ("raw_block", "LMCache raw_block", "d-."),
        ("vllm_fs", "vLLM fs tier", "^:"),
    ]
    fig, axes = plt.subplots(2, len(depths), figsize=(3.2 * len(depths), 6), sharey="row", squeeze=False)
    for col, d in enumerate(depths):
        rows = sorted((r for r in res if r["depth"] == d), key=lambda r: r["size"])
        xs = [r["size"] >> 10 for r in rows]
        for row, rw in enumerate(("write", "read")):
            ax = axes[row][col]
            for key, label, style in who:
                if key in rows[0]:
                    ax.plot(xs, [r[key][f"{rw}_payload_gbps"] for r in rows], style, label=label)
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs)
            ax.set_xticklabels([f"{x}K" if x < 1024 else f"{x >> 10}M" for x in xs])
            ax.set_title(f"{rw}, depth {d}", fontsize=9)
            ax.grid(alpha=0.3)
            if col == 0:
                ax.set_ylabel("payload GB/s")
            if row == 1:
                ax.set_xlabel("block (payload) size")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(
        f"KV block I/O on one disk, median of {doc['params']['rounds']} rounds ({doc['date'][:10]})", fontsize=10
    )
    fig.tight_layout()
    path = os.path.join(outdir, "store_throughput.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def emit(doc: dict, args, render, plot=None) -> int:
    """The benchmarks' common output: --out FILE (JSON), --plot DIR, --json or a table."""
    if getattr(args, "out", None):
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    if plot is not None and getattr(args, "plot", None):
        plot(doc, args.plot)
    if args.json:
        json.dump(doc, sys.stdout, indent=1)
        print()
    else:
        print(render(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
