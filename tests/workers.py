# SPDX-License-Identifier: Apache-2.0
"""Worker-level test helpers: a TransferWorker over a CpuDevice on small KV
tensors (no vLLM), and a way to run one of its calls until its jobs are done."""

from __future__ import annotations

import os
import time

from aiokv.data import format as fmt
from aiokv.data.slotfile import data_path
from aiokv.store.store import ns_dir
from aiokv.worker.device import CpuDevice
from aiokv.worker.transfer import TransferWorker
from tests.conftest import NS


def cpu_worker(root: str, kv: dict, staging_bufs: int, kept: int = 0, **kw) -> TransferWorker:
    """A worker on namespace NS under root, `staging_bufs` staging buffers plus
    `kept` slots of memory tier; kw go to TransferWorker."""
    os.makedirs(ns_dir(root, NS), exist_ok=True)
    dev = CpuDevice(kv, next(iter(kv.values())).shape[0])
    slot = fmt.slot_bytes(dev.payload_bytes)
    return TransferWorker(
        dev, ns_dir(root, NS), NS, 0, staging_bytes=staging_bufs * slot, memory_bytes=kept * slot, **kw
    )


def data_file(root: str) -> tuple[str, bytes]:
    """The path of rank 0's data file of namespace NS under root, and its bytes."""
    path = data_path(ns_dir(root, NS), 0)
    with open(path, "rb") as f:
        return path, f.read()


def flip_payload_bytes(path: str, slot_bytes: int, bad: dict[int, int], mask: int = 0x20) -> None:
    """In the data file at path, XOR `mask` into payload byte `off` of slot `s`, for each s: off of bad."""
    with open(path, "r+b") as f:
        for s, off in bad.items():
            f.seek(s * slot_bytes + fmt.HEADER_BYTES + off)
            b = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b ^ mask]))


def run_jobs(w: TransferWorker, fn, arg, timeout: float = 10.0):
    """fn(arg) (w.save or w.load), then w.poll() once no job is in flight (or after timeout)."""
    fn(arg)
    end = time.monotonic() + timeout
    while w.in_flight and time.monotonic() < end:
        time.sleep(0.002)
    return w.poll()


def until(cond, timeout: float) -> bool:
    """Whether cond() came true within timeout seconds (polled every 10 ms)."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


class Polled:
    """What a worker's polls have handed back so far: the requests finished, the
    block ids failed and the counters, summed. `finished(req)` polls once more."""

    def __init__(self, w: TransferWorker):
        self.w, self.done, self.errors, self.counts = w, set(), set(), {}

    def finished(self, req: str) -> bool:
        d, e, rep = self.w.poll()
        self.done.update(d)
        self.errors.update(e)
        for k, v in rep.counters.items():
            self.counts[k] = self.counts.get(k, 0) + v
        return req in self.done
