# SPDX-License-Identifier: Apache-2.0
"""aiokv's figures as vLLM connector stats and Prometheus series (`vllm:aiokv_*`).

Part of the connector layer (imports vLLM). The path of a figure:

  worker counters (WorkerReport.counters, summed across TP ranks by vLLM's
  aggregation of worker metadata), scheduler counters and store gauges
      -> StatsDelta.take() on the scheduler thread, once per engine step:
         counter deltas since the last step, gauges only when they changed
      -> AioKVStats (vLLM's KVConnectorStats) in SchedulerStats
      -> AioKVPromMetrics.observe() in vLLM's stats logger (API server process)

Which counter becomes which series is the table of every counter,
aiokv/util/counters.py (SERIES: its rows with a series): a counter added
anywhere (scheduler, store, worker) becomes a series by giving its row one.

Ranks: per-rank counters are divided by the TP size (aiokv/util/counters.py).
Worker gauges (e.g. breaker_open, 0 or 1 per rank) arrive summed over ranks:
the number of ranks in that state. Latency histograms get one observation per
rank per load or save.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from aiokv.util.counters import (  # noqa: F401 (SERIES, NOT_EXPORTED and the kinds: read here by tests)
    COUNTER,
    DYNAMIC,
    GAUGE,
    GAUGES,
    HISTOGRAM,
    LEVEL,
    NOT_EXPORTED,
    PER_RANK,
    SERIES,
    Row,
)
from aiokv.util.counting import merge
from aiokv.worker.latency import LATENCY_BUCKETS, bucket_key

log = logging.getLogger("aiokv")


class StatsDelta:
    """Turns totals into per-step deltas for vLLM, which sums what it is handed.

    Scheduler thread only (the scheduler-role connector)."""

    def __init__(self, ranks: int):
        self.ranks = ranks
        self.worker: dict[str, Any] = {}  # worker counters since the last take()
        self._last: dict[str, Any] = {}  # scheduler totals at the last take()
        self._gauges: dict[str, Any] = {}  # gauge values last handed to vLLM

    def add_worker(self, counters: dict[str, Any]) -> None:
        merge(self.worker, counters)

    def take(self, totals: dict[str, Any]) -> dict[str, Any]:
        """totals: scheduler/store counters since start and current gauges."""
        data = {
            k: v / self.ranks if k in PER_RANK and self.ranks > 1 else v
            for k, v in self.worker.items()
            if v or k in GAUGES
        }
        self.worker = {}
        for k, v in totals.items():
            if k in GAUGES:
                data[k] = v
            else:  # a scheduler count wins over a worker count of the same name
                data.pop(k, None)
                if v != self._last.get(k, 0):
                    data[k] = v - self._last.get(k, 0)
                self._last[k] = v
        for k in [k for k in data if k in GAUGES]:
            if self._gauges.get(k) == data[k]:  # unchanged gauges are not resent: idle steps stay empty
                del data[k]
            else:
                self._gauges[k] = data[k]
        return data


class AioKVStats(KVConnectorStats):
    """One or more steps' counter deltas and latest gauges (see StatsDelta).

    Built on the scheduler thread and in vLLM's stats logger; each instance is
    used by one thread at a time."""

    def reset(self):
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merge(self.data, other.data or {})
        return self

    def reduce(self) -> dict[str, int | float]:
        # histograms and per-tenant figures ({tenant: bytes}): see /metrics
        return {k: v for k, v in self.data.items() if "_seconds_b" not in k and not isinstance(v, dict)}

    def is_empty(self) -> bool:
        return not self.data  # a gauge back to 0 is news too


def _clamp_into(mean: float, i: int) -> float:
    """A value inside bucket i, (LATENCY_BUCKETS[i-1], LATENCY_BUCKETS[i]], near `mean`."""
    lo = LATENCY_BUCKETS[i - 1] if i > 0 else 0.0
    hi = LATENCY_BUCKETS[i] if i < len(LATENCY_BUCKETS) else math.inf
    return min(max(mean, math.nextafter(lo, math.inf)), hi)


class AioKVPromMetrics(KVConnectorPromMetrics):
    """Registers the `vllm:aiokv_*` series and records AioKVStats data into them.

    Built and called by vLLM's Prometheus stat logger (API server process, its
    stats thread or loop), one instance per server."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._children: dict[str, tuple[Row, dict[int, Any]]] = {}  # stats key -> (row, engine -> child)
        self._levels: dict[tuple[str, int], float] = {}  # (LEVEL key, engine) -> its value
        # rows with a DYNAMIC label (tenant_bytes): stats key -> (metric, engine -> label values set now)
        self._dynamic: dict[str, tuple[Any, dict[int, set]]] = {}
        self._engine_labels = per_engine_labelvalues
        self._failed: set[str] = set()  # series whose figure could not be recorded (logged once each)
        by_series: dict[str, Any] = {}
        for row in SERIES:
            extra = [k for k, _ in row.labels]
            metric = by_series.get(row.series)
            if metric is None:
                name, doc, names = f"vllm:aiokv_{row.series}", row.help, labelnames + extra
                if row.kind == COUNTER:
                    metric = self._counter_cls(name=name, documentation=doc, labelnames=names)
                elif row.kind in (GAUGE, LEVEL):
                    metric = self._gauge_cls(
                        name=name, documentation=doc, labelnames=names, multiprocess_mode="mostrecent"
                    )
                else:
                    metric = self._histogram_cls(
                        name=name, documentation=doc, labelnames=names, buckets=list(LATENCY_BUCKETS)
                    )
                by_series[row.series] = metric
            values = [v for _, v in row.labels]
            if DYNAMIC in values:  # children made as the figure names them (observe)
                self._dynamic[row.key] = (metric, {})
                continue
            self._children[row.key] = (
                row,
                {idx: metric.labels(*lv, *values) for idx, lv in per_engine_labelvalues.items()},
            )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        """Record one step's figures. Called by vLLM's stat logger: never raises into it; a
        figure that cannot be recorded (a value of the wrong type) is skipped, the others are
        recorded, and the first such failure of each series is logged."""
        data = transfer_stats_data if isinstance(transfer_stats_data, dict) else {}
        for key, (metric, shown) in self._dynamic.items():
            self._guarded(key, self._observe_dynamic, data, key, metric, shown, engine_idx)
        for key, (row, children) in self._children.items():
            child = children.get(engine_idx)
            if child is not None:
                self._guarded(key, self._observe_row, data, key, row, child, engine_idx)

    def _guarded(self, key: str, fn, *args) -> None:
        try:
            fn(*args)
        except Exception:
            if key not in self._failed:
                self._failed.add(key)
                log.warning("aiokv: the figure %r could not be recorded in /metrics; skipped", key, exc_info=True)

    def _observe_dynamic(self, data: dict, key: str, metric, shown: dict, engine_idx: int) -> None:
        got = data.get(key)
        lv = self._engine_labels.get(engine_idx)
        if not isinstance(got, dict) or lv is None:
            return
        # one child per label value named now; those no longer named are removed (a bounded set)
        for value in shown.get(engine_idx, set()) - set(got):
            try:
                metric.remove(*lv, value)
            except KeyError:
                pass
        shown[engine_idx] = set(got)
        for value, v in got.items():
            metric.labels(*lv, value).set(v)

    def _observe_row(self, data: dict, key: str, row, child, engine_idx: int) -> None:
        if row.kind == HISTOGRAM:
            for i in range(len(LATENCY_BUCKETS) + 1):
                n = data.get(bucket_key(key, i))
                if n:
                    # n observations at their mean: exact bucket counts and _sum
                    value = _clamp_into(data.get(bucket_key(key, i) + "_ns", 0) / n / 1e9, i)
                    for _ in range(int(n)):
                        child.observe(value)
        elif key in data:
            if row.kind == GAUGE:
                child.set(data[key])
            elif row.kind == LEVEL:  # the running sum of its changes (mostrecent gauges refuse inc)
                level = self._levels.get((key, engine_idx), 0) + data[key]
                self._levels[(key, engine_idx)] = level
                child.set(level)
            elif data[key] > 0:
                child.inc(data[key])
