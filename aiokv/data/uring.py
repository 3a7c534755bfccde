# SPDX-License-Identifier: Apache-2.0
"""The io_uring backend: one ring per event loop, completions through an eventfd.

The split: the native Ring (native/ring.c) owns every operation, Python
owns batches. `Ring.start` takes a whole batch in one call and queues its
operations in C; the ring hands queued operations to the kernel, reaps their
completions into per-batch result arrays and counts what is left, and tells
Python only which batches have completed, each with its results in operation
order. Python does O(1) work per batch: one start, one dict entry, one
set_result.

Design note (failure contract beyond backend.py), all of it kept by the ring:
at most `depth` operations are in the kernel at once, or up to 2 x depth while
fewer than MIN_BYTES_IN_FLIGHT bytes are in flight (small blocks need more
operations in flight to keep the disk busy; the ring is sized for 2 x depth,
so the completion queue can never overflow). The rest wait in a queue in
submission order. A cancelled batch drops its queued operations (-ECANCELED)
and asks the kernel to cancel its submitted ones with IORING_OP_ASYNC_CANCEL;
each submitted operation still completes (with -ECANCELED or its real result),
and only once the last has is the batch reported and its buffers released.

Ownership across the C boundary: once the ring has prepared an operation, it
owns it until its completion is reaped. A partial submission is submitted
again at once; a refused one (io_uring_enter fails) turns the entries the
kernel did not take into no-ops, and exactly those operations fail with the
errno. The operations still queued stay queued for the next completion to
retry, or fail with the same errno where nothing is left in flight (no
completion would come). No buffer is handed back while the kernel may still
run its operation.

Submission: a batch started while the ring is idle is submitted at once
(latency matters). A batch started while operations are in flight is queued
and submitted at the end of the loop iteration, together with every other
batch started in that iteration (the disk is busy meanwhile, so nothing waits
for it). Completions reaped in one wake-up refill the ring at once too
(Ring.reap pumps). Each io_uring_enter carries at most `Ring.submit_group`
operations (2): with more than two, Linux plugs the block layer and merges
requests for adjacent offsets into larger ones, which the virtual disk of
docs/benchmarks.md ("Where the time goes") serves one at a time (a depth of four
256 KiB reads became one 1 MiB request in flight); two per call leave the
requests as they are, at half the system calls of one per call.

Merged writes (MERGE_WRITE_BYTES): a batch's writes to adjacent offsets of one
file go to the kernel as one vectored write (the ring's merge_bytes), one
request for the disk and one entry against `depth`; each operation still gets
its own result (native/ring_batches.c, op_left_kernel). Reads are never merged
(the block layer's merges lost reads, above).

Threading contract: loop thread only.
"""

from __future__ import annotations

from aiokv import _native
from aiokv.data.backend import IOBackend, _Batch

MIN_BYTES_IN_FLIGHT = 16 << 20
# adjacent writes of one batch (a save's slots, one after another in its data file) go to the
# kernel as one vectored write of up to this many bytes: the virtual disk of docs/benchmarks.md,
# fed fewer and larger writes, is idle less (3-9 % of a phase against 9-12 %; 256 KiB saves at
# depth 4-16: 0.88-1.03 x RawBlockDevice unmerged, 1.13-1.33 merged; "How close to the drive",
# "Where the time goes"). 2 MiB: 256 KiB slots merge
# by 7, 512 KiB by 3; slots of 1 MiB and more stay as they are (merging them measured no gain).
MERGE_WRITE_BYTES = 2 << 20


class UringBackend(IOBackend):
    """io_uring through the native Ring; loop thread only."""

    name = "io_uring"

    def __init__(self, loop, depth: int = 64):
        super().__init__(loop)
        self.depth = depth
        self.ring = _native.Ring(
            max(2 * depth, 8),
            depth=depth,
            max_ops=2 * depth,
            min_bytes=MIN_BYTES_IN_FLIGHT,
            merge_bytes=MERGE_WRITE_BYTES,
        )
        self._batches: dict[int, _Batch] = {}  # Ring batch id -> batch
        self._pump_soon = False
        loop.add_reader(self.ring.fileno(), self._on_ready)

    @property
    def min_bytes(self) -> int:
        """0: exactly `depth` operations in flight (benchmarks against fio)."""
        return self.ring.min_bytes

    @min_bytes.setter
    def min_bytes(self, n: int) -> None:
        self.ring.min_bytes = n

    @property
    def merge_bytes(self) -> int:
        """Adjacent writes of a batch go to the kernel as one, up to this many bytes (0: never)."""
        return self.ring.merge_bytes

    @property
    def in_flight(self) -> int:
        return self.ring.in_flight if self.ring is not None else 0

    def _start(self, batch: _Batch, ops) -> None:
        batch.tag = self.ring.start(ops)
        self._batches[batch.tag] = batch
        if not self.ring.in_flight:
            self._pump()
        elif not self._pump_soon:
            self._pump_soon = True
            self.loop.call_soon(self._deferred_pump)

    def _deferred_pump(self) -> None:
        self._pump_soon = False
        if self.ring is not None:
            self._pump()

    def _pump(self) -> None:
        self._finish(self.ring.pump())

    def _on_ready(self) -> None:
        self._finish(self.ring.reap())

    def _cancel(self, batch: _Batch) -> None:
        self._finish(self.ring.cancel(batch.tag))

    def close(self) -> None:
        # Drain what the kernel still owns before the ring goes away.
        while self.ring.in_flight:
            self.ring.wait()
            self._on_ready()
        self.loop.remove_reader(self.ring.fileno())
        self.ring.close()
        self.ring = None
