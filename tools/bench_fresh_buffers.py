#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Whether writes right after a large allocation run slower: aiokv's writes over
three loop file systems from a pool held for the whole run, from a pool made right
after another was made and freed, and from one made --quiet seconds after that free
(time for a VM's balloon to report the freed memory to its host, which takes it
back: virtio-balloon free page reporting; faulting it back in then shows in the
seconds the new pool takes to make).

    PYTHONPATH=. .venv/bin/python tools/bench_fresh_buffers.py [--rounds 8] [--quiet 8]   (root)

Each round, in this order: the held pool; a pool of the same size made, filled and
freed, then at once a new one; the same with --quiet seconds between the free and
the new pool. Each write is tools/bench_drives.py's aiokv round with --staging 0
(one DriveIO call of all blocks, a buffer each, depth 32 per drive, 1 MiB payloads,
1 GiB); its data path's write GB/s is reported with the seconds it took to make and
fill the pool. Then a pool made after --quiet seconds is held and written --rounds
times more, next to the first pool: whether the cost stays with the memory or goes
with its first use. Why it matters: tools/bench_drives.py made a fresh pool each
round until docs/benchmarks-history.md 11.4.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aiokv.data import format as fmt  # noqa: E402
from aiokv.data.buffers import BufferPool  # noqa: E402
from tools import harness  # noqa: E402
from tools.bench_drives import SETTLE, Mounts, aiokv_round, fill  # noqa: E402

PAYLOAD = 1 << 20
DEPTH = 32


def made(slot: int, n: int) -> tuple[BufferPool, float]:
    """A populated pool of n buffers with a payload in each, and the seconds that took."""
    t = time.perf_counter()
    pool = BufferPool(slot, n, populate=True)
    fill(pool, PAYLOAD)
    return pool, time.perf_counter() - t


def main() -> int:
    ap = harness.parser(__doc__, rounds=8)
    ap.add_argument("--quiet", type=float, default=8.0)
    ap.add_argument("--image-dir", default="/var/tmp")
    args = ap.parse_args()
    log = harness.say(args)
    SETTLE[0] = 1.0
    slot = fmt.slot_bytes(PAYLOAD)
    n = (1 << 30) // slot
    got: dict[str, list[float]] = {}

    def write(dirs, pool, salt) -> float:
        return aiokv_round(dirs, PAYLOAD, n, DEPTH, salt, pool)["write_io_gbps"]

    def note(r, **kv):
        for k, v in kv.items():
            got.setdefault(k, []).append(v)
        log(f"round {r + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in kv.items()))

    with Mounts(3, args.image_dir, 3 << 30, False) as m:
        held, _ = made(slot, n)
        try:
            write(m.dirs, held, 99)  # not counted: fresh file systems first allocate slowly
            for r in range(args.rounds):
                row = {"held_gbps": write(m.dirs, held, r)}
                for name, quiet in (("at_once", 0.0), ("after_quiet", args.quiet)):
                    made(slot, n)[0].close()
                    time.sleep(quiet)
                    pool, secs = made(slot, n)
                    try:
                        row[f"{name}_gbps"], row[f"{name}_make_s"] = write(m.dirs, pool, r), secs
                    finally:
                        pool.close()
                note(r, **row)
            made(slot, n)[0].close()
            time.sleep(args.quiet)
            young, secs = made(slot, n)
            log(f"a pool made after {args.quiet:g} s of quiet, then held: made in {secs:.2f} s")
            try:
                for r in range(args.rounds):
                    note(r, held_again_gbps=write(m.dirs, held, r), young_held_gbps=write(m.dirs, young, r))
            finally:
                young.close()
        finally:
            held.close()
    doc = harness.document(rounds=got, medians={k: statistics.median(v) for k, v in got.items()}, young_make_s=secs)
    return harness.emit(doc, args, lambda d: "medians: " + ", ".join(f"{k} {v:.2f}" for k, v in d["medians"].items()))


if __name__ == "__main__":
    sys.exit(main())
