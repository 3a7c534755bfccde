# SPDX-License-Identifier: Apache-2.0
"""Requests wait for an index that is still loading, instead of missing.

At start the index of each namespace found in the directory is read on the store's loader
thread while the engine already serves (docs/design.md); until it is in, its lookups find
nothing. A request asked about meanwhile is answered "not yet" (SchedulerSide.match returns
None; vLLM keeps it waiting and asks again at its next step, as it does for the bucket tier),
so a restarted engine's first requests hit what the directory holds. The wait is bounded by
the `index_wait` setting, counted from the first request that waited: past it no request
waits any more (one log line) and lookups are misses until the index is in, as without the
wait. A load that failed ends the wait at once (its namespace serves no hits). Once every
index is in or failed, `holds` is one attribute read.

Cost on the scheduler thread: while an index loads, one attribute read per KV-cache group
and a set lookup per call; nothing per block, no file-system call (the store applies what
the loader handed over at its lookups, which match makes before asking here).

Counters: `index_waited` (requests that waited at least one step), `index_wait_expired`
(requests still waiting when index_wait ran out: served as misses).

Threading contract: the EngineCore scheduler thread only (through SchedulerSide).
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("aiokv")


def still_loading(ns) -> bool:
    """Whether ns's index is on its way: not in and not failed (several drives: on any drive)."""
    return ns.still_loading()


class IndexWait:
    def __init__(self, namespaces, limit: float, counters, clock=time.monotonic):
        """namespaces: the KV-cache groups' (a request waits while any of them loads); limit: the
        index_wait setting in seconds (0: no request waits); counters: SchedulerCounters."""
        self.namespaces = list(namespaces)
        self.limit = limit
        self.counters = counters
        self.clock = clock
        self.over = limit <= 0  # nobody waits any more: every index is in or failed, or the wait ran out
        self.until: float | None = None  # when the wait runs out (set by the first request that waits)
        self.waiting: set[str] = set()  # requests answered "not yet" since the wait began

    def holds(self, req_id: str) -> bool:
        """Whether req_id is answered "not yet" now; call after a lookup (it applied finished loads)."""
        if self.over:
            return False
        loading = [ns for ns in self.namespaces if still_loading(ns)]
        if not loading:
            self._end()
            return False
        now = self.clock()
        if self.until is None:
            self.until = now + self.limit
            log.info(
                "aiokv: requests wait for the index of namespace %s, still loading (at most index_wait = %g s; "
                "vLLM asks again at each step)",
                ", ".join(ns.nsid.hex()[:12] for ns in loading),
                self.limit,
            )
        if now >= self.until:
            self.counters.index_wait_expired += len(self.waiting)
            self._end()
            log.warning(
                "aiokv: the index of namespace %s is still loading after index_wait (%g s): requests no longer "
                "wait for it and miss until it is in (a slow or hung cache directory; a larger index_wait waits "
                "longer)",
                ", ".join(ns.nsid.hex()[:12] for ns in loading),
                self.limit,
            )
            return False
        if req_id not in self.waiting:
            self.waiting.add(req_id)
            self.counters.index_waited += 1
        return True

    def finished(self, req_id: str) -> None:
        """The request is gone (finished or aborted, waiting or not)."""
        self.waiting.discard(req_id)

    def _end(self) -> None:
        self.over = True
        self.waiting = set()
