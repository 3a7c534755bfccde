#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Lookups on the scheduler thread while other engines write to the same directory.

    PYTHONPATH=. .venv/bin/python tools/bench_engines.py [--writers 0,1,3] [--blocks 26400]
                                                         [--seconds 5] [--rate 3200] [--sqlite] [--roll N]

This process is engine 0: it holds `--blocks` committed blocks and times
Store.lookup of a 64-key request (32 hits, then a miss) in a loop, the way
get_num_new_matched_tokens calls it; lookups also do the periodic refresh
(following the other engines' journals), so its cost is in the figures. Each
writer is another process and engine on the same directory committing `--rate`
blocks per second in batches of 32 (index only, no data I/O: this measures the
index, like tools/bench_index.py). `--writers 0` runs on an aiokv from before
several engines too (PYTHONPATH=that checkout), for the single-engine baseline. Prints per-lookup mean/p50/p99/max, the
refresh cost, and how many of the writers' blocks engine 0 saw.

--roll N times what another engine's checkpoint of N blocks costs this one (the
document's `roll`). --sqlite also times the alternative design of a shared index in
SQLite (WAL mode): a writer's commit of a batch of 32 rows, and a follower's poll for
new rows, against this store's journal append and Follower.poll (`sqlite`). Results in
docs/benchmarks.md and docs/design.md.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aiokv.data import format as fmt  # noqa: E402
from aiokv.store import Store  # noqa: E402
from tools import harness  # noqa: E402

NSID = b"b" * 16
_loc = getattr(fmt, "loc", lambda engine, slot: slot)  # so --writers 0 also runs on a single-engine aiokv
PAYLOAD = 4096
BATCH = 32


def _commit(st: Store, ns, keys) -> None:
    """Commit keys without data I/O (slots planned, not backed)."""
    slots = ns.alloc.plan_grow(len(keys))
    ns.alloc.grow(slots)
    batch = []
    for k in keys:
        s = ns.alloc.take()
        ns.pending[k] = _loc(getattr(st, "engine", 0), s)
        batch.append((k, ns.pending[k]))
    st.commit(ns, batch)


def writer(root: str, wid: int, rate: int, stop, ready) -> None:
    st = Store(root)
    ns = st.namespace(NSID, PAYLOAD)
    ready.set()
    i = 0
    period = BATCH / rate
    nxt = time.monotonic()
    while not stop.is_set():
        _commit(st, ns, [(wid << 40 | (i + j)).to_bytes(8, "little") * 4 for j in range(BATCH)])
        i += BATCH
        nxt += period
        time.sleep(max(0.0, nxt - time.monotonic()))
    st.close()


def bench_lookups(root: str, writers: int, blocks: int, seconds: float, rate: int) -> dict:
    import inspect

    shutil.rmtree(root, ignore_errors=True)
    # the reader opened as the connector opens it: with the store's I/O thread where this aiokv has one
    st = Store(root, **({"io_thread": True} if "io_thread" in inspect.signature(Store).parameters else {}))
    ns = st.namespace(NSID, PAYLOAD)
    keys = [i.to_bytes(8, "little") * 4 for i in range(blocks)]
    for i in range(0, blocks, 1000):
        _commit(st, ns, keys[i : i + 1000])
    req = keys[:32] + [b"\xff" * 32] * 32  # 32 hits then misses: 1024 hit tokens of 2048 at block size 32
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    procs = []
    for w in range(writers):
        ready = ctx.Event()
        p = ctx.Process(target=writer, args=(root, w + 1, rate, stop, ready))
        p.start()
        ready.wait(60)
        procs.append(p)
    samples = []
    refresh = []
    steps = []  # a step's 1000 lookups and its refresh together
    lookup = st.lookup
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter_ns()
        for _ in range(1000):
            t = time.perf_counter_ns()
            n = lookup(ns, req)
            samples.append(time.perf_counter_ns() - t)
        assert n == 32
        if hasattr(st, "refresh"):  # what the scheduler's plan() adds once per step
            t = time.perf_counter_ns()
            st.refresh()
            refresh.append(time.perf_counter_ns() - t)
        steps.append(time.perf_counter_ns() - t0)
        time.sleep(0.002)  # the rest of a scheduler step
    stop.set()
    for p in procs:
        p.join(30)
    time.sleep(0.2)
    if hasattr(st, "refresh"):
        st.following.followed = 0
        st.refresh()
    seen = ns.count() - blocks
    st.close()
    shutil.rmtree(root, ignore_errors=True)
    samples.sort()
    refresh.sort()
    steps.sort()
    q = lambda xs, f: xs[min(len(xs) - 1, int(f * len(xs)))] / 1000  # noqa: E731
    return {
        "writers": writers,
        "lookups": len(samples),
        "mean_us": statistics.fmean(samples) / 1000,
        "p50_us": q(samples, 0.5),
        "p99_us": q(samples, 0.99),
        "max_us": samples[-1] / 1000,
        "refresh_mean_us": statistics.fmean(refresh) / 1000 if refresh else None,
        "refresh_p50_us": q(refresh, 0.5) if refresh else None,
        "refresh_p99_us": q(refresh, 0.99) if refresh else None,
        "step_mean_us": statistics.fmean(steps) / 1000,
        "steps": len(steps),
        "peer_blocks_seen": seen,
    }


def bench_sqlite(root: str, batches: int = 2000) -> dict:
    """Commit latency and follower poll cost: SQLite WAL vs this store's journal."""
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    db = sqlite3.connect(os.path.join(root, "index.db"), isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("CREATE TABLE blocks (key BLOB PRIMARY KEY, engine INT, slot INT, atime INT)")
    reader = sqlite3.connect(os.path.join(root, "index.db"), isolation_level=None)
    last = 0
    t_commit = t_poll = 0
    for b in range(batches):
        rows = [((b * BATCH + j).to_bytes(8, "little") * 4, 1, b * BATCH + j, time.time_ns()) for j in range(BATCH)]
        t = time.perf_counter_ns()
        db.execute("BEGIN")
        db.executemany("INSERT INTO blocks VALUES (?, ?, ?, ?)", rows)
        db.execute("COMMIT")
        t_commit += time.perf_counter_ns() - t
        t = time.perf_counter_ns()
        got = reader.execute("SELECT rowid, key, slot FROM blocks WHERE rowid > ?", (last,)).fetchall()
        last = got[-1][0]
        t_poll += time.perf_counter_ns() - t
    t = time.perf_counter_ns()
    for _ in range(batches):
        reader.execute("SELECT rowid FROM blocks WHERE rowid > ?", (last,)).fetchall()
    t_idle = time.perf_counter_ns() - t
    out = {
        "batches": batches,
        "sqlite_commit_us": t_commit / batches / 1000,
        "sqlite_poll_us": t_poll / batches / 1000,
        "sqlite_idle_poll_us": t_idle / batches / 1000,
    }
    db.close()
    reader.close()
    shutil.rmtree(root, ignore_errors=True)
    st = Store(os.path.join(root, "s"), engine=1)
    ns = st.namespace(NSID, PAYLOAD)
    ro = Store(os.path.join(root, "s"), engine=0)
    ro.follow_interval = 0
    rns = ro.namespace(NSID, PAYLOAD)
    fl = ro.followers[(NSID, 1)]
    t_commit = t_poll = 0
    for b in range(batches):
        keys = [(b * BATCH + j).to_bytes(8, "little") * 4 for j in range(BATCH)]
        t = time.perf_counter_ns()
        _commit(st, ns, keys)
        t_commit += time.perf_counter_ns() - t
        t = time.perf_counter_ns()
        ro.following.follow(rns)
        t_poll += time.perf_counter_ns() - t
    assert rns.count() == batches * BATCH
    t = time.perf_counter_ns()
    for _ in range(batches):
        fl.poll()
    t_idle = time.perf_counter_ns() - t
    out["journal_commit_us"] = t_commit / batches / 1000
    out["journal_follow_us"] = t_poll / batches / 1000
    out["journal_idle_poll_us"] = t_idle / batches / 1000
    st.close()
    ro.close()
    shutil.rmtree(root, ignore_errors=True)
    return out


def bench_roll(root: str, n: int) -> dict:
    """What another engine's checkpoint costs this engine's scheduler thread: a full
    replay of its files (first look) vs rolling over to the new generation."""
    shutil.rmtree(root, ignore_errors=True)
    st = Store(root, engine=1, checkpoint_every=10**12)
    ns = st.namespace(NSID, PAYLOAD)
    for i in range(0, n, 1000):
        _commit(st, ns, [(j).to_bytes(8, "little") * 4 for j in range(i, min(i + 1000, n))])
    t = time.perf_counter()
    me = Store(root, engine=0)  # its first look at engine 1: a full replay of engine 1's journal
    rns = me.namespace(NSID, PAYLOAD)
    t_replay = time.perf_counter() - t
    st.checkpoint()
    _commit(st, ns, [(n + j).to_bytes(8, "little") * 4 for j in range(BATCH)])
    me.following.followed = 0
    t = time.perf_counter()
    me.following.follow_all()
    t_roll = time.perf_counter() - t
    assert rns.count() == n + BATCH
    st.close()
    me.close()
    shutil.rmtree(root, ignore_errors=True)
    return {"blocks": n, "first_look_s": t_replay, "roll_ms": t_roll * 1000}


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--writers", default="0,1,3")
    ap.add_argument("--blocks", type=int, default=26400)
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--rate", type=int, default=3200, help="blocks committed per second by each writer")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--sqlite", action="store_true")
    ap.add_argument("--roll", type=int, default=0, help="also time following a checkpoint of N blocks")
    args = ap.parse_args()
    base = args.dir or tempfile.mkdtemp(prefix="aiokv-engines-")
    more = {}
    if args.sqlite:
        more["sqlite"] = bench_sqlite(os.path.join(base, "sqlite"))
    if args.roll:
        more["roll"] = bench_roll(os.path.join(base, "roll"), args.roll)
    rows = []
    for w in [int(x) for x in args.writers.split(",") if x]:
        r = bench_lookups(os.path.join(base, "store"), w, args.blocks, args.seconds, args.rate)
        rows.append({"writers": w, "rate": args.rate, **r})
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)
    return harness.emit(harness.document(rows=rows, **more), args, render)


