# SPDX-License-Identifier: Apache-2.0
"""Bug: with the cache on a disk whose reads never answer (here a FUSE file
system whose daemon holds them, tests/stallfs.py), a load that timed out still
waited for its reads: the backend's `run` waited for every operation of a
cancelled batch, a thread in `preadv` (or io_uring's worker) cannot be
interrupted, and worker `close()` waited without a bound. vLLM hung.

Invariant: a cancelled or timed-out load or save ends at once (reported failed
or cancelled); the staging buffers the kernel still owns are set aside, never
handed out, and come back exactly when the I/O ends; with every buffer stuck a
load fails at once instead of waiting; `close()` returns within its bound.

Fix: the backend's abandon mode (aiokv/data/backend.py, `run(..., abandon=)`) and the
worker's stuck-buffer bookkeeping and bounded close (aiokv/worker/transfer.py).
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import time

import pytest
import torch

from aiokv.data.backend import OP_READ
from aiokv.data.buffers import BufferPool
from aiokv.data.choice import open_backend
from aiokv.jobs import SaveResult, Transfer
from aiokv.store.store import ns_dir
from aiokv.worker.device import CpuDevice
from aiokv.worker.transfer import CLOSE_DRAIN_S, TransferWorker
from tests.conftest import NS, key
from tests.workers import Polled
from tests.workers import until as _until

NB = 16
TIMEOUT = 1.0  # the load and save timeouts of the tests below
# A bound that is the point of a test (a timeout honoured) gets this much on top of the timeout: room
# for a busy 2-core machine. What it tells apart is a wait that never ends (the reads hang until the
# test resumes them): the polls below give up well after it.
SLACK = 4.0


async def test_abandoned_read_returns_at_once_and_hands_back_later(stallfs, backend_kind):
    mnt, stall, resume = stallfs
    path = os.path.join(mnt, "x.data")
    with open(path, "wb") as f:
        f.write(b"\x42" * 8192)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    backend = open_backend(asyncio.get_running_loop())
    pool = BufferPool(8192, 2)
    (s,) = pool.acquire(1)
    ctypes.memset(pool.addr(s), 0, 8192)
    handed: list = []

    async def load():
        abandon = lambda addrs, done: handed.append((addrs, done))  # noqa: E731
        return await backend.run([(OP_READ, fd, pool.addr(s), 8192, 0)], abandon=abandon)

    stall()
    task = asyncio.ensure_future(load())
    # the read is inside its system call (threads) or the kernel's (io_uring): it cannot answer
    # while the daemon holds it
    in_kernel = (lambda: backend.running > 0) if backend.name == "threads" else (lambda: backend.in_flight > 0)
    end = time.monotonic() + 10
    while not in_kernel():
        assert time.monotonic() < end and not task.done(), "the read never reached the kernel"
        await asyncio.sleep(0.005)
    assert not task.done(), "the read must hang while the daemon holds it"
    task.cancel()
    # "at once": the read itself hangs until the test resumes it; SLACK is room for a busy machine
    await asyncio.wait({task}, timeout=SLACK)
    if not task.done():
        resume()  # let the test end
        await task
        pytest.fail("a cancelled read waited for a hung disk")
    assert task.cancelled()
    ((addrs, done),) = handed
    assert addrs == [pool.addr(s)] and not done.done(), "the buffer is still the kernel's"
    resume()
    await asyncio.wait_for(asyncio.shield(done), 10)  # the kernel gives it back once the read answers
    assert backend.in_flight == 0
    backend.close()
    os.close(fd)
    pool.close()


def _worker(root: str, **kw) -> tuple[TransferWorker, dict]:
    kv = {f"l{i}": torch.randn(NB, 2, 32, 8) for i in range(2)}
    os.makedirs(ns_dir(root, NS), exist_ok=True)
    w = TransferWorker(CpuDevice(kv, NB), ns_dir(root, NS), NS, 0, staging_bytes=1, **kw)  # the 4-buffer minimum
    return w, kv


def _saved(w: TransferWorker, n: int) -> list[Transfer]:
    ts = [Transfer(f"s{i}", [key(i)], [i], [i + 1]) for i in range(n)]
    w.save(ts)
    w.drain(10)
    _, _, rep = w.poll()
    assert len(rep.written()) == n and not rep.not_written(), rep
    return ts


def test_timed_out_load_is_reported_and_its_buffers_set_aside(stallfs):
    mnt, stall, resume = stallfs
    w, kv = _worker(mnt, load_timeout=TIMEOUT, io="threads")
    try:
        _saved(w, 4)
        stall()
        t0 = time.monotonic()
        w.load([Transfer("r", [key(0), key(1)], [0, 1], [9, 10])])
        got = Polled(w)
        finished, errors, counts = got.finished, got.errors, got.counts

        assert _until(lambda: finished("r"), TIMEOUT + 2 * SLACK), "the load never came back"
        took = time.monotonic() - t0
        # the timeout honoured: not before it, and not much after (the reads hang for ever)
        assert TIMEOUT * 0.9 < took < TIMEOUT + SLACK, took
        assert counts.get("load_timeouts") == 1, counts
        assert errors == {9, 10}, "a timed-out load fails its blocks (vLLM recomputes them)"
        assert w.stuck == 2 and w.pool.available == 2, "the buffers the kernel holds are not handed out"
        assert w.in_flight == 0, "the job is over: nothing left for the engine to wait for"
        # a second load takes the two free buffers and hangs too (and times out); a third finds every
        # buffer stuck
        w.load([Transfer("r2", [key(2), key(3)], [2, 3], [11, 12])])
        assert _until(lambda: finished("r2"), TIMEOUT + 2 * SLACK) and w.stuck == 4
        counts.clear()
        w.load([Transfer("r3", [key(0)], [0], [13])])
        assert _until(lambda: finished("r3"), TIMEOUT + 2 * SLACK)
        # failed at once, without waiting for a buffer: the refusal counted, no timeout (a load that
        # waited for a buffer here would end by its timeout instead)
        assert counts.get("load_staging_stuck") == 1 and not counts.get("load_timeouts"), counts
        resume()
        assert _until(lambda: w.stuck == 0, 10), "stuck buffers come back once the reads answer"
        assert w.pool.available == w.pool.count and w.pool.in_use == 0
        # and the disk works again: a load now succeeds
        w.load([Transfer("r4", [key(1)], [1], [14])])
        assert _until(lambda: w.in_flight == 0, 10)
        _, errors, rep = w.poll()
        assert not errors and rep.counters.get("loads_ok_blocks") == 1
        assert torch.equal(kv["l0"][14], kv["l0"][2])
    finally:
        w.close()


@pytest.mark.parametrize("io", ["uring", "threads"])
def test_close_returns_while_reads_hang(stallfs, io):
    mnt, stall, resume = stallfs
    w, _ = _worker(mnt, load_timeout=60.0, io=io)
    _saved(w, 2)
    stall()
    w.load([Transfer("r", [key(0), key(1)], [0, 1], [3, 4])])
    assert _until(lambda: w.backend.in_flight > 0, 2), "the reads must be in the kernel"
    t0 = time.monotonic()
    w.close()  # load_timeout is 60 s: close must not wait for it, nor for the disk
    took = time.monotonic() - t0
    # a close that waited for the hung load would give up only after CLOSE_DRAIN_S (10 s);
    # half of that leaves room for a busy machine
    assert took < CLOSE_DRAIN_S / 2, took
    finished, errors, _ = w.poll()
    assert finished == {"r"} and errors == {3, 4}, "a load cut short by close is still reported"
    resume()
    assert _until(lambda: io == "uring" or w.backend.running == 0, 10)  # (neither backend is reaped any more)
    time.sleep(0.2)
    for fd in w.io.fds():  # close left them open for the stuck read: let the file system go
        if fd >= 0:
            os.close(fd)


def test_stuck_save_is_dropped_after_save_timeout(stallfs):
    mnt, stall, resume = stallfs
    w, _ = _worker(mnt, save_timeout=TIMEOUT, io="threads")
    try:
        _saved(w, 1)
        stall("rw")
        t0 = time.monotonic()
        w.save([Transfer("s", [key(7)], [7], [5])])
        assert _until(lambda: w.in_flight == 0, TIMEOUT + 2 * SLACK), "the engine would wait for this save forever"
        assert TIMEOUT * 0.9 < time.monotonic() - t0 < TIMEOUT + SLACK  # the timeout honoured
        _, _, rep = w.poll()
        assert rep.saves == [SaveResult(0, 0, [], [key(7)])], "reported failed: its slot is given back"
        assert rep.counters.get("save_timeouts") == 1
        assert rep.counters.get("write_errors") == 1, "a save timeout counts against the disk (breaker)"
        assert w.stuck == 1 and w.pool.in_use == 1, "its staging buffer waits for the write the daemon holds"
        resume()
        assert _until(lambda: w.stuck == 0 and w.pool.in_use == 0, 10)
    finally:
        w.close()
