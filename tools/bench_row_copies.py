#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""What a CUDA worker's copies between its gather buffer and the pinned staging arena cost the
calling thread (vLLM's, for a save) per block: a `copy_` a row, as CudaDevice did, against one
batch call a gather whose addresses CudaDevice computes with tensor ops (worker/cuda.py,
`_rows_out`: vLLM's swap_blocks_batch, handed down by the connector).

    PYTHONPATH=. .venv/bin/python tools/bench_row_copies.py [--blocks 2000] [--rounds 5] [--json]

On the CPU (this machine: no GPU) the rows are CPU tensors of 64 bytes, so a copy's own
memcpy is negligible, and the batch call is a stand-in that does nothing: the figures are the
Python and dispatcher time of the two ways to ask, not the driver's (a row's cudaMemcpyAsync, or
cuMemcpyBatchAsync's submission, come on top on a GPU; tools/gpu_check.py measures real
copies). Figures: us_per_block for each way (the median over rounds of the median of 20
calls), and rows_over_batch (the median of each round's own ratio).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # last: PYTHONPATH's aiokv

from tools import harness  # noqa: E402

ROW = 64  # bytes a row: the copy's own work negligible beside the asking


def main() -> int:
    ap = harness.parser(__doc__, rounds=5)
    ap.add_argument("--blocks", type=int, default=2000, help="blocks a gather (a 32k-token prefill: 2000)")
    args = ap.parse_args()
    import torch

    from aiokv.worker.cuda import row_addrs

    n = args.blocks
    arena = torch.zeros(2 * n, 2 * ROW, dtype=torch.uint8)  # slots: a header, then the payload
    gather = torch.ones(n, ROW, dtype=torch.uint8)
    bufs = list(range(0, 2 * n, 2))  # staging buffers scattered over the arena
    asked = []

    def rows() -> None:
        for i, s in enumerate(bufs):
            arena[s, ROW:].copy_(gather[i], non_blocking=True)

    def batch() -> None:
        src = row_addrs(gather, torch.arange(n))
        dst = row_addrs(arena, torch.tensor(bufs), ROW)
        asked.append((src, dst, torch.full((n,), ROW, dtype=torch.int64)))  # the batch call's arguments

    def timed(fn):
        def run(_r: int) -> dict:
            took = []
            for _ in range(20):
                t = time.perf_counter()
                fn()
                took.append(time.perf_counter() - t)
            asked.clear()
            return {"us_per_block": statistics.median(took) / n * 1e6}

        return run

    runs = harness.interleave({"rows": timed(rows), "batch": timed(batch)}, args.rounds, harness.say(args))
    out = {
        "blocks": n,
        "rounds": args.rounds,
        "rows_us_per_block": harness.medians(runs["rows"])["us_per_block"],
        "batch_us_per_block": harness.medians(runs["batch"])["us_per_block"],
        "rows_over_batch": harness.paired(runs["rows"], runs["batch"], "us_per_block"),
    }
    return harness.flat(out, args, digits=3)


if __name__ == "__main__":
    sys.exit(main())