def render(doc: dict) -> str:
    lines = []
    sq = doc.get("sqlite")
    if sq:
        lines += [
            f"sqlite WAL: commit of {BATCH} rows {sq['sqlite_commit_us']:.1f} us, follower poll with new rows "
            f"{sq['sqlite_poll_us']:.1f} us, without {sq['sqlite_idle_poll_us']:.1f} us",
            f"aiokv journal: commit of {BATCH} records {sq['journal_commit_us']:.1f} us, follow with new records "
            f"{sq['journal_follow_us']:.1f} us, journal poll without {sq['journal_idle_poll_us']:.1f} us",
        ]
    ro = doc.get("roll")
    if ro:
        lines.append(
            f"another engine with {ro['blocks']} blocks: first look (full replay) {ro['first_look_s']:.2f} s; after "
            f"its checkpoint, the look that rolls over {ro['roll_ms']:.2f} ms"
        )
    for r in doc["rows"]:
        rf = (
            f"mean {r['refresh_mean_us']:.1f} us, p50 {r['refresh_p50_us']:.1f}, p99 {r['refresh_p99_us']:.1f}"
            if r["refresh_mean_us"] is not None
            else "n/a"
        )
        lines.append(
            f"{r['writers']} writer engine(s) at {r['rate']} blocks/s each: lookup of 64 keys (32 hits) "
            f"mean {r['mean_us']:.2f} us, p50 {r['p50_us']:.2f}, p99 {r['p99_us']:.2f}, max {r['max_us']:.0f} "
            f"({r['lookups']} lookups); refresh per step {rf}; step (1000 lookups + refresh) mean "
            f"{r['step_mean_us']:.0f} us ({r['steps']} steps); writers' blocks seen {r['peer_blocks_seen']}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
