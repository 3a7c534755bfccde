# SPDX-License-Identifier: Apache-2.0
"""The host-memory tier: blocks recently saved or loaded stay in host memory,
so that another hit on them is a copy into the KV cache, not a disk read.

Staging and the memory tier are one arena (data/buffers.py BufferPool, pinned on
CUDA by device.attach), owned by one object (worker/staging.py). A buffer is free, owned by a job (a device copy or I/O
uses it), or kept: it holds the whole verified slot image (header + payload)
of one key, in LRU order. Buffers reach the tier only from jobs that succeeded:
a save keeps its buffers once they are on disk (the disk stays the persistent
copy; a block that failed to write is not kept), a load keeps the buffers it
read and verified once their copy into the KV cache is done. Jobs take free
buffers first, then the least recently used kept ones: a job never waits for
the tier, and the tier never holds more than `limit` buffers.

Why the staging buffers themselves and not a copy: keeping a block costs no copy
(it is in staging already when its job ends), and a hit from memory is the
same one copy into the KV cache that ends a disk load.

Keys: one HostCache per worker process, shared by its KV-cache groups; the
staging owner keys it by (namespace, rank) and key: the same key may name
another group's block (groups of one layout), their namespaces tell them apart.
Within its namespace and rank a key names the same bytes wherever they are
stored, so a kept block is served for its key whatever slot the store gives
it now. Which keys are hits is still the scheduler's index: a block the disk
tier evicted is not offered, even if it is kept here.

Threading contract: its one owner is the worker's Staging (worker/staging.py),
which calls every method with its lock held (vLLM's worker thread takes buffers
for saves, the loop thread for loads and for keeping); nothing else calls it.
"""

from __future__ import annotations

import collections

from aiokv.data.buffers import BufferPool


class HostCache:
    def __init__(self, pool: BufferPool, limit: int):
        self.pool = pool
        self.limit = limit  # buffers kept at most (0: the tier is off)
        self._kept: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # key -> buf, LRU first

    @property
    def kept(self) -> int:
        return len(self._kept)

    @property
    def available(self) -> int:
        """Buffers a job can take now: free ones and kept ones."""
        return self.pool.available + len(self._kept)

    def acquire(self, n: int) -> list[int] | None:
        """n buffers for a job (evicting kept blocks, oldest first, if the free ones are short), or None."""
        if n > self.available:
            return None
        while self.pool.available < n:
            self._evict()
        return self.pool.acquire(n)

    def take(self, key: bytes) -> int | None:
        """The buffer holding `key`, now owned by the caller (a job that reads it), or None."""
        return self._kept.pop(key, None)

    def keep(self, key: bytes, buf: int) -> None:
        """A job's buffer, holding a verified image of `key`, joins the tier as the most
        recent block (with the tier off it is simply freed)."""
        old = self._kept.pop(key, None)
        if old is not None:
            self.pool.release([old])
        if self.limit <= 0:
            self.pool.release([buf])
        else:
            self._kept[key] = buf
            while len(self._kept) > self.limit:
                self._evict()

    def clear(self) -> int:
        """Forget every kept block (the cache was reset); returns how many."""
        n = len(self._kept)
        self.pool.release(list(self._kept.values()))
        self._kept.clear()
        return n

    def _evict(self) -> None:
        _, buf = self._kept.popitem(last=False)
        self.pool.release([buf])
