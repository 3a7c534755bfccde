# SPDX-License-Identifier: Apache-2.0
"""Bug: the io_uring backend prepares SQEs before io_uring_submit; when the
submission failed (an error from io_uring_enter) or the kernel took only part
of them, the Python side forgot the operations while their SQEs stayed in the
ring. The next submission ran them: a stale read landed in a staging buffer
that had been given back and reused (wrong KV), and the operations of a
partial submit never completed (a hung batch).
Invariant: once prepared, an SQE belongs to the ring until its completion is
reaped, or until it has been turned into a no-op that touches no memory; a
buffer is handed back only then. A failed submission completes its operations
as failed (-errno); a partial one is submitted again until the kernel has
taken every entry.
Fix: Ring.submit retries partial submissions and, on an error, rewrites the
entries the kernel did not take into tagged no-ops and returns them, so the
backend fails exactly those operations; Ring.cancel checks its submission.
The failures are shaped by a test hook in the extension (Ring._inject_submit);
the reads, files and ring are real.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os

import pytest

from aiokv.data.backend import OP_READ, OP_WRITE
from aiokv.data.buffers import BufferPool

try:
    from aiokv.data.uring import UringBackend

    UringBackend(asyncio.new_event_loop(), depth=4).close()
except OSError as e:  # pragma: no cover - io_uring refused by the kernel
    pytest.fail(f"io_uring is needed for this test: {e}")

BS = 1 << 16


@pytest.fixture
def setup(tmp_path):
    path = tmp_path / "data"
    with open(path, "wb") as f:
        f.write(b"\xaa" * BS + b"\xbb" * BS + b"\xcc" * BS)
    fd = os.open(path, os.O_RDWR)
    pool = BufferPool(BS, 4)
    yield fd, [pool.addr(s) for s in pool.acquire(4)]
    os.close(fd)
    pool.close()


async def test_failed_submit_fails_its_reads_and_never_runs_them_later(setup):
    fd, bufs = setup
    be = UringBackend(asyncio.get_running_loop(), depth=4)
    try:
        be.ring._inject_submit(err=errno.EAGAIN)
        res = await asyncio.wait_for(be.run([(OP_READ, fd, bufs[0], BS, 0)]), 5)
        assert res == [-errno.EAGAIN]
        assert be.in_flight == 0
        # The buffer was handed back: its next owner fills it.
        ctypes.memset(bufs[0], 0x11, BS)
        # Any later submission must not run the failed read into it.
        assert await asyncio.wait_for(be.run([(OP_READ, fd, bufs[1], BS, BS)]), 5) == [BS]
        await asyncio.sleep(0.05)
        be._on_ready()
        assert ctypes.string_at(bufs[0], BS) == b"\x11" * BS, "a failed read ran later into a reused buffer"
        assert ctypes.string_at(bufs[1], BS) == b"\xbb" * BS
    finally:
        be.close()


async def test_partial_submit_completes_every_operation(setup):
    fd, bufs = setup
    be = UringBackend(asyncio.get_running_loop(), depth=4)
    try:
        be.ring._inject_submit(consume=1)
        ops = [(OP_READ, fd, bufs[i], BS, i * BS) for i in range(3)]
        assert await asyncio.wait_for(be.run(ops), 5) == [BS] * 3
        for i, b in enumerate((b"\xaa", b"\xbb", b"\xcc")):
            assert ctypes.string_at(bufs[i], BS) == b * BS
        assert be.in_flight == 0
    finally:
        be.close()


async def test_failed_submit_of_writes_changes_nothing_on_disk(setup):
    fd, bufs = setup
    be = UringBackend(asyncio.get_running_loop(), depth=4)
    try:
        ctypes.memset(bufs[0], 0x55, BS)
        be.ring._inject_submit(err=errno.ENOMEM)
        assert await asyncio.wait_for(be.run([(OP_WRITE, fd, bufs[0], BS, 0)]), 5) == [-errno.ENOMEM]
        assert await asyncio.wait_for(be.run([(OP_READ, fd, bufs[1], BS, 0)]), 5) == [BS]
        await asyncio.sleep(0.05)
        be._on_ready()
        assert os.pread(fd, BS, 0) == b"\xaa" * BS, "a failed write reached the disk at a later submission"
    finally:
        be.close()


async def test_cancel_survives_a_failed_submission(setup):
    fd, bufs = setup
    be = UringBackend(asyncio.get_running_loop(), depth=4)
    try:
        task = asyncio.ensure_future(be.run([(OP_READ, fd, bufs[i], BS, i * BS) for i in range(3)]))
        await asyncio.sleep(0)
        be.ring._inject_submit(err=errno.EAGAIN)  # the cancel's own submission fails
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)
        assert be.in_flight == 0
    finally:
        be.close()
