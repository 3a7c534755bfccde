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

import asyncio
import concurrent.futures
import ctypes
import datetime
import errno
import functools
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from array import array

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aiokv import _native  # noqa: E402
from aiokv.config import parse_size  # noqa: E402
from aiokv.data import format as fmt  # noqa: E402
from aiokv.data import window  # noqa: E402
from aiokv.data.backend import IOBackend  # noqa: E402
from aiokv.data.buffers import BufferPool  # noqa: E402
from aiokv.data.choice import open_backend  # noqa: E402
from aiokv.data.window import read_through, shape  # noqa: E402
from tools import harness, peers  # noqa: E402
from tools.storeio import StoreIO  # noqa: E402

NSID = bytes.fromhex("be0c" * 8)
# the io_uring ring's settings given on the command line (--submit-group, --merge-bytes), set on aiokv's ring
RING: dict[str, int] = {}
# --settle: before every timed phase of every contender the file system is synced (on a file system mounted
# with `discard` a delete's discards are issued when the journal commits: a previous round's files, freed
# just before, otherwise land in the next phase), then this many seconds of quiet
SETTLE = 0.0
# --copy-in loop|thread: each chunk a load read is copied into a "KV cache" (KV[slot], a payload per block)
# before its buffers go back, the payload's CRC checked in the copy; "loop": on the loop thread, as the
# CPU worker's load does (worker/loads.py, Device.copy_in); "thread": on a thread of the loop's executor;
# "pumped": on the loop thread in pieces of PUMP_BYTES, the ring reaped and refilled between them
COPY_IN: str | None = None
PUMP_BYTES = 1 << 20
KV: dict[int, BufferPool] = {}


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
            for name, value in RING.items() if hasattr(st._backend, "ring") else ():
                setattr(st._backend.ring, name, value)  # --submit-group, --merge-bytes
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

            harness.phase_sync(SETTLE)
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
            if COPY_IN == "thread":
                await asyncio.get_running_loop().run_in_executor(
                    None, _copy_in, pool, io.payload_bytes, [i for i, _, _ in part], bufs, res, crc
                )
            elif COPY_IN:  # on the loop thread: whole ("loop"), or in pieces with the ring reaped between them
                ids = [i for i, _, _ in part]
                per = max(1, PUMP_BYTES // io.payload_bytes) if COPY_IN == "pumped" else len(ids)
                for j in range(0, len(ids), per):
                    if j:
                        io.backend._on_ready()  # what the loop's wake-up would do: reap, refill the ring
                    piece = res[j : j + per]
                    _copy_in(pool, io.payload_bytes, ids[j : j + per], bufs[j : j + per], piece, crc)
                    res[j : j + per] = piece
            for (i, _, _), r in zip(part, res):
                out[i] = r
        finally:
            give(bufs)

    try:
        todo = [(i, s, k) for i, (s, k) in enumerate(zip(slots, keys)) if s is not None]
        if COPY_IN:
            _kv(pool, io.payload_bytes)
        p0, t0 = time.process_time(), time.perf_counter()
        await read_through(todo, take, give, run, *shape(io))
        spent["read"][0] += time.perf_counter() - t0
        spent["read"][1] += time.process_time() - p0
    finally:
        st.unpin(ns, [k for k, s in zip(keys, slots) if s is not None])
    return out


def _kv(pool: BufferPool, payload: int) -> BufferPool:
    """--copy-in's KV cache for `pool`'s slots: made (its pages touched) once, before a load is timed."""
    if pool.slot_bytes not in KV:
        KV[pool.slot_bytes] = BufferPool(payload, pool.count, populate=True)
    return KV[pool.slot_bytes]


def _copy_in(pool: BufferPool, payload: int, blocks: list[int], bufs: list[int], res: list[int], crc: bool) -> None:
    """--copy-in: the payloads of `bufs` into KV blocks `blocks` (as CpuDevice.copy_in): a plain copy
    where the read checked the payloads' CRC (`crc`), else their CRC checked in the copy (a mismatch
    is a failed read)."""
    kv = _kv(pool, payload)
    dst = array("q", [kv.addr(b % kv.count) for b in blocks]).tobytes()
    if crc:
        _native.memcpy_many(dst, array("q", [pool.addr(b) + fmt.HEADER_BYTES for b in bufs]).tobytes(), payload)
        return
    verdicts = _native.memcpy_crc_in(dst, array("q", [pool.addr(b) for b in bufs]).tobytes(), payload)
    for j, v in enumerate(verdicts):
        if v and res[j] == 0:
            res[j] = -errno.EBADMSG


def _time_data_path(io, reads: bool = True, crc: bool = True) -> dict:
    """Wraps BlockIO `io`'s write and read (the data path a worker runs: stamp, write; read,
    verify) so each call adds its wall and process CPU seconds to the returned
    {"write": [s, cpu_s], "read": [...]}: with one call per phase (batch mode), the data
    path's share of the store's save and load (which add reserve and commit, pin and unpin)."""
    spent = {"write": [0.0, 0.0], "read": [0.0, 0.0]}

    def timed(rw: str, fn):
        async def call(items, crc_in_copy: bool = False, **kw):
            p0, t0 = time.process_time(), time.perf_counter()
            try:
                return await fn(items, crc_in_copy or not crc, **kw)  # not crc: as if a device copy had made it
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
    """fio writing then reading a fresh file of n slots (the same I/Os as aiokv's)."""
    out = {}
    harness.unlink(path)
    try:
        for rw in ("write", "read"):
            harness.phase_sync(SETTLE)
            f = harness.fio([path], slot, n * slot, rw, depth, mem, fixedbufs)
            out[f"{rw}_gbps"] = n * slot / f["s"] / 1e9
            out[f"{rw}_cpu_us"] = f["cpu_s"] / n * 1e6
            out[f"{rw}_s"] = f["s"]
        return out
    finally:
        harness.unlink(path)


# ------------------------------------------------------------------ LMCache's raw_block side


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
        got = peers.device_phases(path, slot, n, depth, [pool.addr(i) for i in range(n)], SETTLE)
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
            out[f"{rw}_cpu_s_per_gb"] = harness.cpu_s_per_gb(dc, n * payload)
            out[f"{rw}_s"] = dt
    finally:
        pool.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    return out


# ------------------------------------------------------------------ main


def _sizes(text: str) -> list[int]:
    return [parse_size(x) for x in text.split(",") if x]


def _rounds(args, work, size, n, depth, workers, mem, arena, who, log) -> dict:
    """One size and depth: args.rounds interleaved rounds of every contender (`who`: aiokv,
    fio, raw_block, vllm_fs, fio_fixedbufs, those run), each round in another order."""
    # a CUDA worker's checksum threads (worker/cuda.py: 2), or None: every checksum on the loop thread
    cpu = concurrent.futures.ThreadPoolExecutor(args.checksum_threads, "bench-crc") if args.checksum_threads else None
    slot = fmt.slot_bytes(size)
    fio_at = os.path.join(work, "fio.dat")

    def aiokv(w: str):
        return lambda r: aiokv_round(
            os.path.join(work, "store"),
            size,
            n,
            depth,
            workers,
            r,
            mode=args.mode,
            secret=args.secret,
            cpu=cpu,
            reads="block" if w == "aiokv_blocks" else "window",
            crc=w != "aiokv_nocrc",
        )

    runs = {w: aiokv(w) for w in MINE}
    runs["fio"] = lambda r: fio_round(fio_at, slot, n, depth, mem)
    runs["fio_fixedbufs"] = lambda r: fio_round(fio_at, slot, n, depth, mem, fixedbufs=True)
    runs["raw_block"] = lambda r: raw_block_round(os.path.join(work, "rbd.dat"), size, n, depth)
    runs["vllm_fs"] = lambda r: vllm_fs_round(os.path.join(work, "vllmfs"), size, n, depth, arena)

    def progress(r: int, rounds: dict) -> None:
        log(
            f"{size >> 10:>5} KiB depth {depth:>2} round {r + 1}: "
            + " | ".join(f"{w} W {rs[-1]['write_gbps']:.2f} R {rs[-1]['read_gbps']:.2f}" for w, rs in rounds.items())
            + " GB/s"
        )

    try:
        return harness.interleave({w: runs[w] for w in who}, args.rounds, progress)
    finally:
        if cpu is not None:
            cpu.shutdown()


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
                    rw: harness.paired(rounds[mine], rounds[who], f"{pre}{rw}_gbps", f"{rw}_gbps", scale)
                    for rw in ("write", "read")
                }
    return row


