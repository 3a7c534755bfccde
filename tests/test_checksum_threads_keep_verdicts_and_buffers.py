# SPDX-License-Identifier: Apache-2.0
"""Checksums on worker threads give the same verdicts and never outlive their call.

Bug guarded against: with every CRC32C computed on the event-loop thread, one
worker's loop is the ceiling on a node whose drives deliver more than one core
can checksum (about 15 GB/s on data fresh from the disk). Moving that work to
other threads risks two things: a verdict that differs from the loop's (a bad
block loaded), and a thread still writing a slot's header after its call was
cancelled and the slot handed to another job (a block saved with another
block's header).

Invariants: with checksum threads, BlockIO writes the same bytes and reads give
the same per-block verdicts as without (a block corrupted on disk is -EBADMSG,
the rest load); chunks of at least SPREAD_MIN_BYTES really go to the threads,
smaller ones stay on the loop; a cancelled write or read returns only after
every stamp or verify it started on a thread has ended; a TransferWorker built
with checksum_threads uses them, and the setting is checked at start.

Fix: BlockIO(cpu=Executor) runs large stamp_slots/verify_slots calls there
(`BlockIO._native`, shielded and awaited to the end on cancel);
TransferWorker(checksum_threads=N), setting `checksum_threads`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import errno
import os
import threading
import time

import pytest
import torch

from aiokv.config import AioKVConfig, ConfigError
from aiokv.data import format as fmt
from aiokv.data.blockio import SPREAD_MIN_BYTES, BlockIO
from aiokv.data.buffers import BufferPool
from aiokv.data.choice import open_backend
from aiokv.data.slotfile import data_path
from aiokv.jobs import Transfer
from aiokv.store.store import ns_dir
from aiokv.worker.device import CpuDevice
from aiokv.worker.transfer import TransferWorker
from tests.conftest import NS, key

PAYLOAD = 512 << 10  # 16 blocks at depth 16: chunks of 4 blocks = 2 MiB (8 on the threads), over SPREAD_MIN_BYTES
N = 16


class CountingPool(concurrent.futures.ThreadPoolExecutor):
    """A real thread pool that records each call it ran: (thread name, start, end); while
    `gate` is clear, each call waits for it (GIL released) before its work: the test holds
    calls in their threads at a point it controls."""

    def __init__(self, n: int = 2):
        super().__init__(n, "test-crc")
        self.gate = threading.Event()
        self.gate.set()
        self.calls: list[tuple[str, float, float]] = []
        self.started = 0  # calls a thread has begun (waiting at the gate or in their work)

    def submit(self, fn, *args, **kw):
        def timed():
            t0 = time.monotonic()
            self.started += 1
            assert self.gate.wait(60)
            try:
                return fn(*args, **kw)
            finally:
                self.calls.append((threading.current_thread().name, t0, time.monotonic()))

        return super().submit(timed)


def _fill(pool: BufferPool, seed: int) -> None:
    for i in range(N):
        ctypes.memset(pool.addr(i) + fmt.HEADER_BYTES, (seed + i * 7) % 251, PAYLOAD)


def _io(root: str, cpu=None) -> BlockIO:
    os.makedirs(ns_dir(root, NS), exist_ok=True)
    backend = open_backend(asyncio.get_running_loop(), "uring", depth=16)
    return BlockIO(backend, ns_dir(root, NS), NS, 0, PAYLOAD, cpu=cpu)


async def test_threads_give_the_loops_verdicts(tmp_path):
    results = {}
    for name, cpu in (("loop", None), ("threads", CountingPool(2))):
        root = str(tmp_path / name)
        pool = BufferPool(fmt.slot_bytes(PAYLOAD), N)
        io = _io(root, cpu)
        _fill(pool, 3)
        items = [(i, key(i), pool.addr(i)) for i in range(N)]
        assert await io.write(items) == [0] * N
        slot_bytes = fmt.slot_bytes(PAYLOAD)
        # spoil one payload byte of blocks 5 and 11 on disk
        fd = os.open(data_path(ns_dir(root, NS), 0), os.O_RDWR)
        for b in (5, 11):
            os.pwrite(fd, b"\x00\xff", b * slot_bytes + fmt.HEADER_BYTES + 1000)
        os.close(fd)
        ctypes.memset(pool.addr(0), 0, N * slot_bytes)
        res = await io.read(items)
        results[name] = res
        assert res == [-errno.EBADMSG if i in (5, 11) else 0 for i in range(N)]
        for i in range(N):
            if i not in (5, 11):
                assert ctypes.string_at(pool.addr(i) + fmt.HEADER_BYTES + 4096, 1) == bytes([(3 + i * 7) % 251])
        # the payload CRCs the threads stamped are the loop's
        results[name + "-crc"] = [
            fmt.unpack_header(ctypes.string_at(pool.addr(i), fmt.HDR_USED))["payload_crc"] if res[i] == 0 else None
            for i in range(N)
        ]
        if cpu is not None:
            names = {c[0] for c in cpu.calls}
            assert names and all(n.startswith("test-crc") for n in names)
            # every chunk stamped and every chunk verified on the threads (chunks of SPREAD_CHUNK_BYTES
            # there: 8 blocks, 2 chunks); none small enough to stay on the loop
            chunks = -(-N // io._chunk(spread=True))
            assert chunks >= 2 and len(cpu.calls) == 2 * chunks, cpu.calls
            cpu.shutdown()
        io.close()
        io.backend.close()
        pool.close()
    assert results["loop"] == results["threads"]
    assert results["loop-crc"] == results["threads-crc"]


async def test_small_chunks_stay_on_the_loop(tmp_path):
    cpu = CountingPool(2)
    pool = BufferPool(fmt.slot_bytes(PAYLOAD), N)
    io = _io(str(tmp_path), cpu)
    _fill(pool, 1)
    n = SPREAD_MIN_BYTES // PAYLOAD - 1  # under the threshold, one batch
    items = [(i, key(i), pool.addr(i)) for i in range(n)]
    assert await io.write(items) == [0] * n
    assert await io.read(items) == [0] * n
    assert cpu.calls == []
    cpu.shutdown()
    io.close()
    io.backend.close()
    pool.close()


@pytest.mark.parametrize("op", ["write", "read"])
async def test_cancelled_call_returns_after_its_threads(tmp_path, op):
    cpu = CountingPool(2)
    pool = BufferPool(fmt.slot_bytes(PAYLOAD), N)
    io = _io(str(tmp_path), cpu)
    _fill(pool, 2)
    items = [(i, key(i), pool.addr(i)) for i in range(N)]
    if op == "read":
        assert await io.write(items) == [0] * N
        cpu.calls.clear()
        cpu.started = 0
    cpu.gate.clear()  # calls wait in their threads until the cancel has been made (it slept 0.3 s before,
    # hoping the call was still running when the cancel came)
    task = asyncio.ensure_future(getattr(io, op)(items))
    end = time.monotonic() + 10
    while not cpu.started:  # a thread holds a call at the gate
        assert time.monotonic() < end and not task.done(), "no checksum call ever reached a thread"
        await asyncio.sleep(0.001)
    cancelled = time.monotonic()
    task.cancel()
    await asyncio.sleep(0.05)  # the task takes the cancel while its threads' calls are held
    assert not task.done(), "the cancelled call returned while its threads still held its slots"
    cpu.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    returned = time.monotonic()
    started = len(cpu.calls)
    cpu.shutdown(wait=True)  # whatever was still queued or running runs to its end now
    # every call a thread had taken had ended before the cancelled call returned (and there
    # were such calls: one had begun before the cancel came)
    assert cpu.calls and min(start for _, start, _ in cpu.calls) < cancelled, (cancelled, cpu.calls)
    assert all(end <= returned for _, _, end in cpu.calls), (returned, cpu.calls)
    assert len(cpu.calls) == started, "a thread went on with the slots after the call returned"
    io.close()
    io.backend.close()
    pool.close()


def test_worker_checksums_on_its_threads(tmp_path):
    """A worker that checks payloads in BlockIO (here: with a secret, whose MAC the
    stamp and check compute over every payload, the CRC being the copy's) stamps
    and verifies on its checksum threads."""
    nb = 24
    kv = {f"l{i}": torch.randn(nb, 2, 256, 64) for i in range(2)}  # 256 KiB per block
    root = str(tmp_path)
    os.makedirs(ns_dir(root, NS), exist_ok=True)
    dev = CpuDevice(kv, nb)
    slot = fmt.slot_bytes(dev.payload_bytes)
    w = TransferWorker(
        dev,
        ns_dir(root, NS),
        NS,
        0,
        staging_bytes=16 * slot,
        queue_depth=16,
        secret="a-secret-of-16-chars",
        checksum_threads=2,
    )
    try:
        assert w.cpu is not None and w.cpu._max_workers == 2
        busy = set()
        orig = w.cpu.submit

        def submit(fn, *a, **k):
            def run():
                busy.add(threading.current_thread().name)
                return fn(*a, **k)

            return orig(run)

        w.cpu.submit = submit
        ids = list(range(10))
        w.save([Transfer("s", [key(i) for i in ids], ids, [i + 1 for i in ids])])
        w.drain()
        _, _, rep = w.poll()
        assert len(rep.written()) == 10 and not rep.not_written()
        w.load([Transfer("r", [key(i) for i in ids], ids, [i + 12 for i in ids])])
        w.drain()
        done, errors, rep = w.poll()
        assert done == {"r"} and not errors
        for i in ids:
            for t in kv.values():
                assert torch.equal(t[12 + i], t[i + 1])
        assert busy and all(n.startswith("aiokv-crc0") for n in busy), busy
    finally:
        w.close()


def test_checksum_threads_setting_is_checked():
    assert AioKVConfig.from_extra({}).checksum_threads is None
    assert AioKVConfig.from_extra({"checksum_threads": 4}).checksum_threads == 4
    for bad in (-1, 65, "2", 1.5, True):
        with pytest.raises(ConfigError, match="checksum_threads must be a whole number"):
            AioKVConfig.from_extra({"checksum_threads": bad})


@pytest.mark.parametrize(
    "secret, asked, threads",
    [(None, None, 0), ("a-secret-of-16-chars", None, 1), ("a-secret-of-16-chars", 0, 0), (None, 3, 3)],
)
def test_a_secret_gives_the_cpu_build_a_checksum_thread_by_default(tmp_path, secret, asked, threads):
    """On the CPU build the CRC is the copy's, so no thread is the default; a secret's MAC
    reads every payload, and on the loop thread it held back the completions of reads (secret
    loads of 1 MiB at depth 16: 0.76-0.83 x fio on the loop, about 0.9 and more on threads):
    with a secret the default is one thread. A setting is kept as it is."""
    nb = 4
    dev = CpuDevice({"l0": torch.zeros(nb, 2, 16, 64)}, nb)
    os.makedirs(ns_dir(str(tmp_path), NS), exist_ok=True)
    w = TransferWorker(
        dev, ns_dir(str(tmp_path), NS), NS, 0, staging_bytes=1 << 20, secret=secret, checksum_threads=asked
    )
    try:
        assert w.checksum_threads == threads
        assert (w.cpu is None) == (threads == 0)
    finally:
        w.close()
