# SPDX-License-Identifier: Apache-2.0
"""The I/O backend interface: what both backends (uring.py, threads.py) keep.

An operation is a tuple (op, fd, addr, length, offset): read or write `length`
bytes at `offset` of `fd` from/into the caller-owned memory at `addr`. A backend
runs a batch of them and returns, per operation, the byte count or -errno.

Failure contract (both backends):
- An I/O error fails only its own operation (its -errno is returned); `run` raises
  only for programming errors.
- Cancelling the task awaiting `run` returns only once no operation of the batch
  can still touch its buffer: queued operations are dropped, submitted ones are
  cancelled through the kernel (io_uring) or waited for (threads). Then the
  CancelledError propagates. So the caller may reuse or free its buffers as soon
  as `run` has returned or raised.
- Abandon mode (a hung disk must not hang the caller): where the caller passes
  `run(ops, abandon=callback)`, a cancelled `run` drops and cancels as above but does
  not wait for the operations the kernel or a thread still holds (a read stuck
  in a FUSE daemon or a dead device cannot be interrupted). It calls
  `callback(addrs, done)` with the buffer addresses of the batch and a future
  that completes once none of them can be touched any more, then raises
  CancelledError at once. The callback's owner sets those buffers aside until
  `done` completes.
- `close` ends every batch it can: io_uring's waits for what the kernel holds; the thread
  pool's drops what is queued (-ECANCELED) and reports it, but never reports a batch one of
  its threads is still in (a hung disk: those buffers are never safe to reuse).

Threading contract: a backend belongs to one asyncio event loop and is called from
that loop's thread only.

Which backend a caller gets: choice.py (open_backend).
"""

from __future__ import annotations

import abc
import asyncio
import errno
import logging

from aiokv.util.loops import settle

OP_READ = 0
OP_WRITE = 1

log = logging.getLogger("aiokv")
_said: set[str] = set()

# results of an operation that say nothing about the disk's health (breakers ignore them)
NOT_IO_ERRORS = (0, -errno.EBADMSG, -errno.ECANCELED, -errno.ENOBUFS)


def say_once(msg: str) -> None:
    if msg not in _said:
        _said.add(msg)
        log.warning(msg)


class _Batch:
    """Completion state of one `run` call (loop thread only). `fut` (awaited by
    run) gets the results; `ended`, made only once run was cancelled with
    operations still out, completes when the last of them has. A backend
    completes it per operation (`complete`: the benchmarks' null backend) or whole
    (`finish`: io_uring, whose ring counts the operations in C, and the thread
    pool, whose last system call of the batch hands it back); `remaining`
    is non-zero while any operation is out. `tag` is the backend's handle."""

    __slots__ = ("results", "remaining", "fut", "cancelled", "ended", "tag")

    def __init__(self, n: int, fut: asyncio.Future):
        self.results = [-errno.ECANCELED] * n
        self.remaining = n
        self.fut = fut
        self.cancelled = False
        self.ended: asyncio.Future | None = None
        self.tag = None

    def complete(self, i: int, res: int) -> None:
        self.results[i] = res
        self.remaining -= 1
        if self.remaining == 0:
            self.finish(self.results)

    def finish(self, results: list[int]) -> None:
        """Every operation has ended; results in operation order."""
        self.results = results
        self.remaining = 0
        if not self.fut.done():
            self.fut.set_result(results)
        if self.ended is not None and not self.ended.done():
            self.ended.set_result(None)


class IOBackend(abc.ABC):
    """Runs batches of reads and writes; see the module docstring for the contract."""

    name = "abstract"
    merge_bytes = 0  # adjacent writes of a batch go to the kernel as one up to this many bytes (uring.py)
    # operations it keeps in the kernel (BlockIO sizes its batches by it); the thread pool keeps
    # this default whatever its number of threads (choice.py: min(depth, 16))
    depth = 16
    min_bytes = 0  # below this many bytes in flight it keeps up to twice `depth` (uring.py)

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop

    async def run(self, ops, abandon=None) -> list[int]:
        """abandon: None (wait for the kernel when cancelled), or the callback of abandon mode
        (the module docstring): a caller that would rather set its buffers aside."""
        if not ops:
            return []
        batch = _Batch(len(ops), self.loop.create_future())
        self._start(batch, ops)
        try:
            # awaited bare (no asyncio.shield: a future and two callbacks less per
            # batch); a cancellation cancels batch.fut, and `remaining`, not the
            # future, says whether operations are still out
            return await batch.fut
        except asyncio.CancelledError:
            batch.cancelled = True
            self._cancel(batch)
            if batch.remaining == 0:
                raise
            batch.ended = self.loop.create_future()
            if abandon is not None:
                abandon([op[2] for op in ops], batch.ended)
                raise
            # The kernel or a thread may still own a buffer: wait, even if
            # cancelled again, until every operation of the batch has ended.
            await settle([batch.ended])
            raise

    @abc.abstractmethod
    def _start(self, batch: _Batch, ops) -> None: ...

    def _finish(self, done) -> None:
        """The batches a native runner reported, [(tag, results), ...], each given its results:
        for the backends that keep their batches by tag in `_batches` (uring.py, threads.py)."""
        batches = self._batches
        for tag, results in done:
            batches.pop(tag).finish(results)

    @abc.abstractmethod
    def _cancel(self, batch: _Batch) -> None: ...

    @property
    @abc.abstractmethod
    def in_flight(self) -> int:
        """Operations handed to the kernel or a thread and not yet completed."""

    def close(self) -> None:  # noqa: B027 (optional: a backend with nothing to close keeps this)
        pass
