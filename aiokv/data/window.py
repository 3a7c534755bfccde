# SPDX-License-Identifier: Apache-2.0
"""A long read through a few buffers: chunk after chunk, each read into buffers
given back by the chunks before it.

A load of N blocks could read each block into a buffer of its own (N buffers
at once, one read call). `read_through` instead runs the blocks in chunks of
`step` (BlockIO's batch: `shape`), at most `ahead` chunks at once: a chunk
takes its buffers when it starts and gives them back when it ends (after the
caller's `run` has read, verified and copied them out), so the buffers in use
are those of `ahead` chunks, however long the load, and with a pool that hands
out the most recently given back first (data/buffers.py) the same few are read
into again and again.

Why: on the virtual disk of docs/benchmarks.md a read is a copy the host makes
into guest memory, and it takes 1.3-1.5 x longer per request into memory no
read touched lately (one buffer per block of a 128 MiB load) than into a few
MiB read into again and again (fio's `iodepth` buffers): 0.69-0.77 x fio's
bandwidth at depth 4 for a bare C loop with one buffer per block, 0.95-1.05 x
with 8 MiB of buffers reused (docs/benchmarks-history.md: the buffer footprint). The
checksum pass after the read then finds the payload in cache too.
`ahead` = the chunks that keep the disk's queue full, plus SLACK_CHUNKS (one
being checked and copied out while the others are in the kernel, one queued
so that a completion is replaced at once).

Failure contract: a chunk's own results (I/O errors, bad slots) are the
caller's `run`'s to handle; `run` gives its buffers back however it ends
(its `finally`), and a chunk cancelled before `run` began gives them back
through `give`. An exception from `take` (no buffer can come) or from a
chunk ends the whole read: the other chunks are cancelled and waited for
(each chunk's I/O ends or is set aside by the backend's rules,
data/backend.py), then the exception is raised. Cancelled, likewise.

Threading contract: one asyncio loop thread (the BlockIO's).
"""

from __future__ import annotations

import asyncio

from aiokv.util.loops import settle

SLACK_CHUNKS = 2


def in_kernel(backend, slot_bytes: int) -> int:
    """Operations `backend` keeps in the kernel for reads of `slot_bytes`: its depth, or up to
    twice that while fewer than its min_bytes are in flight (data/uring.py)."""
    depth = getattr(backend, "depth", 16)
    least = getattr(backend, "min_bytes", 0)
    return min(2 * depth, max(depth, -(-least // slot_bytes))) if least else depth


def shape(io) -> tuple[int, int]:
    """(step, ahead) of a read through a window by `io` (a BlockIO, or a DriveIO over
    several): BlockIO's batch size, and enough chunks to keep every drive's queue full
    plus SLACK_CHUNKS."""
    ios = list(io.ios.values()) if hasattr(io, "ios") else [io]
    step = ios[0]._chunk()
    depth = sum(in_kernel(x.backend, x.slot_bytes) for x in ios)
    return step, -(-depth // step) + SLACK_CHUNKS


async def read_through(items: list, take, give, run, step: int, ahead: int) -> None:
    """run(part, bufs) over `items` in order, chunk by chunk: each chunk is the next up to
    `step` items, as many as `take(n)` (awaited: at least one buffer, at most n) gave it
    buffers for; a chunk starts only while fewer than `ahead` run. `run` gives its buffers
    back; those of a chunk cancelled before it began go back through `give(bufs)`."""
    tasks: list[asyncio.Future] = []
    errors: list[BaseException] = []  # of chunks that ended by an exception

    async def chunk(part, bufs, began):
        began.append(True)
        await run(part, bufs)

    def ended(task, bufs, began) -> None:
        room.release()
        if not began:
            give(bufs)
        elif not task.cancelled() and task.exception() is not None:
            errors.append(task.exception())

    room = asyncio.Semaphore(max(1, ahead))
    i = 0
    try:
        while i < len(items):
            await room.acquire()
            if errors:
                raise errors[0]
            try:
                bufs = await take(min(step, len(items) - i))
            except BaseException:
                room.release()
                raise
            part = items[i : i + len(bufs)]
            i += len(part)
            began: list[bool] = []
            task = asyncio.ensure_future(chunk(part, bufs, began))
            task.add_done_callback(lambda task, bufs=bufs, began=began: ended(task, bufs, began))
            tasks.append(task)
        for t in tasks:
            await t
    except BaseException:
        # no chunk may still be running when this call ends: its buffers are the caller's again
        for t in tasks:
            t.cancel()
        await settle(tasks)
        for t in tasks:
            if not t.cancelled():
                t.exception()  # retrieved: the error that matters is re-raised
        raise
