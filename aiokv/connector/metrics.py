"""aiokv's figures as vLLM connector stats and Prometheus series (`vllm:aiokv_*`).

Part of the connector layer (imports vLLM). The path of a figure:

  worker counters (WorkerReport.counters, summed across TP ranks by vLLM's
  aggregation of worker metadata), scheduler counters and store gauges
      -> StatsDelta.take() on the scheduler thread, once per engine step:
         counter deltas since the last step, gauges only when they changed
      -> AioKVStats (vLLM's KVConnectorStats) in SchedulerStats
      -> AioKVPromMetrics.observe() in vLLM's stats logger (API server process)

Which counter becomes which series is the table SERIES below: a counter added
anywhere (scheduler, store, worker) becomes a series by adding a row.

Ranks: a worker counter with `per_rank=True` counts one event per rank for the
same block or request (each rank loads its shard of every block); its sum over
ranks is divided by the TP size, so a block loaded on every rank counts once.
Byte counters are true sums over ranks. Worker gauges (e.g. breaker_open, 0 or
1 per rank) arrive summed over ranks: the number of ranks in that state.
Latency histograms get one observation per rank per load or save.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from aiokv.worker.latency import LATENCY_BUCKETS, bucket_key

# LEVEL: a figure that goes up and down, reported by workers as its changes (they add up across
# ranks, groups and steps like counters) and exposed as a gauge
COUNTER, GAUGE, HISTOGRAM, LEVEL = "counter", "gauge", "histogram", "level"


@dataclasses.dataclass(frozen=True)
class Row:
    key: str          # the counter's name in aiokv (worker, scheduler, or store_* for StoreStats)
    series: str       # exposed as vllm:aiokv_<series> (counters get Prometheus' _total suffix)
    kind: str
    help: str
    labels: tuple[tuple[str, str], ...] = ()
    per_rank: bool = False


SERIES: tuple[Row, ...] = (
    # hits: hit_tokens / queried_tokens is aiokv's hit rate
    Row("queried_tokens", "queried_tokens", COUNTER,
        "Prompt tokens asked of aiokv (those not already in vLLM's own prefix cache), once per scheduling."),
    Row("hit_tokens", "hit_tokens", COUNTER, "Prompt tokens aiokv had on disk and loaded instead of computing."),
    Row("hit_requests", "hit_requests", COUNTER, "Requests that got a hit from aiokv."),
    # volume
    Row("bytes_read", "loaded_bytes", COUNTER, "Bytes read from disk for loads, all TP ranks together."),
    Row("bytes_written", "stored_bytes", COUNTER, "Bytes written to disk for saves, all TP ranks together."),
    Row("loads_ok_blocks", "loaded_blocks", COUNTER, "KV blocks loaded and verified (from disk or memory).",
        per_rank=True),
    # the host-memory tier (`memory` setting)
    Row("memory_hit_blocks", "memory_hit_blocks", COUNTER,
        "KV blocks a hit copied from host memory (the memory tier) instead of reading the disk.", per_rank=True),
    Row("memory_held_bytes", "memory_bytes", LEVEL,
        "Bytes of KV blocks held in host memory by the memory tier, all ranks together."),
    Row("saves_planned", "save_planned_blocks", COUNTER, "KV blocks a save was started for."),
    Row("saves_committed", "saved_blocks", COUNTER, "KV blocks written on every rank and committed to the index."),
    # failures: every one is a recompute or a block not saved, never a failed request
    Row("load_failed_blocks", "load_failed_blocks", COUNTER,
        "KV blocks that could not be loaded and were recomputed (any cause).", per_rank=True),
    Row("load_timeouts", "load_failures", COUNTER,
        "Load failures by cause: timeout = a request's load abandoned after load_timeout; "
        "corrupt = a block that failed verification (dropped from the index).",
        labels=(("cause", "timeout"),), per_rank=True),
    Row("load_bad_blocks", "load_failures", COUNTER, "", labels=(("cause", "corrupt"),)),
    Row("loads_cancelled", "loads_cancelled", COUNTER, "Loads stopped because vLLM aborted their request."),
    Row("save_failures", "save_failed_blocks", COUNTER,
        "KV blocks a worker reported not written (any cause, staging_full included); their slots are freed."),
    Row("save_skipped_staging_full", "save_dropped_blocks", COUNTER,
        "KV blocks not saved, by cause: staging_full = no free staging memory (raise `staging`); "
        "no_space = nothing evictable or the disk is full; timeout = a write over save_timeout; "
        "breaker = the circuit breaker was open.",
        labels=(("cause", "staging_full"),), per_rank=True),
    Row("store_skipped_no_space", "save_dropped_blocks", COUNTER, "", labels=(("cause", "no_space"),)),
    Row("save_timeouts", "save_dropped_blocks", COUNTER, "", labels=(("cause", "timeout"),), per_rank=True),
    Row("store_evictions", "evicted_blocks", COUNTER, "KV blocks evicted (least recently used) to make room."),
    Row("store_enospc", "disk_full_events", COUNTER,
        "Times the file system said it was full (aiokv then lowers its capacity to what it holds)."),
    Row("saves_skipped_breaker", "save_dropped_blocks", COUNTER, "", labels=(("cause", "breaker"),)),
    Row("read_errors", "io_errors", COUNTER,
        "Disk I/O errors (EIO, short transfers; not verification failures), by op, all TP ranks together.",
        labels=(("op", "read"),)),
    Row("write_errors", "io_errors", COUNTER, "", labels=(("op", "write"),)),
    Row("breaker_opens", "breaker_trips", COUNTER,
        "Times the circuit breaker opened on a failing disk (no hits or saves for breaker_cooldown, then a probe)."),
    # gauges: the last value reported
    Row("disk_bytes", "disk_bytes", GAUGE, "Bytes of disk held by aiokv's data files (slots allocated)."),
    Row("capacity_bytes", "capacity_bytes", GAUGE,
        "Capacity in force: the `capacity` setting, or less after the disk was found full."),
    Row("stored_blocks", "blocks", GAUGE, "KV blocks committed in the index (all namespaces)."),
    Row("pending_saves", "pending_saves", GAUGE, "KV blocks being written, not yet reported by every rank."),
    Row("breaker_open", "breaker_open", GAUGE,
        "1 while the circuit breaker is open or probing (the disk is bypassed), 0 when all is well."),
    # histograms: bucket counts and sums carried as counters (aiokv/worker/latency.py)
    Row("load", "load_seconds", HISTOGRAM,
        "Seconds a worker took to load one request's blocks (read, verify, copy in); one per rank."),
    Row("save", "save_seconds", HISTOGRAM,
        "Seconds a worker took to write one request's blocks of one step; one per rank."),
)

# counters aiokv keeps that are deliberately not series (each says why); every other counter
# needs a row (tests/test_metrics_series_table.py checks that)
NOT_EXPORTED = {
    "hit_blocks": "hit_tokens / block size",
    "load_blocks": "blocks of every KV-cache group a hit loads: loaded_blocks + load_failed_blocks + cancelled add up to it",
    "saves_ok_blocks": "per-rank twin of saved_blocks (which counts a block once all ranks wrote it)",
    "save_failed_blocks": "per-rank twin of save_failed_blocks (save_failures, counted once per block)",
    "load_cancelled_blocks": "blocks of cancelled loads: loads_cancelled counts the loads",
    "store_commits": "the same as saves_committed",
    "load_staging_stuck": "loads failed at once because every staging slot waits for a hung disk: "
                          "part of load_failed_blocks, and the breaker's io_errors tell the cause",
    "store_save_failures": "the same as save_failures",
    "store_corrupt_dropped": "the same as load_failures{cause=corrupt}",
    "store_loads": "the store's own load path (tools, tests), not the engine's",
    "store_load_failures": "the store's own load path (tools, tests), not the engine's",
    "reports_ignored": "worker results for jobs the scheduler side no longer holds: a check, 0 expected",
    # the shared tier (docs/sharing.md): in the connector's counters; no series yet
    **{k: "shared tier: no series yet (docs/sharing.md)" for k in (
        "remote_hit_blocks", "remote_loaded_blocks", "remote_missed_blocks", "remote_bad_blocks", "uploaded",
        "upload_bytes",
        "upload_already_there", "upload_failed", "upload_replaced_bad", "upload_dropped_queue_full",
        "upload_dropped_unavailable", "upload_dropped_at_close")},
}

GAUGES = frozenset(r.key for r in SERIES if r.kind == GAUGE)
PER_RANK = frozenset(r.key for r in SERIES if r.per_rank)


def merge(into: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """Adds `new` to `into` (counters add up, gauges take the newer value); returns `into`."""
    for k, v in new.items():
        into[k] = v if k in GAUGES else into.get(k, 0) + v
    return into


class StatsDelta:
    """Turns totals into per-step deltas for vLLM, which sums what it is handed.

    Scheduler thread only (the scheduler-role connector)."""

    def __init__(self, ranks: int):
        self.ranks = ranks
        self.worker: dict[str, Any] = {}     # worker counters since the last take()
        self._last: dict[str, Any] = {}      # scheduler totals at the last take()
        self._gauges: dict[str, Any] = {}    # gauge values last handed to vLLM

    def add_worker(self, counters: dict[str, Any]) -> None:
        merge(self.worker, counters)

    def take(self, totals: dict[str, Any]) -> dict[str, Any]:
        """totals: scheduler/store counters since start and current gauges."""
        data = {k: v / self.ranks if k in PER_RANK and self.ranks > 1 else v
                for k, v in self.worker.items() if v or k in GAUGES}
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
        return {k: v for k, v in self.data.items() if "_seconds_b" not in k}  # histograms: see /metrics

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
        by_series: dict[str, Any] = {}
        for row in SERIES:
            extra = [k for k, _ in row.labels]
            metric = by_series.get(row.series)
            if metric is None:
                name, doc, names = f"vllm:aiokv_{row.series}", row.help, labelnames + extra
                if row.kind == COUNTER:
                    metric = self._counter_cls(name=name, documentation=doc, labelnames=names)
                elif row.kind in (GAUGE, LEVEL):
                    metric = self._gauge_cls(name=name, documentation=doc, labelnames=names,
                                             multiprocess_mode="mostrecent")
                else:
                    metric = self._histogram_cls(name=name, documentation=doc, labelnames=names,
                                                 buckets=list(LATENCY_BUCKETS))
                by_series[row.series] = metric
            values = [v for _, v in row.labels]
            self._children[row.key] = (row, {idx: metric.labels(*lv, *values)
                                             for idx, lv in per_engine_labelvalues.items()})

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        data = transfer_stats_data or {}
        for key, (row, children) in self._children.items():
            child = children.get(engine_idx)
            if child is None:
                continue
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
