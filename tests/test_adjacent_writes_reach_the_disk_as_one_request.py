# SPDX-License-Identifier: Apache-2.0
"""Bug: a save's slots, one after another in its data file, went to the disk as one
request each. The virtual disk of docs/benchmarks.md, fed fewer and larger writes,
is idle less of the time; unmerged, at 256 KiB and depth 4-16 aiokv wrote at 0.88-1.03 x
LMCache's RawBlockDevice, whose batches the block layer merges.
Invariant: a batch's writes to adjacent offsets of one file, up to the ring's
merge_bytes, go to the kernel as one vectored write (one entry against the
depth), from wherever their buffers are; every operation still gets its own
result, in order: an error is each one's, a short count covers them in order.
Reads, other files and gaps are never merged. Cancelling a batch with a merged
write in the kernel cancels that one request and reports the batch once.
Fix: the native Ring merges at submission (native/ring_submit.c, merged_span)
and shares the result out (native/ring_batches.c, op_left_kernel); uring.py turns
it on (MERGE_WRITE_BYTES). Real io_uring, real files and pipes.
The thread-pool backend (where io_uring is refused) wrote and handed back each
operation alone: one pwritev and one wake-up of the loop per slot (256 KiB saves:
0.18-0.21 core-s per GB against 0.07-0.09 merged). It now makes one pwritev per
run of adjacent writes (native/pool.c, by native/ops.c's op_run, the ring's rule)
and hands a batch back once.
"""

from __future__ import annotations

import ctypes
import errno
import os
import subprocess
import sys
import textwrap

import pytest

from aiokv import _native
from aiokv.data.backend import OP_READ, OP_WRITE
from aiokv.data.uring import MERGE_WRITE_BYTES, UringBackend

BS = 4096


def addr(buf) -> int:
    return ctypes.addressof(buf)


# a file-size limit (RLIMIT_FSIZE) of 2.5 blocks, set in a process of its own
LIMITED = f"""
import ctypes, os, resource, signal, sys
BS = {BS}
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit is cut, not a signal
resource.setrlimit(resource.RLIMIT_FSIZE, (BS * 5 // 2, resource.RLIM_INFINITY))
bufs = [ctypes.create_string_buffer(BS) for _ in range(4)]
"""


