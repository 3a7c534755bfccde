"""The io_uring backend: one ring per event loop, completions through an eventfd.

Design note (failure contract beyond backend.py): at most `depth` operations are
in the kernel at once, or up to 2 x depth while fewer than MIN_BYTES_IN_FLIGHT
bytes are in flight (small blocks need more operations in flight to keep the
disk busy; the ring is sized for 2 x depth, so the completion queue can never
overflow). The rest wait in a queue in submission order. A cancelled batch
drops its queued operations and asks the kernel to cancel its submitted ones
with IORING_OP_ASYNC_CANCEL; each submitted operation still completes (with
-ECANCELED or its real result) and only then is its buffer released.

Ownership across the C boundary: once Ring.submit has prepared an operation,
the ring owns it until its completion is reaped. A partial submission is
submitted again inside Ring.submit; a refused one (io_uring_enter fails) turns
the entries the kernel did not take into no-ops and names them, and only those
operations (and the rest of that chunk) complete here as failed with the
errno. No buffer is handed back while the kernel may still run its operation.

Submission: a batch started while the ring is idle is submitted at once (one
io_uring_enter; latency matters). A batch started while operations are in
flight is queued and submitted at the end of the loop iteration, together with
every other batch started in that iteration: one system call for all of them
(the disk is busy meanwhile, so nothing waits for it). Completions reaped in
one wake-up refill the ring with one submission too.

Threading contract: loop thread only.
"""
from __future__ import annotations

import collections
import errno
import itertools

from aiokv import _native
from aiokv.io.backend import IOBackend, _Batch

MIN_BYTES_IN_FLIGHT = 16 << 20


class UringBackend(IOBackend):
    name = "io_uring"

    def __init__(self, loop, depth: int = 64):
        super().__init__(loop)
        self.depth = depth
        self.max_ops = 2 * depth
        self.min_bytes = MIN_BYTES_IN_FLIGHT  # 0: exactly `depth` operations (benchmarks against fio)
        self.ring = _native.Ring(max(self.max_ops, 8))
        self._ids = itertools.count(1)
        self._waiting: dict[int, tuple[_Batch, int]] = {}
        self._submitted: dict[int, int] = {}  # user_data -> bytes
        self._bytes = 0
        self._queue: collections.deque = collections.deque()
        self._pump_soon = False
        loop.add_reader(self.ring.fileno(), self._on_ready)

    @property
    def in_flight(self) -> int:
        return len(self._submitted)

    def _start(self, batch: _Batch, ops) -> None:
        ids = self._ids
        waiting, queue = self._waiting, self._queue
        for i, (op, fd, addr, length, offset) in enumerate(ops):
            ud = next(ids)
            waiting[ud] = (batch, i)
            queue.append((op, fd, addr, length, offset, ud))
        if not self._submitted:
            self._pump()
        elif not self._pump_soon:
            self._pump_soon = True
            self.loop.call_soon(self._deferred_pump)

    def _deferred_pump(self) -> None:
        self._pump_soon = False
        if self.ring is not None:
            self._pump()

    def _room(self) -> int:
        n = len(self._submitted)
        if self._bytes < self.min_bytes:
            return self.max_ops - n
        return self.depth - n

    def _pump(self) -> None:
        q = self._queue
        submitted = self._submitted
        while q:
            room = self._room()
            if room <= 0:
                break
            chunk = []
            nbytes = self._bytes
            while q and len(chunk) < room:
                sqe = q[0]
                if chunk and nbytes >= self.min_bytes and len(submitted) + len(chunk) >= self.depth:
                    break
                q.popleft()
                batch, i = self._waiting[sqe[5]]
                if batch.cancelled:
                    del self._waiting[sqe[5]]
                    batch.complete(i, -errno.ECANCELED)
                    continue
                chunk.append(sqe)
                nbytes += sqe[3]
            if not chunk:
                continue
            taken, voided, err = self.ring.submit(chunk)
            voided = set(voided)
            for sqe in chunk[:taken]:
                if sqe[5] not in voided:  # the ring owns it until its completion is reaped
                    submitted[sqe[5]] = sqe[3]
                    self._bytes += sqe[3]
            if err:
                # The kernel refused the submission: the entries it did not take
                # are no-ops now, so their buffers are free and they fail here,
                # together with the rest of the chunk (retrying a refused
                # submission at once would most likely be refused again).
                for sqe in chunk[taken:]:
                    voided.add(sqe[5])
                for ud in voided:
                    batch, i = self._waiting.pop(ud)
                    batch.complete(i, -err)
                break
            # whatever the ring had no room for goes back to the head of the queue
            q.extendleft(reversed(chunk[taken:]))
            if taken == 0:
                break

    def _on_ready(self) -> None:
        submitted, waiting = self._submitted, self._waiting
        for ud, res in self.ring.reap():
            n = submitted.pop(ud, None)
            if n is not None:
                self._bytes -= n
            entry = waiting.pop(ud, None)
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
        self.ring = None
