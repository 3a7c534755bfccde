# SPDX-License-Identifier: Apache-2.0
"""Bug: cancelling an asyncio task does not cancel an I/O the kernel already
owns; handing the buffer back at once lets the kernel write into memory that
has a new owner.
Invariant: when a cancelled save/load has finished cancelling, no operation
of it is in flight, its buffers are untouched afterwards, its reservations are
given back and nothing half-written is visible.
Fix: backends wait for (io_uring: cancel then reap) every submitted operation
of a cancelled batch before the CancelledError propagates.
"""

from __future__ import annotations

import asyncio
import ctypes
import time

import pytest

from aiokv.data import format as fmt
from aiokv.data.backend import OP_READ
from aiokv.data.buffers import BufferPool
from aiokv.data.choice import open_backend
from tests.conftest import NS, key
from tools.storeio import StoreIO

PAYLOAD = 1 << 20


async def _cancel_once_in_flight(start, undo, io, delay: float) -> None:
    """Cancel the task `start()` makes `delay` s after its first operation reached the backend
    (with delay 0: while that operation is still in flight). A buffered write or a page-cached
    read can complete inside the very io_uring_enter that submits it, so the whole call may end
    before the loop ever sees an operation in flight; on a fast machine it may also end within
    the delay (the cancel then found it done: "DID NOT RAISE"). Either way `undo()` and try again,
    the delay halved each time: below 0.1 ms the cancel is made at once, while the operation
    seen is still in flight (no await between), so the last tries cannot miss it."""
    for _ in range(50):
        task = asyncio.ensure_future(start())
        end = time.monotonic() + 10
        while io.backend.in_flight == 0 and not task.done():
            assert time.monotonic() < end, "the call neither ended nor had an operation in flight"
            await asyncio.sleep(0)
        if not task.done() and delay >= 1e-4:
            await asyncio.sleep(delay)
        if not task.done():
            break
        await task
        undo()
        delay /= 2
    assert not task.done(), "no operation of the call was ever seen in flight in 50 tries"
    if delay < 1e-4:
        assert io.backend.in_flight > 0
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.parametrize("delay", [0, 0.0005, 0.002])
async def test_cancelled_save_and_load_own_nothing(tmp_path, backend_kind, delay):
    st = StoreIO(tmp_path / "s")
    ns = st.namespace(NS, PAYLOAD)
    pool = BufferPool(fmt.slot_bytes(PAYLOAD), 48)
    slots = pool.acquire(48)
    items = [(key(i), pool.addr(s)) for i, s in enumerate(slots)]
    io = st.blockio(ns)
    await _cancel_once_in_flight(
        lambda: st.save(ns, items), lambda: st.drop(ns, [k for k, _ in items], corrupt=False), io, delay
    )
    assert io.backend.in_flight == 0
    assert not ns.pending, "a cancelled save must give its reservations back"
    assert st.stats.save_failures == 0
    # whatever was not committed is invisible; whatever is committed verifies
    committed = [k for k, _ in items if ns.has(k)]
    assert committed == []

    res = await st.save(ns, items)
    assert res == [0] * 48
    await _cancel_once_in_flight(lambda: st.load(ns, items), lambda: None, io, delay)
    assert io.backend.in_flight == 0
    assert not st.index.pins, "a cancelled load must unpin"
    # buffers are ours again: nothing writes into them after the cancel returned
    for _, addr in items:
        ctypes.memset(addr, 0x5A, 4096)
    await asyncio.sleep(0.05)
    assert all(ctypes.string_at(addr, 4096) == b"\x5a" * 4096 for _, addr in items)
    st.close()
    pool.close()


async def test_cancel_twice_still_waits(tmp_path, backend_kind):
    """A second cancel while the first is draining must not cut the drain short."""
    path = tmp_path / "f"
    path.write_bytes(b"\0" * (8 << 20))
    import os

    fd = os.open(path, os.O_RDONLY)
    backend = open_backend(asyncio.get_running_loop())
    pool = BufferPool(1 << 20, 8)
    ops = [(OP_READ, fd, pool.addr(s), 1 << 20, i << 20) for i, s in enumerate(pool.acquire(8))]
    for _ in range(50):  # 8 MiB of page-cached reads: on a busy machine they may all end unseen; try again
        task = asyncio.ensure_future(backend.run(ops))
        while backend.in_flight == 0 and not task.done():
            await asyncio.sleep(0)
        if not task.done():
            break
        await task
    assert not task.done(), "no read was ever seen in flight"
    task.cancel()
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert backend.in_flight == 0
    backend.close()
    os.close(fd)
    pool.close()
