# SPDX-License-Identifier: Apache-2.0
"""The thread-pool backend: reads and writes on threads of the native Pool (native/pool.c).

Used where io_uring is refused (a container's seccomp profile), where a submission to it
could block the loop (FUSE, network file systems: choice.py), or forced with
AIOKV_IO=threads.

The split is the io_uring backend's (uring.py): `Pool.start` takes a whole batch in one
call; the pool's threads run its operations with preadv and pwritev and never take the GIL;
the thread that ends a batch's last system call signals an eventfd, and the loop reaps the
batches completed, each with its results in operation order. Python does O(1) work per
batch. A batch's writes to adjacent offsets of one file go to one thread as one pwritev, up
to MERGE_WRITE_BYTES (as the ring merges them); each operation still gets its own result (an
error is every merged write's; a short count covers them in file order). Reads are never
merged.

Design note (failure contract beyond backend.py): an operation no thread has taken is
dropped when its batch is cancelled; one already in a system call cannot be interrupted, so
cancellation waits for it to return before the buffer is handed back (or, in abandon mode,
hands the wait to the caller; backend.py). Such a thread also holds its pool place until it
returns: a hung disk fills the pool, and later operations queue behind it (their callers'
timeouts end them). `close` does not wait for a thread stuck in a system call.

Threading contract: loop thread only (the pool's threads are the native Pool's own).
"""

from __future__ import annotations

from aiokv import _native
from aiokv.data.backend import IOBackend, _Batch

# adjacent writes of a batch merged into one pwritev up to this many bytes (docs/benchmarks.md,
# "The thread-pool backend"), and at most 64 buffers (native/ops.h, MERGE_MAX_OPS)
MERGE_WRITE_BYTES = 2 << 20


class ThreadBackend(IOBackend):
    """Batches on the native Pool's threads; loop thread only."""

    name = "threads"

    def __init__(self, loop, threads: int = 8, merge_bytes: int = MERGE_WRITE_BYTES):
        super().__init__(loop)
        self.pool = _native.Pool(threads, merge_bytes=merge_bytes)
        self._batches: dict[int, _Batch] = {}  # Pool batch id -> batch
        loop.add_reader(self.pool.fileno(), self._on_ready)

    @property
    def merge_bytes(self) -> int:
        """Adjacent writes of a batch go to one pwritev up to this many bytes (0: never)."""
        return self.pool.merge_bytes if self.pool is not None else 0

    @property
    def in_flight(self) -> int:
        return self.pool.in_flight if self.pool is not None else 0

    @property
    def running(self) -> int:
        """Operations inside their system call now (a hung disk's stay there)."""
        return self.pool.running if self.pool is not None else 0

    def _start(self, batch: _Batch, ops) -> None:
        batch.tag = self.pool.start(ops)
        self._batches[batch.tag] = batch

    def _on_ready(self) -> None:
        self._finish(self.pool.reap())

    def _cancel(self, batch: _Batch) -> None:
        if self.pool is not None:  # closed: a batch still out is one a stuck thread holds
            self._finish(self.pool.cancel(batch.tag))

    def close(self) -> None:
        # What is queued is dropped; a thread stuck in a system call (a hung disk) is left to
        # end when it can (the kernel owns its buffer), the others leave now.
        if self.pool is None:
            return
        # the eventfd is asked of the Pool, never kept: in a child of fork the Pool refuses it
        # (RuntimeError), as it must, since a remove_reader there would take it off the epoll
        # the child shares with its parent, whose loop would then never wake for it again
        self.loop.remove_reader(self.pool.fileno())
        pool, self.pool = self.pool, None
        # every batch complete gets its results (those close dropped: -ECANCELED); one a
        # thread is stuck in is never reported (its buffer is the kernel's)
        self._finish(pool.close())
