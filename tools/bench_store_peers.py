#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""tools/bench_store.py --peers: aiokv's store and data path against LMCache's RawBlockDevice and
RawBlockCore (and fio) at one queue depth, interleaved rounds on one directory.

    PYTHONPATH=. .venv/bin/python tools/bench_store.py --peers [--sizes 256K,1M,2M,4M] [--depth 16]
        [--rounds 5] [--mib 384] [--peer-crc threads,copy] [--peer-keys K] [--no-fio] [--json]

Each contender moves the same slot images (header + payload) from the same staging buffers (one
arena per size, held for every round, as a worker's): aiokv reserves, writes through BlockIO and
commits, then pins, reads and unpins (its data path, the BlockIO calls, timed alone as io_*);
RawBlockDevice writes and reads them in depth-sized batches; RawBlockCore puts and loads them
(--peer-keys a call); fio runs the same I/Os. Ratios are the median of each round's own ratio
("paired") and the ratio of the medians ("ratios"). Installing the peer: tools/peers.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import functools
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aiokv import _native  # noqa: E402
from aiokv.data import blockio  # noqa: E402
from aiokv.data import format as fmt  # noqa: E402
from aiokv.data.buffers import BufferPool  # noqa: E402
from aiokv.data.choice import open_backend  # noqa: E402
from tools import harness, peers  # noqa: E402
from tools.bench_store import NSID, _keys, crc_us, fio_round  # noqa: E402
from tools.storeio import StoreIO  # noqa: E402

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
            harness.phase_sync(settle)
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


def _rbc_peer(path: str, payload: int, n: int, depth: int, salt: int, pool, settle: float, per_call: int) -> dict:
    """RawBlockCore: put_many / load_many_into of `per_call` keys a call (its header and
    payload writes, its index), payloads in place in the same buffers (tools/peers.py)."""
    slot = fmt.slot_bytes(payload)
    peers.make_file(path, peers.META_BYTES + n * slot)
    core = peers.open_core(path, slot, n, depth)
    try:
        keys = [peers.core_key(i, salt) for i in range(n)]
        objs = [peers.Obj(pool.addr(i) + fmt.HEADER_BYTES, payload) for i in range(n)]
        out = {}
        harness.phase_sync(settle)
        p0, t0 = time.process_time(), time.perf_counter()
        ok = []
        for i in range(0, n, per_call):
            ok += core.put_many(keys[i : i + per_call], objs[i : i + per_call]).results
        out["write_s"], out["write_cpu_s"] = time.perf_counter() - t0, time.process_time() - p0
        if not all(ok):
            raise RuntimeError(f"RawBlockCore: {ok.count(False)} puts failed")
        enc = [k.encoded for k in keys]
        harness.phase_sync(settle)
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


def _contenders(args, work: str, size: int, n: int, depth: int, pool, fio_mem: str, per_call: int, who) -> dict:
    """{name: one round of it (called with the round's number)} for one size."""
    import uvloop

    slot = fmt.slot_bytes(size)
    addrs = [pool.addr(i) for i in range(n)]

    def fio(r: int) -> dict:
        harness.phase_sync(args.settle)
        f = fio_round(os.path.join(work, "fio.dat"), slot, n, depth, fio_mem)
        got = {f"{rw}_s": f[f"{rw}_s"] for rw in ("write", "read")}
        got.update({f"{rw}_cpu_s": f[f"{rw}_cpu_us"] * n / 1e6 for rw in ("write", "read")})
        return got

    def aiokv(crc: str):
        store = os.path.join(work, "store")
        return lambda r: uvloop.run(_aiokv_peer(store, size, n, depth, r, pool, crc, args.settle))

    out = {f"aiokv_{c}": aiokv(c) for c in (w[6:] for w in who if w.startswith("aiokv_"))}
    out["rbd"] = lambda r: peers.device_phases(os.path.join(work, "rbd.dat"), slot, n, depth, addrs, args.settle)
    out["rbc"] = lambda r: _rbc_peer(os.path.join(work, "rbc.dat"), size, n, depth, r, pool, args.settle, per_call)
    if "fio" in who:
        out["fio"] = fio
    return out


def _progress(log, size: int, nbytes: int, r: int, rounds: dict) -> None:
    """One line a round: each contender's GB/s (aiokv's data path)."""
    pre = lambda w: "io_" if w.startswith("aiokv") else ""  # noqa: E731
    log(
        f"{size >> 10:>5} KiB round {r + 1}: "
        + " | ".join(
            f"{w} W {nbytes / rs[-1][pre(w) + 'write_s'] / 1e9:.2f} R {nbytes / rs[-1][pre(w) + 'read_s'] / 1e9:.2f}"
            for w, rs in rounds.items()
        )
        + " GB/s"
    )


def peers_main(args, sizes: list[int], depth: int, log) -> dict:
    """aiokv (CRC on checksum threads, and in the copy) against RawBlockDevice and
    RawBlockCore (and fio), interleaved rounds on one directory; see the module docstring."""
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
    mach = harness.machine(base)
    hp = harness.HugePages(max(harness.huge_pages(depth * fmt.slot_bytes(s)) for s in sizes))
    fio_mem = "mmaphuge" if "fio" in who and hp.__enter__().ok else "malloc"
    try:
        for size in sizes:
            slot = fmt.slot_bytes(size)
            n = args.blocks or max(2 * depth, (args.mib << 20) // slot)
            pool = BufferPool(slot, n, populate=True)  # held for all rounds, as a worker's arena
            _peer_fill(pool, size)
            try:
                runs = _contenders(args, work, size, n, depth, pool, fio_mem, per_call, who)
                rounds = harness.interleave(runs, args.rounds, functools.partial(_progress, log, size, n * slot))
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
                                harness.cpu_s_per_gb(x[f"{pre}{rw}_cpu_s"], n * size) for x in rs
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

    return harness.document(
        peers=True,
        params={
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
        versions={p: md.version(p) for p in ("lmcache", "lmcache-rust-raw-block-io")},
        crc32c=_native_crc_note(),
        machine=mach,
        seconds=round(time.monotonic() - t_start, 1),
        results=results,
    )


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
