# SPDX-License-Identifier: Apache-2.0
"""Writes checksummed on the checksum threads keep the disk fed: stamping runs a queue depth ahead.

Bug guarded against: with the payload CRC32C on checksum threads (a CUDA worker's
default), a pipelined write let at most one queue depth of its blocks be stamped
or in the kernel at once. Each time a chunk's writes completed, the next chunk
was only then handed to a thread, stamped and handed back, and meanwhile the
kernel held less than the queue depth: writes ran at 0.71-0.91 x LMCache's
RawBlockDevice on the same disk, 0.79-0.94 x in paired rounds
(docs/benchmarks.md, "Beside LMCache's NVMe tier"), the CRC pass and not the I/O holding them back.

Invariants: while the backend holds a full queue depth of a call's writes, the
next queue depth of its blocks is already stamped and handed to the backend
(whose ring keeps `depth` in the kernel and replaces each completion at once
from those), and no more than that (stamping runs at the disk's pace); every
block reaches the backend stamped (its header and payload CRC verify at that
moment); the call returns each block's result once all are written.

Fix: BlockIO._pipelined bounds a spread write's stamped-or-written blocks at
(1 + STAMP_AHEAD_DEPTHS) queue depths instead of one, in chunks of at least
SPREAD_CHUNK_BYTES (fewer hand-offs to the threads).

Bug 2: where the backend merges adjacent writes (data/uring.py, MERGE_WRITE_BYTES),
a chunk is fewer kernel entries than blocks, and the bound, counted in chunks, held the
kernel at a fraction of its depth (a chunk of 16 slots of 256 KiB, merged by 7, is 3
entries: secret saves at 256 KiB on threads ran at 0.64-0.82 x fio). The depths are
counted in the backend's entries (BlockIO._entries).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import os
import time

import pytest

from aiokv.data import format as fmt
from aiokv.data.backend import IOBackend
from aiokv.data.blockio import BlockIO
from aiokv.data.buffers import BufferPool
from aiokv.store.store import ns_dir
from tests.conftest import NS, key

PAYLOAD = 256 << 10
DEPTH = 16
N = 4 * DEPTH


class HeldBackend(IOBackend):
    """Takes every batch and completes none until `release` (a disk that holds what it
    was given, as the kernel and the ring's queue do); checks each block it is handed."""

    name = "held"

    def __init__(self, loop, depth: int, stamped, merge_bytes: int = 0):
        super().__init__(loop)
        self.depth = depth
        self.merge_bytes = merge_bytes  # as the io_uring backend's: writes merged up to this many bytes
        self.stamped = stamped  # addr -> whether the slot there verifies now
        self.held: list = []
        self.handed = 0
        self.unstamped: list[int] = []

    def _start(self, batch, ops) -> None:
        self.unstamped += [op[2] for op in ops if not self.stamped(op[2])]
        self.held.append((batch, ops))
        self.handed += len(ops)

    def release(self) -> None:
        held, self.held = self.held, []
        for batch, ops in held:
            batch.finish([op[3] for op in ops])

    def _cancel(self, batch) -> None:
        pass

    @property
    def in_flight(self) -> int:
        return sum(len(ops) for _, ops in self.held)


@pytest.mark.parametrize("merged", [1, 4])
async def test_a_queue_depth_is_stamped_while_the_disk_holds_one(tmp_path, merged):
    """merged: slots one kernel entry takes (the backend's merge_bytes); the depths the
    call hands over are of entries, so `merged` times as many blocks."""
    n = N * merged
    ahead = 2 * DEPTH * merged  # blocks of two queue depths of entries
    root = str(tmp_path)
    os.makedirs(ns_dir(root, NS), exist_ok=True)
    pool = BufferPool(fmt.slot_bytes(PAYLOAD), n)
    cpu = concurrent.futures.ThreadPoolExecutor(2, "test-crc")
    keys = {pool.addr(i): key(i) for i in range(n)}
    io = task = None
    merge = merged * fmt.slot_bytes(PAYLOAD) if merged > 1 else 0
    backend = HeldBackend(asyncio.get_running_loop(), DEPTH, lambda addr: io.verify(keys[addr], addr), merge)
    io = BlockIO(backend, ns_dir(root, NS), NS, 0, PAYLOAD, cpu=cpu)
    try:
        for i in range(n):
            ctypes.memset(pool.addr(i) + fmt.HEADER_BYTES, (i * 13 + 1) % 251, PAYLOAD)
        task = asyncio.ensure_future(io.write([(i, key(i), pool.addr(i)) for i in range(n)]))

        # nothing completes: the call stamps and hands over one queue depth beyond the one the disk
        # holds, then waits for room (waited for by count: a pause of 0.2 s in stamping on a loaded
        # machine read as "stopped" before); a call that went further would do so meanwhile
        end = time.monotonic() + 30
        while backend.handed < ahead:
            assert time.monotonic() < end and not task.done(), backend.handed
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert backend.handed == ahead
        assert not task.done()
        while not task.done():  # the disk completes what it holds; the rest follows, each block stamped
            backend.release()
            await asyncio.sleep(0.01)
        assert task.result() == [0] * n
        assert backend.handed == n and backend.unstamped == []
    finally:
        if task is not None and not task.done():  # a failed check: end the call (it waits for its batches)
            task.cancel()
            while not task.done():
                backend.release()
                await asyncio.sleep(0.01)
        io.close()
        cpu.shutdown()
        pool.close()
