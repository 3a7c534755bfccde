# SPDX-License-Identifier: Apache-2.0
"""The thread-pool fallback backend: os.preadv/os.pwritev in a small pool.

Used where io_uring is refused (containers) or forced with AIOKV_IO=threads.
Design note (failure contract beyond backend.py): an operation a thread has not
started yet is skipped when its batch is cancelled; one already in a system call
cannot be interrupted, so cancellation waits for it to return before the buffer
is handed back (or, in abandon mode, hands the wait to the caller; backend.py).
Such a thread also holds its pool place until it returns: a hung disk fills the
pool, and later operations queue behind it (their callers' timeouts end them).

A batch's writes to adjacent offsets of one file go to one thread as one
`os.pwritev` over their buffers, up to `merge_bytes` (as the io_uring ring merges
them: uring.py); each operation still gets its own result (an error is every
merged write's; a short count covers them in file order). Reads are never merged.
A batch is handed back to the loop once, by the thread that ends its last system
call (one wake-up of the loop per batch, not per operation).

Threading contract: `run` is called from the loop thread; the pool threads only
touch the operations they run, their batch's results and its count of runs left (`tag`,
under the backend's lock), and the last one hands the results back with call_soon_threadsafe.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from aiokv.data.backend import OP_READ, OP_WRITE, IOBackend, _Batch, say_once

# adjacent writes of a batch merged into one pwritev up to this many bytes (docs/benchmarks.md,
# "The thread-pool backend"), and this many buffers (far below IOV_MAX, as the ring's MERGE_MAX_OPS)
MERGE_WRITE_BYTES = 2 << 20
MERGE_MAX_OPS = 64


def runs(ops, merge_bytes: int) -> list[tuple[int, int]]:
    """(first, count) of each system call a batch makes: a write joins the run before it where
    it is to the same file at the offset where that run ends, within merge_bytes in all."""
    out: list[tuple[int, int]] = []
    end = fd = -1
    size = 0
    for i, (kind, f, _, length, offset) in enumerate(ops):
        if (
            kind == OP_WRITE
            and f == fd
            and offset == end
            and size + length <= merge_bytes
            and out[-1][1] < MERGE_MAX_OPS
        ):
            first, k = out[-1]
            out[-1] = (first, k + 1)
            size += length
        else:
            out.append((i, 1))
            fd, size = (f, length) if kind == OP_WRITE else (-1, 0)
        end = offset + length
    return out


class ThreadBackend(IOBackend):
    name = "threads"

    def __init__(self, loop, threads: int = 8, merge_bytes: int = MERGE_WRITE_BYTES):
        super().__init__(loop)
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="aiokv-io")
        self.merge_bytes = merge_bytes
        self._lock = threading.Lock()
        self._running = 0  # operations inside their system call
        self._out = 0  # operations handed to the pool and not yet completed (queued or running)

    @property
    def in_flight(self) -> int:
        return self._out

    def _start(self, batch: _Batch, ops) -> None:
        parts = runs(ops, self.merge_bytes)
        batch.tag = len(parts)  # system calls of the batch still to end (counted off under the lock)
        with self._lock:
            self._out += len(ops)
        for first, k in parts:
            self.pool.submit(self._call, batch, ops, first, k)

    def _call(self, batch: _Batch, ops, first: int, k: int) -> None:
        """One system call for ops[first:first + k] (one operation, or adjacent writes). Whatever
        happens here, the run is counted off, so the batch always ends (an operation that is not
        one, a programming error, fails with -EINVAL rather than leave its batch waiting)."""
        try:
            if not batch.cancelled:
                self._syscall(batch.results, ops, first, k)
        except Exception as e:
            say_once(f"aiokv: a thread-pool I/O operation could not run ({e!r}); it fails with EINVAL")
            batch.results[first : first + k] = [-errno.EINVAL] * k
        with self._lock:
            self._out -= k
            batch.tag -= 1
            last = batch.tag == 0
        if last:
            try:
                self.loop.call_soon_threadsafe(batch.finish, batch.results)
            except RuntimeError:
                pass  # loop closed while shutting down

    def _syscall(self, res: list, ops, first: int, k: int) -> None:
        """Run ops[first:first + k] as one preadv or pwritev; each operation's result into res (an
        error is each one's, a short count covers them in order). Written before the last run of
        the batch hands `res` back, which it does after taking the lock."""
        mine = ops[first : first + k]
        kind, fd, _, _, offset = mine[0]
        bufs = [(ctypes.c_char * op[3]).from_address(op[2]) for op in mine]
        with self._lock:
            self._running += k
        try:
            got = os.preadv(fd, bufs, offset) if kind == OP_READ else os.pwritev(fd, bufs, offset)
        except OSError as e:
            got = -(e.errno or errno.EIO)
        finally:
            with self._lock:
                self._running -= k
        for i, op in enumerate(mine, first):
            res[i] = got if got < 0 else min(op[3], got)
            got = got if got < 0 else got - res[i]

    def _cancel(self, batch: _Batch) -> None:
        pass  # batch.cancelled makes threads skip what they have not started

    def close(self) -> None:
        # A thread stuck in a system call (a hung disk) cannot be joined: leave it
        # to the process exit, which waits for it (the kernel owns its buffer).
        self.pool.shutdown(wait=self._running == 0)
