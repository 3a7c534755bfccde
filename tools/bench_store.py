#!/usr/bin/env python3
"""Store save/load bandwidth against fio on the same directory, same block size,
same queue depth, same total bytes.

    PYTHONPATH=. .venv/bin/python tools/bench_store.py [--json] [--blocks N] [--sizes 256K,1M,2M]
        [--depth 8] [--workers W] [--rounds 3] [--dir PATH]

For each payload size B a round is:
- aiokv: a fresh Store in DIR, one namespace of B-byte payloads; N blocks saved
  with Store.save, then loaded with Store.load (headers stamped, CRC32C
  computed on save and verified on load, index committed to the journal), on
  uvloop. Staging slots come from one SlotPool (a huge-page-advised arena).
  `depth` blocks are kept in flight as W concurrent save()/load() loops, each
  issuing depth/W blocks per call (W=1: one call of `depth` blocks at a time,
  the pipe drains between calls; W=depth: one block per call, always ~depth
  in flight, most calls). See --workers for the measured choice.
- fio: io_uring, direct=1, bs = the slot size (B + 4096 header), iodepth=depth,
  a fresh file of N slots written then read. Buffers are huge pages
  (--mem=mmaphuge) when /proc/sys/vm/nr_hugepages can be raised (root): it is
  raised for the run and set back after; otherwise fio's default buffers, said
  in the output (its reads are then capped and ratios flatter aiokv).
Rounds interleave (aiokv, fio, aiokv, fio, ...); medians are reported.

aiokv CPU per block is time.process_time() over the phase divided by N (all
threads of this process, user + system). fio's is (usr_cpu + sys_cpu) x its
runtime / N. "null I/O" re-runs save/load with a backend that completes every
operation at once: the CPU aiokv spends per block outside the kernel's I/O
(Python, header stamping, CRC32C, index), and "crc" is CRC32C of one payload.
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aiokv import _native  # noqa: E402
from aiokv.io.backend import IOBackend, open_backend  # noqa: E402
from aiokv.io.buffers import SlotPool  # noqa: E402
from aiokv.store import Store, parse_size  # noqa: E402
from aiokv.store import format as fmt  # noqa: E402

NSID = bytes.fromhex("be0c" * 8)
HUGE = 2 << 20
NR_HUGE = "/proc/sys/vm/nr_hugepages"


# ------------------------------------------------------------------ aiokv side

class NullBackend(IOBackend):
    """Completes every operation at once with its full length (no I/O): for CPU overhead."""

    name = "null"

    def _start(self, batch, ops) -> None:
        for i, op in enumerate(ops):
            batch.complete(i, op[3])

    def _cancel(self, batch) -> None:
        pass

    @property
    def in_flight(self) -> int:
        return 0


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


async def _aiokv_round(root: str, payload: int, n: int, depth: int, workers: int, salt: int,
                       null_io: bool = False) -> dict:
    shutil.rmtree(root, ignore_errors=True)
    per = max(1, depth // workers)
    if null_io:  # one staging slot per key, so a "load" finds the header its save stamped
        n = min(n, 128)
    pool = SlotPool(fmt.slot_bytes(payload), n if null_io else per * workers)
    st = Store(root)
    try:
        if null_io:
            st._backend = NullBackend(asyncio.get_running_loop())  # bench only: no I/O at all
        ns = st.namespace(NSID, payload, fields={"bench": "bench_store"})
        # random payloads (written once; save stamps only the header of each slot)
        rand = os.urandom(payload)
        for s in range(pool.count):
            ctypes.memmove(pool.addr(s) + fmt.HEADER_BYTES, rand, payload)
        keys = _keys(n, salt)
        thp = _anon_huge_kb()

        async def phase(call) -> tuple[float, float]:
            it = iter(range(0, n, per))

            async def loop(w: int) -> None:
                addrs = [pool.addr(w * per + j) for j in range(per)]
                for start in it:
                    ks = keys[start:start + per]
                    if null_io:
                        addrs = [pool.addr(start + j) for j in range(len(ks))]
                    res = await call(ns, list(zip(ks, addrs)))
                    if any(res):
                        raise RuntimeError(f"aiokv: {call.__name__} failed: {res}")

            p0, t0 = time.process_time(), time.perf_counter()
            await asyncio.gather(*(loop(w) for w in range(workers)))
            return time.perf_counter() - t0, time.process_time() - p0

        wt, wc = await phase(st.save)
        rt, rc = await phase(st.load)
        nbytes = n * fmt.slot_bytes(payload)  # bytes the disk moved, as fio counts them
        return {"write_gbps": nbytes / wt / 1e9, "read_gbps": nbytes / rt / 1e9,
                "write_cpu_us": wc / n * 1e6, "read_cpu_us": rc / n * 1e6,
                "write_s": wt, "read_s": rt, "staging_anon_huge_kb": thp}
    finally:
        st.close()
        pool.close()
        shutil.rmtree(root, ignore_errors=True)


def aiokv_round(*a, **kw) -> dict:
    import uvloop

    return uvloop.run(_aiokv_round(*a, **kw))


def crc_us(payload: int, reps: int = 50) -> float:
    pool = SlotPool(fmt.slot_bytes(payload), 1)
    try:
        a = pool.addr(0)
        t = time.perf_counter()
        for _ in range(reps):
            _native.crc32c(a, payload)
        return (time.perf_counter() - t) / reps * 1e6
    finally:
        pool.close()


# ------------------------------------------------------------------ fio side

def fio_round(path: str, slot: int, n: int, depth: int, mem: str) -> dict:
    out = {}
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    try:
        for rw, key in (("write", "write"), ("read", "read")):
            cmd = ["fio", "--name=bench", f"--filename={path}", f"--size={n * slot}", f"--bs={slot}",
                   f"--rw={rw}", "--ioengine=io_uring", "--direct=1", f"--iodepth={depth}",
                   "--output-format=json"]
            if mem == "mmaphuge":
                cmd += ["--mem=mmaphuge", "--hugepage-size=2M"]
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                raise RuntimeError(f"fio failed: {p.stderr.strip() or p.stdout.strip()}")
            j = json.loads(p.stdout[p.stdout.index("{"):])["jobs"][0]
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
    return {"nproc": os.cpu_count(), "memory": mem, "kernel": platform.release(),
            "python": platform.python_version(), "fio": _sh(["fio", "--version"]),
            "df": df[-1] if df else "", "lsblk": _sh(["lsblk", "-dno", "NAME,SIZE,ROTA,MODEL", dev]) if dev else "",
            "thp": thp}


# ------------------------------------------------------------------ main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--sizes", default="256K,1M,2M", help="payload sizes, comma separated")
    ap.add_argument("--depth", type=int, default=8, help="blocks in flight")
    ap.add_argument("--workers", type=int, default=None,
                    help="concurrent save()/load() loops sharing the depth (default: depth, one block per "
                         "call; measured best, see docs/benchmarks.md)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--no-null", action="store_true", help="skip the null-I/O overhead runs")
    args = ap.parse_args()
    workers = args.workers or args.depth
    if workers < 1 or workers > args.depth:
        ap.error("--workers must be between 1 and --depth")
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if any(s % 4096 for s in sizes):
        ap.error("sizes must be multiples of 4 KiB")
    if shutil.which("fio") is None:
        ap.error("fio is not installed")
    base = args.dir or tempfile.mkdtemp(prefix="aiokv-bench-")
    os.makedirs(base, exist_ok=True)
    work = tempfile.mkdtemp(prefix="run-", dir=base)
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    backend_name = asyncio.run(_backend_name())
    pages = max(-(-args.depth * fmt.slot_bytes(s) // HUGE) for s in sizes) + 4
    results = []
    t_start = time.monotonic()
    mach = machine(base)
    try:
        with HugePages(pages) as hp:
            mem = "mmaphuge" if hp.ok else "malloc"
            for size in sizes:
                slot = fmt.slot_bytes(size)
                rounds = {"aiokv": [], "fio": []}
                for r in range(args.rounds):
                    a = aiokv_round(os.path.join(work, "store"), size, args.blocks, args.depth, workers, r)
                    rounds["aiokv"].append(a)
                    f = fio_round(os.path.join(work, "fio.dat"), slot, args.blocks, args.depth, mem)
                    rounds["fio"].append(f)
                    log(f"{size >> 10:>5} KiB round {r + 1}: aiokv W {a['write_gbps']:.2f} R {a['read_gbps']:.2f}"
                        f" | fio W {f['write_gbps']:.2f} R {f['read_gbps']:.2f} GB/s")
                med = {who: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for who, rs in rounds.items()}
                row = {"size": size, "slot_bytes": slot, "aiokv": med["aiokv"], "fio": med["fio"],
                       "ratio": {"write": med["aiokv"]["write_gbps"] / med["fio"]["write_gbps"],
                                 "read": med["aiokv"]["read_gbps"] / med["fio"]["read_gbps"]},
                       "rounds": rounds}
                if not args.no_null:
                    nul = aiokv_round(os.path.join(work, "store"), size, args.blocks, args.depth, workers, 99,
                                      null_io=True)
                    row["null_io"] = {"write_cpu_us": nul["write_cpu_us"], "read_cpu_us": nul["read_cpu_us"]}
                    row["crc_us"] = crc_us(size)
                results.append(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    doc = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "params": {"blocks": args.blocks, "depth": args.depth, "workers": workers,
                   "per_call": max(1, args.depth // workers), "rounds": args.rounds, "dir": base},
        "aiokv_backend": backend_name,
        "fio_mem": mem,
        "fio_mem_note": hp.note or (f"nr_hugepages raised by {pages} for the run and set back" if hp.ok else ""),
        "machine": mach,
        "seconds": round(time.monotonic() - t_start, 1),
        "results": results,
    }
    if args.json:
        json.dump(doc, sys.stdout, indent=1)
        print()
    else:
        print(render(doc))
    return 0


async def _backend_name() -> str:
    b = open_backend(asyncio.get_running_loop())
    try:
        return b.name
    finally:
        b.close()


def render(doc: dict) -> str:
    p = doc["params"]
    lines = [f"aiokv {doc['aiokv_backend']} vs fio io_uring, direct, {p['blocks']} blocks, depth {p['depth']} "
             f"({p['workers']} x {p['per_call']} per call), median of {p['rounds']} rounds; fio buffers: "
             f"{doc['fio_mem']}{' (' + doc['fio_mem_note'] + ')' if doc['fio_mem_note'] else ''}",
             "",
             "| payload | aiokv write GB/s | fio write GB/s | ratio | aiokv read GB/s | fio read GB/s | ratio "
             "| aiokv CPU µs/block W/R | fio CPU µs/block W/R | null-I/O CPU µs/block W/R | CRC32C µs |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        a, f = r["aiokv"], r["fio"]
        nul = r.get("null_io")
        null_s = f"{nul['write_cpu_us']:.0f} / {nul['read_cpu_us']:.0f}" if nul else "-"
        crc_s = f"{r['crc_us']:.0f}" if "crc_us" in r else "-"
        lines.append(
            f"| {r['size'] >> 10} KiB | {a['write_gbps']:.2f} | {f['write_gbps']:.2f} | {r['ratio']['write']:.2f} "
            f"| {a['read_gbps']:.2f} | {f['read_gbps']:.2f} | {r['ratio']['read']:.2f} "
            f"| {a['write_cpu_us']:.0f} / {a['read_cpu_us']:.0f} | {f['write_cpu_us']:.0f} / {f['read_cpu_us']:.0f} "
            f"| {null_s} | {crc_s} |")
    lines.append("")
    lines.append("GB/s: bytes moved to/from the disk (slots of payload + 4 KiB header), the same I/Os for both; "
                 "payload GB/s = that x payload / slot.")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
