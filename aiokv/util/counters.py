# SPDX-License-Identifier: Apache-2.0
"""The table of every counter aiokv keeps: one row each, wherever it is counted.

A row names the counter (its key in WorkerReport.counters, the stats vLLM is
handed and the connector's counters()), its kind, where it is counted, and
either the Prometheus series it becomes (`vllm:aiokv_<series>`, with help and
labels: aiokv/connector/metrics.py builds the series from this table) or why
it is not one. A counter added anywhere gets a row here;
tests/test_metrics_series_table.py holds every mechanism that counts to it. The
records the scheduler side and the store count into (SchedulerCounters,
StoreStats) are built from the rows (aiokv/util/counting.py's `record`): adding
one of theirs is a row.

Kinds: COUNTER (adds up), GAUGE (the last value), LEVEL (a figure that goes up
and down, reported by workers as its changes, which add up across ranks,
groups and steps like counters; exposed as a gauge), HISTOGRAM (latencies
carried as bucket counters, aiokv/worker/latency.py).

Where counted (`source`): WORKER (each rank's TransferWorker, summed across
ranks by vLLM's aggregation of worker metadata), SCHEDULER (SchedulerSide's
counters), STORE (the store's stats, keyed `store_<name>`), CONNECTOR (the
scheduler-role connector: tokens queried, the store's gauges), BUCKET (the
bucket tier's lookups on the scheduler side), STATE (the connector's
counters() only: the state of this instance, for tests and the demo).

Ranks: a worker counter with `per_rank=True` counts one event per rank for the
same block or request (each rank loads its shard of every block); its sum over
ranks is divided by the TP size, so a block loaded on every rank counts once.
Byte counters are true sums over ranks.

What is done with the figures (records built from the rows, reports added
up, the store's stats named, a label's values bounded) is aiokv/util/counting.py.

Threading contract: constant data, read by any thread.
"""

from __future__ import annotations

import dataclasses

COUNTER, GAUGE, HISTOGRAM, LEVEL = "counter", "gauge", "histogram", "level"
# a label whose values come with the figure: the figure is then {label value: number}
# (tenant_bytes: the TOP_TENANTS tenants holding most, and "other")
DYNAMIC = "*"
TOP_TENANTS = 8
WORKER, SCHEDULER, STORE, CONNECTOR, BUCKET, STATE = "worker", "scheduler", "store", "connector", "bucket", "state"


@dataclasses.dataclass(frozen=True)
class Row:
    key: str  # the counter's name in aiokv
    series: str | None  # exposed as vllm:aiokv_<series> (counters get Prometheus' _total suffix); None: not one
    kind: str
    help: str  # the series' help (its first row), or why the counter is not a series
    source: str | tuple[str, ...]  # where it is counted (a tuple: in more than one place)
    labels: tuple[tuple[str, str], ...] = ()
    per_rank: bool = False

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.source,) if isinstance(self.source, str) else self.source


def _no(key: str, source: str, why: str, kind: str = COUNTER) -> Row:
    return Row(key, None, kind, why, source)


_BUCKET = "bucket tier: no series yet (docs/sharing.md)"
_STATE = "this instance's state, in counters() only (tests, the demo)"

