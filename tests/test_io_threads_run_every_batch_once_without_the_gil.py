# SPDX-License-Identifier: Apache-2.0
"""Bug: the thread-pool backend (where io_uring is refused, as under a container's default
seccomp profile, or where a submission could block: FUSE, network file systems) ran its
reads and writes on Python's thread pool: the GIL taken and given back around every
operation, 256 KiB reads at 0.12-0.14 core-s per GB against the io_uring ring's 0.04-0.05,
and every pool thread waiting for the GIL while the loop thread held it.
Invariant: the native Pool's threads (native/pool.c) never take the GIL, and every batch is
still reported exactly once, each operation with its own result, whatever the interleaving of
batches, threads and cancellations; a cancelled batch is reported only once no thread can
touch its buffers; a pool closed while one of its threads is stuck in a system call returns
at once, ends every batch no thread is in, and the stuck thread ends later without touching
what was freed; a report that fails (no memory) loses no batch.
Fix: native/pool.c (threads of its own, an eventfd for completed batches, the batch shape of
the io_uring Ring); aiokv/data/threads.py drives it as uring.py drives the Ring.
Real threads, real files and pipes.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import mmap
import os
import random
import select
import subprocess
import sys
import textwrap
import time

import pytest

from aiokv import _native
from aiokv.data.backend import OP_READ, OP_WRITE
from aiokv.data.threads import ThreadBackend
from tests.workers import until

BS = 4096


def addr(buf) -> int:
    return ctypes.addressof(buf)


def io_threads() -> int:
    """Threads of this process named as the pool names its own."""
    n = 0
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                n += f.read().strip() == "aiokv-io"
        except OSError:
            pass  # a thread that just left
    return n


def test_the_pool_runs_a_batch_while_the_loop_thread_keeps_the_gil(tmp_path):
    """With the interpreter's switch interval at 100 s, a thread that needs the GIL waits for
    it as long as this thread spins in Python; the pool's threads run the batch regardless."""
    fd = os.open(tmp_path / "data", os.O_RDWR | os.O_CREAT, 0o600)
    bufs = [ctypes.create_string_buffer(bytes([i]) * BS, BS) for i in range(8)]
    pool = _native.Pool(4)
    old = sys.getswitchinterval()
    sys.setswitchinterval(100)
    try:
        bid = pool.start([(OP_WRITE, fd, addr(b), BS, 2 * i * BS) for i, b in enumerate(bufs)])  # no merges
        done, end = [], time.monotonic() + 10
        while not done and time.monotonic() < end:  # spins holding the GIL: no call here gives it up
            done = pool.reap()
    finally:
        sys.setswitchinterval(old)
    assert done == [(bid, [BS] * 8)], "the pool's threads waited for the GIL"
    assert all(os.pread(fd, BS, 2 * i * BS) == bytes([i]) * BS for i in range(8))
    pool.close()
    os.close(fd)


def stalled(mnt: str, stall, blocks: int) -> int:
    """An O_DIRECT fd of a file of `blocks` blocks of 0x42 on the FUSE mount, whose reads
    now hang until resume()."""
    path = os.path.join(mnt, "x.data")
    with open(path, "wb") as f:
        f.write(b"\x42" * blocks * BS)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    stall()
    return fd


def aligned(n: int) -> list[mmap.mmap]:
    return [mmap.mmap(-1, BS) for _ in range(n)]  # page-aligned, as O_DIRECT wants


