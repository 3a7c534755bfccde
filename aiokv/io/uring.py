"""The io_uring backend: one ring per event loop, completions through an eventfd.

Design note (failure contract beyond backend.py): at most `depth` operations are
in the kernel at once; the rest wait in a queue in submission order, so the
completion queue can never overflow. A cancelled batch drops its queued
operations and asks the kernel to cancel its submitted ones with
IORING_OP_ASYNC_CANCEL; each submitted operation still completes (with
-ECANCELED or its real result) and only then is its buffer released.

Threading contract: loop thread only.
"""
from __future__ import annotations

import collections
import errno
import itertools

from aiokv import _native
from aiokv.io.backend import IOBackend, _Batch


class UringBackend(IOBackend):
    name = "io_uring"

    def __init__(self, loop, depth: int = 64):
        super().__init__(loop)
        self.depth = depth
        self.ring = _native.Ring(max(depth, 8))
        self._ids = itertools.count(1)
        self._waiting: dict[int, tuple[_Batch, int]] = {}
        self._submitted: set[int] = set()
        self._queue: collections.deque = collections.deque()
        loop.add_reader(self.ring.fileno(), self._on_ready)

    @property
    def in_flight(self) -> int:
        return len(self._submitted)

    def _start(self, batch: _Batch, ops) -> None:
        ids = self._ids
        for i, (op, fd, addr, length, offset) in enumerate(ops):
            ud = next(ids)
            self._waiting[ud] = (batch, i)
            self._queue.append((op, fd, addr, length, offset, ud))
        self._pump()

    def _pump(self) -> None:
        room = self.depth - len(self._submitted)
        q = self._queue
        while q and room > 0:
            chunk = []
            while q and len(chunk) < room:
                sqe = q.popleft()
                batch, i = self._waiting[sqe[5]]
                if batch.cancelled:
                    del self._waiting[sqe[5]]
                    batch.complete(i, -errno.ECANCELED)
                    continue
                chunk.append(sqe)
            if not chunk:
                break
            taken = self.ring.submit(chunk)
            for sqe in chunk[:taken]:
                self._submitted.add(sqe[5])
            # whatever the ring had no room for goes back to the head of the queue
            q.extendleft(reversed(chunk[taken:]))
            room -= taken
            if taken == 0:
                break

    def _on_ready(self) -> None:
        for ud, res in self.ring.reap():
            self._submitted.discard(ud)
            entry = self._waiting.pop(ud, None)
            if entry is not None:
                entry[0].complete(entry[1], res)
        self._pump()

    def _cancel(self, batch: _Batch) -> None:
        for ud, (b, _) in list(self._waiting.items()):
            if b is batch and ud in self._submitted:
                self.ring.cancel(ud)
        self._pump()  # completes the batch's queued operations as cancelled

    def close(self) -> None:
        # Drain what the kernel still owns before the ring goes away.
        while self._submitted:
            self.ring.wait()
            self._on_ready()
        self.loop.remove_reader(self.ring.fileno())
        self.ring.close()