TABLE: tuple[Row, ...] = (
    # hits: hit_tokens / queried_tokens is aiokv's hit rate
    Row(
        "queried_tokens",
        "queried_tokens",
        COUNTER,
        "Prompt tokens asked of aiokv (those not already in vLLM's own prefix cache), once per scheduling.",
        CONNECTOR,
    ),
    Row(
        "lora_fingerprint_misses",
        "lora_fingerprint_misses",
        COUNTER,
        "Requests served as a miss that saved nothing because their LoRA adapter's files were not "
        "fingerprinted yet (aiokv looks at them on an I/O thread of its own; a hung mount keeps them coming).",
        CONNECTOR,
    ),
    Row(
        "hit_tokens",
        "hit_tokens",
        COUNTER,
        "Prompt tokens aiokv had on disk and loaded instead of computing.",
        SCHEDULER,
    ),
    Row("hit_requests", "hit_requests", COUNTER, "Requests that got a hit from aiokv.", SCHEDULER),
    Row(
        "index_waited",
        "index_waited_requests",
        COUNTER,
        "Requests that waited (vLLM asked again at its next step) because their namespace's index was still "
        "loading at start.",
        SCHEDULER,
    ),
    Row(
        "index_wait_expired",
        "index_wait_expired_requests",
        COUNTER,
        "Requests still waiting for a loading index when index_wait ran out: served as misses.",
        SCHEDULER,
    ),
    # volume
    Row("bytes_read", "loaded_bytes", COUNTER, "Bytes read from disk for loads, all TP ranks together.", WORKER),
    Row("bytes_written", "stored_bytes", COUNTER, "Bytes written to disk for saves, all TP ranks together.", WORKER),
    Row(
        "loads_ok_blocks",
        "loaded_blocks",
        COUNTER,
        "KV blocks loaded and verified (from disk or memory).",
        WORKER,
        per_rank=True,
    ),
    # the host-memory tier (`memory` setting)
    Row(
        "memory_hit_blocks",
        "memory_hit_blocks",
        COUNTER,
        "KV blocks a hit copied from host memory (the memory tier) instead of reading the disk.",
        WORKER,
        per_rank=True,
    ),
    Row(
        "memory_held_bytes",
        "memory_bytes",
        LEVEL,
        "Bytes of KV blocks held in host memory by the memory tier, all ranks together.",
        WORKER,
    ),
    Row("saves_planned", "save_planned_blocks", COUNTER, "KV blocks a save was started for.", SCHEDULER),
    Row(
        "saves_committed",
        "saved_blocks",
        COUNTER,
        "KV blocks written on every rank and committed to the index.",
        SCHEDULER,
    ),
    # failures: every one is a recompute or a block not saved, never a failed request
    Row(
        "load_failed_blocks",
        "load_failed_blocks",
        COUNTER,
        "KV blocks that could not be loaded and were recomputed (any cause).",
        WORKER,
        per_rank=True,
    ),
    Row(
        "load_timeouts",
        "load_failures",
        COUNTER,
        "Load failures by cause: timeout = a request's load abandoned after load_timeout; "
        "corrupt = a block that failed verification (dropped from the index).",
        WORKER,
        labels=(("cause", "timeout"),),
        per_rank=True,
    ),
    Row("load_bad_blocks", "load_failures", COUNTER, "", SCHEDULER, labels=(("cause", "corrupt"),)),
    Row(
        "loads_cancelled",
        "loads_cancelled",
        COUNTER,
        "Loads stopped because vLLM aborted their request.",
        (SCHEDULER, WORKER),
    ),  # the scheduler's count wins (StatsDelta)
    Row(
        "save_failures",
        "save_failed_blocks",
        COUNTER,
        "KV blocks a worker reported not written (any cause, staging_full included); their slots are freed.",
        SCHEDULER,
    ),
    Row(
        "save_skipped_staging_full",
        "save_dropped_blocks",
        COUNTER,
        "KV blocks not saved, by cause: staging_full = no free staging memory (raise `staging`); "
        "no_space = nothing evictable or the disk is full; timeout = a write over save_timeout; "
        "breaker = the circuit breaker was open; quota = its tenant's quota left nothing to evict; "
        "tenants = a new tenant and no tenant id free (65,534 tenants holding blocks); index_loading = "
        "the index was still loading at start; space_busy = the disk space for it was still being reserved.",
        WORKER,
        labels=(("cause", "staging_full"),),
        per_rank=True,
    ),
    Row("store_skipped_no_space", "save_dropped_blocks", COUNTER, "", STORE, labels=(("cause", "no_space"),)),
    Row("store_skipped_drive_down", "save_dropped_blocks", COUNTER, "", STORE, labels=(("cause", "drive_down"),)),
    Row("save_timeouts", "save_dropped_blocks", COUNTER, "", WORKER, labels=(("cause", "timeout"),), per_rank=True),
    Row("store_evictions", "evicted_blocks", COUNTER, "KV blocks evicted (least recently used) to make room.", STORE),
    Row(
        "store_quota_evictions",
        "quota_evicted_blocks",
        COUNTER,
        "KV blocks of a tenant over its `quota` evicted (its own least recently used) to keep it there.",
        STORE,
    ),
    Row("store_skipped_quota", "save_dropped_blocks", COUNTER, "", STORE, labels=(("cause", "quota"),)),
    Row("store_skipped_tenants", "save_dropped_blocks", COUNTER, "", STORE, labels=(("cause", "tenants"),)),
    Row("store_skipped_loading", "save_dropped_blocks", COUNTER, "", STORE, labels=(("cause", "index_loading"),)),
    Row("store_skipped_fs_busy", "save_dropped_blocks", COUNTER, "", STORE, labels=(("cause", "space_busy"),)),
    Row(
        "store_cleared",
        "cleared_blocks",
        COUNTER,
        "KV blocks this engine removed for `aiokv clear` (its own, and the other engines' it stopped serving).",
        STORE,
    ),
    Row(
        "store_pins_refused",
        "pins_refused_blocks",
        COUNTER,
        "KV blocks a pin (a request's, or `aiokv pin`) left unpinned because pinned blocks would exceed "
        "pin_capacity, or, for a request's, its tenant's request_pins bound (or request_pins does not name it).",
        STORE,
    ),
    Row(
        "store_enospc",
        "disk_full_events",
        COUNTER,
        "Times the file system said it was full (aiokv then lowers its capacity to what it holds).",
        STORE,
    ),
    Row("saves_skipped_breaker", "save_dropped_blocks", COUNTER, "", SCHEDULER, labels=(("cause", "breaker"),)),
    Row(
        "saves_not_admitted",
        "save_not_admitted_blocks",
        COUNTER,
        "KV blocks not written because `admit` is reused and no other request had met their key yet.",
        SCHEDULER,
    ),
    Row(
        "read_errors",
        "io_errors",
        COUNTER,
        "Disk I/O errors (EIO, short transfers; not verification failures), by op, all TP ranks together.",
        WORKER,
        labels=(("op", "read"),),
    ),
    Row("write_errors", "io_errors", COUNTER, "", WORKER, labels=(("op", "write"),)),
    Row(
        "hook_errors",
        "scheduler_errors",
        COUNTER,
        "Times aiokv's own work in one of vLLM's scheduler-side calls raised; vLLM never sees it: that "
        "step's saves are dropped and its loads recomputed (the first of each call is logged).",
        SCHEDULER,
    ),
    Row(
        "breaker_opens",
        "breaker_trips",
        COUNTER,
        "Times the circuit breaker opened on a failing disk (no hits or saves for breaker_cooldown, then a probe).",
        SCHEDULER,
    ),
    Row(
        "store_drive_breaker_opens",
        "drive_breaker_trips",
        COUNTER,
        "Times one drive's circuit breaker opened (several drives: no hits or saves on that drive for "
        "breaker_cooldown, then a probe; the other drives go on).",
        STORE,
    ),
    # gauges: the last value reported
    *(
        Row(key, series, GAUGE, text, CONNECTOR)
        for key, series, text in (
            ("disk_bytes", "disk_bytes", "Bytes of disk held by aiokv's data files (slots allocated)."),
            (
                "capacity_bytes",
                "capacity_bytes",
                "Capacity in force: the `capacity` setting, or less after the disk was found full.",
            ),
            ("stored_blocks", "blocks", "KV blocks committed in the index (all namespaces)."),
            (
                "pinned_bytes",
                "pinned_bytes",
                "Bytes of pinned blocks in the cache directory (every engine's; bounded by pin_capacity).",
            ),
        )
    ),
    # one series per tenant, for the TOP_TENANTS tenants holding most, and "other" for the rest
    Row(
        "tenant_bytes",
        "tenant_bytes",
        GAUGE,
        'Bytes of blocks each tenant (a request\'s cache_salt; "" for none) holds in the cache directory: the '
        'tenants holding most by name, every other one together as "other".',
        CONNECTOR,
        labels=(("tenant", DYNAMIC),),
    ),
    *(
        Row(key, series, GAUGE, text, CONNECTOR)
        for key, series, text in (
            (
                "index_loading",
                "index_loading",
                "Namespaces whose index is still loading at start (no hits, saves dropped); 0 once hits begin.",
            ),
            (
                "drive_writes_per_day",
                "drive_writes_per_day",
                "Drive writes per day this engine's saves cost at their rate since start: bytes written per day over "
                "the size of the cache directory's file system(s) (aiokv inspect: since the directory's first use).",
            ),
            ("pending_saves", "pending_saves", "KV blocks being written, not yet reported by every rank."),
            (
                "breaker_open",
                "breaker_open",
                "1 while the circuit breaker is open or probing (the disk is bypassed), 0 when all is well.",
            ),
        )
    ),
    # histograms: bucket counts and sums carried as counters (aiokv/worker/latency.py)
    Row(
        "load",
        "load_seconds",
        HISTOGRAM,
        "Seconds a worker took to load one request's blocks (read, verify, copy in); one per rank.",
        WORKER,
    ),
    Row(
        "save",
        "save_seconds",
        HISTOGRAM,
        "Seconds a worker took to write one request's blocks of one step; one per rank.",
        WORKER,
    ),
    # counters that are deliberately not series (each says why)
    _no("hit_blocks", SCHEDULER, "hit_tokens / block size"),
    _no(
        "load_blocks",
        SCHEDULER,
        "blocks of every KV-cache group a hit loads: loaded_blocks + load_failed_blocks + cancelled add up to it",
    ),
    _no("saves_ok_blocks", WORKER, "per-rank twin of saved_blocks (which counts a block once all ranks wrote it)"),
    _no("save_failed_blocks", WORKER, "per-rank twin of save_failed_blocks (save_failures, counted once per block)"),
    _no("load_cancelled_blocks", WORKER, "blocks of cancelled loads: loads_cancelled counts the loads"),
    _no("store_commits", STORE, "the same as saves_committed"),  # blocks the store committed
    _no(
        "load_staging_stuck",
        WORKER,
        "loads failed at once because every staging buffer waits for a hung disk: "
        "part of load_failed_blocks, and the breaker's io_errors tell the cause",
    ),
    _no("store_save_failures", STORE, "the same as save_failures"),  # reservations aborted (I/O error in a writer)
    _no("store_corrupt_dropped", STORE, "the same as load_failures{cause=corrupt}"),  # failed verification or I/O
    _no(
        "reports_ignored", SCHEDULER, "worker results for jobs the scheduler side no longer holds: a check, 0 expected"
    ),
    # the bucket tier (docs/sharing.md): in the connector's counters; no series yet
    _no("bucket_hit_blocks", SCHEDULER, _BUCKET),
    *(
        _no(k, WORKER, _BUCKET)
        for k in (
            "bucket_loaded_blocks",
            "bucket_missed_blocks",
            "bucket_bad_blocks",
            "uploaded",
            "upload_bytes",
            "upload_already_there",
            "upload_failed",
            "upload_replaced_bad",
            "upload_dropped_queue_full",
            "upload_dropped_unavailable",
            "upload_dropped_at_close",
        )
    ),
    *(_no(k, BUCKET, _BUCKET) for k in ("bucket_probes", "bucket_probe_gave_up", "bucket_breaker_opened")),
    # block labels published beside the blocks for nodes warmed from the bucket (aiokv/bucket/publisher.py)
    *(_no(k, BUCKET, _BUCKET) for k in ("bucket_labels_uploaded", "bucket_labels_dropped")),
    # the state of this instance (counters() only)
    *(
        _no(k, STATE, _STATE, GAUGE)
        for k in (
            "pinned",
            "hits_offered",
            "worker_in_flight",
            "staging_in_use",
            "load_report_breaches",  # refused duplicate load reports (worker/groups.py): the tests require 0
        )
    ),
    *(
        _no(f"layerwise_{k}", STATE, "the layer-by-layer copies (worker/layerwise.py): " + _STATE)
        for k in ("staged_loads", "staged_blocks", "copied_blocks", "layer_waits", "dropped_blocks")
    ),
)

ROWS: dict[str, Row] = {r.key: r for r in TABLE}
SERIES: tuple[Row, ...] = tuple(r for r in TABLE if r.series is not None)
NOT_EXPORTED: dict[str, str] = {r.key: r.help for r in TABLE if r.series is None}
GAUGES = frozenset(r.key for r in SERIES if r.kind == GAUGE)
PER_RANK = frozenset(r.key for r in SERIES if r.per_rank)
