# SPDX-License-Identifier: Apache-2.0
"""Bug: a load of N blocks read each block into a staging buffer of its own, N
buffers at once. On a virtual disk, whose reads are copies the host makes into
guest memory, a read into memory no read touched lately takes 1.3-1.5 x
longer than into a few buffers read into again and again (docs/benchmarks-history.md:
the buffer footprint); and a long load held most of the pool.

Invariants: a load reads through a window of buffers (data/window.py): it
holds at most `step` x `ahead` staging buffers at once however many blocks it
has, and every block still arrives verified in its KV block. Ending a read
through a window (cancelled, or a failure to get buffers) returns only once
no chunk's I/O can touch its buffers, and gives every buffer back, those of
chunks cancelled before they began too (failure catalogue 11).

Fix: data/window.py read_through, used by worker/loads.py for the disk reads
of a load.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno

import pytest
import torch

from aiokv.data import format as fmt
from aiokv.data.buffers import BufferPool
from aiokv.data.window import read_through, shape
from aiokv.jobs import Transfer
from aiokv.worker.staging import StagingStuck
from tests.conftest import NS, key
from tests.test_cancel_releases_buffers import _cancel_once_in_flight
from tests.workers import cpu_worker, run_jobs
from tools.storeio import StoreIO

NB = 64  # blocks in a long load
PAYLOAD = 256 << 10


def test_a_long_load_holds_only_a_window_of_buffers(tmp_path):
    kv = {f"l{i}": torch.randn(2 * NB + 2, 2, 32, 8) for i in range(2)}
    w = cpu_worker(str(tmp_path), kv, NB + 8, queue_depth=4)  # buffers enough for the whole load at once
    staging = w.host.staging
    seen: set[int] = set()
    most = [0]
    wait = staging.wait

    async def spy(n, whole=False):
        bufs = await wait(n, whole)
        seen.update(bufs)
        most[0] = max(most[0], staging.in_use)
        return bufs

    staging.wait = spy
    try:
        _, _, rep = run_jobs(w, w.save, [Transfer(f"s{i}", [key(i)], [i], [i + 1]) for i in range(NB)])
        assert len(rep.written()) == NB
        t = Transfer("r", [key(i) for i in range(NB)], list(range(NB)), list(range(NB + 1, 2 * NB + 1)))
        done, errors, _ = run_jobs(w, w.load, [t])
        assert done == {"r"} and not errors
        for i in range(NB):
            for x in kv.values():
                assert torch.equal(x[NB + 1 + i], x[i + 1])
        step, ahead = w.reads.window()
        assert step * ahead < NB, "the test needs a load longer than the window"
        assert most[0] <= step * ahead, f"a load held {most[0]} buffers at once, its window is {step * ahead}"
        assert len(seen) <= step * ahead, f"a load of {NB} blocks read into {len(seen)} distinct buffers"
        assert staging.in_use == 0
    finally:
        w.close()


def _saved(tmp_path, n: int):
    st = StoreIO(tmp_path / "s")
    ns = st.namespace(NS, PAYLOAD)
    pool = BufferPool(fmt.slot_bytes(PAYLOAD), n)
    return st, ns, pool


async def test_a_read_through_a_window_ends_owning_no_buffer(tmp_path, backend_kind):
    n = 48
    st, ns, pool = _saved(tmp_path, n)
    items = [(key(i), pool.addr(i)) for i in range(n)]
    assert await st.save(ns, items) == [0] * n
    io = st.blockio(ns)
    slots = st.pin(ns, [k for k, _ in items])
    todo = [(s, k) for s, (k, _) in zip(slots, items)]

    async def take(k):
        return pool.acquire(min(k, pool.available)) or []

    async def run(part, bufs):
        try:
            res = await io.read([(s, k, pool.addr(b)) for (s, k), b in zip(part, bufs)])
            assert res == [0] * len(part)
        finally:
            pool.release(bufs)

    for delay in (0, 0.0005):
        await _cancel_once_in_flight(lambda: read_through(todo, take, pool.release, run, 4, 3), lambda: None, io, delay)
        assert io.backend.in_flight == 0
        assert pool.in_use == 0, "every chunk's buffers are back once the read has ended"
        for b in range(n):  # nothing writes into them any more
            ctypes.memset(pool.addr(b), 0x5A, 4096)
        await asyncio.sleep(0.05)
        assert all(ctypes.string_at(pool.addr(b), 4096) == b"\x5a" * 4096 for b in range(n))
    await read_through(todo, take, pool.release, run, *shape(io))  # and whole, when not cancelled
    assert pool.in_use == 0
    st.unpin(ns, [k for k, _ in items])
    st.close()
    pool.close()


async def test_chunks_cut_before_they_began_give_their_buffers_back():
    pool = BufferPool(4096, 16)
    calls = []

    async def take(k):
        if calls:  # the second chunk's buffers cannot come: every buffer in use is stuck
            raise StagingStuck(errno.EBUSY, "stuck")
        calls.append(k)
        return pool.acquire(k)

    async def run(part, bufs):  # never begins: the read ends before the loop runs it
        pool.release(bufs)
        raise AssertionError("the chunk ran")

    with pytest.raises(StagingStuck):
        await read_through(list(range(12)), take, pool.release, run, 4, 3)
    assert calls == [4]
    assert pool.in_use == 0, "a chunk cancelled before it began keeps its buffers"
    pool.close()


async def test_a_failed_chunk_ends_the_read_and_waits_for_the_others():
    pool = BufferPool(4096, 16)
    ran, ended = [], []

    async def take(k):
        return pool.acquire(k)

    async def run(part, bufs):
        ran.append(part[0])
        try:
            if part[0] == 0:
                raise ValueError("a chunk's own error")
            await asyncio.sleep(0.05)
        finally:
            ended.append(part[0])
            pool.release(bufs)

    with pytest.raises(ValueError):
        await read_through(list(range(40)), take, pool.release, run, 4, 3)
    assert sorted(ended) == sorted(ran) and len(ran) < 10, "chunks after the failure started, or one still ran"
    assert pool.in_use == 0
    pool.close()
