# SPDX-License-Identifier: Apache-2.0
"""The scheduler side's figures, handed to vLLM's stats once per engine step.

vLLM asks for them at every step (get_kv_connector_stats); most decode steps change none.
A look at what every figure follows (the scheduler's and the store's counters, the connector's
own counts, the gauges' inputs, the time in REFRESH_S buckets) costs a few tuples of ints and
the namespaces' sizes; only when it differs from the last step's are the figures gathered
(the store's gauges: disk bytes, bytes per tenant, ...) and their changes handed on
(metrics.StatsDelta). A gauge that moves with time alone (writes per day, the other engines'
file sizes, a breaker's cooldown) is recomputed at least every REFRESH_S while vLLM steps.

Threading contract: the EngineCore scheduler thread only (the SchedulerRole's calls).
"""

from __future__ import annotations

import time
from typing import Any

from aiokv.connector.metrics import StatsDelta
from aiokv.util.counters import TOP_TENANTS
from aiokv.util.counting import merge, store_counters

REFRESH_S = 1.0  # the figures are gathered at least this often while vLLM steps


class SchedulerFigures:
    def __init__(self, ranks: int):
        self.delta = StatsDelta(ranks)  # what vLLM's stats have not been handed yet
        self.totals: dict[str, int] = {}  # worker counters since start
        self.queried_tokens = 0  # prompt tokens asked of aiokv (counted at allocation)
        self.lora_misses = 0  # requests allocated with no key root: their adapter was not fingerprinted yet
        self.started = time.monotonic()  # (the wear gauge's rate)
        self._last: tuple | None = None  # look() when figures were last gathered

    def add_worker(self, counters: dict[str, Any]) -> None:
        """A worker report's counters (summed across ranks by vLLM)."""
        self.delta.add_worker(counters)
        merge(self.totals, counters)

    def take(self, sched, gather) -> dict[str, Any] | None:
        """This step's figures for vLLM (deltas of counters, gauges that changed), None when
        nothing moved since the last step. gather(): every figure now (scheduler_counters)."""
        seen = self.look(sched)
        if seen == self._last and not self.delta.worker:
            return None
        data = self.delta.take(gather())
        self._last = seen
        return data or None

    def look(self, sched) -> tuple:
        """What every figure of scheduler_counters follows; equal between two steps, none moved."""
        st = sched.store
        return (
            tuple(vars(sched.counters).values()),
            tuple(vars(st.stats).values()),  # (several drives: every drive's added up, and their own)
            self.queried_tokens,
            self.lora_misses,
            sched.pending_saves,
            sched.breaker.is_open,
            st.blocks(),
            st.loading,
            tuple(sched.bucket.counters.values()) if sched.bucket is not None else (),
            int(time.monotonic() // REFRESH_S),
        )

    def scheduler_counters(self, sched) -> dict[str, Any]:
        """Scheduler and store counters since start, and the store's gauges."""
        st = sched.store
        out = dict(vars(sched.counters))
        out.update(store_counters(st.stats))
        out.update(
            queried_tokens=self.queried_tokens,
            lora_fingerprint_misses=self.lora_misses,
            disk_bytes=st.used(),
            capacity_bytes=st.limit or 0,
            pending_saves=sched.pending_saves,
            breaker_open=int(sched.breaker.is_open),
            stored_blocks=st.blocks(),
            pinned_bytes=st.pinned_bytes(),
            tenant_bytes=st.tenant_bytes(TOP_TENANTS),
            index_loading=st.loading,
            drive_writes_per_day=self.writes_per_day(st),
        )
        if sched.bucket is not None:
            out.update(sched.bucket.counters)
        return out

    def writes_per_day(self, store) -> float:
        """This life's bytes written per day over the drives' size (an estimate: the rate since start)."""
        size = store.fs_bytes  # (several drives: every drive's)
        up = max(time.monotonic() - self.started, 60.0)
        return round(self.totals.get("bytes_written", 0) / up * 86400 / size, 6) if size else 0.0
