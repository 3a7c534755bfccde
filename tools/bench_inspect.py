#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""`aiokv inspect` at node scale: wall time and peak RSS of `inspect`, `--keys` and `--verify`
on a directory of N blocks.

    PYTHONPATH=. .venv/bin/python tools/bench_inspect.py --n 1000000,10000000,30000000 --dir PATH [--json]
        [--modes summary,keys,keys_text,verify] [--verify-max 1000000] [--baseline OTHER_TREE --baseline-max N]

The directory (built once per N under --dir, kept for the next run) is a real store's: a Store
makes the namespace and commits one block for each of --tenants tenants (so the tenants file
names them); the other blocks are written in bulk with the store's own persistence, IndexLog:
COMMIT records (32-byte keys, atimes over the last two weeks, the tenants in turn) appended to
the journal a chunk at a time, a checkpoint (with its index image) written from the table every
CHECKPOINT_EVERY records, and the last eighth of the blocks left in the journal (what an engine
leaves at most: a read replays it). The data file is sparse (slots without disk space: the
blocks read as zeros, so --verify finds every one corrupt: the worst case of its output, a wiped
drive).

Each command runs in a process of its own (`python -m aiokv.cli.main`, output to /dev/null);
its wall time and peak RSS (getrusage of the child) are measured, for each N. --verify reads
every slot: it runs only up to --verify-max blocks.

With --baseline, each measurement is made again with another tree's aiokv (the tree before a
change), its --keys and --verify only up to --baseline-max blocks (before issue 40 they held about
1 KB a block), and the ratios are given (baseline / this).

Prints one JSON line with --json: {"runs": [{"n", "mode", "wall_s", "peak_rss_mb", "rc",
"baseline": {...}, "wall_ratio", "rss_ratio"}]}. PYTHONPATH names the tree measured.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

NSID = b"i" * 16
PAYLOAD = 1024
CHUNK = 1 << 20  # records appended at a time
CHECKPOINT_EVERY = 1 << 22  # records between checkpoints while building
TWO_WEEKS = 14 * 86400 * 10**9


