#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Several drives: aiokv's store over N file systems at once against fio running
the same jobs on the same set of directories, in the same run.

    PYTHONPATH=. .venv/bin/python tools/bench_drives.py --dirs D0,D1,D2 [--sizes 64K,256K,1M,4M]
        [--depth 16] [--mib 384] [--rounds 3] [--settle S] [--crc copy|threads|loop]
        [--submit-group G] [--staging BYTES] [--calls C] [--json] [--out FILE]
    PYTHONPATH=. .venv/bin/python tools/bench_drives.py --loop 3 --image-dir DIR ...   (root: makes them)

--loop N makes N file systems for the run: N image files in --image-dir, each
written whole first (a loop device's first write to a hole of its image allocates
in the file system below), a loop device with direct I/O to its file (losetup
--direct-io=on), ext4 on it made without discarding (a discard punches the image
full of holes again; checked), mounted under a temp directory; unmounted, detached
and deleted at the end (tmpfs mounts instead with --tmpfs, where loop devices
are refused).

For each payload size B a round runs, one after another on the same directories,
the order alternating between rounds (medians of the rounds; one round more at
the first size is not counted: fresh file systems allocate their first blocks
slowly). Before each timed phase of either side, --settle S: a sync and S
seconds of quiet, so that no phase pays for the write-back of the one before
(a write phase's bytes still leaving the host's cache slowed the read phase
after it; without the quiet fio's runs had a process start-up between phases
and aiokv's none).
- aiokv: a Drives store (aiokv/store/drives.py, one Store per directory, a
  namespace of B-byte payloads) with its data path (a DriveIO over one BlockIO
  per drive, each on its drive's own io_uring backend of `depth` operations in
  flight, as a vLLM worker's; tools/storeio.py DrivesIO), n = --mib MiB / slot
  blocks spread by key over the drives: all n reserved on their drives (the
  scheduler side's part in vLLM), written by the data path (DriveIO.write: the
  worker's part), committed to each drive's journal (the scheduler's); then all
  pinned, read and verified (DriveIO.read; in "copy" mode the headers, the
  payload CRC being the device copy's), unpinned. The data path's calls
  (--staging, --calls): from a pool of buffers shared by 4 concurrent loops of
  calls, each call as many blocks as its loop's share of buffers, reused call
  after call. The default pool is a default worker's arena, 1280 MiB: `staging`
  (256 MiB) and the memory tier (`memory`, 1 GiB), which shares the arena and
  keeps each saved block in its buffer, so that saves go round the whole arena;
  --staging 256MiB is a worker with the memory tier off (memory=0), whose saves
  reuse the same few buffers; --staging 0: one call of all n blocks, a buffer
  each. The pool is made, populated and filled once per payload size, as a worker makes
  its arena once at start: made afresh each round, the timed writes were its
  first use, and a fresh pool writes slower than a held one on this VM
  (docs/benchmarks-history.md 11.4; tools/bench_fresh_buffers.py).
  The payloads' CRC32C (--crc): "copy", as a CPU worker computes it, inside the
  device copy that fills the staging buffer (copy_out) or empties it (copy_in),
  which is not part of this benchmark: the headers are stamped and checked here,
  each buffer's payload CRC put in its header before the timed phases; "threads",
  as a CUDA worker, on two checksum threads; "loop", on the loop thread.
  Timed: the data path's calls, and the whole phase with the bookkeeping
  (reserve, commit; pin, unpin), which in vLLM runs in another process.
- fio: one job per directory, run together (group_reporting), io_uring,
  direct=1, bs = the slot (B + 4096 header), iodepth = depth each, a fresh file
  of n/N slots per job written then read: the same I/Os on the same set.
Aggregate GB/s = bytes moved on all drives / wall time (aiokv: of the data path's
calls, and of the whole phase; fio: its group's bytes / the longest job's runtime);
GB = 1e9. The ratios: aiokv's data path / fio, and the whole phase's / fio.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import functools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aiokv.config import parse_size  # noqa: E402
from aiokv.data import format as fmt  # noqa: E402
from aiokv.data.buffers import BufferPool  # noqa: E402
from aiokv.data.choice import open_backend  # noqa: E402
from tools import harness  # noqa: E402
from tools.bench_store import _keys  # noqa: E402
from tools.storeio import DrivesIO  # noqa: E402

NSID = bytes.fromhex("d71e" * 8)
# where aiokv computes the payloads' CRC32C: in the device copy (a CPU worker's way: copy_out leaves
# it in the header, copy_in checks it; the copy is not part of this benchmark, so the CRC is not
# either), on two checksum threads (a CUDA worker's default), or on the loop thread
CRC_MODES = ("copy", "threads", "loop")
SETTLE = [0.0]  # --settle: seconds of quiet before each timed phase
SUBMIT_GROUP = [None]  # --submit-group: operations per io_uring_enter (None: the ring's default)


def quiesce() -> None:
    """Before each timed phase, aiokv's and fio's alike: the file systems synced and
    SETTLE seconds of quiet, so no phase pays for the previous one's write-back."""
    if SETTLE[0] > 0:
        harness.phase_sync(SETTLE[0])


def share_of(n: int, slot: int, staging: int, calls: int) -> int:
    """Blocks per call: all n (staging 0), else each loop's share of the pool; a pool
    that holds the whole phase gives every block its own buffer."""
    return n if not staging else (-(-n // calls) if staging // slot >= n else max(1, staging // slot // calls))


def fill(pool: BufferPool, payload: int) -> None:
    """The same random payload in every buffer (so, in "copy" mode, the same CRC in every header)."""
    rand = os.urandom(payload)
    for s in range(pool.count):
        ctypes.memmove(pool.addr(s) + fmt.HEADER_BYTES, rand, payload)


def make_pool(n: int, payload: int, staging: int, calls: int) -> BufferPool:
    """aiokv's buffers for one payload size, made and filled once for all its rounds
    and populated, as a worker makes its arena once at start (a fresh pool's first
    writes run slower on this VM: docs/benchmarks-history.md 11.4)."""
    slot = fmt.slot_bytes(payload)
    pool = BufferPool(slot, n if not staging else share_of(n, slot, staging, calls) * calls, populate=True)
    fill(pool, payload)
    return pool


async def _aiokv(
    dirs: list[str],
    payload: int,
    n: int,
    depth: int,
    salt: int,
    pool: BufferPool,
    staging: int = 0,
    calls: int = 1,
    crc: str = "copy",
) -> dict:
    """staging 0: one call of all n blocks, a buffer each; else a pool of `staging` bytes
    of buffers (a worker's staging memory), shared evenly by `calls` concurrent loops of
    calls, each call as many blocks as its share of buffers, reused call after call.
    pool: make_pool's (or filled by `fill`), for this size. crc: where the payloads' CRC32C is computed (CRC_MODES)."""
    threads = 2 if crc == "threads" else 0
    roots = [os.path.join(d, "aiokv") for d in dirs]
    for r in roots:
        shutil.rmtree(r, ignore_errors=True)
    slot = fmt.slot_bytes(payload)
    share = share_of(n, slot, staging, calls)
    cpu = concurrent.futures.ThreadPoolExecutor(threads, "bench-crc") if threads else None
    st = DrivesIO(roots, capacity=4 * n * slot * len(dirs), cpu=cpu)
    try:
        for d in st.live:  # a backend per drive, `depth` each, as a worker's (and fio's jobs)
            be = st._backends[d] = open_backend(asyncio.get_running_loop(), depth=depth)
            if hasattr(be, "min_bytes"):
                be.min_bytes = 0  # exactly the depth in flight, as fio's iodepth
            if SUBMIT_GROUP[0] is not None and hasattr(be, "ring"):
                be.ring.submit_group = SUBMIT_GROUP[0]
        ns = st.namespace(NSID, payload, fields={"bench": "bench_drives"})
        keys = _keys(n, salt)
        io = st.blockio(ns)
        if crc == "copy":  # the device copy's part, before the timed phases: each header holds its payload's CRC
            for i, k in enumerate(keys[: pool.count]):  # (the same payload in every buffer: the same CRC)
                io.stamp(k, pool.addr(i))
        in_copy = crc == "copy"

        async def data_path(call, where: list) -> list[int]:
            """The worker's calls: all blocks in one, or `calls` loops over their share of the pool."""
            if not staging:
                return await call([(w, k, pool.addr(i)) for i, (w, k) in enumerate(zip(where, keys))], in_copy)
            starts = iter(range(0, n, share))

            async def loop(c: int) -> list[int]:
                got = []
                for i in starts:
                    got += await call(
                        [
                            (w, k, pool.addr(c * share + j))
                            for j, (w, k) in enumerate(zip(where[i : i + share], keys[i : i + share]))
                        ],
                        in_copy,
                    )
                return got

            return [r for part in await asyncio.gather(*(loop(c) for c in range(calls))) for r in part]

        out = {}
        # write: reserve (the scheduler side's), the data path (the worker's), commit (the scheduler's)
        quiesce()
        t0 = time.perf_counter()
        where = [st.reserve(ns, k) for k in keys]
        if None in where:
            raise RuntimeError("aiokv: reserve refused a block (no room, a drive down, or the key there)")
        t1 = time.perf_counter()
        res = await data_path(io.write, where)
        t2 = time.perf_counter()
        if any(res):
            raise RuntimeError(f"aiokv: write failed: {sorted(set(res))}")
        st.commit(ns, list(zip(keys, where)))
        times = {"write": (t0, t1, t2, time.perf_counter())}
        # read: pin, the data path, unpin
        quiesce()
        t0 = time.perf_counter()
        where = st.pin(ns, keys)
        if None in where:
            raise RuntimeError("aiokv: a committed block was not found")
        t1 = time.perf_counter()
        res = await data_path(io.read, where)
        t2 = time.perf_counter()
        st.unpin(ns, keys)
        times["read"] = (t0, t1, t2, time.perf_counter())
        if any(res):
            raise RuntimeError(f"aiokv: read failed: {sorted(set(res))}")
        for name, (t0, t1, t2, t3) in times.items():
            out[f"{name}_gbps"] = n * slot / (t3 - t0) / 1e9  # the whole: bookkeeping and data path
            out[f"{name}_io_gbps"] = n * slot / (t2 - t1) / 1e9  # the data path alone (a worker's calls)
            out[f"{name}_book_us"] = (t3 - t0 - (t2 - t1)) / n * 1e6
        out["per_drive"] = [s.index.namespaces[NSID].count(s.engine) for _, _, s in st.drives()]
        out["buffers"] = pool.count
        return out
    finally:
        st.close()
        if cpu is not None:
            cpu.shutdown()
        for r in roots:
            shutil.rmtree(r, ignore_errors=True)


def aiokv_round(*a) -> dict:
    import uvloop

    return uvloop.run(_aiokv(*a))


def fio_round(dirs: list[str], slot: int, n: int, depth: int, mem: str) -> dict:
    """One fio job per directory, run together: writing, then reading, n slots in all."""
    per = -(-n // len(dirs))
    files = [os.path.join(d, "fio.dat") for d in dirs]
    out = {}
    try:
        for rw in ("write", "read"):
            quiesce()
            f = harness.fio(files, slot, per * slot, rw, depth, mem)
            out[f"{rw}_gbps"] = f["bytes"] / f["s"] / 1e9
        return out
    finally:
        harness.unlink(*files)


class Mounts:
    """N file systems for the run: loop devices (direct I/O to their image files) with
    ext4, or tmpfs; undone in reverse at exit."""

    def __init__(self, n: int, image_dir: str, size: int, tmpfs: bool):
        self.n, self.image_dir, self.size, self.tmpfs = n, image_dir, size, tmpfs
        self.undo: list[list[str]] = []
        self.dirs: list[str] = []
        self.kind = ""

    def _sh(self, *cmd: str) -> str:
        return subprocess.run(list(cmd), check=True, capture_output=True, text=True).stdout.strip()

    def __enter__(self):
        top = tempfile.mkdtemp(prefix="aiokv-drives-")
        self.undo.append(["rmdir", top])
        try:
            for i in range(self.n):
                mnt = os.path.join(top, f"d{i}")
                os.makedirs(mnt)
                self.undo.append(["rmdir", mnt])
                if self.tmpfs:
                    self._sh("mount", "-t", "tmpfs", "-o", f"size={self.size}", f"aiokv{i}", mnt)
                    self.kind = "tmpfs"
                else:
                    img = os.path.join(self.image_dir, f"aiokv-drive{i}.img")
                    self.undo.append(["rm", "-f", img])
                    # written whole before use: a loop device's first write to a hole of its image
                    # file allocates in the file system below, and whichever side of a round
                    # landed on fresh image blocks paid for it (fio's writes moved 1.9-3.6 GB/s)
                    self._sh(
                        "dd",
                        "if=/dev/zero",
                        f"of={img}",
                        "bs=64M",
                        f"count={-(-self.size // (64 << 20))}",
                        "oflag=direct",
                        "conv=fsync",
                        "status=none",
                    )
                    dev = self._sh("losetup", "--direct-io=on", "-f", "--show", img)
                    self.undo.append(["losetup", "-d", dev])
                    # nodiscard: mkfs discards the whole device by default, and a loop device
                    # discards by punching holes in its image file, which undid the writing above
                    # (a 1 GiB image held 49 MiB after mkfs); the holes were then filled by whichever
                    # side first wrote a region, and aiokv's new directories each round land in
                    # regions fio's file had not yet filled (docs/benchmarks-history.md 11.3)
                    self._sh("mkfs.ext4", "-q", "-F", "-E", "nodiscard,lazy_itable_init=0,lazy_journal_init=0", dev)
                    held = os.stat(img).st_blocks * 512
                    if held < self.size:
                        raise RuntimeError(
                            f"{img}: {held} of {self.size} bytes allocated after mkfs; the"
                            " image must be whole (holes cost whichever side fills them)"
                        )
                    self._sh("mount", dev, mnt)
                    self.kind = f"ext4 on loop devices (direct I/O to image files in {self.image_dir})"
                self.undo.append(["umount", mnt])
                os.chmod(mnt, 0o700)
                self.dirs.append(mnt)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        for cmd in reversed(self.undo):
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode and cmd[0] != "rmdir":  # (a directory left by a failed umount: said once, there)
                print(
                    f"bench_drives: `{' '.join(cmd)}` failed ({(p.stderr or p.stdout).strip()}); "
                    "see `losetup -l` and `mount | grep aiokv-drives`",
                    file=sys.stderr,
                )
        self.undo.clear()


def render(doc: dict) -> str:
    lines: list[str] = []
    how = (
        f"{doc['calls']} loops of calls sharing {doc['staging'] >> 20} MiB of staging buffers"
        if doc["staging"]
        else "one call of all blocks, a buffer each"
    )
    lines.append(
        f"{len(doc['dirs'])} drives ({doc.get('file_systems', 'given directories')}), depth {doc['depth']} each, "
        f"{doc['mib']} MiB per phase, median of {doc['rounds']}; aiokv {how}; fio buffers {doc['fio_mem']}"
    )
    lines.append(
        f"CRC32C: {doc['crc']}; operations per io_uring_enter: {doc['submit_group'] or 'the ring default'}; "
        f"{doc['settle']:g} s of quiet before each phase"
    )
    lines.append(
        "| payload | aiokv W GB/s | fio W GB/s | W ratio | aiokv R GB/s | fio R GB/s | R ratio "
        "| whole W / R ratio | bookkeeping W / R µs per block | blocks per drive | aiokv buffers |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in doc["rows"]:
        io_w, io_r = r["aiokv_write_io_gbps"], r["aiokv_read_io_gbps"]
        book = f"{r['aiokv_write_book_us']:.1f} / {r['aiokv_read_book_us']:.1f}"
        lines.append(
            f"| {r['payload'] >> 10} KiB | {io_w:.2f} | {r['fio_write_gbps']:.2f} | "
            f"**{r['write_ratio']:.2f}** | {io_r:.2f} | {r['fio_read_gbps']:.2f} | "
            f"**{r['read_ratio']:.2f}** | {r['write_ratio_whole']:.2f} / {r['read_ratio_whole']:.2f} | {book} | "
            f"{'/'.join(map(str, r['per_drive']))} | {r['buffers']} |"
        )
    for r in doc["rows"]:
        lines.append(
            f"{r['payload'] >> 10} KiB, each round's own ratio (data path / fio), "
            + "; ".join(
                f"{k}: median {statistics.median(r[f'{k}_ratio_rounds']):.2f}, "
                f"{min(r[f'{k}_ratio_rounds']):.2f}-{max(r[f'{k}_ratio_rounds']):.2f}"
                for k in ("write", "read")
            )
        )
    return "\n".join(lines)


def _progress(log, size: int, r: int, got: dict) -> None:
    a, f = got["aiokv"][-1], got["fio"][-1]
    log(
        f"{size >> 10:>5} KiB round {r + 1}: aiokv W {a['write_gbps']:.2f} R {a['read_gbps']:.2f} "
        f"(data path W {a['write_io_gbps']:.2f} R {a['read_io_gbps']:.2f}) "
        f"(blocks per drive {a['per_drive']}) | fio W {f['write_gbps']:.2f} R {f['read_gbps']:.2f}"
    )


def main() -> int:
    ap = harness.parser(__doc__, rounds=3)
    ap.add_argument("--dirs", default=None, help="comma-separated directories, one per file system")
    ap.add_argument("--loop", type=int, default=0, help="make this many loop-mounted ext4 file systems (root)")
    ap.add_argument("--tmpfs", action="store_true", help="with --loop: tmpfs mounts instead of loop devices")
    ap.add_argument("--image-dir", default="/var/tmp", help="where --loop puts its image files")
    ap.add_argument("--image-size", default="3GiB")
    ap.add_argument("--sizes", default="64K,256K,1M,4M")
    ap.add_argument("--depth", type=int, default=16, help="operations in flight per drive")
    ap.add_argument("--mib", type=int, default=384, help="MiB per phase, all drives together")
    ap.add_argument(
        "--staging",
        default="1280MiB",
        help="the buffers aiokv's calls go round (default: a default worker's arena, staging 256 MiB "
        "+ memory tier 1 GiB; 256MiB: a worker with memory=0); 0 = one call of all blocks, "
        "a buffer each",
    )
    ap.add_argument(
        "--calls",
        type=int,
        default=4,
        help="with --staging: concurrent loops of calls, each on an equal share of the buffers",
    )
    ap.add_argument(
        "--crc",
        choices=CRC_MODES,
        default="copy",
        help="where aiokv computes the payloads' CRC32C: in the device copy, outside the timed I/O "
        "(a CPU worker), on 2 checksum threads (a CUDA worker), or on the loop thread",
    )
    ap.add_argument(
        "--settle",
        type=float,
        default=0.0,
        help="seconds of quiet (after a sync) before each timed phase of either side",
    )
    ap.add_argument(
        "--submit-group", type=int, default=None, help="aiokv: operations per io_uring_enter (default: the ring's)"
    )
    args = ap.parse_args()
    if bool(args.dirs) == bool(args.loop):
        ap.error("give --dirs or --loop N")
    if args.calls < 1:
        ap.error("--calls: at least 1")
    sizes = [parse_size(x) for x in args.sizes.split(",") if x]
    SETTLE[0] = args.settle
    SUBMIT_GROUP[0] = args.submit_group
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    mounts = Mounts(args.loop, args.image_dir, parse_size(args.image_size), args.tmpfs) if args.loop else None
    t0 = time.monotonic()
    staging = parse_size(args.staging)
    doc = harness.document(
        depth=args.depth,
        staging=staging,
        calls=args.calls if staging else 1,
        mib=args.mib,
        rounds=args.rounds,
        crc=args.crc,
        submit_group=args.submit_group,
        settle=args.settle,
        loadavg_start=os.getloadavg(),
        rows=[],
    )
    doc.pop("machine", None)  # (the first drive's, below)
    try:
        if mounts is not None:
            mounts.__enter__()
            dirs = mounts.dirs
            doc["file_systems"] = mounts.kind
        else:
            dirs = args.dirs.split(",")
        doc["dirs"] = dirs
        doc["machine"] = harness.machine(dirs[0])
        pages = max(args.depth * len(dirs) * -(-fmt.slot_bytes(s) // harness.HUGE) for s in sizes) + 4
        with harness.HugePages(pages) as hp:
            mem = hp.mem
            doc["fio_mem"] = mem
            for size in sizes:
                slot = fmt.slot_bytes(size)
                n = max(4 * len(dirs), (args.mib << 20) // slot)
                pool = make_pool(n, size, staging, args.calls)
                try:
                    if size == sizes[0]:  # a round not counted: fresh file systems first allocate slowly
                        aiokv_round(dirs, size, n, args.depth, 99, pool, staging, args.calls, args.crc)
                        fio_round(dirs, slot, n, args.depth, mem)
                    runs = {
                        "aiokv": lambda r, size=size, n=n, pool=pool: aiokv_round(
                            dirs, size, n, args.depth, r, pool, staging, args.calls, args.crc
                        ),
                        "fio": lambda r, slot=slot, n=n: fio_round(dirs, slot, n, args.depth, mem),
                    }
                    got = harness.interleave(runs, args.rounds, functools.partial(_progress, log, size))
                finally:
                    pool.close()
                row = {"payload": size, "slot": slot, "blocks": n, "buffers": got["aiokv"][0]["buffers"]}
                extra = ("write_io_gbps", "read_io_gbps", "write_book_us", "read_book_us")
                for who, rounds in got.items():
                    for k in ("write_gbps", "read_gbps") + (extra if who == "aiokv" else ()):
                        row[f"{who}_{k}"] = harness.medians(rounds)[k]
                # the ratios: aiokv's data path (a worker's calls) against fio; with the store's
                # bookkeeping in the same thread and phase ("whole"), where it is measured apart
                for k in ("write", "read"):
                    row[f"{k}_ratio"] = row[f"aiokv_{k}_io_gbps"] / row[f"fio_{k}_gbps"]
                    row[f"{k}_ratio_whole"] = row[f"aiokv_{k}_gbps"] / row[f"fio_{k}_gbps"]
                row["per_drive"] = got["aiokv"][0]["per_drive"]
                # each round's own ratio (aiokv and fio run next to each other): their spread is the noise
                for k in ("write", "read"):
                    row[f"{k}_ratio_rounds"] = harness.ratios(got["aiokv"], got["fio"], f"{k}_io_gbps", f"{k}_gbps")
                doc["rows"].append(row)
    finally:
        if mounts is not None:
            mounts.__exit__()
    doc["seconds"] = time.monotonic() - t0
    doc["loadavg_end"] = os.getloadavg()
    return harness.emit(doc, args, render)


if __name__ == "__main__":
    raise SystemExit(main())