def maddr(m: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


def test_a_cancelled_batch_drops_what_no_thread_took_and_waits_for_the_rest(stallfs):
    """One thread, stuck in a read the file system holds: the batch's second read is dropped
    (-ECANCELED), and the batch is reported only once the first has its bytes."""
    mnt, stall, resume = stallfs
    fd = stalled(mnt, stall, 2)
    pool = _native.Pool(1)
    a, b = aligned(2)
    bid = pool.start([(OP_READ, fd, maddr(a), BS, 0), (OP_READ, fd, maddr(b), BS, BS)])
    assert until(lambda: pool.running == 1, 10)
    assert pool.cancel(bid) == [], "reported while a thread may still write into its buffer"
    assert pool.in_flight == 2
    resume()
    assert until(lambda: pool.running == 0, 10)
    assert until(lambda: select.select([pool.fileno()], [], [], 0)[0], 10), "no signal for the batch"
    assert pool.reap() == [(bid, [BS, -errno.ECANCELED])]
    assert a[:] == b"\x42" * BS and b[:] == bytes(BS), "the dropped read touched its buffer"
    assert pool.in_flight == 0 and pool.cancel(bid) == [], "a stale id matches nothing"
    pool.close()
    os.close(fd)


async def test_a_cancelled_batch_no_thread_took_gives_its_buffers_back_at_once(stallfs):
    """Behind a thread stuck in a read, a batch cancelled before any thread took it ends at
    once: its buffers are the caller's again, not set aside for a read that never began (the
    Python pool ended such a batch only when a thread reached it: never, on a hung disk)."""
    mnt, stall, resume = stallfs
    fd = stalled(mnt, stall, 2)
    be = ThreadBackend(asyncio.get_running_loop(), threads=1)
    a, b = aligned(2)
    handed: list = []

    def abandon(addrs, done):
        handed.append(addrs)

    first = asyncio.ensure_future(be.run([(OP_READ, fd, maddr(a), BS, 0)], abandon=abandon))
    while be.running < 1:
        await asyncio.sleep(0.005)
    second = asyncio.ensure_future(be.run([(OP_READ, fd, maddr(b), BS, BS)], abandon=abandon))
    while be.in_flight < 2:
        await asyncio.sleep(0.005)
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    assert handed == [], "a batch no thread had taken was set aside as if the disk held it"
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert handed == [[maddr(a)]], "the read the disk holds keeps its buffer set aside"
    resume()
    while be.running:
        await asyncio.sleep(0.005)
    assert b[:] == bytes(BS), "the dropped read ran"
    be.close()
    os.close(fd)


def test_closing_with_threads_stuck_returns_at_once_and_they_end_later(stallfs):
    mnt, stall, resume = stallfs
    fd = stalled(mnt, stall, 4)
    base = io_threads()
    pool = _native.Pool(3)
    assert until(lambda: io_threads() == base + 3, 10)
    bufs = aligned(5)
    pool.start([(OP_READ, fd, maddr(bufs[0]), BS, 0)])
    assert until(lambda: pool.running == 1, 10)
    pool.start([(OP_READ, fd, maddr(bufs[i]), BS, i * BS) for i in (1, 2, 3)])  # two more stuck, one queued
    assert until(lambda: pool.running == 3, 10)
    pool.start([(OP_READ, fd, maddr(bufs[4]), BS, 0)])  # queued behind them too
    t0 = time.monotonic()
    pool.close()
    assert time.monotonic() - t0 < 1.0, "close waited for threads stuck in a system call"
    assert pool.in_flight == 0 and pool.running == 0
    assert io_threads() == base + 3, "the stuck threads are still in their reads"
    resume()
    assert until(lambda: io_threads() == base, 10), "a thread outlived its system call"
    assert [m[:] == b"\x42" * BS for m in bufs] == [True, True, True, False, False], (
        "the stuck reads ended into their buffers; those queued at close never ran"
    )
    assert bufs[3][:] == bytes(BS) and bufs[4][:] == bytes(BS)
    os.close(fd)


async def test_many_batches_from_many_tasks_end_once_each_with_their_own_bytes(tmp_path):
    """30 tasks, 10 batches each of 1-8 writes then a read-back, on 4 threads; a quarter of the
    batches cancelled at a random moment. Every batch that ends has each operation's own result
    and its bytes where they belong; nothing is left in flight or unreported."""
    be = ThreadBackend(asyncio.get_running_loop(), threads=4)
    fd = os.open(tmp_path / "data", os.O_RDWR | os.O_CREAT, 0o600)
    rnd = random.Random(7)
    outcomes = {"done": 0, "cancelled": 0}

    async def task(t: int) -> None:
        for j in range(10):
            n = rnd.randint(1, 8)
            base = (t * 10 + j) * 8  # each batch's own 8 slots of the file
            src = [ctypes.create_string_buffer(bytes([(t * 10 + j + i) % 251]) * BS, BS) for i in range(n)]
            ops = [(OP_WRITE, fd, addr(src[i]), BS, (base + i) * BS) for i in range(n)]
            run = asyncio.ensure_future(be.run(ops))
            if rnd.random() < 0.25:
                await asyncio.sleep(rnd.random() * 0.002)
                run.cancel()
            try:
                assert await run == [BS] * n
            except asyncio.CancelledError:
                outcomes["cancelled"] += 1
                continue
            dst = [ctypes.create_string_buffer(BS) for _ in range(n)]
            got = await be.run([(OP_READ, fd, addr(dst[i]), BS, (base + i) * BS) for i in range(n)])
            assert got == [BS] * n
            assert [d.raw for d in dst] == [s.raw for s in src], f"batch {t}/{j} read back other bytes"
            outcomes["done"] += 1

    await asyncio.wait_for(asyncio.gather(*(task(t) for t in range(30))), 60)
    assert outcomes["done"] + outcomes["cancelled"] == 300 and outcomes["done"] > 150, outcomes
    assert be.in_flight == 0 and be.running == 0 and not be._batches
    be.close()
    os.close(fd)


# ---- found by review: close, a failed report, Python code run while a batch is parsed ----

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(code: str, timeout: float = 20):
    """Runs `code` in a Python process of its own (one that may crash)."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=timeout
    )


def test_closing_reports_a_batch_already_complete(tmp_path):
    """A batch every operation of which has ended, but not reaped yet, when the backend is
    closed: its run() must still get its one completion (uring.py's close drains; the old
    Python pool's queued work still ran and reported)."""
    path = tmp_path / "data"
    path.write_bytes(b"\x42" * BS)
    fd = os.open(path, os.O_RDONLY)
    buf = ctypes.create_string_buffer(BS)

    async def main():
        bk = ThreadBackend(asyncio.get_running_loop(), threads=2)
        task = asyncio.ensure_future(bk.run([(OP_READ, fd, ctypes.addressof(buf), BS, 0)]))
        await asyncio.sleep(0)  # started
        end = time.monotonic() + 5
        while bk.pool.running or bk.pool.calls == 0:  # ends in C; the loop does not reap
            assert time.monotonic() < end
            time.sleep(0.01)
        time.sleep(0.05)
        bk.close()
        return await asyncio.wait_for(task, 2)

    try:
        assert asyncio.run(main()) == [BS]
    finally:
        os.close(fd)


async def test_closing_ends_the_batches_it_dropped(stallfs):
    """Batches queued behind a thread stuck in a read when the backend is closed: dropped by
    close, their run() ends with -ECANCELED rather than awaiting for ever. The batch the thread
    is in is never reported (its buffer is the kernel's); its caller, in abandon mode as the
    store's are, gets its cancellation at once. (This test once let the thread race close on
    a fast file: when the thread was in its read at close, cancelling that run waited for a
    report that never comes, and the test hung, once in ten runs on a loaded machine.)"""
    mnt, stall, resume = stallfs
    fd = stalled(mnt, stall, 8)
    bk = ThreadBackend(asyncio.get_running_loop(), threads=1)
    bufs = aligned(8)
    handed: list = []

    def abandon(addrs, done):
        handed.append(addrs)

    runs = [
        asyncio.ensure_future(bk.run([(OP_READ, fd, maddr(b), BS, i * BS)], abandon=abandon))
        for i, b in enumerate(bufs)
    ]
    while bk.running < 1 or bk.in_flight < 8:  # the first in its read, seven queued behind it
        await asyncio.sleep(0.005)
    bk.close()
    done, pending = await asyncio.wait(runs[1:], timeout=10)
    assert not pending, "run() of a batch close dropped never returned"
    assert [t.result() for t in runs[1:]] == [[-errno.ECANCELED]] * 7
    assert not runs[0].done(), "the batch a thread is still in was reported"
    runs[0].cancel()
    with pytest.raises(asyncio.CancelledError):
        await runs[0]
    assert handed == [[maddr(bufs[0])]], "the read the disk holds keeps its buffer set aside"
    resume()
    assert until(lambda: bufs[0][:] == b"\x42" * BS, 10), "the stuck read never ended"
    assert all(m[:] == bytes(BS) for m in bufs[1:]), "a read close dropped ran"
    os.close(fd)


def test_a_failed_report_loses_no_batch(tmp_path):
    """reap() failing to build its list (MemoryError) must leave the batches to a later reap,
    not free them: their run() would await for ever."""
    pytest.importorskip("_testcapi")  # the allocator's failure hook (CPython's test module)
    path = tmp_path / "data"
    path.write_bytes(b"\x42" * BS)
    r = child(
        f"""
        import ctypes, os, time, _testcapi
        from aiokv import _native
        fd = os.open({str(path)!r}, os.O_RDONLY)
        buf = ctypes.create_string_buffer(4096)
        pool = _native.Pool(1)
        bid = pool.start([(0, fd, ctypes.addressof(buf), 4096, 0)])
        while pool.running or pool.calls == 0:
            time.sleep(0.01)
        time.sleep(0.05)
        reap = pool.reap
        _testcapi.set_nomemory(0)
        try:
            reap()
            err = None
        except MemoryError as e:
            err = e
        finally:
            _testcapi.remove_mem_hooks()
        print("first reap failed:", err is not None)
        print("in_flight", pool.in_flight)
        print("second reap", pool.reap() == [(bid, [4096])])
        """
    )
    assert "first reap failed: True" in r.stdout, (r.stdout, r.stderr)
    assert "second reap True" in r.stdout, r.stdout


def test_an_operation_closing_the_pool_while_parsed_does_not_crash():
    """op_parse calls __index__ (PyLong_AsLong): Python code that closes the pool in the
    middle of start() must get an error, not a NULL core dereference."""
    r = child(
        """
        from aiokv import _native
        pool = _native.Pool(1)
        class Evil:
            def __index__(self):
                pool.close()
                return 0
        try:
            pool.start([(Evil(), -1, 0, 0, 0)])
        except Exception as e:
            print("raised", type(e).__name__, e)
        print("alive")
        """
    )
    assert r.returncode == 0 and "alive" in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])


