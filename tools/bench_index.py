#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The index at the sizes users run: open, memory, lookups, commits and replay at N blocks.

    PYTHONPATH=. .venv/bin/python tools/bench_index.py --n 10000000 [--json] [--dir PATH]

Each phase runs in a fresh process (this script again, --phase), on one directory
whose data files are sparse (slots without disk space: this measures the index,
not the disk):

1. build: commits N keys through the owner's API in batches of 1000 (no data I/O),
   then exits as a crash would (os._exit: every record in the journal, no checkpoint).
2. replay: opens the directory (the whole journal replayed: N records; after a crash the
   store replays at most its checkpoint interval, an eighth of the blocks past 1.6M)
   -> replay_s; checkpoints and closes -> checkpoint_s.
3. open: a fresh process opens the directory from its checkpoint -> open_s (the time a
   background load takes; the engine serves meanwhile), its RSS growth / N ->
   bytes_per_block; lookups of 64 stored keys at a time (what a request's lookup does)
   -> lookup_us a key; a lookup that misses at once -> miss_us; absent keys whose tag
   matched a stored one -> tag_hits (collisions: a miss after the header check); 100 000
   commits at size N in batches of 1000 -> commit_us; 20 000 evictions (the LRU block
   found and forgotten) -> evict_us, and the longest one -> evict_worst_ms (a new batch
   of victims picked: the pause a step may see).

4. wait (a restart): the directory opened as the engine opens it (the index loads on the
   store's loader thread) with a SchedulerSide (index_wait 600 s) asked, step after step (a
   millisecond apart), about 64 requests of 1024 tokens until they are answered: each ask
   while the index loads ("not yet") -> wait_ask_us (median; the first ask of a request
   also computes its 64 keys: first_ask_us), wait_ask_worst_us, asks_while_loading, and
   the time until they are answered -> answered_after_s (about open_s: the index in).

5. with --engines K: K more engines open the directory at once, each a process of its
   own following the blocks engine 0 left (N, plus phase 3's commits, less its evictions:
   blocks_left; engine 0 is not running); while all K are up,
   their RSS growth and PSS (/proc/PID/smaps_rollup: shared pages split among the
   processes mapping them) are summed -> engines_rss_mb, engines_pss_mb, and each
   one's open (its first look at engine 0) -> engines_open_s (the slowest).

With --lru-trace alone: the eviction order's hit ratio against exact LRU (an OrderedDict,
the index before issue 36) on the chat and agent conversations of tools/bench_chat.py
(its `workloads`, --conversations 64 --turns 8; replies stand in as random tokens):
every turn looks up each prompt's blocks (16 tokens, chained keys) until the first miss,
the hits touched, then stores the prompt and reply blocks, with room for a quarter of
the distinct blocks.

Prints one JSON line with --json (n, open_s, bytes_per_block, lookup_us, commit_us,
replay_s, and the rest). Runs against any tree with the same Store API: PYTHONPATH
names the one measured (docs/benchmarks.md, "Tens of millions of blocks": this tree against the one before).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools import harness  # noqa: E402

NSID = b"r" * 16
PAYLOAD = 4096
BATCH = 1000


def keys(lo: int, hi: int, salt: int = 0) -> list[bytes]:
    """32-byte keys lo..hi-1 (structured on purpose: the index's tags must mix them)."""
    return [(i ^ salt).to_bytes(8, "little") * 4 for i in range(lo, hi)]


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def commit_range(st, ns, lo: int, hi: int) -> float:
    """Commit keys lo..hi-1 into slots lo..hi-1 (given disk space by fiat); seconds taken."""
    ns.alloc.grow(range(lo, hi))
    t = time.perf_counter()
    for i in range(lo, hi, BATCH):
        batch = []
        for k in keys(i, min(i + BATCH, hi)):
            s = ns.alloc.take()
            ns.pending[k] = s
            batch.append((k, s))
        st.commit(ns, batch)
    return time.perf_counter() - t


def phase_build(root: str, n: int) -> dict:
    from aiokv.store import Store

    st = Store(root, checkpoint_every=10**12)
    ns = st.namespace(NSID, PAYLOAD)
    took = commit_range(st, ns, 0, n)
    out = {"build_commit_us": took / n * 1e6}
    print(json.dumps(out), flush=True)
    os._exit(0)  # a crash: the journal holds every record, no checkpoint


def _ready(st, ns) -> None:
    while not getattr(ns, "ready", True):
        st.refresh()
        time.sleep(0.001)


def phase_replay(root: str, n: int) -> dict:
    from aiokv.store import Store

    t = time.perf_counter()
    st = Store(root, checkpoint_every=10**12)
    ns = st.namespace(NSID, PAYLOAD)
    _ready(st, ns)
    replay = time.perf_counter() - t
    got = ns.count()
    t = time.perf_counter()
    st.checkpoint()  # (close checkpoints only up to persist.CLOSE_CHECKPOINT_BLOCKS)
    st.close()
    return {"replay_s": replay, "replayed": got, "checkpoint_s": time.perf_counter() - t}