def under_size_limit(script: str, path) -> list[str]:
    """The lines the script (given `path` as argv[1], and LIMITED's names) printed under the limit."""
    out = subprocess.run(
        [sys.executable, "-c", LIMITED + script, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split("\n")


def entries(ring, bid) -> tuple[int, list]:
    """Runs batch `bid` on a ring of depth 1 to its end: (kernel entries it took, results).
    With one entry in the kernel at a time, each wait/reap takes exactly one completion."""
    done, n = ring.pump(), 0
    while not done:
        assert ring.in_flight == 1
        ring.wait()
        done = ring.reap()
        n += 1
    ((got, res),) = done
    assert got == bid
    return n, res


@pytest.mark.parametrize("merge, expect", [(4 * BS, 6), (0, 13), (2 * BS, 8)])
def test_adjacent_writes_of_a_batch_go_to_the_kernel_as_one_entry(tmp_path, merge, expect):
    path, other = tmp_path / "data", tmp_path / "other"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fd2 = os.open(other, os.O_RDWR | os.O_CREAT, 0o600)
    os.pwrite(fd, b"\x11" * 32 * BS, 0)
    bufs = [ctypes.create_string_buffer(BS) for _ in range(13)]
    for i, b in enumerate(bufs):
        ctypes.memset(b, 0x40 + i, BS)
    # buffers in no order: op i writes bufs[k[i]] (a worker's staging buffers are anywhere)
    k = [12, 3, 7, 0, 9, 1, 11, 5, 2, 4, 6, 8, 10]
    # slots 0-5 (0-3, then 4-5: 4 at most); 20-22 after a gap (a run of their own); 23-24 in
    # another file at the next offsets (their own)
    where = [(fd, s) for s in range(6)] + [(fd, s) for s in (20, 21, 22)] + [(fd2, 23), (fd2, 24)]
    ops = [(OP_WRITE, f, addr(bufs[k[i]]), BS, s * BS) for i, (f, s) in enumerate(where)]
    ops += [(OP_READ, fd, addr(bufs[k[11]]), BS, 8 * BS), (OP_READ, fd, addr(bufs[k[12]]), BS, 9 * BS)]
    ring = _native.Ring(8, depth=1, max_ops=1, merge_bytes=merge)
    assert ring.merge_bytes == merge
    n, res = entries(ring, ring.start(ops))
    assert res == [BS] * 13
    assert n == expect, "merged: [0-3] [4-5] [20-22] [23-24] and two reads; 2 x BS: pairs, 22 alone"
    for i, (f, s) in enumerate(where):
        assert os.pread(f, BS, s * BS) == bytes([0x40 + k[i]]) * BS, f"op {i} landed wrong"
    assert bufs[k[11]].raw == b"\x11" * BS and bufs[k[12]].raw == b"\x11" * BS
    assert os.pread(fd, BS, 6 * BS) == b"\x11" * BS, "nothing written between the runs"
    ring.close()
    os.close(fd)
    os.close(fd2)


def test_a_merged_write_shares_its_error_and_a_short_count_in_order(tmp_path):
    """An error (a file open read-only) is every merged operation's; a short write
    (the process's file-size limit cuts it) covers them in order: the first whole, one
    cut, the rest nothing. BlockIO calls anything short an I/O error (blockio.py)."""
    path = tmp_path / "data"
    script = textwrap.dedent("""
        from aiokv import _native
        ring = _native.Ring(8, depth=1, max_ops=1, merge_bytes=4 * BS)
        def run(fd):
            ring.start([(1, fd, ctypes.addressof(b), BS, i * BS) for i, b in enumerate(bufs)])
            done = ring.pump()
            while not done:
                ring.wait()
                done = ring.reap()
            return done[0][1]
        path = sys.argv[1]
        open(path, "wb").close()
        ro = os.open(path, os.O_RDONLY)
        print(run(ro))
        rw = os.open(path, os.O_RDWR)
        print(run(rw))
        print(os.path.getsize(path))
    """)
    lines = under_size_limit(script, path)
    assert lines[0] == str([-errno.EBADF] * 4)
    assert lines[1] == str([BS, BS, BS // 2, 0])
    assert lines[2] == str(BS * 5 // 2)


def test_cancelling_a_batch_cancels_its_merged_write_once(tmp_path):
    """A full pipe holds a merged write in the kernel; the batch's cancel asks the
    kernel once for that request, every operation of it ends -ECANCELED with the
    queued ones, the batch is reported once, and nothing reaches the pipe."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    filled = 0
    try:
        while True:
            filled += os.write(w, b"f" * 65536)
    except BlockingIOError:
        pass
    os.set_blocking(w, True)
    bufs = [ctypes.create_string_buffer(BS) for _ in range(6)]
    ring = _native.Ring(8, depth=1, max_ops=1, merge_bytes=4 * BS)
    bid = ring.start(
        [(OP_WRITE, w, addr(b), BS, 0) for b in bufs[:1]]
        + [(OP_WRITE, w, addr(b), BS, (i + 1) * BS) for i, b in enumerate(bufs[1:])]
    )
    assert ring.pump() == [] and ring.in_flight == 1
    assert ring.cancel(bid) == [], "the merged write is still the kernel's"
    done = []
    while ring.in_flight:
        ring.wait()
        done += ring.reap()
    assert done == [(bid, [-errno.ECANCELED] * 6)]
    os.set_blocking(r, False)
    got = b""
    try:
        while True:
            got += os.read(r, 1 << 20)
    except BlockingIOError:
        pass
    assert got == b"f" * filled, "a cancelled write reached the pipe"
    assert ring.cancel(bid) == []
    ring.close()
    os.close(r)
    os.close(w)


async def test_the_engine_backend_merges_a_saves_writes(tmp_path):
    """The backend every engine opens merges (MERGE_WRITE_BYTES), and a save's slots
    through it read back byte for byte."""
    import asyncio

    assert MERGE_WRITE_BYTES >= 2 * (256 << 10)
    be = UringBackend(asyncio.get_running_loop(), depth=2)
    assert be.ring.merge_bytes == MERGE_WRITE_BYTES
    fd = os.open(tmp_path / "data", os.O_RDWR | os.O_CREAT, 0o600)
    bufs = [ctypes.create_string_buffer(BS) for _ in range(40)]
    for i, b in enumerate(bufs):
        ctypes.memset(b, i, BS)
    res = await asyncio.wait_for(be.run([(OP_WRITE, fd, addr(bufs[39 - i]), BS, i * BS) for i in range(40)]), 10)
    assert res == [BS] * 40
    assert all(os.pread(fd, BS, i * BS) == bytes([39 - i]) * BS for i in range(40))
    be.close()
    os.close(fd)


# ---- the thread-pool backend (where io_uring is refused): the same merge, one pwritev per run ----


async def test_the_thread_backend_makes_one_system_call_per_run_of_adjacent_writes(tmp_path):
    """The runs the ring makes (capped at merge_bytes; a gap, another file or a read starts a
    new one), counted as the pool's system calls, each written where it belongs."""
    import asyncio

    from aiokv.data.threads import ThreadBackend

    be = ThreadBackend(asyncio.get_running_loop(), threads=2, merge_bytes=4 * BS)
    fd = os.open(tmp_path / "data", os.O_RDWR | os.O_CREAT, 0o600)
    fd2 = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT, 0o600)
    bufs = [ctypes.create_string_buffer(BS) for _ in range(12)]
    for i, b in enumerate(bufs):
        ctypes.memset(b, 0x40 + i, BS)

    async def calls(ops) -> int:
        before = be.pool.calls
        assert await asyncio.wait_for(be.run(ops), 10) == [op[3] for op in ops]
        return be.pool.calls - before

    w = [(OP_WRITE, fd, addr(bufs[i]), BS, i * BS) for i in range(6)]
    assert await calls(w) == 2  # [0-3] [4-5]: capped at merge_bytes
    gap = w[:2] + [(OP_WRITE, fd, addr(bufs[6]), BS, 9 * BS), (OP_WRITE, fd, addr(bufs[7]), BS, 10 * BS)]
    assert await calls(gap) == 2
    other = w[:2] + [(OP_WRITE, fd2, addr(bufs[8]), BS, 2 * BS)]
    assert await calls(other) == 2
    reads = [(OP_READ, fd, addr(bufs[9 + i]), BS, s * BS) for i, s in enumerate((9, 10, 0))]
    assert await calls(reads) == 3  # reads never merge
    assert await calls(reads[:1] + w[1:3]) == 2  # a write after a read starts a run
    assert [os.pread(fd, BS, i * BS) for i in (0, 1, 2, 9, 10)] == [bytes([0x40 + b]) * BS for b in (0, 1, 2, 6, 7)]
    assert os.pread(fd2, BS, 2 * BS) == bytes([0x48]) * BS
    assert bufs[9].raw == bytes([0x40 + 6]) * BS, "read 9 landed in its buffer"
    be.close()
    assert ThreadBackend(asyncio.get_running_loop(), threads=1, merge_bytes=0).merge_bytes == 0
    os.close(fd)
    os.close(fd2)


async def test_the_thread_backend_merges_writes_and_hands_each_its_result(tmp_path):
    """Adjacent writes of a batch are one pwritev, read back byte for byte; the batch comes
    back to the loop whole, once; an error is every merged write's."""
    import asyncio

    from aiokv.data.threads import ThreadBackend

    be = ThreadBackend(asyncio.get_running_loop(), threads=4, merge_bytes=8 * BS)
    assert be.merge_bytes == 8 * BS
    reaps, reap = [], be.pool.reap

    class Counted:  # the pool, counting the batches each reap hands back
        def __getattr__(self, name):
            return getattr(pool, name)

        def reap(self):
            done = reap()
            reaps.append(len(done))
            return done

    pool, be.pool = be.pool, Counted()
    fd = os.open(tmp_path / "data", os.O_RDWR | os.O_CREAT, 0o600)
    bufs = [ctypes.create_string_buffer(BS) for _ in range(20)]
    for i, b in enumerate(bufs):
        ctypes.memset(b, i, BS)
    ops = [(OP_WRITE, fd, addr(bufs[19 - i]), BS, i * BS) for i in range(20)]  # buffers in any order
    res = await asyncio.wait_for(be.run(ops), 10)
    assert res == [BS] * 20
    assert pool.calls == 3, f"{pool.calls} system calls for runs of 8 + 8 + 4"
    assert sum(reaps) == 1, f"the batch was handed back {sum(reaps)} times"
    assert all(os.pread(fd, BS, i * BS) == bytes([19 - i]) * BS for i in range(20))
    assert be.in_flight == 0

    ro = os.open(tmp_path / "data", os.O_RDONLY)
    res = await asyncio.wait_for(be.run([(OP_WRITE, ro, addr(bufs[i]), BS, i * BS) for i in range(3)]), 10)
    assert res == [-errno.EBADF] * 3
    be.pool = pool
    be.close()
    os.close(fd)
    os.close(ro)


def test_a_short_merged_write_on_threads_covers_its_writes_in_file_order(tmp_path):
    """A merged pwritev cut short (the process's file-size limit) covers its writes in order:
    the first two whole, one cut, the last nothing."""
    path = tmp_path / "data"
    script = textwrap.dedent("""
        import asyncio
        from aiokv.data.threads import ThreadBackend
        async def main():
            be = ThreadBackend(asyncio.get_running_loop(), threads=2, merge_bytes=8 * BS)
            fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
            res = await be.run([(1, fd, ctypes.addressof(b), BS, i * BS) for i, b in enumerate(bufs)])
            print(res, be.pool.calls)
            be.close()
        asyncio.run(main())
        print(os.path.getsize(sys.argv[1]))
    """)
    lines = under_size_limit(script, path)
    assert lines[0] == f"{[BS, BS, BS // 2, 0]} 1"
    assert lines[1] == str(BS * 5 // 2)


async def test_a_bad_operation_on_threads_is_refused_at_start_and_nothing_runs(tmp_path):
    """An operation no system call can take (a programming error: no fd) made a pool thread
    raise before the batch was counted off: the batch never ended and its caller waited for
    ever. The batch is now refused whole when it starts, on the loop thread, and the pool
    goes on."""
    import asyncio

    from aiokv.data.threads import ThreadBackend

    be = ThreadBackend(asyncio.get_running_loop(), threads=2)
    fd = os.open(tmp_path / "data", os.O_RDWR | os.O_CREAT, 0o600)
    b = ctypes.create_string_buffer(BS)
    ctypes.memset(b, 0x5A, BS)
    try:
        with pytest.raises(TypeError):
            await asyncio.wait_for(be.run([(OP_WRITE, fd, addr(b), BS, 0), (OP_WRITE, None, addr(b), BS, BS)]), 10)
        with pytest.raises(ValueError, match="bad operation"):
            await asyncio.wait_for(be.run([(7, fd, addr(b), BS, 0)]), 10)
        assert be.in_flight == 0 and be.pool.calls == 0 and os.fstat(fd).st_size == 0, "nothing ran"
        assert await asyncio.wait_for(be.run([(OP_WRITE, fd, addr(b), BS, 0)]), 10) == [BS]
    finally:
        be.close()
        os.close(fd)


async def test_thousands_of_small_adjacent_writes_stay_below_the_iovec_limit(tmp_path):
    """1,100 adjacent writes of 512 bytes fit in merge_bytes, but not in one pwritev (IOV_MAX is
    1,024: EINVAL for all): a merged write takes at most 64 buffers (native/ops.h)."""
    import asyncio

    from aiokv.data.threads import ThreadBackend

    be = ThreadBackend(asyncio.get_running_loop(), threads=2)
    fd = os.open(tmp_path / "data", os.O_RDWR | os.O_CREAT, 0o600)
    b = ctypes.create_string_buffer(512)
    try:
        res = await asyncio.wait_for(be.run([(OP_WRITE, fd, addr(b), 512, i * 512) for i in range(1100)]), 10)
        assert res == [512] * 1100
        assert be.pool.calls == -(-1100 // 64), f"{be.pool.calls} system calls for 1,100 writes of 64 at most"
    finally:
        be.close()
        os.close(fd)
