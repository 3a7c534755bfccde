# SPDX-License-Identifier: Apache-2.0
"""Bug: the io_uring backend spent about 9 us of Python per operation (a dict
entry, a queue tuple, a submitted-set entry and a completion call per op, one
tuple parsed per SQE and one built per CQE), a third of the CPU of a save or
load at 256 KiB blocks.
Invariant: the native Ring, which now keeps a batch's operations in C (queue,
depth and bytes-in-flight limits, submission, reaping, results), reports each
batch exactly once, when every operation of it has a result, with the results
in operation order; never has more than its limit in the kernel, whatever the
batch size; keeps batches apart when many are interleaved; on cancel drops
exactly the queued operations and waits for the submitted ones; on a refused
submission fails exactly the entries the kernel did not take and retries the
queued ones at the next completion (or fails them where none will come).
Fix: Ring.start/pump/reap/cancel work on whole batches; uring.py does O(1)
Python per batch. Real io_uring, real files; the refused submissions are
shaped by the extension's test hook (Ring._inject_submit).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import time

import pytest

from aiokv import _native
from aiokv.data.backend import OP_READ, OP_WRITE
from aiokv.data.uring import UringBackend

BS = 4096
BLOCKS = 256


@pytest.fixture
def data(tmp_path):
    """A file of BLOCKS blocks, block i filled with byte i; buffers for reads."""
    path = tmp_path / "data"
    path.write_bytes(b"".join(bytes([i]) * BS for i in range(BLOCKS)))
    fd = os.open(path, os.O_RDWR)
    bufs = [ctypes.create_string_buffer(BS) for _ in range(BLOCKS)]
    yield fd, bufs
    os.close(fd)


def addr(buf) -> int:
    return ctypes.addressof(buf)


def reads(fd, bufs, blocks):
    return [(OP_READ, fd, addr(bufs[b]), BS, b * BS) for b in blocks]


def drain(ring) -> list:
    done = []
    while ring.in_flight:
        ring.wait()
        done += ring.reap()
    return done


def test_results_are_per_operation_in_order(data):
    fd, bufs = data
    ring = _native.Ring(8)
    bad = os.open(os.devnull, os.O_RDONLY)
    os.close(bad)  # a closed fd: that operation alone fails with -EBADF
    ops = [
        (OP_READ, fd, addr(bufs[0]), BS, 3 * BS),
        (OP_READ, bad, addr(bufs[1]), BS, 0),
        (OP_READ, fd, addr(bufs[2]), 1000, 5 * BS),  # a shorter read: its own length
        (OP_READ, fd, addr(bufs[3]), BS, BLOCKS * BS),  # past the end: 0 bytes
        (_native.OP_NOP, fd, 0, 0, 0),
        (OP_READ, fd, addr(bufs[4]), BS, (BLOCKS - 1) * BS),
    ]
    bid = ring.start(ops)
    assert ring.pump() == []
    assert drain(ring) == [(bid, [BS, -errno.EBADF, 1000, 0, 0, BS])]
    assert bufs[0].raw == bytes([3]) * BS and bufs[2].raw[:1000] == bytes([5]) * 1000
    assert bufs[4].raw == bytes([BLOCKS - 1]) * BS
    ring.close()


def test_a_batch_larger_than_the_ring_never_exceeds_its_limits(data):
    fd, bufs = data
    ring = _native.Ring(8, depth=2, max_ops=8, min_bytes=0)  # exactly `depth` in flight
    bid = ring.start(reads(fd, bufs, range(100)))
    seen, done = [], ring.pump()
    while not done:
        seen.append(ring.in_flight)
        ring.wait()
        done = ring.reap()
    assert max(seen) == 2 and len(seen) >= 50
    assert done == [(bid, [BS] * 100)]
    assert all(bufs[i].raw == bytes([i]) * BS for i in range(100))
    # below min_bytes in flight, up to max_ops go to the kernel instead
    ring.min_bytes = 1 << 30
    ring.start(reads(fd, bufs, range(100)))
    ring.pump()
    assert ring.in_flight == 8
    drain(ring)
    ring.close()


async def test_many_interleaved_batches_each_get_their_own_results(data):
    fd, bufs = data
    be = UringBackend(asyncio.get_running_loop(), depth=4)
    be.min_bytes = 0
    # batch k reads blocks k, k+32, ... each with a length that names the block
    # (BS - block), so results from another batch or position would show
    runs = [be.run([(OP_READ, fd, addr(bufs[b]), BS - b, b * BS) for b in range(k, BLOCKS, 32)]) for k in range(32)]
    results = await asyncio.wait_for(asyncio.gather(*runs), 10)
    for k, res in enumerate(results):
        assert res == [BS - b for b in range(k, BLOCKS, 32)]
    assert all(bufs[b].raw[: BS - b] == bytes([b]) * (BS - b) for b in range(BLOCKS))
    assert be.in_flight == 0 and not be._batches
    be.close()


async def test_cancel_of_a_half_submitted_batch_drops_the_queued_rest(data):
    fd, bufs = data
    be = UringBackend(asyncio.get_running_loop(), depth=2)
    be.min_bytes = 0
    for b in bufs:
        ctypes.memset(b, 0xEE, BS)
    r, w = os.pipe()  # reads of an empty pipe stay the kernel's until cancelled
    stuck = [(OP_READ, r, addr(bufs[i]), BS, 0) for i in range(2)]
    task = asyncio.ensure_future(be.run(stuck + reads(fd, bufs, range(2, 40))))
    end = time.monotonic() + 10
    while be.in_flight < 2:  # the two pipe reads submitted (they cannot complete)
        assert time.monotonic() < end and not task.done(), "the batch was never submitted"
        await asyncio.sleep(0.001)
    assert be.in_flight == 2 and not task.done(), "two submitted, 38 queued"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    assert be.in_flight == 0 and not be._batches
    os.write(w, b"x" * BS)  # a cancelled read that still ran would take this
    await asyncio.sleep(0.05)
    be._on_ready()
    assert all(bufs[i].raw == b"\xee" * BS for i in range(40)), "a dropped or cancelled operation ran"
    assert os.read(r, 2 * BS) == b"x" * BS
    # the ring goes on as before
    assert await asyncio.wait_for(be.run(reads(fd, bufs, range(40, 50))), 5) == [BS] * 10
    be.close()
    os.close(r)
    os.close(w)


def test_cancel_reports_queued_as_cancelled_and_waits_for_submitted(data):
    fd, bufs = data
    ring = _native.Ring(8, depth=2, max_ops=2)
    bid = ring.start(reads(fd, bufs, range(10)))
    ring.pump()
    assert ring.cancel(bid) == [], "two operations are still the kernel's"
    ((got, res),) = drain(ring)
    assert got == bid and res[2:] == [-errno.ECANCELED] * 8
    assert all(r in (BS, -errno.ECANCELED) for r in res[:2])
    assert ring.cancel(bid) == [], "a reported batch is gone; its id matches nothing"
    ring.close()


def test_refused_submission_fails_only_what_the_kernel_did_not_take(data):
    fd, bufs = data
    ring = _native.Ring(8, depth=4, max_ops=4)
    a = ring.start(reads(fd, bufs, range(2)))
    ring.pump()
    b = ring.start(reads(fd, bufs, range(2, 6)))
    ring._inject_submit(err=errno.EAGAIN)
    assert ring.pump() == []  # b's first two are voided; its last two stay queued (a is in flight)
    assert ring.in_flight == 2
    done = dict(drain(ring))
    assert done == {a: [BS, BS], b: [-errno.EAGAIN, -errno.EAGAIN, BS, BS]}
    # nothing in flight: the refused batch's queued rest fails with it (no completion would retry it)
    c = ring.start(reads(fd, bufs, range(6, 12)))
    ring._inject_submit(err=errno.ENOMEM)
    assert ring.pump() == [(c, [-errno.ENOMEM] * 6)]
    assert ring.in_flight == 0
    # a partial submission is submitted again: everything completes
    d = ring.start(reads(fd, bufs, range(12, 16)))
    ring._inject_submit(consume=1)
    ring.pump()
    assert drain(ring) == [(d, [BS] * 4)]
    ring.close()


def test_writes_land_where_their_batch_says(data):
    fd, bufs = data
    ring = _native.Ring(8, depth=2)
    for i in range(20):
        ctypes.memset(bufs[i], 0x80 + i, BS)
    bid = ring.start([(OP_WRITE, fd, addr(bufs[i]), BS, i * BS) for i in range(20)])
    ring.pump()
    assert drain(ring) == [(bid, [BS] * 20)]
    assert all(os.pread(fd, BS, i * BS) == bytes([0x80 + i]) * BS for i in range(20))
    ring.close()


@pytest.mark.parametrize(
    "ops, exc",
    [
        ([(OP_READ, 0, 0, BS)], TypeError),
        ([[OP_READ, 0, 0, BS, 0]], TypeError),
        ([(7, 0, 0, BS, 0)], ValueError),
        ([(OP_READ, 0, 0, 1 << 33, 0)], ValueError),
        ([(OP_READ, 0, -1, BS, 0)], OverflowError),
        ([], ValueError),
    ],
)
def test_bad_operations_are_refused_whole(data, ops, exc):
    fd, bufs = data
    ring = _native.Ring(8)
    with pytest.raises(exc):
        ring.start(reads(fd, bufs, range(3)) + ops if ops else [])
    assert ring.pump() == [] and ring.in_flight == 0, "nothing of a refused batch is queued"
    bid = ring.start(reads(fd, bufs, range(3)))
    ring.pump()
    assert drain(ring) == [(bid, [BS] * 3)]
    ring.close()


@pytest.mark.parametrize("group", [0, 1, 2, 3, 8])
def test_any_submit_group_gives_the_same_results(data, group):
    """The ring hands the kernel at most `submit_group` operations per
    io_uring_enter (default 2, native/ring.c SUBMIT_GROUP); however the
    operations are grouped, a batch larger than the ring completes whole, in
    order, within its depth."""
    assert _native.Ring(8).submit_group == 2
    fd, bufs = data
    ring = _native.Ring(16, depth=8, max_ops=16, submit_group=group)
    assert ring.submit_group == group
    blocks = list(range(100, 200))
    bid = ring.start(reads(fd, bufs, blocks))
    done = ring.pump()
    assert ring.in_flight == 8  # depth: a group boundary never leaves operations unsubmitted
    done += drain(ring)
    assert done == [(bid, [BS] * len(blocks))]
    assert all(bufs[b].raw == bytes([b]) * BS for b in blocks)
    ring.submit_group = 0
    assert ring.submit_group == 0
    ring.close()
