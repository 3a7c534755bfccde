#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""CPU seconds per GB of a worker-level save and load, with the payload CRC32C as
a separate pass ("separate") and inside the CPU device copy ("in copy", the worker's
crc_in_copy).

    PYTHONPATH=. .venv/bin/python tools/bench_crc_in_copy.py [--gib 1] [--layers 28] [--rounds 3] [--dir DIR]
        [--paths fold,isal] [--baseline SO]

A TransferWorker over a CpuDevice with the CPU backend's KV layout (per layer
[num_blocks, kv_heads, block_size, 2 * head_dim] bf16, views of one buffer):
  save = TransferWorker.save of every block (device copy on this thread, then
         stamp + io_uring write on the worker loop), until all are reported;
  load = TransferWorker.load of every block (read, verify, device copy), until reported.
The separate pass and the CRC in the copy alternate on the same worker, files and
data (the worker's `_crc_in_copy` switched between rounds); every byte is cold (the KV cache and the
staging arena are each --gib, far above the caches). "disk" rows: the whole
job, CPU of the process (time.process_time: every thread, kernel included).
"memory" rows: the same CPU work without the disk (device copy + stamp, and
verify + device copy, on slots already in staging). "copy in": the device copy
alone, plain against the CRC in the copy (what a memory-tier hit would pay for checking its
already verified slots again). core-s/GB per GB of
payload, median of --rounds; wall GB/s alongside. "beyond the copy": a disk save or load
with the CRC in the copy, less the plain copy alone (the 0.05 core-s/GB goal).

Contenders, each round running them in turn on the same worker and data: this build's
CRC32C paths named by --paths (default: the one it picks, CRC_PATH; every CRC32C the
module computes takes that path: _native.crc32c_use), and with --baseline another build
of aiokv._native (its .so, or a tree with it built in place, e.g. a worktree at main),
its CRC-computing calls (copies, slot stamp and check, crc32c) swapped in for ours.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aiokv import _native  # noqa: E402
from aiokv.data import format as fmt  # noqa: E402
from aiokv.jobs import Transfer  # noqa: E402
from aiokv.store.store import ns_dir  # noqa: E402
from aiokv.worker.device import CpuDevice  # noqa: E402
from aiokv.worker.transfer import TransferWorker  # noqa: E402
from tools import harness  # noqa: E402
from tools.bench_crc import load_build  # noqa: E402

# the calls of aiokv._native that compute CRC32C, swapped for a baseline build's
SWAPPED = ("crc32c", "crc32c_bytes", "memcpy_many", "memcpy_crc_out", "memcpy_crc_in", "verify_slots", "check_slot")

NS = bytes(range(16))


def _wait(w: TransferWorker) -> None:
    while w.in_flight:
        w.wait_for_jobs(1.0)


def contenders(args) -> list[tuple[str, object, object]]:
    """(label, start, stop): what each contender switches on, and off again."""
    out = []
    for path in args.paths.split(",") if args.paths else [_native.CRC_PATH]:

        def start(path=path):
            return _native.crc32c_use(path)

        def stop(was):
            _native.crc32c_use(was)

        out.append((f"new {path}", start, stop))
    if args.baseline:
        base = load_build(args.baseline)

        keyed = []  # [True] once known: the baseline takes a MAC key (None) where this build takes the scheme

        def base_stamp(*a):
            if not keyed:  # decided by the first call: a build of the same signature takes `a` as it is
                try:
                    out = base.stamp_slots(*a)
                except TypeError:
                    keyed.append(True)
                else:
                    keyed.append(False)
                    return out
            return base.stamp_slots(*a[:7], *([None] if len(a) > 7 else [])) if keyed[0] else base.stamp_slots(*a)

        def bstart():
            was = {name: getattr(_native, name) for name in (*SWAPPED, "stamp_slots")}
            for name in SWAPPED:
                setattr(_native, name, getattr(base, name))
            _native.stamp_slots = base_stamp
            return was

        def bstop(was):
            for name, fn in was.items():
                setattr(_native, name, fn)

        out.append((f"base {base.CRC_PATH}", bstart, bstop))
    return out