def main() -> int:
    ap = harness.parser(__doc__, rounds=3, plot=True)
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
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--no-null", action="store_true", help="skip the null-I/O overhead runs")
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM's fs tier")
    ap.add_argument(
        "--no-raw-block",
        action="store_true",
        help=f"skip LMCache's RawBlockDevice (by default installed with pip --target into {peers.PEER_DIR} if missing)",
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
        "--merge-bytes",
        type=lambda t: _sizes(t)[0],
        default=None,
        help="aiokv: adjacent writes of one batch merged into one vectored write up to this many bytes "
        "(0: never; default: the ring's, data/uring.py MERGE_WRITE_BYTES)",
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
        help="also run aiokv without its payload CRC32C pass (aiokv_nocrc: each header holds its payload's "
        "CRC already, as the device copy leaves it, on the CPU build inside its memcpy and on CUDA made on the "
        "GPU, worker/devcrc.py): what the checksum costs, and a CUDA worker's host side",
    )
    ap.add_argument(
        "--copy-in",
        choices=("loop", "thread", "pumped"),
        default=None,
        help="aiokv's loads copy each chunk into a KV cache (the payload CRC checked in the copy) before its "
        "buffers go back: on the loop thread, as a CPU worker's do (loop), or on a thread of the loop's "
        "executor (thread), or on the loop thread in pieces of --pump-bytes with the ring reaped and refilled "
        "between them (pumped: measured, not kept); fio and raw_block copy nothing",
    )
    ap.add_argument(
        "--pump-bytes",
        type=lambda t: _sizes(t)[0],
        default=1 << 20,
        help="--copy-in pumped: bytes copied between two reaps of the ring (at least one block)",
    )
    ap.add_argument(
        "--window-slack",
        type=int,
        default=None,
        help="aiokv's loads: chunks read ahead past those that fill the queue (data/window.py SLACK_CHUNKS)",
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
        f"(needs the optional extra: {peers.INSTALL})",
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
        from tools import bench_store_peers as bp

        return harness.emit(bp.peers_main(args, _sizes(args.sizes), depths[0], log), args, bp.render_peers)
    global SETTLE, COPY_IN, PUMP_BYTES
    RING.update(
        (k, v) for k, v in (("submit_group", args.submit_group), ("merge_bytes", args.merge_bytes)) if v is not None
    )
    SETTLE, COPY_IN, PUMP_BYTES = args.settle, args.copy_in, args.pump_bytes
    if args.window_slack is not None:
        window.SLACK_CHUNKS = args.window_slack
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
    rb_note = peers.install_device() if want_rb else "skipped"
    who = ["aiokv", "fio"] + (["raw_block"] if not rb_note else []) + (["vllm_fs"] if use_vllm else [])
    who += ["aiokv_blocks"] if args.per_block_reads else []
    who += ["aiokv_nocrc"] if args.no_crc_too else []
    who += ["fio_fixedbufs"] if args.fixedbufs else []
    if only is not None:
        who = [w for w in who if w in only]
    base = args.dir or tempfile.mkdtemp(prefix="aiokv-bench-")
    os.makedirs(base, exist_ok=True)
    work = tempfile.mkdtemp(prefix="run-", dir=base)
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    backend_name = asyncio.run(_backend_name())
    pages = max(harness.huge_pages(d * fmt.slot_bytes(s)) for s in sizes for d in depths)
    results = []
    overhead = []
    t_start = time.monotonic()
    mach = harness.machine(base)
    try:
        with harness.HugePages(pages) as hp:
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
                        rounds = _rounds(args, work, size, n, depth, workers, mem, arena, who, log)
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
            "copy_in": args.copy_in,
            "window_slack": window.SLACK_CHUNKS,
            "dir": base,
        },
        "aiokv_backend": backend_name,
        "fio_mem": mem,
        "fio_mem_note": hp.note or (f"nr_hugepages raised by {pages} for the run and set back" if hp.ok else ""),
        "vllm_fs": vllm_note or "vllm.fs_io_C (C helper), DualQueueThreadPool",
        "raw_block": rb_note or f"{peers.RAW_BLOCK_PKG}: RawBlockDevice, batches of depth waited for whole",
        "contenders": who,
        "secret": bool(args.secret),
        "checksum_threads": args.checksum_threads,
        "machine": mach,
        "seconds": round(time.monotonic() - t_start, 1),
        "results": results,
        "overhead": overhead,
    }
    return harness.emit(doc, args, render, plot)


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
    "aiokv_nocrc": "aiokv, the CRC made by the device",
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
        lines += [
            "",
            "aiokv without its payload CRC32C pass (aiokv_nocrc: the CRC made by the device copy, as a CUDA "
            "worker's GPU makes it), data path:",
            "",
        ]
        peers = [w for w in others if f"nocrc_ratio_{w}_data_path" in res[0]]
        head = "| payload | depth | W/R GB/s |" + "".join(f" /{NAMES[w]} W/R |" for w in peers)
        head += " CPU s/GB W/R | with the CRC | CRC's share |"
        lines += [head, "|" + "---|" * (head.count("|") - 1)]
        for r in res:
            b, a = r["aiokv_nocrc"], r.get("aiokv")  # (no aiokv with --only: its columns say -)
            line = f"| {r['size'] >> 10} KiB | {r['depth']} | {b['io_write_gbps']:.2f} / {b['io_read_gbps']:.2f} |"
            line += "".join(f" {rq(r[f'nocrc_ratio_{w}_data_path'])} |" for w in peers)
            mine = [b[f"io_{rw}_cpu_s_per_gb"] for rw in ("write", "read")]
            line += f" {mine[0]:.3f} / {mine[1]:.3f} |"
            if a is None:
                lines.append(line + " - | - |")
                continue
            full = [a[f"io_{rw}_cpu_s_per_gb"] for rw in ("write", "read")]
            line += f" {full[0]:.3f} / {full[1]:.3f} |"
            lines.append(line + f" {full[0] - mine[0]:.3f} / {full[1] - mine[1]:.3f} |")
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


if __name__ == "__main__":
    raise SystemExit(main())
