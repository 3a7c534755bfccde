#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""What another engine's hits cost this engine's scheduler thread: a look at the directory that
finds K TOUCH records (engine B loaded K of engine A's blocks), applied by A.

    PYTHONPATH=. .venv/bin/python tools/bench_touches.py [--blocks 200000] [--touches 100000]
        [--rounds 3] [--json]
    PYTHONPATH=. .venv/bin/python tools/ab.py --before OLD --after . -- $PWD/tools/bench_touches.py

Each round, in a fresh directory: engine A commits --blocks keys (by fiat: no data written),
engine B follows A, then pins --touches of them (a load: B holds none, so each is a TOUCH record
in B's journal, B's LoadPins). Then, timed apart: A's look at B's files (the file-system half,
the store's I/O thread in an engine) and its applying what it found (the owner's half, on the
scheduler thread), two ways:
- records: A had followed B before the pins, so the look reads B's new records (peer_apply);
- replay: a third engine C opens the directory after them (A still running) and its first look replays B's files
  whole (peer_reset and the TOUCH records the replay kept).
Figures: {records,replay}_io_ms, {records,replay}_apply_ms (medians of the rounds), and
{records,replay}_apply_us_touch. Checked: every touched key's block in A is younger after the
look than before it, and C's view of it as young as A's.

The store measured is PYTHONPATH's tree's (this script puts its own tree last on sys.path), so
tools/ab.py can run it against two trees by its absolute path.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # last: PYTHONPATH's aiokv

from tools import harness  # noqa: E402
from tools.bench_served import PAYLOAD, commit, key  # noqa: E402 (its keys, committed by fiat)

NSID = b"t" * 16


def look(st, ns) -> tuple[float, float]:
    """(ms of the file-system half, ms of the owner's half) of one look at the other engines."""
    t0 = time.perf_counter()
    found = st.following._follow_io(ns)
    t1 = time.perf_counter()
    st.following._apply(ns, found)
    return (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3


def one_round(base: str, args, r: int) -> dict:
    from aiokv.store import Store

    root = os.path.join(base, f"r{r}")
    a, b = Store(root, checkpoint_every=10**12), Store(root, checkpoint_every=10**12)
    na, nb = a.namespace(NSID, PAYLOAD), b.namespace(NSID, PAYLOAD)
    commit(a, na, range(args.blocks))
    look(b, nb)  # B sees A's blocks
    look(a, na)  # A has followed B: the next look reads B's new records
    time.sleep(1.05)  # A's blocks are a TOUCH interval old in B's view
    touched = [key(j) for j in range(0, args.blocks, max(1, args.blocks // args.touches))][: args.touches]
    b.pin(nb, touched)
    b.unpin(nb, touched)
    before = {k: atime(na.table, k) for k in touched}
    out = {}
    out["records_io_ms"], out["records_apply_ms"] = look(a, na)
    after = {k: atime(na.table, k) for k in touched}
    if sum(after[k] > before[k] for k in touched) != len(touched):
        raise SystemExit(f"bench_touches: {sum(after[k] > before[k] for k in touched)} of {len(touched)} made younger")
    c = Store(root, checkpoint_every=10**12)
    nc = c.namespace(NSID, PAYLOAD)
    c.followers[(NSID, b.dirs.engine)].forget()  # (its opening followed B already): the look replays B whole
    out["replay_io_ms"], out["replay_apply_ms"] = look(c, nc)
    seen = nc.tables[a.dirs.engine]  # C's view of A's blocks: B's hits in it, as A has them
    if sum(atime(seen, k) == after[k] for k in touched) != len(touched):
        raise SystemExit(f"bench_touches: C sees {sum(atime(seen, k) == after[k] for k in touched)} of B's hits")
    for st in (a, b, c):
        st.close()
    return out


def atime(table, k: bytes) -> int:
    return int(table.atime_at(table.find(k)))


def main() -> int:
    ap = harness.parser(__doc__, rounds=3)
    ap.add_argument("--blocks", type=int, default=200_000, help="blocks engine A holds")
    ap.add_argument("--touches", type=int, default=100_000, help="of them loaded by engine B (TOUCH records)")
    ap.add_argument("--dir", default=None, help="the run's directory (default: a temp one, removed)")
    args = ap.parse_args()
    if not 0 < args.touches <= args.blocks:
        ap.error("--touches must be between 1 and --blocks")
    with harness.workdir(args.dir, "aiokv-touches-") as base:
        runs = [one_round(base, args, r) for r in range(args.rounds)]
    out = {"blocks": args.blocks, "touches": args.touches, "rounds": args.rounds}
    for k in runs[0]:
        out[k] = statistics.median(r[k] for r in runs)
    for way in ("records", "replay"):
        out[f"{way}_apply_us_touch"] = out[f"{way}_apply_ms"] * 1e3 / args.touches
    return harness.flat(out, args, digits=3)


if __name__ == "__main__":
    sys.exit(main())