def test_a_forked_child_is_refused_the_parents_pool_and_can_drop_it():
    """A process that forks with a Pool open: the child has none of its threads (work it
    queued would wait for ever, and a thread may have held the pool's mutex at the fork).
    There the Pool refuses work in one line, and dropping it neither joins threads that do
    not exist nor takes that mutex; the parent's Pool goes on."""
    r = child(
        """
        import os, select, time
        from aiokv import _native
        pool = _native.Pool(2)
        pid = os.fork()
        if pid == 0:
            try:
                pool.start([(2, -1, 0, 0, 0)])
                os._exit(3)
            except RuntimeError as e:
                ok = "parent of a fork" in str(e) and pool.in_flight == 0
            del pool
            os._exit(0 if ok else 4)
        for _ in range(50):
            got, status = os.waitpid(pid, os.WNOHANG)
            if got:
                print("child exited", os.waitstatus_to_exitcode(status))
                break
            time.sleep(0.1)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            print("child hung")
        bid = pool.start([(2, -1, 0, 0, 0)])
        select.select([pool.fileno()], [], [], 10)
        print("parent", pool.reap() == [(bid, [0])])
        """
    )
    assert "child exited 0" in r.stdout and "parent True" in r.stdout, (r.stdout, r.stderr)


def test_an_operation_closing_the_ring_while_parsed_does_not_crash():
    """The same through the Ring (op_parse is shared; pre-existing, moved by this commit)."""
    if not _native.HAVE_URING:
        pytest.skip("built without io_uring: no Ring")
    r = child(
        """
        from aiokv import _native
        ring = _native.Ring(8)
        class Evil:
            def __index__(self):
                ring.close()
                return 0
        try:
            ring.start([(Evil(), -1, 0, 0, 0)])
        except Exception as e:
            print("raised", type(e).__name__, e)
        print("alive")
        """
    )
    assert r.returncode == 0 and "alive" in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])