def _records(lo: int, hi: int, tids: list[int], now: int) -> np.ndarray:
    """Sealed COMMIT records of keys lo..hi-1 into slots lo..hi-1."""
    from aiokv import _index
    from aiokv.data import format as fmt
    from aiokv.store.logrecords import REC

    n = hi - lo
    i = np.arange(lo, hi, dtype=np.uint64)
    recs = np.zeros(n, REC)
    recs["kind"] = fmt.REC_COMMIT
    recs["klen"] = 32
    recs["slot"] = i
    recs["atime"] = now - (i * np.uint64(7919) % np.uint64(TWO_WEEKS // 10**6)) * np.uint64(10**6)
    keys = np.repeat((i * np.uint64(0x9E3779B97F4A7C15))[:, None], 4, axis=1)
    keys[:, 1] ^= np.uint64(0x5555)
    recs["key"] = keys.view(np.uint8).reshape(n, 32).view("V32").reshape(n)
    recs["tenant"] = np.asarray(tids, np.uint16)[i % np.uint64(len(tids))]
    _index.seal(recs.view(np.uint8).reshape(-1), fmt.REC_BYTES)
    return recs


def build(root: str, n: int, tenants: int = 4) -> None:
    """A directory of n blocks (see the module's docstring); kept once built (a file `built`)."""
    from aiokv.data import format as fmt
    from aiokv.data.slotfile import data_path
    from aiokv.store import Store
    from aiokv.store.journal import IndexLog
    from aiokv.store.logrecords import record_tags
    from aiokv.store.store import ns_dir
    from aiokv.store.table import Table

    if os.path.exists(os.path.join(root, "built")):
        return
    st = Store(root, capacity="64TiB")
    ns = st.namespace(NSID, PAYLOAD)
    tids = [st.tenant("")]
    for t in range(tenants):  # one block each through the store: the tenants file names them
        name = f"tenant-{t}"
        arg = name if hasattr(st.tenants, "register") else st.tenant(name)  # (ids given at a first commit)
        key = (n + t).to_bytes(8, "little") * 4
        where = st.reserve(ns, key, arg)
        st.commit(ns, [(key, where)], arg)
        tids.append(st.tenant(name))
    slot_bytes = ns.slot_bytes
    st.close()
    d = ns_dir(root, NSID)
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        log = IndexLog(d, dfd)
        small = log.load_table(1 << 32)
        base = len(small.tag)  # (the tenants' blocks sit in the first slots)
        table = Table(base + n)
        for name in ("tag", "atime", "tenant", "flags"):
            getattr(table, name)[:base] = getattr(small, name)
        now, since = time.time_ns(), 0
        journal_from = base + n - n // 8  # (checkpointed up to here; the rest stays in the journal)
        bounds = [*range(base, journal_from, CHUNK), *range(journal_from, base + n, CHUNK), base + n]
        for lo, hi in zip(bounds, bounds[1:]):
            recs = _records(lo, hi, tids, now)
            log.append(recs.tobytes())
            table.tag[lo:hi] = record_tags(recs)
            table.atime[lo:hi] = recs["atime"]
            table.tenant[lo:hi] = recs["tenant"]
            since += hi - lo
            if since >= CHECKPOINT_EVERY and hi < journal_from or hi == journal_from:
                log.checkpoint(table)
                since = 0
        log.sync()
        log.close()
    finally:
        os.close(dfd)
    with open(data_path(d, 0), "r+b") as f:
        f.truncate((base + n) * slot_bytes)  # sparse: no disk space
    assert fmt.engine_dir(0) == ""
    open(os.path.join(root, "built"), "w").close()


def measure(root: str, args: list[str]) -> dict:
    """One `aiokv inspect` in a process of its own: wall time, its peak RSS, exit status."""
    cmd = [sys.executable, "-m", "aiokv.cli.main", "inspect", root, *args]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t = time.perf_counter()
    with open(os.devnull, "w") as out:
        p = subprocess.run(cmd, stdout=out, stderr=subprocess.PIPE, text=True, cwd=os.sep)  # (PYTHONPATH's aiokv)
    wall = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # (the largest child so far: ours, if larger)
    got = {"wall_s": round(wall, 3), "peak_rss_mb": round(peak / 1024, 1), "rc": p.returncode}
    if peak <= before:
        got["peak_rss_mb_at_most"] = got.pop("peak_rss_mb")  # an earlier child was larger
    if p.returncode not in (0, 1):
        got["stderr"] = p.stderr[-2000:]
    return got


def one(root: str, mode: str, tree: str | None = None) -> dict:
    """A fresh interpreter per measurement (ru_maxrss of RUSAGE_CHILDREN is a maximum over
    children), the aiokv of `tree` (None: PYTHONPATH's)."""
    env = dict(os.environ, PYTHONPATH=tree) if tree else None
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--measure", root, mode], capture_output=True, text=True, env=env
    )
    if out.returncode != 0:
        return {"error": out.stderr[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


MODES = {
    "summary": ["--format", "json"],
    "keys": ["--keys", "--format", "json"],
    "keys_text": ["--keys"],
    "verify": ["--verify", "--no-progress", "--format", "json"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", default="1000000", help="block counts, comma-separated")
    ap.add_argument("--dir", help="where the directories are built (and kept)")
    ap.add_argument("--modes", default="summary,keys,verify")
    ap.add_argument("--verify-max", type=int, default=1_000_000, help="--verify only up to this many blocks")
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--baseline", help="another tree, measured beside this one (its aiokv: PYTHONPATH)")
    ap.add_argument(
        "--baseline-max", type=int, default=1_000_000, help="the baseline's --keys and --verify only up to this many"
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--measure", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.measure:
        print(json.dumps(measure(a.measure[0], MODES[a.measure[1]])))
        return
    runs = []
    for n in (int(x) for x in a.n.split(",")):
        root = os.path.join(a.dir, f"inspect-{n}")
        t = time.perf_counter()
        build(root, n, a.tenants)
        if not a.json:
            print(f"{n} blocks: directory ready in {time.perf_counter() - t:.1f} s", file=sys.stderr)
        for mode in a.modes.split(","):
            if mode == "verify" and n > a.verify_max:
                continue
            got = {"n": n, "mode": mode, **one(root, mode)}
            if a.baseline and (mode == "summary" or n <= a.baseline_max):
                base = one(root, mode, a.baseline)
                got["baseline"] = base
                if "wall_s" in base and "wall_s" in got:
                    got["wall_ratio"] = round(base["wall_s"] / max(got["wall_s"], 1e-9), 2)
                    mb = [x.get("peak_rss_mb", x.get("peak_rss_mb_at_most")) for x in (base, got)]
                    got["rss_ratio"] = round(mb[0] / max(mb[1], 1e-9), 2)
            runs.append(got)
            if not a.json:
                print(json.dumps(got), flush=True)
    if a.json:
        print(json.dumps({"runs": runs}))


if __name__ == "__main__":
    main()
