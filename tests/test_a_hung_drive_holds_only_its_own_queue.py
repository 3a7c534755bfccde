# SPDX-License-Identifier: Apache-2.0
"""Bug: a worker's drives (`path` a list) shared one I/O backend, so one queue
depth (io_uring) or one thread pool. A drive whose reads hang (a dead device, a
stalled FUSE daemon or network mount) kept them in the kernel; once they filled
that queue, every other drive's reads waited behind them, and loads of blocks on
healthy drives ran into their timeout: the whole cache was down although one
drive was sick. One drive on FUSE also put every drive on the thread pool.

Invariant: a drive's hung operations hold only its own queue. While one drive's
reads hang, loads from the other drives complete, verified, well within their
timeout; each drive gets the backend its own file system allows (io_uring beside
a FUSE drive on threads).

Fix: one backend per drive, each with the worker's queue depth
(aiokv/worker/lifecycle.py).
"""

from __future__ import annotations

import os
import time

import torch

from aiokv.data import format as fmt
from aiokv.jobs import Transfer
from aiokv.store.store import ns_dir
from aiokv.worker.device import CpuDevice
from aiokv.worker.transfer import TransferWorker
from tests.conftest import NS, key
from tests.stallfs import mounted
from tests.workers import Polled, until

NB = 28  # (not 32: a dimension of the KV tensors below)
DEPTH = 4  # the worker's queue depth: the sick drive's reads fill it twice over
LOAD_TIMEOUT = 8.0
HEALTHY_WITHIN = 3.0  # a load from the healthy drives, with room for a busy 2-core machine


def test_loads_from_healthy_drives_finish_while_one_drives_reads_hang(tmp_path):
    control = str(tmp_path / "stall")
    with mounted(str(tmp_path / "src"), str(tmp_path / "mnt"), control):
        paths = [str(tmp_path / "mnt" / "c"), str(tmp_path / "d1" / "c"), str(tmp_path / "d2" / "c")]
        dirs = [ns_dir(p, NS) for p in paths]
        for d in dirs:
            os.makedirs(d)
        kv = {f"l{i}": torch.randn(NB, 2, 32, 8) for i in range(2)}
        dev = CpuDevice(kv, NB)
        w = TransferWorker(
            dev,
            dirs,
            NS,
            0,
            staging_bytes=24 * fmt.slot_bytes(dev.payload_bytes),
            queue_depth=DEPTH,
            load_timeout=LOAD_TIMEOUT,
        )
        try:
            assert [b.name for b in w.backends] == ["threads", "io_uring", "io_uring"], (
                "each drive gets the backend its own file system allows"
            )
            # 8 blocks on the FUSE drive (slots 0-7), 2 on each other drive; block ids 1-12
            where = [(0, s) for s in range(8)] + [(1, 0), (1, 1), (2, 0), (2, 1)]
            w.save([Transfer(f"s{i}", [key(i)], [fmt.on_drive(d, s)], [i + 1]) for i, (d, s) in enumerate(where)])
            w.drain(10)
            _, _, rep = w.poll()
            assert len(rep.written()) == len(where) and not rep.not_written(), rep

            with open(control, "w") as f:
                f.write("r")  # the FUSE drive's reads hang from now on
            w.load(
                [
                    Transfer(
                        "sick", [key(i) for i in range(8)], [fmt.on_drive(0, s) for s in range(8)], list(range(13, 21))
                    )
                ]
            )
            assert until(lambda: w.backends[0].in_flight >= DEPTH, 5), "the sick drive's reads hang"
            healthy = list(range(8, 12))
            t0 = time.monotonic()
            w.load(
                [
                    Transfer(
                        "healthy",
                        [key(i) for i in healthy],
                        [fmt.on_drive(d, s) for d, s in where[8:]],
                        list(range(21, 25)),
                    )
                ]
            )
            got = Polled(w)
            finished, done, errors, counts = got.finished, got.done, got.errors, got.counts

            assert until(lambda: finished("healthy"), LOAD_TIMEOUT + 5), "the healthy load never came back"
            took = time.monotonic() - t0
            assert not errors & set(range(21, 25)), f"the healthy drives' blocks failed: {errors}"
            assert counts.get("loads_ok_blocks") == 4 and not counts.get("load_timeouts"), counts
            assert took < HEALTHY_WITHIN, f"the healthy load waited {took:.1f} s behind the sick drive's reads"
            for i, b in zip(healthy, range(21, 25)):
                assert torch.equal(kv["l0"][b], kv["l0"][i + 1]) and torch.equal(kv["l1"][b], kv["l1"][i + 1])
            assert "sick" not in done, "the sick drive's load is still held by its reads"

            os.unlink(control)  # the sick drive answers again: its load ends (loaded or timed out)
            assert until(lambda: finished("sick"), LOAD_TIMEOUT + 5)
            assert until(lambda: w.stuck == 0 and w.life.in_flight == 0, 10)
        finally:
            if os.path.exists(control):
                os.unlink(control)
            w.close()
