#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""CRC32C speed of each path this CPU has, hot and cold, against one core's
memory-read floor, and against another build's paths in the same run.

    PYTHONPATH=. .venv/bin/python tools/bench_crc.py [--hot-mib 2] [--cold-mib 2048] [--baseline SO] [--json]

- hot: CRC32C of one --hot-mib buffer, repeated (it stays in cache): the path's own speed.
- cold: one pass over a --cold-mib buffer (make it several times the last-level
  cache), 1 MiB per call, the way the store meets payloads fresh from a copy.
- floor: numpy sum of uint64 over the same buffers, hot and cold: what one core
  reads without computing anything (cold: the DRAM bandwidth one core gets).
- --baseline: another build of aiokv._native (its .so file, or a tree with it built
  in place), loaded beside this one; its paths run in the same rounds ("base fold"...),
  this build's as "new ..." (ISA-L's "isal" among them where it is linked).
GB/s are 1e9 bytes per second; us/MiB is the cost per MiB of payload (one core: the
CPU seconds per GB are 1 / GB/s).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aiokv import _native  # noqa: E402
from tools import harness  # noqa: E402

MIB = 1 << 20


def _gbps(nbytes: int, secs: float) -> float:
    return nbytes / secs / 1e9


def hot(buf: np.ndarray, fn, min_s: float = 0.3) -> float:
    addr, n = buf.ctypes.data, buf.nbytes
    fn(addr, n)
    reps, t = 0, time.perf_counter()
    while time.perf_counter() - t < min_s:
        fn(addr, n)
        reps += 1
    return _gbps(n * reps, time.perf_counter() - t)


def cold(buf: np.ndarray, fn, step: int = MIB) -> float:
    addr, n = buf.ctypes.data, buf.nbytes
    t = time.perf_counter()
    for off in range(0, n, step):
        fn(addr + off, step)
    return _gbps(n, time.perf_counter() - t)


def load_build(where: str):
    """Another build of aiokv._native, loaded beside ours (its init function is
    the only name it exports, so the two do not clash)."""
    if os.path.isdir(where):
        found = glob.glob(os.path.join(where, "aiokv", "_native*.so"))
        if not found:
            raise SystemExit(
                f"bench_crc: no aiokv/_native*.so in {where}; build it there (setup.py build_ext --inplace)"
            )
        where = found[0]
    spec = importlib.util.spec_from_file_location("baseline._native", where)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--hot-mib", type=int, default=2)
    ap.add_argument("--cold-mib", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best of each is reported")
    ap.add_argument("--baseline", default=None, help="another build's aiokv/_native*.so (or its tree)")
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    small = rng.integers(0, 2**63, args.hot_mib * MIB // 8, dtype=np.uint64)
    big = np.empty(args.cold_mib * MIB // 8, dtype=np.uint64)
    big[:] = 0x0123456789ABCDEF  # touched: every page is mapped before timing

    def evict() -> None:  # one pass over another buffer of the same size pushes `big` out of the cache
        spare = np.ones(args.cold_mib * MIB // 8, dtype=np.uint64)
        spare.sum()

    def sum_fn(view):
        return lambda addr, n: view[(addr - view.ctypes.data) // 8 : (addr - view.ctypes.data + n) // 8].sum()

    out = {
        "path_default": _native.CRC_PATH,
        "hot_mib": args.hot_mib,
        "cold_mib": args.cold_mib,
        "rounds": args.rounds,
        "gbps": {},
    }
    builds = [("new", _native), ("base", load_build(args.baseline))] if args.baseline else [("", _native)]
    fns = {}
    for tag, mod in builds:
        for p in mod.CRC_PATHS:
            fns[f"{tag} {p}".strip()] = lambda a, n, p=p, mod=mod: mod.crc32c_path(p, a, n)
        if tag:
            out[f"path_default_{tag}"] = mod.CRC_PATH
    fns["floor (sum u64)"] = None
    best: dict[str, dict[str, float]] = {name: {"hot": 0.0, "cold": 0.0} for name in fns}
    for _ in range(args.rounds):  # interleaved rounds, best of each: other tenants' noise only slows a run down
        for name, fn in fns.items():
            h = hot(small, fn or sum_fn(small))
            evict()
            c = cold(big, fn or sum_fn(big))
            best[name] = {"hot": max(best[name]["hot"], h), "cold": max(best[name]["cold"], c)}
    out["gbps"] = best
    return harness.emit(harness.document(**out), args, render)


def render(doc: dict) -> str:
    lines = [
        f"default path: {doc['path_default']}; hot {doc['hot_mib']} MiB repeated, cold {doc['cold_mib']} MiB once; "
        f"best of {doc['rounds']} rounds",
        "| path | hot GB/s | hot us/MiB | cold GB/s | cold us/MiB |",
        "|---|---|---|---|---|",
    ]
    for p, r in doc["gbps"].items():
        lines.append(
            f"| {p} | {r['hot']:.1f} | {MIB / r['hot'] / 1e3:.1f} | {r['cold']:.1f} | {MIB / r['cold'] / 1e3:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
