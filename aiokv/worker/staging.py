# SPDX-License-Identifier: Apache-2.0
"""The staging buffers of one worker, and their one owner.

A staging buffer (data/buffers.py BufferPool, one pinned arena) is at any time one of:
- free;
- a job's: `acquire` hands it out, `release` takes it back (a device copy, a read
  or a write uses it in between);
- kept: it holds the verified image of one key in the memory tier (worker/memory.py
  HostCache, LRU); `keep` turns a job's buffer into a kept one, `take_kept` a kept one
  back into a job's, and `acquire` evicts the oldest kept buffers when too few are free;
- stuck: the backend's abandon mode (data/backend.py) left I/O on it that the kernel
  or a thread still holds; `abandon` sets it aside, and a stuck buffer its job has
  released ("held") goes back to the pool only once that I/O has ended.

Loads that need buffers wait for them (`wait`), except when every buffer in use is stuck
(none may come back soon): they then fail at once (`StagingStuck`).

Threading contract: every method may be called from any thread (vLLM's worker
thread takes buffers for saves, the loop thread for loads, the layerwise copy thread
gives them back); one lock of this object guards the pool, the memory tier and the
stuck buffers, and is held only for in-memory bookkeeping. `bind` (once) and `wait`
run on the worker's event-loop thread; a release on any thread wakes the waiters
there. `close` is called once no I/O or copy can still touch the arena.
"""

from __future__ import annotations

import asyncio
import errno
import threading

from aiokv.data.buffers import BufferPool
from aiokv.worker.memory import HostCache


class StagingStuck(OSError):
    """Every staging buffer in use is held by I/O the disk has not finished."""


class Staging:
    def __init__(self, slot_bytes: int, count: int, kept: int):
        self.slot_bytes = slot_bytes  # every buffer's size (the largest KV-cache group's slot)
        self.pool = BufferPool(slot_bytes, count, populate=True)
        self.cache = HostCache(self.pool, kept)
        self._lock = threading.Lock()
        self._stuck: set[int] = set()  # buffers whose abandoned I/O the kernel or a thread still holds
        self._held: set[int] = set()  # stuck buffers their job has let go of: freed when the I/O ends
        self._loop = None
        self._freed: asyncio.Event | None = None

    def bind(self, loop) -> None:
        """On `loop`'s thread: the loop whose loads `wait` for buffers."""
        self._loop, self._freed = loop, asyncio.Event()

    # ---- sizes ----
    @property
    def count(self) -> int:
        return self.pool.count

    @property
    def limit(self) -> int:
        """Buffers the memory tier may keep at most."""
        return self.cache.limit

    @property
    def kept(self) -> int:
        with self._lock:
            return self.cache.kept

    @property
    def in_use(self) -> int:
        """Buffers owned by jobs (not those kept in the memory tier)."""
        with self._lock:
            return self.pool.in_use - self.cache.kept

    @property
    def stuck(self) -> int:
        """Buffers set aside until the kernel gives them back."""
        with self._lock:
            return len(self._stuck)

    def addr(self, buf: int) -> int:
        return self.pool.addr(buf)

    # ---- jobs' buffers ----
    def acquire(self, n: int, whole: bool = True) -> list[int] | None:
        """n buffers (`whole`) or as many up to n as there are (at least one), free ones
        first, then the memory tier's oldest; None when that many are not there. Never waits."""
        with self._lock:
            take = n if whole else min(n, self.cache.available)
            return self.cache.acquire(take) if take else None

    async def wait(self, n: int, whole: bool = False) -> list[int]:
        """Loop thread: like `acquire`, but waits while too few are there; raises
        StagingStuck at once when every buffer in use is stuck."""
        while True:
            with self._lock:
                take = n if whole else min(n, self.cache.available)
                bufs = self.cache.acquire(take) if take else None
                used = self.pool.in_use - self.cache.kept
                all_stuck = bufs is None and used and used == len(self._stuck)
            if bufs is not None:
                return bufs
            if all_stuck:
                raise StagingStuck(errno.EBUSY, "every staging buffer is held by I/O the disk has not finished")
            self._freed.clear()
            await self._freed.wait()

    def release(self, bufs: list[int]) -> None:
        """A job is done with these buffers: free now, or once their stuck I/O has ended."""
        with self._lock:
            stuck = self._stuck.intersection(bufs)
            self._held |= stuck
            self.pool.release([s for s in bufs if s not in stuck])
        self._wake()

    # ---- the memory tier ----
    def keep(self, items: list[tuple[bytes, int]], ns=None) -> None:
        """Buffers of jobs that succeeded (verified images of their keys) join the memory tier.
        `ns` names the keys' namespace: the KV-cache groups of a process share the tier, and a
        key names a block only within its group's namespace (and rank)."""
        if items:
            with self._lock:
                for key, buf in items:
                    self.cache.keep((ns, key), buf)

    def take_kept(self, keys: list[bytes], ns=None) -> list[int | None]:
        """Per key (of namespace `ns`), the kept buffer holding it, now the caller's (a job
        that reads it), or None."""
        with self._lock:
            return [self.cache.take((ns, k)) for k in keys]

    def clear_kept(self) -> None:
        """The cache was reset: the memory tier keeps nothing from before."""
        with self._lock:
            cleared = self.cache.clear()
        if cleared:
            self._wake()

    # ---- abandoned I/O ----
    def abandon(self, addrs: list[int], done: asyncio.Future) -> None:
        """Backend callback (loop thread): these buffers stay the kernel's until `done`."""
        base, size = self.pool.arena.addr, self.slot_bytes
        bufs = {(a - base) // size for a in addrs}
        with self._lock:
            self._stuck |= bufs
        done.add_done_callback(lambda _: self._unstick(bufs))

    def _unstick(self, bufs: set[int]) -> None:
        with self._lock:
            self._stuck -= bufs
            back = self._held & bufs
            self._held -= back
        if back:
            self.release(list(back))

    def _wake(self) -> None:
        if self._freed is not None:
            try:
                self._loop.call_soon_threadsafe(self._freed.set)
            except RuntimeError:
                pass  # the loop is closed: nobody waits for buffers any more

    def close(self) -> None:
        self.pool.close()
