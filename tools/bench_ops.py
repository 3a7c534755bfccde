#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The operators' orders at node scale: what `aiokv clear`, `pin` and `unpin` cost an engine's
scheduler thread, its memory and the wall clock, on a directory of N blocks (issue 40).

    PYTHONPATH=. .venv/bin/python tools/bench_ops.py --dir /mnt/nvme/ops --n 10000000 --json

The directory is built in bulk (`build`: its checkpoint written directly, N blocks of `--tenants`
tenants in turn, every 1/--pinned-th pinned, the data file sparse: this measures the index, the
journal and the punches, not the disk), then each phase runs in a fresh process on a fresh build,
as an engine's scheduler side does (a Store with its I/O thread, the index loaded in the
background): the order is appended to DIR/control, and every `--step-ms` (the time a vLLM step
waits on the device, the GIL released) the process makes a step's calls: `refresh` (timed: the
order's share of the step is in it), then a commit of --commits new blocks (saves go on). Done
when the order is applied, its MARK queued and every chunk and punch written.

- clear: every block (`aiokv clear DIR`); clear_tenant: one tenant's (every --tenants-th slot:
  the scattered case); pin: every tenant's blocks pinned; unpin: the same unpinned (after pin,
  same process).
- `<op>_step_max_ms`: the longest refresh of a step while it ran (wall clock: waits for the GIL
  and for a CPU included); `<op>_step_max_cpu_ms`: the most CPU time the scheduler's thread
  spent in one (its own work); `<op>_steps`: steps it took;
  `<op>_wall_s`: from the order's append until done (the I/O thread reads orders every 0.1 s);
  `<op>_bytes_per_block`: the process's peak RSS growth while it ran (VmHWM, reset first) per
  block it changed; `<op>_blocks`: blocks it changed.
- victims: tools/bench_victims.py's figures (`victim_us_median`, `victim_us_max`, ...: choosing a
  victim for a quota or the capacity on the scheduler thread) on a directory of its own build.

Prints one JSON line with --json. Runs against any tree with the same Store API: PYTHONPATH
names the one measured (docs/benchmarks.md, "Clears, pins and unpins at node scale").
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools import harness  # noqa: E402

NSID = b"o" * 16
PAYLOAD = 4096
CHUNK = 1 << 20  # records written at a time by the build


def tenant_name(i: int) -> str:
    return f"tenant{i}"


# ---- the directory, in bulk ----
def build(root: str, n: int, tenants: int, pin_every: int) -> None:
    """N blocks in slots 0..N-1 (key i: i eight bytes four times; tenant 1 + i % tenants; pinned
    where i % pin_every == 0; last used in slot order), as a checkpoint of generation 1."""
    import numpy as np

    from aiokv import _index, _native
    from aiokv.data import format as fmt
    from aiokv.store import Store
    from aiokv.store.logrecords import REC

    shutil.rmtree(root, ignore_errors=True)
    st = Store(root)
    ns = st.namespace(NSID, PAYLOAD)
    for t in range(tenants):  # a block each through the store: the tenants file names them (ids at a first commit)
        key = (1 << 63 | t).to_bytes(8, "little") * 4
        st.commit(ns, [(key, st.reserve(ns, key, tenant_name(t)))], tenant_name(t))
    ids = [st.tenant(tenant_name(t)) for t in range(tenants)]
    st.close(checkpoint=False)
    d = os.path.join(root, "ns", NSID.hex())
    for name in os.listdir(d):
        if name.startswith("journal.") or name in ("checkpoint", fmt.INDEX_NAME):
            os.unlink(os.path.join(d, name))
    with open(os.path.join(d, fmt.data_file(0)), "wb") as f:
        f.truncate(n * ns.slot_bytes)  # sparse
    base = time.time_ns() - 10**12
    ids = np.array(ids, np.uint16)
    crc = 0
    with open(os.path.join(d, "checkpoint"), "wb") as f:
        f.write(bytes(fmt.FILE_HDR_BYTES))
        for lo in range(0, n, CHUNK):
            i = np.arange(lo, min(lo + CHUNK, n), dtype=np.uint64)
            r = np.zeros(len(i), REC)
            r["kind"], r["klen"], r["slot"], r["atime"] = fmt.REC_COMMIT, 32, i, base + i
            r["key"] = np.repeat(i, 4).view("V32")
            r["tenant"] = ids[(i % tenants).astype(np.int64)]
            r["flags"] = np.where(i % pin_every == 0, fmt.FLAG_PINNED, 0) if pin_every else 0
            raw = r.view(np.uint8).reshape(-1)
            tags = np.zeros(len(r), np.uint64)
            _index.record_tags(raw, fmt.REC_BYTES, fmt.REC_KLEN_AT, fmt.REC_KEY_AT, tags)
            r["tag"] = tags
            _index.seal(raw, fmt.REC_BYTES)
            crc = _native.crc32c_bytes(raw, crc)
            f.write(raw.tobytes())
        f.seek(0)
        f.write(fmt.pack_file_header(fmt.CKPT_MAGIC, 1, n, crc))


