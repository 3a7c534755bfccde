# SPDX-License-Identifier: Apache-2.0
"""The thread-pool fallback backend: os.preadv/os.pwritev in a small pool.

Used where io_uring is refused (containers) or forced with AIOKV_IO=threads.
Design note (failure contract beyond backend.py): an operation a thread has not
started yet is skipped when its batch is cancelled; one already in a system call
cannot be interrupted, so cancellation waits for it to return before the buffer
is handed back (or, in abandon mode, hands the wait to the caller; backend.py).
Such a thread also holds its pool place until it returns: a hung disk fills the
pool, and later operations queue behind it (their callers' timeouts end them).

Threading contract: `run` is called from the loop thread; the pool threads only
touch the operation they run and hand the result back with call_soon_threadsafe.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from aiokv.data.backend import OP_READ, IOBackend, _Batch


class ThreadBackend(IOBackend):
    name = "threads"

    def __init__(self, loop, threads: int = 8):
        super().__init__(loop)
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="aiokv-io")
        self._lock = threading.Lock()
        self._running = 0  # operations inside their system call
        self._out = 0  # operations handed to the pool and not yet completed (queued or running)

    @property
    def in_flight(self) -> int:
        return self._out

    def _start(self, batch: _Batch, ops) -> None:
        with self._lock:
            self._out += len(ops)
        for i, op in enumerate(ops):
            self.pool.submit(self._one, batch, i, op)

    def _one(self, batch: _Batch, i: int, op) -> None:
        if batch.cancelled:
            res = -errno.ECANCELED
        else:
            with self._lock:
                self._running += 1
            kind, fd, addr, length, offset = op
            buf = (ctypes.c_char * length).from_address(addr)
            try:
                if kind == OP_READ:
                    res = os.preadv(fd, [buf], offset)
                else:
                    res = os.pwritev(fd, [buf], offset)
            except OSError as e:
                res = -(e.errno or errno.EIO)
            finally:
                with self._lock:
                    self._running -= 1
        with self._lock:
            self._out -= 1
        try:
            self.loop.call_soon_threadsafe(batch.complete, i, res)
        except RuntimeError:
            pass  # loop closed while shutting down

    def _cancel(self, batch: _Batch) -> None:
        pass  # batch.cancelled makes threads skip what they have not started

    def close(self) -> None:
        # A thread stuck in a system call (a hung disk) cannot be joined: leave it
        # to the process exit, which waits for it (the kernel owns its buffer).
        self.pool.shutdown(wait=self._running == 0)