def phase_open(root: str, n: int) -> dict:
    from aiokv.store import Store

    gc.collect()
    before = rss()
    t = time.perf_counter()
    st = Store(root, checkpoint_every=10**12)
    ns = st.namespace(NSID, PAYLOAD)
    _ready(st, ns)
    open_s = time.perf_counter() - t
    gc.collect()
    grown = rss() - before
    got = ns.count()
    rnd = random.Random(1)
    # lookups: runs of 64 stored keys (a request's prefix), each run from a random start
    runs = [keys(s, s + 64) for s in (rnd.randrange(0, max(1, n - 64)) for _ in range(2000))]
    t = time.perf_counter()
    hits = sum(st.lookup(ns, r) for r in runs)
    lookup_us = (time.perf_counter() - t) / hits * 1e6
    # misses: absent keys (one each: a lookup stops at its first miss)
    absent = [[k] for k in keys(0, 100_000, salt=0x5A5A5A5A5A5A5A5A)]
    t = time.perf_counter()
    tag_hits = sum(st.lookup(ns, a) for a in absent)
    miss_us = (time.perf_counter() - t) / len(absent) * 1e6
    more = min(100_000, max(1000, n // 10))
    took = commit_range(st, ns, n, n + more)
    # evictions: the LRU block found and forgotten (a FREE record), its slot kept
    k, worst = min(20_000, n // 2), 0.0
    t = time.perf_counter()
    for _ in range(k):
        a = time.perf_counter()
        v = st.index.victim()
        st.space.evict(*v, punch=False)
        worst = max(worst, time.perf_counter() - a)
    evict_us = (time.perf_counter() - t) / k * 1e6
    out = {
        "open_s": open_s,
        "opened": got,
        "bytes_per_block": grown / max(got, 1),
        "rss_growth_mb": grown / 2**20,
        "lookup_us": lookup_us,
        "miss_us": miss_us,
        "tag_hits": tag_hits,
        "absent_lookups": len(absent),
        "commit_us": took / more * 1e6,
        "evict_us": evict_us,
        "evict_worst_ms": worst * 1e3,
        "blocks_left": ns.count(),  # N + the commits - the evictions: what the engines of phase 5 follow
    }
    print(json.dumps(out), flush=True)
    os._exit(0)  # (no checkpoint of the extra commits: the directory stays as measured)


def phase_wait(root: str, n: int) -> dict:
    import inspect

    from aiokv.scheduler.side import SchedulerSide
    from aiokv.store import Store

    if "index_wait" not in inspect.signature(SchedulerSide).parameters:  # a tree before issue 41
        print("{}", flush=True)
        os._exit(0)
    st = Store(root, checkpoint_every=10**12, io_thread=True)
    side = SchedulerSide(st, st.namespace(NSID, PAYLOAD), 16, index_wait=600.0)
    reqs = [[i] + list(range(1023)) for i in range(64)]
    first, asks, open_ = [], [], set(range(64))
    t0 = time.perf_counter()
    while open_:
        for i in sorted(open_):  # one scheduler step: every request still waiting is asked again
            a = time.perf_counter_ns()
            got = side.match(f"r{i}", reqs[i], b"\0" * 16, 0)
            took = time.perf_counter_ns() - a
            if len(first) < 64:
                first.append(took)
            elif got is None:
                asks.append(took)  # "not yet": the index is still loading
            if got is not None:
                open_.discard(i)
        time.sleep(0.001)  # the step's model work
    out = {
        "answered_after_s": time.perf_counter() - t0,
        "first_ask_us": sorted(first)[len(first) // 2] / 1e3,
        "wait_ask_us": sorted(asks)[len(asks) // 2] / 1e3 if asks else 0.0,
        "wait_ask_worst_us": max(asks) / 1e3 if asks else 0.0,
        "asks_while_loading": len(asks),
    }
    print(json.dumps(out), flush=True)
    os._exit(0)


def pss() -> int:
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def phase_follow(root: str, n: int) -> None:
    """One more engine on the directory: opens it (following engine 0), reports, and
    stays up until the parent says (a file `go` beside the store)."""
    from aiokv.store import Store

    gc.collect()
    before, before_pss = rss(), pss()
    t = time.perf_counter()
    st = Store(root, checkpoint_every=10**12)
    ns = st.namespace(NSID, PAYLOAD)
    open_s = time.perf_counter() - t
    gc.collect()
    assert ns.count() == n, f"an engine sees {ns.count()} of the {n} blocks engine 0 left"
    print(json.dumps({"rss": rss() - before, "pss": pss() - before_pss, "open_s": open_s}), flush=True)
    done = os.path.join(os.path.dirname(root), "go")
    while not os.path.exists(done):
        time.sleep(0.05)
    os._exit(0)


def engines(root: str, n: int, k: int) -> dict:
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--phase", "follow", "--n", str(n), "--dir", root],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(k)
    ]
    got = []
    try:
        for p in procs:
            line = p.stdout.readline()
            if not line.startswith("{"):
                raise SystemExit(f"bench_index: an engine failed:\n{p.stderr.read()[-4000:]}")
            got.append(json.loads(line))
    finally:
        open(os.path.join(os.path.dirname(root), "go"), "w").close()
        for p in procs:
            p.wait()
        os.unlink(os.path.join(os.path.dirname(root), "go"))
    return {
        "engines": k,
        "engines_rss_mb": sum(g["rss"] for g in got) / 2**20,
        "engines_pss_mb": sum(g["pss"] for g in got) / 2**20,
        "engines_open_s": max(g["open_s"] for g in got),
    }


def lru_trace() -> dict:
    """Hit ratios on bench_chat's conversations: exact LRU against the index's eviction order."""
    import collections
    import hashlib
    import types

    import bench_chat

    from aiokv.store.table import Table, tag_of

    a = types.SimpleNamespace(conversations=64, turns=8, reply=192, tool=512)
    rnd = random.Random(5)
    bs = 16
    trace = []  # [(keys looked up, keys stored)] a request
    for name, turns in bench_chat.workloads(a).items():
        convs = [list(p) for p in turns[0]["prompts"]]
        for t, turn in enumerate(turns):
            for c in range(len(convs)):
                if t:
                    convs[c] += turn["new"][c]
                prompt = convs[c]
                keys, prev = [], name.encode()
                full = prompt + [rnd.randrange(3, 500) for _ in range(turn["reply"])]
                for j in range(len(full) // bs):
                    prev = hashlib.blake2b(
                        prev + bytes(str(full[j * bs : (j + 1) * bs]), "ascii"), digest_size=32
                    ).digest()
                    keys.append(prev)
                trace.append((keys[: len(prompt) // bs], keys))
                convs[c] = full
    distinct = len({k for _, ks in trace for k in ks})
    cap = distinct // 4
    lru: collections.OrderedDict = collections.OrderedDict()
    t, free, clock = Table(), list(range(cap)), 0
    looked = hits_lru = hits_index = 0
    for lookup, stored in trace:
        looked += len(lookup)
        n = 0
        while n < len(lookup) and lookup[n] in lru:
            lru.move_to_end(lookup[n])
            n += 1
        hits_lru += n
        m = 0
        while m < len(lookup) and t.find(lookup[m]) >= 0:
            clock += 1
            t.touch(t.find(lookup[m]), clock)
            m += 1
        hits_index += m
        for k in stored:
            if k not in lru:
                if len(lru) >= cap:
                    lru.popitem(last=False)
                lru[k] = None
            if t.find(k) < 0:
                if not free:
                    s = t.oldest()
                    t.clear(s)
                    free.append(s)
                clock += 1
                t.put(free.pop(), tag_of(k), clock)
    return {
        "trace_requests": len(trace),
        "trace_blocks_looked_up": looked,
        "trace_distinct_blocks": distinct,
        "trace_capacity_blocks": cap,
        "hit_ratio_exact_lru": hits_lru / looked,
        "hit_ratio_index": hits_index / looked,
    }


def run_phase(name: str, root: str, n: int) -> dict:
    argv = [os.path.abspath(__file__), "--phase", name, "--n", str(n), "--dir", root]
    return harness.child(argv, f"bench_index: phase {name}")


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--dir", default=None, help="where the store goes (a file system with room for N slots)")
    ap.add_argument("--engines", type=int, default=0, help="K more engines opening the directory at once")
    ap.add_argument("--lru-trace", action="store_true", help="only the hit ratios on bench_chat's conversations")
    ap.add_argument("--phase", choices=["build", "replay", "open", "wait", "follow"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        phases = {"build": phase_build, "replay": phase_replay, "open": phase_open, "wait": phase_wait}
        phases["follow"] = phase_follow
        out = phases[args.phase](args.dir, args.n)
        print(json.dumps(out), flush=True)
        return
    if args.lru_trace:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        args.json = True  # (one JSON line, as ever)
        harness.flat(lru_trace(), args, 6)
        return
    import aiokv

    out = {"n": args.n, "tree": os.path.dirname(os.path.abspath(aiokv.__file__))}
    with harness.workdir(args.dir, "aiokv-index-") as base:
        root = os.path.join(base, "store")
        shutil.rmtree(root, ignore_errors=True)
        try:
            for phase in ("build", "replay", "open", "wait"):
                out.update(run_phase(phase, root, args.n))
            if args.engines:
                out.update(engines(root, out["blocks_left"], args.engines))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    harness.flat(out, args, 4)


if __name__ == "__main__":
    main()
