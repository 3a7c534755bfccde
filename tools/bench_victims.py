#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Victims at node scale (issue 40): what the scheduler thread pays to choose a block to evict
(tools/bench_ops.py runs it as its `victims` phase).

    PYTHONPATH=. .venv/bin/python tools/bench_victims.py --dir /mnt/nvme/ops --n 10000000 --tenants 100 --json \\
        [--against /tmp/quota-base]

Builds, in a fresh process, a directory of --n blocks (default 10M) of --tenants tenants (five
tiny ones of 8 blocks each, the others alike), 1% of the blocks pinned, through the owner's API
(data files sparse: this measures the index, not the disk); each phase then runs in a fresh
process on it, and with --against once more with PYTHONPATH naming another tree (its extensions
built in place: `git archive main | tar -x -C DIR`, then setup.py build_ext --inplace there),
whose figures come out prefixed `base_`, with the ratios (`victim_us_max_ratio`: base / this).

victims: the engine opens the directory (the index loaded at once: `open_s`), quotas on half the
tenants (within them for most, past them for some), 64 blocks held by loads (Store.pin); then
--calls rounds, each for the next tenant in turn (a tiny one and one holding no block here among
them): its own least recently used block (Quotas.own_victim: what a save past its quota asks), a
save's victim in a full directory (Quotas.victim: every tenant but those within their quota),
and the capacity's (Index.victim); the tenant's own block found (else the capacity's) is evicted
and the tenant commits a new one, so the order keeps changing. Each call timed:
`victim_us_median`, `victim_us_max` (the worst call, the scheduler's pause), `victim_calls`, and
the median of each kind (`victim_us_median_own`, `_quota`, `_capacity`); the most entries one
call read: `victim_examined_max` (Table.examined; -1 in a tree without it).

One JSON line with --json. Time it with nothing else running on the machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(ROOT)  # last: the aiokv measured is PYTHONPATH's (--against runs another tree's)

from tools import harness  # noqa: E402

NSID = b"o" * 16
PAYLOAD = 4096
BATCH = 1000
TINY, TINY_BLOCKS = 5, 8
HELD = 64
PIN_SHARE = 100  # one block in this many is pinned


def key(i: int) -> bytes:
    return i.to_bytes(8, "little") * 4


def tenant_names(tenants: int) -> list[str]:
    return [f"tenant-{i}" for i in range(tenants)]


def owners(n: int, tenants: int) -> list[tuple[str, int, int]]:
    """(tenant, first block, end) runs: the tiny tenants first, then the others alike, in
    runs of BATCH blocks dealt round the tenants (so every tenant has old and new blocks)."""
    names = tenant_names(tenants)
    runs, i = [], 0
    for t in names[:TINY]:
        runs.append((t, i, i + TINY_BLOCKS))
        i += TINY_BLOCKS
    rest, j = names[TINY:], 0
    while i < n and rest:
        end = min(i + BATCH, n)
        runs.append((rest[j % len(rest)], i, end))
        i, j = end, j + 1
    return runs


def tenant_arg(st, name: str):
    """What Store.commit takes for a tenant: its name (ids given at a first commit), or in a tree
    from before that (--against), its id."""
    return name if hasattr(st.tenants, "register") else st.tenant(name)


def tenant_id(st, name: str) -> int:
    """A tenant's id, registered if it holds nothing yet."""
    return st.tenants.register(name)[1] if hasattr(st.tenants, "register") else st.tenant(name)


def commit_run(st, ns, tid, lo: int, hi: int, pinned: bool = False) -> None:
    """Keys lo..hi-1 of tenant tid (tenant_arg) committed into free slots (disk space by fiat)."""
    batch = []
    for k in map(key, range(lo, hi)):
        s = ns.alloc.take()
        if s is None:
            ns.alloc.grow(range(ns.alloc.hwm, ns.alloc.hwm + max(BATCH, hi - lo)))
            s = ns.alloc.take()
        ns.pending[k] = s
        batch.append((k, s))
    st.commit(ns, batch, tid, pinned)


def phase_build(root: str, n: int, tenants: int) -> dict:
    from aiokv.store import Store

    st = Store(root, checkpoint_every=10**12)  # (one checkpoint, at close)
    ns = st.namespace(NSID, PAYLOAD)
    t = time.perf_counter()
    for name, lo, hi in owners(n, tenants):
        pin = hi - lo == BATCH and (lo // BATCH) % PIN_SHARE == 0
        commit_run(st, ns, tenant_arg(st, name), lo, hi, pin)
    took = time.perf_counter() - t
    st.close()  # (a checkpoint: the next opening reads it)
    return {"build_s": took}


def _examined(st) -> int:
    return sum(
        getattr(t, "examined", -1) for ns in st.index.namespaces.values() for t in (ns.table, *ns.tables.values())
    )


def phase_victims(root: str, n: int, tenants: int, calls: int) -> dict:
    from aiokv.store import Store

    gc.collect()
    t = time.perf_counter()
    st = Store(root, checkpoint_every=10**12)
    ns = st.namespace(NSID, PAYLOAD)
    open_s = time.perf_counter() - t
    names = tenant_names(tenants)
    every = [*names, "holds-nothing-here"]
    tids = [tenant_id(st, name) for name in every]
    cost = ns.slot_cost
    # quotas: within them for most of the tenants named, past them for every fourth
    sizes = {}
    for i, name in enumerate(names[::2]):
        held = ns.table.blocks_of(tenant_id(st, name)) * cost
        sizes[name] = held + 64 * cost if i % 4 else max(cost, held - 64 * cost)
    st.set_quotas(sizes)
    st.pin(ns, [key(i) for i in range(TINY * TINY_BLOCKS, n, max(1, n // HELD))][:HELD])  # held by loads
    q, took, worst_examined = st.quotas, [], 0
    kinds = {"own": [], "quota": [], "capacity": []}
    nxt = n
    gc.collect()
    for r in range(calls):
        tid, name = tids[r % len(tids)], every[r % len(tids)]
        got = []
        for kind, call, arg in (
            ("own", q.own_victim, tid),
            ("quota", q.victim, tid),
            ("capacity", st.index.victim, None),
        ):
            e = _examined(st)
            a = time.perf_counter_ns()
            v = call(arg)
            took.append(time.perf_counter_ns() - a)
            kinds[kind].append(took[-1])
            worst_examined = max(worst_examined, _examined(st) - e)
            got.append(v)
        victim = got[0] or got[2]
        if victim is not None:
            st.space.evict(*victim, punch=False)
        commit_run(st, ns, tenant_arg(st, name), nxt, nxt + 1)
        nxt += 1
    took.sort()
    out = {
        "open_s": round(open_s, 3),
        "victim_calls": len(took),
        "victim_us_median": round(took[len(took) // 2] / 1e3, 2),
        "victim_us_max": round(took[-1] / 1e3, 2),
        "victim_examined_max": worst_examined if _examined(st) >= 0 else -1,
    }
    for kind, ts in kinds.items():
        out[f"victim_us_median_{kind}"] = round(sorted(ts)[len(ts) // 2] / 1e3, 2)
    os._exit(print(json.dumps(out), flush=True) or 0)  # (no checkpoint: the directory stays as built)


def run_phase(name: str, args, tree: str = ROOT) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    argv = [sys.executable, os.path.abspath(__file__), "--phase", name, "--dir", args.dir, "--n", str(args.n)]
    argv += ["--tenants", str(args.tenants), "--calls", str(args.calls)]
    return harness.child(argv[1:], f"bench_ops: phase {name} ({tree})", env)


def parse_args(argv=None):
    """The options every part of this benchmark shares (--dir --n --tenants --json), and the victims'."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--dir", default=None, help="where the directory is built (room for its journal: ~130 B a block)")
    ap.add_argument("--n", type=int, default=10_000_000, help="blocks in the directory")
    ap.add_argument("--tenants", type=int, default=100, help="tenants holding them (five of them tiny)")
    ap.add_argument("--json", action="store_true", help="one JSON line")
    ap.add_argument("--calls", type=int, default=300, help="victims: rounds of three calls")
    ap.add_argument("--against", default=None, help="another tree measured the same way (figures: base_*)")
    ap.add_argument("--phase", choices=["build", "victims"], help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.phase == "build":
        print(json.dumps(phase_build(os.path.join(args.dir, "store"), args.n, args.tenants)), flush=True)
        return
    if args.phase == "victims":
        phase_victims(os.path.join(args.dir, "store"), args.n, args.tenants, args.calls)
        return
    own = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="aiokv-ops-")
    shutil.rmtree(os.path.join(args.dir, "store"), ignore_errors=True)
    try:
        out = {"n": args.n, "tenants": args.tenants}
        out.update(run_phase("build", args))
        out.update(run_phase("victims", args))
        if args.against:
            base = run_phase("victims", args, os.path.abspath(args.against))
            out.update({f"base_{k}": v for k, v in base.items()})
            for k in ("victim_us_median", "victim_us_max"):
                out[f"{k}_ratio"] = round(base[k] / max(out[k], 1e-9), 1)
    finally:
        shutil.rmtree(os.path.join(args.dir, "store"), ignore_errors=True)
        if own:
            shutil.rmtree(args.dir, ignore_errors=True)
    harness.flat(out, args)


if __name__ == "__main__":
    main()
