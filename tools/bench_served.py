#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The scheduler thread's bulk asks of the store: `served` (which of these keys are hits now:
sliding-window and recurrent-state groups' matching) and `pin` (each key's location, held for a
load) for K keys at once, on one directory (a Store) and on D drives (a Drives).

    PYTHONPATH=. .venv/bin/python tools/bench_served.py [--blocks 300000] [--keys 6000]
        [--hits 0.5] [--drives 3] [--reps 40] [--inline] [--json]
    PYTHONPATH=. .venv/bin/python tools/ab.py --before OLD --after . -- $PWD/tools/bench_served.py

One process; the measured engine's store has its I/O thread, as an engine's does (its journal
written there; --inline: on the caller's thread, as tools open a store); --blocks keys committed (by fiat: no data written, the data files stay sparse)
on one directory, and as many spread over --drives directories (key i on drive i mod D); each
directory shared with a second engine holding a tenth of them (a namespace then has two tables
to probe, as on a host of several engines). Each rep asks --keys keys, a --hits share of them
stored, the rest never saved, in a random order: `served` timed, then `pin` timed, then `unpin`
of every key asked timed (what a finished load gives back). Figures per layout (one: a Store,
drives: a Drives): served_ms, pin_ms, unpin_ms (medians of the reps), served_worst_ms,
pin_worst_ms, unpin_worst_ms (the slowest rep: the step a request's match may cost),
served_us_key, pin_us_key, unpin_us_key. The answers are checked: served's and pin's count of
hits is the hits asked, and nothing is held after the unpin.

The store measured is PYTHONPATH's tree's (this script puts its own tree last on sys.path), so
tools/ab.py can run this one script against two trees by its absolute path.
"""

from __future__ import annotations

import gc
import os
import random
import statistics
import sys
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # last: PYTHONPATH's aiokv

from tools import harness  # noqa: E402

NSID = b"s" * 16
PAYLOAD = 4096
BATCH = 1000


def key(i: int) -> bytes:
    return (i * 0x9E3779B1).to_bytes(8, "little") * 4


def commit(st, ns, ids) -> None:
    """Commit these keys into fresh slots by fiat (no data I/O: the data files stay sparse)."""
    ids = list(ids)
    ns.alloc.grow(ns.alloc.plan_grow(len(ids)))
    for i in range(0, len(ids), BATCH):
        batch = [(key(j), ns.base | ns.alloc.take()) for j in ids[i : i + BATCH]]
        ns.pending.update(batch)
        st.commit(ns, batch)


def directory(root: str, ids: list[int], io_thread: bool = True):
    """(the engine measured, its namespace, the second engine) on `root`: the second engine
    holds every tenth of `ids`, the first the rest, seen (followed) by the first. io_thread: the
    engine's store writes its journal on its I/O thread, as an engine's does (False: inline)."""
    from aiokv.store import Store

    st = Store(root, checkpoint_every=10**12, io_thread=io_thread)
    peer = Store(root, checkpoint_every=10**12)
    ns, pns = st.namespace(NSID, PAYLOAD), peer.namespace(NSID, PAYLOAD)
    commit(peer, pns, ids[::10])
    commit(st, ns, [i for n, i in enumerate(ids) if n % 10])
    st.follow_interval = 0  # follows the second engine (with the I/O thread: its looks, applied at a lookup)
    theirs, until = len(ids[::10]), time.monotonic() + 60
    while sum(t.count for e, t in ns.tables.items() if e != ns.engine) < theirs:
        if time.monotonic() > until:
            raise SystemExit(f"bench_served: the second engine's {theirs} blocks not seen in 60 s")
        st.lookup(ns, (), 0)
        time.sleep(0.001)
    st.follow_interval = 10**9  # no more looks while timed
    return st, ns, peer


def layout(base: str, name: str, drives: int, blocks: int, io_thread: bool) -> tuple:
    """(store, namespace, closers): one directory (a Store) or `drives` (a Drives)."""
    from aiokv.store.drives import Drives

    if name == "one":
        st, ns, peer = directory(os.path.join(base, "one"), list(range(blocks)), io_thread)
        return st, ns, [st, peer]
    paths = [os.path.join(base, f"d{d}") for d in range(drives)]
    opened = [directory(p, list(range(d, blocks, drives)), io_thread) for d, p in enumerate(paths)]
    st = Drives(paths, {d: o[0] for d, o in enumerate(opened)})
    return st, st.namespace(NSID, PAYLOAD), [st] + [o[2] for o in opened]


def measure(st, ns, args, rnd: random.Random) -> dict:
    served, pinned, unpinned = [], [], []
    hits = int(args.keys * args.hits)
    for _ in range(args.reps):
        asked = [key(i) for i in rnd.sample(range(args.blocks), hits)]
        asked += [key(args.blocks + i) for i in rnd.sample(range(args.blocks), args.keys - hits)]
        rnd.shuffle(asked)
        gc.collect()
        t = time.perf_counter()
        got = st.served(ns, asked)
        served.append(time.perf_counter() - t)
        t = time.perf_counter()
        where = st.pin(ns, asked)
        pinned.append(time.perf_counter() - t)
        t = time.perf_counter()
        st.unpin(ns, asked)
        unpinned.append(time.perf_counter() - t)
        if st.load_pinned():
            raise SystemExit(f"bench_served: {st.load_pinned()} keys still held after unpin")
        if sum(got) != hits or sum(w is not None for w in where) != hits:
            raise SystemExit(f"bench_served: {sum(got)} served, {hits} stored")
    out = {}
    for name, took in (("served", served), ("pin", pinned), ("unpin", unpinned)):
        out[f"{name}_ms"] = statistics.median(took) * 1e3
        out[f"{name}_worst_ms"] = max(took) * 1e3
        out[f"{name}_us_key"] = statistics.median(took) / args.keys * 1e6
    return out


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--blocks", type=int, default=300_000, help="keys stored (each layout)")
    ap.add_argument("--keys", type=int, default=6000, help="keys asked a call")
    ap.add_argument("--hits", type=float, default=0.5, help="share of the keys asked that are stored")
    ap.add_argument("--drives", type=int, default=3, help="drives of the Drives layout")
    ap.add_argument("--reps", type=int, default=40, help="calls timed (medians and the worst)")
    ap.add_argument(
        "--inline", action="store_true", help="the store's file-system calls on the caller's thread (no I/O thread)"
    )
    ap.add_argument("--dir", default=None, help="the run's directory (default: a temp one, removed)")
    args = ap.parse_args()
    say = harness.say(args)
    import aiokv

    rows = []
    with harness.workdir(args.dir, "aiokv-served-") as base:
        for name, drives in (("one", 1), ("drives", args.drives)):
            st, ns, closers = layout(base, name, drives, args.blocks, not args.inline)
            row = {"name": name, "drives": drives, **measure(st, ns, args, random.Random(1))}
            say(f"{name}: {row}")
            rows.append(row)
            for c in closers:
                c.close()
    doc = harness.document(aiokv=os.path.dirname(aiokv.__file__), params=vars(args), layouts=rows)
    return harness.emit(doc, args, lambda d: "\n".join(str(r) for r in d["layouts"]))


if __name__ == "__main__":
    sys.exit(main())
