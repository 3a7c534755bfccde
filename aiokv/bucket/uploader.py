# SPDX-License-Identifier: Apache-2.0
"""Write-behind uploads of committed-to-disk blocks to the bucket tier.

A block is offered once its local write succeeded; `offer` only queues a copy
of its bytes. A few upload tasks drain the queue with write-once PUTs. "Already
there" is success when the object there verifies as this block (another engine
uploaded it); an object that does not (foreign, truncated, tampered, written by
an older layout) would otherwise block the block's name for good, so it is
replaced by ours with a plain PUT (counted: upload_replaced_bad). Races with
another engine uploading the same block are harmless: every object either
engine writes is a whole valid slot of that key (a PUT replaces an object at
once, a reader never sees a mix), so whichever lands last, the name holds a
valid block; each upload replaces at most once. The queue is
bounded in bytes: when it is full, or the breaker is open, or a PUT fails, the
block is dropped and counted; nothing waits for the server, so a step is never
blocked by it. `flush` (clean shutdown) waits for the queue, bounded by a
timeout; what is left then is dropped and counted.

Threading contract: every method runs on one asyncio loop, the worker's loop
thread (TransferWorker), its counts go through `count` (the owner's, thread-safe).
"""

from __future__ import annotations

import asyncio
import collections
import logging

import numpy

from aiokv.bucket.client import BucketClient, BucketError
from aiokv.bucket.naming import key_of

log = logging.getLogger("aiokv")


class Uploader:
    def __init__(self, client: BucketClient, max_bytes: int, concurrency: int = 4, count=None, verify=None):
        """verify(key, addr) -> bool: whether the slot image at addr is `key`'s block, intact
        (BlockIO.verify); None: an object already there is trusted."""
        self.client = client
        self.verify = verify
        self.max_bytes = max_bytes
        self.concurrency = concurrency
        self.queued_bytes = 0
        self.counters = collections.Counter()
        self.count = count or self.counters.update  # count(name=n): the owner's thread-safe counter
        self._queue: collections.deque = collections.deque()
        self._wake: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        self._busy = 0
        self._warned = False

    def offer(self, name: str, data: bytes) -> bool:
        """Queue one object; False (dropped, counted) if the queue is full or the tier is skipped."""
        if not self._tasks:
            self._wake, self._idle = asyncio.Event(), asyncio.Event()
            self._tasks = [asyncio.ensure_future(self._run()) for _ in range(self.concurrency)]
        if self.client.breaker.in_cooldown:
            self.count(upload_dropped_unavailable=1)
            return False
        if self.queued_bytes + len(data) > self.max_bytes:
            self.count(upload_dropped_queue_full=1)
            return False
        self._queue.append((name, data))
        self.queued_bytes += len(data)
        self._idle.clear()
        self._wake.set()
        return True

    async def _run(self) -> None:
        while True:
            if not self._queue:
                if not self._busy:
                    self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            name, data = self._queue.popleft()
            self._busy += 1
            try:
                created = await self.client.put_once(name, data)
                if created:
                    self.count(uploaded=1, upload_bytes=len(data))
                elif await self._holds_valid(name, len(data)):
                    self.count(upload_already_there=1)
                else:
                    await self.client.put(name, data)
                    self.count(upload_replaced_bad=1, upload_bytes=len(data))
            except BucketError as e:
                self.count(upload_failed=1)
                if not self._warned:
                    self._warned = True
                    log.warning("aiokv: uploads to %s fail (%s); they are dropped and counted", self.client.url, e)
            except Exception:
                self.count(upload_failed=1)
                log.exception("aiokv: an upload failed unexpectedly; it is dropped")
            finally:
                self._busy -= 1
                self.queued_bytes -= len(data)

    async def _holds_valid(self, name: str, size: int) -> bool:
        """Whether the object under `name` is an intact slot of its key (of `size` bytes)."""
        if self.verify is None:
            return True
        got = await self.client.get(name)
        if got is None:
            return False  # gone since the PUT said it was there: ours goes in
        src = numpy.frombuffer(got, numpy.uint8)
        if src.nbytes != size:
            return False
        buf = numpy.empty(size, numpy.uint8)  # verify reads a writable, stable image
        buf[:] = src
        return bool(self.verify(key_of(name), buf.ctypes.data))

    @property
    def pending(self) -> int:
        return len(self._queue) + self._busy

    async def flush(self, timeout: float) -> int:
        """Wait up to `timeout` s for queued uploads; drop (and count) the rest. Returns how many were dropped."""
        if self._tasks and self.pending:
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        dropped = self.pending
        self.count(upload_dropped_at_close=dropped)
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self._queue.clear()
        self.queued_bytes = 0
        return dropped
