# SPDX-License-Identifier: Apache-2.0
"""Which blocks past the local hit the bucket has, without a round trip on
the scheduler thread.

`lookup` answers from two caches (present / absent, each with an expiry) or,
where they do not know, starts one batched probe (concurrent HEADs of the next
blocks' objects) on the prober's own event loop and answers None: "not yet".
vLLM then skips the request for this step and asks again at the next one. A
request waits for the bucket at most `timeout` seconds in all: past that,
or when the probe failed, or while the breaker is open, it is answered with
what is known (often 0 more blocks) and goes on.

An object counts as present only with the size of a whole slot, so a
truncated upload is a miss before any GET.

Threading contract: lookup/forget/close from one thread (vLLM's scheduler
thread); the probes run on the prober's loop thread; the caches are shared
under a lock.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time

from aiokv.bucket.client import BucketClient, BucketError
from aiokv.util.loops import LoopThread

BATCH_BLOCKS = 256  # blocks probed by one probe, at most (8k tokens at block size 32)
CONCURRENCY = 64  # HEADs in flight per probe
WAIT_S = 0.002  # a lookup waits this long for its probe before answering "not yet"
PRESENT_TTL = 300.0  # s: a present object may expire (bucket lifecycle)
ABSENT_TTL = 5.0  # s: another engine may upload it meanwhile
MAX_CACHED = 200_000  # names remembered (both caches together)


class _Probe:
    __slots__ = ("started", "future", "failed")

    def __init__(self, started: float):
        self.started = started
        self.future = None
        self.failed = False


class Prober:
    def __init__(self, client: BucketClient, timeout: float = 1.0, clock=time.monotonic):
        self.client = client
        self.timeout = timeout
        self.clock = clock
        self._lock = threading.Lock()
        self._known: collections.OrderedDict[str, tuple[bool, float]] = collections.OrderedDict()
        self._probes: dict[str, _Probe] = {}
        self.counters = collections.Counter()
        self._lt = self.lt = LoopThread("aiokv-prober")  # (the publisher's uploads run on it too)
        self.loop, self.thread = self._lt.loop, self._lt.thread

    def _state(self, name: str, now: float) -> bool | None:
        v = self._known.get(name)
        if v is None or v[1] < now:
            return None
        return v[0]

    def lookup(self, req_id: str, blocks: list[list[tuple[str, int]]]) -> int | None:
        """How many of `blocks` (each: the (object name, size) that must all exist),
        from the first, the bucket has; None: not known yet, ask again."""
        now = self.clock()
        with self._lock:
            n, unknown = 0, []
            for i, objs in enumerate(blocks):
                states = [self._state(name, now) for name, _ in objs]
                if False in states:
                    break
                if None in states:
                    unknown = [o for b in blocks[i : i + BATCH_BLOCKS] for o in b if self._state(o[0], now) is None]
                    break
                n += 1
        if not unknown:
            self._probes.pop(req_id, None)
            return n
        p = self._probes.get(req_id)
        if p is None:
            p = self._probes[req_id] = _Probe(now)
        if p.failed or now - p.started >= self.timeout or self.client.breaker.in_cooldown:
            self.counters["probe_gave_up"] += 1
            return n  # the request goes on with what is known
        if p.future is None or p.future.done():
            self.counters["probes"] += 1
            p.future = asyncio.run_coroutine_threadsafe(self._probe(p, unknown), self.loop)
        # Wait a moment, GIL released: the probe's answers need the GIL on the prober's
        # thread, which an engine spinning empty steps would otherwise hand over only
        # every switch interval (5 ms) per answer.
        try:
            p.future.result(WAIT_S)
        except Exception:  # not done yet, or failed (p.failed says so)
            return None
        return self.lookup(req_id, blocks)

    async def _probe(self, p: _Probe, objs: list[tuple[str, int]]) -> None:
        sem = asyncio.Semaphore(CONCURRENCY)

        async def one(name: str, size: int) -> None:
            async with sem:
                got = await self.client.size(name)
            present = got == size
            with self._lock:
                self._known[name] = (present, self.clock() + (PRESENT_TTL if present else ABSENT_TTL))
                self._known.move_to_end(name)
                while len(self._known) > MAX_CACHED:
                    self._known.popitem(last=False)

        try:
            await asyncio.gather(*(one(n, s) for n, s in objs))
        except BucketError:
            p.failed = True
        except Exception:
            p.failed = True
            raise

    def forget(self, req_id: str) -> None:
        """The request is gone: drop its probe state (a running probe still fills the caches)."""
        self._probes.pop(req_id, None)

    def mark_absent(self, names) -> None:
        """Objects a load did not find or could not verify: not present any more."""
        with self._lock:
            for n in names:
                self._known[n] = (False, self.clock() + ABSENT_TTL)

    def close(self) -> None:
        self._lt.stop(timeout=5)