def run(args) -> dict:
    blk = args.heads * args.block * 2 * args.head_dim * 2  # bf16
    payload = blk * args.layers
    n = max(8, int(args.gib * (1 << 30)) // payload)
    buf = torch.randn(args.layers, n + 1, args.heads, args.block, 2 * args.head_dim).to(torch.bfloat16)
    kv = {f"l{i}": buf[i] for i in range(args.layers)}
    root = tempfile.mkdtemp(dir=args.dir, prefix="bench_crc_in_copy.")
    os.makedirs(ns_dir(root, NS), exist_ok=True)
    dev = CpuDevice(kv, n + 1)
    slot = fmt.slot_bytes(dev.payload_bytes)
    w = TransferWorker(dev, ns_dir(root, NS), NS, 0, staging_bytes=n * slot, queue_depth=args.depth)
    assert w._crc_in_copy and dev.crc_in_copy, "this layout should copy with checksums"
    keys = [i.to_bytes(4, "little") * 8 for i in range(n)]
    ids = list(range(1, n + 1))
    gb = n * payload / 1e9
    out: dict[str, list] = {}

    def phase(name, fn):
        p0, t0 = time.process_time(), time.perf_counter()
        fn()
        dc, dt = time.process_time() - p0, time.perf_counter() - t0
        out.setdefault(name, []).append((dc / gb, gb / dt))

    def save():
        w.save([Transfer("s", keys, list(range(n)), ids)])
        _wait(w)
        assert len(w.poll()[2].written()) == n

    def load():
        w.load([Transfer("r", keys, list(range(n)), ids)])
        _wait(w)
        done, errors, _ = w.poll()
        assert done == {"r"} and not errors

    io = w._blockio()
    lay = (io.nsid, io.rank, io.payload_bytes, io.layout)
    stg = list(range(n))  # the worker is idle in the memory rounds: its staging buffers, used directly
    addrs = [w.pool.addr(s) for s in stg]

    def mem_save(in_copy):
        dev.copy_out(ids, stg, crc_in_copy=in_copy)
        fmt.stamp_slots(addrs, keys, *lay, in_copy)

    def mem_load(in_copy):
        v = fmt.verify_slots(addrs, keys, *lay, in_copy)
        ok = dev.copy_in(ids, stg, crc_in_copy=in_copy)
        assert not any(v) and (ok is None or all(ok))

    who = contenders(args)
    try:
        save()  # the data file grows to its size once, outside the measured rounds
        load()
        for r in range(args.rounds):
            for label, start, stop in who if r % 2 == 0 else who[::-1]:
                was = start()
                try:
                    for in_copy in (False, True):
                        tag = f"{label}|{'in copy' if in_copy else 'separate'}"
                        w._crc_in_copy = in_copy
                        phase(f"disk save|{tag}", save)
                        phase(f"disk load|{tag}", load)
                        phase(f"memory save|{tag}", lambda in_copy=in_copy: mem_save(in_copy))
                        phase(f"memory load|{tag}", lambda in_copy=in_copy: mem_load(in_copy))
                        phase(f"copy in|{tag}", lambda in_copy=in_copy: dev.copy_in(ids, stg, crc_in_copy=in_copy))
                finally:
                    stop(was)
    finally:
        w.close()
        shutil.rmtree(root)
    return {
        "payload": payload,
        "blocks": n,
        "gb": gb,
        "contenders": [label for label, _, _ in who],
        "results": {
            k: (statistics.median(c for c, _ in v), statistics.median(g for _, g in v)) for k, v in out.items()
        },
    }


def main() -> int:
    ap = harness.parser(__doc__, rounds=3)
    ap.add_argument("--gib", type=float, default=1.0, help="payload moved each way per round (and KV cache size)")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--heads", type=int, default=4, help="KV heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block", type=int, default=16, help="tokens per block")
    ap.add_argument("--depth", type=int, default=32, help="io_uring queue depth")
    ap.add_argument("--dir", default=None, help="where the data file goes (a real disk; default: the temp dir)")
    ap.add_argument("--paths", default=None, help="this build's CRC32C paths to run, comma separated")
    ap.add_argument("--baseline", default=None, help="another build's aiokv/_native*.so (or its tree)")
    args = ap.parse_args()
    return harness.emit(harness.document(rounds=args.rounds, **run(args)), args, render)


def render(r: dict) -> str:
    lines = [
        f"{r['blocks']} blocks of {r['payload'] / 1024:.0f} KiB ({r['gb']:.2f} GB) each way, median of {r['rounds']} rounds"
    ]
    res = r["results"]
    for label in r["contenders"]:
        lines.append(f"\n{label}")
        lines.append(
            f"{'':14}{'separate core-s/GB':>20}{'in copy core-s/GB':>19}{'saved':>8}{'separate GB/s':>15}"
            f"{'in copy GB/s':>14}"
        )
        for kind in ("disk save", "disk load", "memory save", "memory load", "copy in"):
            (oc, og), (fc, fg) = res[f"{kind}|{label}|separate"], res[f"{kind}|{label}|in copy"]
            lines.append(f"{kind:14}{oc:20.4f}{fc:19.4f}{oc - fc:8.4f}{og:15.2f}{fg:14.2f}")
        plain = res[f"copy in|{label}|separate"][0]
        lines.append(
            f"beyond the copy (in copy, less the plain copy {plain:.4f}): "
            f"save {res[f'disk save|{label}|in copy'][0] - plain:.4f}, "
            f"load {res[f'disk load|{label}|in copy'][0] - plain:.4f} core-s/GB"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