# ---- one engine's scheduler side ----
def rss() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process, bytes."""
    got = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                got[line.split(":")[0]] = int(line.split()[1]) * 1024
    return got["VmRSS"], got["VmHWM"]


def reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
    except OSError:
        pass


def open_engine(root: str):
    from aiokv.store import Store

    st = Store(root, io_thread=True, checkpoint_every=10**12)
    st.pin_capacity = 1 << 62
    ns = st.namespace(NSID, PAYLOAD)
    t = time.monotonic()
    while not ns.ready:
        st.refresh()
        time.sleep(0.01)
        if time.monotonic() - t > 600:
            raise SystemExit("bench_ops: the index did not load")
    return st, ns


def applying(st) -> bool:
    """Whether the store is still applying an order (a tree before issue 40 applies it whole)."""
    jobs = getattr(st.control, "jobs", None)
    return jobs is not None and jobs.busy


def run_order(st, ns, op: str, tenants, step_s: float, commits: int, next_key: list) -> dict:
    """One order through the steps of a live engine; its figures."""
    from aiokv.store.control import append_order

    commit_some(st, ns, commits, next_key)  # (a commit past the loaded table grows its columns: not the order's)
    st.fs.wait(st.fs.submit(lambda: None), 600)
    gc.collect()
    before_rss, _ = rss()
    reset_peak()
    count0, pinned0 = ns.table.count, ns.table.pinned
    t0 = time.monotonic()
    order = append_order(st.dirs.root_fd, op, None, tenants)
    worst, worst_cpu, steps = 0.0, 0.0, 0
    while True:
        a, c = time.perf_counter(), time.thread_time()
        st.refresh()
        worst = max(worst, time.perf_counter() - a)
        worst_cpu = max(worst_cpu, time.thread_time() - c)
        steps += 1
        commit_some(st, ns, commits, next_key)
        if ns.mark >= order.number and not applying(st):
            break
        time.sleep(step_s)
        if time.monotonic() - t0 > 3600:
            raise SystemExit(f"bench_ops: {op} did not finish")
    st.fs.wait(st.fs.submit(lambda: None), 600)  # what it queued (records, punches, MARK) written
    wall = time.monotonic() - t0
    _, peak = rss()
    changed = abs(ns.table.pinned - pinned0) if op != "clear" else count0 + steps * commits - ns.table.count
    return {
        "step_max_ms": worst * 1e3,
        "step_max_cpu_ms": worst_cpu * 1e3,
        "steps": steps,
        "wall_s": wall,
        "blocks": changed,
        "bytes_per_block": max(0, peak - before_rss) / max(changed, 1),
    }


def commit_some(st, ns, k: int, next_key: list) -> None:
    """k new blocks committed (slots given disk space by fiat), as a step's saves."""
    if not k:
        return
    lo = next_key[0]
    next_key[0] += k
    ns.alloc.grow(range(ns.alloc.hwm, ns.alloc.hwm + k))
    items = []
    for i in range(lo, lo + k):
        key = (i | 1 << 62).to_bytes(8, "little") * 4
        where = ns.alloc.take()
        ns.pending[key] = where
        items.append((key, where))
    st.commit(ns, items, tenant_name(0))


def phase(args) -> dict:
    from aiokv.data import format as fmt

    st, ns = open_engine(args.dir)
    out = {}
    every = frozenset(fmt.tenant_tag(tenant_name(t)) for t in range(args.tenants))
    nk, step_s = [0], args.step_ms / 1e3
    try:
        if args.phase == "clear":
            out.update({f"clear_{k}": v for k, v in run_order(st, ns, "clear", None, step_s, args.commits, nk).items()})
        elif args.phase == "clear_tenant":
            one = frozenset([fmt.tenant_tag(tenant_name(1))])
            got = run_order(st, ns, "clear", one, step_s, args.commits, nk)
            out.update({f"clear_tenant_{k}": v for k, v in got.items()})
        else:
            for op in ("pin", "unpin"):
                out.update({f"{op}_{k}": v for k, v in run_order(st, ns, op, every, step_s, args.commits, nk).items()})
    finally:
        st.close(checkpoint=False)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/aiokv-bench-ops")
    ap.add_argument("--n", type=int, default=10_000_000)
    ap.add_argument("--tenants", type=int, default=10)
    ap.add_argument("--pinned", type=int, default=100, help="every PINNED-th block is pinned (0: none)")
    ap.add_argument("--step-ms", type=float, default=10.0, help="a vLLM step's wait on the device")
    ap.add_argument("--commits", type=int, default=32, help="blocks committed per step meanwhile")
    ap.add_argument(
        "--phases",
        default="clear,clear_tenant,pin,victims",
        help="clear, clear_tenant, pin (pin and unpin), victims (tools/bench_victims.py)",
    )
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.phase == "build":
        build(args.dir, args.n, args.tenants, args.pinned)
        return
    if args.phase:
        print(json.dumps(phase(args)), flush=True)
        return
    out = {"n": args.n, "tenants": args.tenants, "pinned_every": args.pinned, "step_ms": args.step_ms}
    me = [
        sys.executable,
        os.path.abspath(__file__),
        "--dir",
        args.dir,
        "--n",
        str(args.n),
        "--tenants",
        str(args.tenants),
        "--pinned",
        str(args.pinned),
        "--step-ms",
        str(args.step_ms),
        "--commits",
        str(args.commits),
    ]
    for ph in args.phases.split(","):
        if ph == "victims":
            victims = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_victims.py")
            got = harness.child(
                [victims, "--dir", args.dir, "--n", str(args.n), "--tenants", str(args.tenants), "--json"],
                "bench_victims",
            )
        else:
            subprocess.run(me + ["--phase", "build"], check=True)
            got = harness.child(me[1:] + ["--phase", ph], f"bench_ops: phase {ph}")
        out.update({k: v for k, v in got.items() if k not in out})
    shutil.rmtree(args.dir, ignore_errors=True)
    harness.flat(out, args)


if __name__ == "__main__":
    main()
