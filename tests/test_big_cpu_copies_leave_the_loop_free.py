# SPDX-License-Identifier: Apache-2.0
"""A load's big CPU copies into the KV cache run off the worker's loop thread.

Bug: a CPU worker's load copied each chunk it read into the KV cache on the loop thread. The
ring refills itself from its queue only when the loop reaps, so while a chunk of 8 MiB or more
was being copied the disk's queue drained: loads with the copy ran at 0.67-0.71 x fio's read
bandwidth with 1-2 MiB blocks at depth 16-32 (tools/bench_store.py --copy-in; docs/benchmarks.md,
"Where the time goes").
Invariant: a copy of at least COPY_THREAD_BYTES runs while the loop goes on (a callback queued
before it runs before it ends), byte for byte, with the CRC verdicts of the copy; cancelled, the
copy_in call returns only once the copy is done (its buffers and KV blocks are the caller's
again only then). A smaller copy stays on the loop thread.
Fix: Reads.copy_in hands a big synchronous copy to a thread of the loop's executor (waited).
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from aiokv.data import format as fmt
from aiokv.data.buffers import BufferPool
from aiokv.worker import reads as reads_mod
from aiokv.worker.device import CpuDevice
from aiokv.worker.reads import Reads

NB = 12
HOLD = 10.0  # seconds a held copy waits for its signal at most (a failure, never a pass, if it runs out)


class HeldDevice(CpuDevice):
    """The CPU device, whose copy_in waits (at most HOLD) for `go` before it copies, and says on
    which thread it ran and whether `go` came."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.go, self.started = threading.Event(), threading.Event()
        self.copied_on, self.went = None, None

    def copy_in(self, block_ids, bufs, crc_in_copy=False):
        self.copied_on = threading.get_ident()
        self.started.set()
        self.went = self.go.wait(HOLD)
        return super().copy_in(block_ids, bufs, crc_in_copy)


def _setup(monkeypatch):
    g = torch.Generator().manual_seed(1)
    buf = torch.randn(3, NB, 2, 32, 64, generator=g)  # the CPU backend's layout, views of one buffer
    kv = {f"l{i}": buf[i] for i in range(3)}
    dev = HeldDevice(kv, NB)
    slot = fmt.slot_bytes(dev.payload_bytes)
    pool = BufferPool(slot, 6)
    dev.attach(pool)
    assert dev.crc_in_copy
    monkeypatch.setattr(reads_mod, "COPY_THREAD_BYTES", 3 * slot, raising=False)  # 3 blocks and more: big
    reads = Reads(dev, None, None, lambda **k: None, slot)
    bufs = pool.acquire(4)
    dev.copy_out([0, 1, 2, 3], bufs, crc_in_copy=True)  # payloads, each CRC in its header
    want = {k: v[:4].clone() for k, v in kv.items()}
    return dev, kv, pool, reads, bufs, want


def test_a_big_copy_runs_while_the_loop_goes_on_and_copies_every_byte(monkeypatch):
    dev, kv, pool, reads, bufs, want = _setup(monkeypatch)

    async def main():
        asyncio.get_running_loop().call_soon(dev.go.set)  # runs only while the loop is free
        return await reads.copy_in([8, 9, 10, 11], bufs, crc_in_copy=True)

    try:
        ok = asyncio.run(main())
        assert dev.went, f"the loop did not run while the copy ran (it waited {HOLD} s on the loop thread)"
        assert dev.copied_on != threading.get_ident()
        assert ok == [True] * 4
        for k, v in kv.items():
            assert torch.equal(v[8:12], want[k]), k
    finally:
        pool.close()


def test_a_small_copy_stays_on_the_loop_thread(monkeypatch):
    dev, kv, pool, reads, bufs, want = _setup(monkeypatch)
    dev.go.set()

    async def main():
        return threading.get_ident(), await reads.copy_in([8, 9], bufs[:2], crc_in_copy=True)

    try:
        loop_thread, ok = asyncio.run(main())
        assert dev.copied_on == loop_thread and ok == [True, True]
        for k, v in kv.items():
            assert torch.equal(v[8:10], want[k][:2]), k
    finally:
        pool.close()


def test_a_cancelled_big_copy_returns_only_once_the_copy_is_done(monkeypatch):
    dev, kv, pool, reads, bufs, want = _setup(monkeypatch)

    async def main():
        task = asyncio.ensure_future(reads.copy_in([8, 9, 10, 11], bufs, crc_in_copy=True))
        while not dev.started.is_set():  # the copy is running on its thread, held
            await asyncio.sleep(0.001)
        task.cancel()
        await asyncio.sleep(0.05)  # (a call that gave up early would be done by now)
        assert not task.done(), "copy_in returned while its copy still ran"
        dev.go.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(asyncio.wait_for(main(), 2 * HOLD))
        assert dev.went
        for k, v in kv.items():  # done whole before the cancellation was raised
            assert torch.equal(v[8:12], want[k]), k
    finally:
        pool.close()