# ---- found by a second review: argument ranges, a table that fails to grow, a fork's eventfd ----


@pytest.mark.parametrize(
    "kw",
    [
        dict(threads=2**64 + 3),  # "k" masks: 3 threads
        dict(threads=-(2**64) + 2),  # 2 threads
        dict(merge_bytes=2**64 + 5),  # merges up to 5 bytes
        dict(merge_bytes=-(2**64) + 7),
    ],
)
def test_an_out_of_range_thread_count_or_merge_size_is_refused_not_wrapped(kw):
    """Pool_init parses with "kk" (unsigned long, no overflow check: the value is taken modulo
    2**64), so the range check sees the wrapped value and a nonsense argument is accepted."""
    with pytest.raises((ValueError, OverflowError)):
        pool = _native.Pool(**kw)
        pool.close()


def test_a_table_growth_that_fails_part_way_leaves_every_slot_usable_once():
    """slot_alloc grows three arrays; whichever realloc fails (the 1st, 2nd or 3rd allocation
    of that start(): checked, the 4th is not slot_alloc's), the Pool stays consistent: later
    starts grow it, every batch is reported once, and every slot is handed out again once."""
    pytest.importorskip("_testcapi")
    r = child(
        """
        import select, time, _testcapi
        from aiokv import _native
        NOP = [(2, -1, 0, 0, 0)]
        for fail in (1, 2, 3):
            pool = _native.Pool(1)
            start, reap = pool.start, pool.reap
            live = {start(NOP) for _ in range(16)}  # the table full (16), the stack empty
            _testcapi.set_nomemory(fail - 1, fail)
            try:
                start(NOP)
                raised = False
            except MemoryError:
                raised = True
            finally:
                _testcapi.remove_mem_hooks()
            live |= {start(NOP) for _ in range(100)}
            got, end = [], time.monotonic() + 10
            while len(got) < len(live) and time.monotonic() < end:
                select.select([pool.fileno()], [], [], 1)
                got += reap()
            again = {start(NOP) & 0xFFFF for _ in range(128)}
            print(fail, raised, len(live), sorted(i for i, _ in got) == sorted(live), again == set(range(128)))
            pool.close()
        """
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines() == [f"{f} True 116 True True" for f in (1, 2, 3)], r.stdout


def test_a_forked_child_dropping_the_pool_lets_go_of_its_eventfd():
    """The child's close touches nothing of the parent's core, but keeps its own descriptor of
    the parent's eventfd open for the rest of its life (closing the child's copy is safe: the
    parent's descriptor and the parent's epoll registration stay)."""
    r = child(
        """
        import os, select
        from aiokv import _native
        pool = _native.Pool(2)
        efd = pool.fileno()
        pid = os.fork()
        if pid == 0:
            pool.close()
            try:
                os.fstat(efd)
                os._exit(5)  # still open
            except OSError:
                os._exit(0)
        print("child", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        bid = pool.start([(2, -1, 0, 0, 0)])
        select.select([pool.fileno()], [], [], 10)
        print("parent", pool.reap() == [(bid, [0])])
        """
    )
    assert "parent True" in r.stdout, (r.stdout, r.stderr)
    assert "child 0" in r.stdout, r.stdout
