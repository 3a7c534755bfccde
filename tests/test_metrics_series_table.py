# SPDX-License-Identifier: Apache-2.0
"""aiokv's counters become `vllm:aiokv_*` Prometheus series correctly.

The bug: aiokv handed vLLM one flat dict of counters that vLLM summed, so a gauge
(bytes on disk) would have grown with every step, per-rank counts were
multiplied by the TP size, nothing reached `/metrics`, and a counter added
later silently had no series.

The invariants: counters reach Prometheus as exact totals however vLLM splits
and re-aggregates the per-step deltas; gauges show the last value (a return to
0 included) and idle steps hand vLLM nothing; per-rank counters count a block
once at any TP size; the latency histograms carried as counters give the same
bucket counts and sum as observing each latency directly; every counter aiokv
keeps has a row in the table of counters (aiokv/util/counters.py): a series
(metrics.SERIES) or a stated reason (metrics.NOT_EXPORTED); a figure Prometheus refuses
never raises into vLLM's stat logger (it raised there, unguarded, before).

The fix: aiokv/connector/metrics.py (StatsDelta, AioKVStats, AioKVPromMetrics),
the table aiokv/util/counters.py and aiokv/worker/latency.py.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from aiokv.connector import metrics
from aiokv.connector.metrics import SERIES, AioKVPromMetrics, AioKVStats, StatsDelta
from aiokv.scheduler.side import SchedulerCounters
from aiokv.store.store import StoreStats
from aiokv.util import counters as table
from aiokv.util import counting
from aiokv.worker import transfer
from aiokv.worker.latency import LATENCY_BUCKETS, bucket_key, latency_counts

LABELS = ["model_name", "engine"]


class _Cfg:
    kv_transfer_config = None


def prom(registry: CollectorRegistry) -> AioKVPromMetrics:
    def bound(cls):
        return lambda **kw: cls(registry=registry, **kw)

    types = {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)}
    return AioKVPromMetrics(_Cfg(), types, LABELS, {0: ["tiny", "0"]})


def sample(reg: CollectorRegistry, name: str, **labels) -> float | None:
    return reg.get_sample_value(name, {"model_name": "tiny", "engine": "0", **labels})


def _counted_in_code() -> set[str]:
    """The names the worker (its loads, saves and reads), the layerwise copies and the bucket tier count under (read from their code)."""
    import ast

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = set()
    # (file, the counting call's attribute chain, the prefix its names get in the connector's counters)
    for rel, call, prefix in (
        ("aiokv/worker/loads.py", "self.results.count", ""),
        ("aiokv/worker/saves.py", "self.results.count", ""),
        ("aiokv/worker/reads.py", "self.count", ""),
        ("aiokv/bucket/uploader.py", "self.count", ""),
        ("aiokv/worker/layerwise.py", "self.counts.update", "layerwise_"),
        ("aiokv/bucket/prober.py", "self.counters", "bucket_"),
    ):
        with open(os.path.join(root, rel)) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == call:
                found |= {prefix + kw.arg for kw in node.keywords if kw.arg is not None}
            elif (
                isinstance(node, ast.Subscript)
                and ast.unparse(node.value) == call
                and isinstance(node.slice, ast.Constant)
            ):
                found.add(prefix + node.slice.value)
    assert len(found) > 20, found
    return found


def test_every_counter_has_a_series_or_a_reason():
    produced = {f.name for f in dataclasses.fields(SchedulerCounters)}
    produced |= {f"store_{f.name}" for f in dataclasses.fields(StoreStats)}
    produced |= set(transfer.COUNTERS)
    produced |= _counted_in_code()
    rows = {r.key for r in SERIES}
    missing = produced - rows - set(metrics.NOT_EXPORTED)
    assert not missing, f"counters with no row in metrics.SERIES and no reason in NOT_EXPORTED: {missing}"
    assert not rows & set(metrics.NOT_EXPORTED)
    assert len(table.ROWS) == len(table.TABLE), "a counter with two rows"
    # the table says where each is counted: the same names as the mechanisms that count them (the
    # scheduler side's and the store's records are built from its rows: counting.record)
    assert set(counting.names(table.SCHEDULER)) == {f.name for f in dataclasses.fields(SchedulerCounters)}
    assert set(counting.names(table.STORE)) == {f"store_{f.name}" for f in dataclasses.fields(StoreStats)}
    assert set(transfer.COUNTERS) >= {k for k in _counted_in_code() if not k.startswith(("layerwise_", "bucket_"))}
    assert all(r.kind in (metrics.COUNTER, metrics.GAUGE, metrics.LEVEL, metrics.HISTOGRAM) for r in table.TABLE)
    # one help text, kind and label set per series
    by_series = {}
    for r in SERIES:
        first = by_series.setdefault(r.series, r)
        assert (first.kind, [k for k, _ in first.labels]) == (r.kind, [k for k, _ in r.labels]), r
        assert first.help, first


def test_counters_gauges_and_ranks_reach_prometheus_exactly():
    reg = CollectorRegistry()
    pm = prom(reg)
    delta = StatsDelta(ranks=2)
    rnd = random.Random(5)
    totals = {"hit_tokens": 0, "queried_tokens": 0, "disk_bytes": 0, "store_skipped_no_space": 0}
    want_loaded = want_bytes = 0
    accumulated = None  # vLLM's logger folds several steps' stats together: do the same at times
    for step in range(200):
        blocks = rnd.randrange(0, 4)
        for _ in range(2):  # both ranks load their shard of the same blocks
            delta.add_worker({"loads_ok_blocks": blocks, "bytes_read": blocks * 100, "breaker_open": 0})
        want_loaded += blocks
        want_bytes += 2 * blocks * 100
        totals["hit_tokens"] += rnd.randrange(0, 3) * 32
        totals["queried_tokens"] += 64
        totals["disk_bytes"] = rnd.choice([totals["disk_bytes"], rnd.randrange(1, 1 << 30)])
        if step == 199:
            totals["disk_bytes"] = 0  # back to zero must be seen
        data = delta.take(dict(totals))
        if not data:
            continue
        stats = AioKVStats(data=data)
        if rnd.random() < 0.3:
            accumulated = stats if accumulated is None else accumulated.aggregate(stats)
            continue
        if accumulated is not None:
            stats = accumulated.aggregate(stats)
            accumulated = None
        pm.observe(stats.to_dict(), 0)
    if accumulated is not None:
        pm.observe(accumulated.to_dict(), 0)
    assert sample(reg, "vllm:aiokv_loaded_blocks_total") == want_loaded  # once per block, not per rank
    assert sample(reg, "vllm:aiokv_loaded_bytes_total") == want_bytes  # bytes: the true sum
    assert sample(reg, "vllm:aiokv_hit_tokens_total") == totals["hit_tokens"]
    assert sample(reg, "vllm:aiokv_queried_tokens_total") == totals["queried_tokens"]
    assert sample(reg, "vllm:aiokv_disk_bytes") == 0
    # an idle step hands vLLM nothing (no stats, no log line)
    assert delta.take(dict(totals)) == {}
    # a labelled cause
    totals["store_skipped_no_space"] = 7
    pm.observe(AioKVStats(data=delta.take(dict(totals))).to_dict(), 0)
    assert sample(reg, "vllm:aiokv_save_dropped_blocks_total", cause="no_space") == 7
    assert sample(reg, "vllm:aiokv_save_dropped_blocks_total", cause="staging_full") == 0


@pytest.mark.parametrize("seed", [0, 1])
def test_latency_histogram_matches_direct_observation(seed):
    rnd = random.Random(seed)
    latencies = [10 ** rnd.uniform(-4, 1.7) for _ in range(500)] + list(LATENCY_BUCKETS)  # edges included
    reg = CollectorRegistry()
    pm = prom(reg)
    direct = Histogram("direct", "", buckets=LATENCY_BUCKETS, registry=reg)
    for chunk in range(0, len(latencies), 37):
        data: dict = {}
        for s in latencies[chunk : chunk + 37]:
            metrics.merge(data, latency_counts("load", s))
            direct.observe(s)
        pm.observe(data, 0)
    for le in [*LATENCY_BUCKETS, float("inf")]:
        le_s = "+Inf" if le == float("inf") else str(le)
        got = sample(reg, "vllm:aiokv_load_seconds_bucket", le=le_s)
        assert got == reg.get_sample_value("direct_bucket", {"le": le_s}), le_s
    assert sample(reg, "vllm:aiokv_load_seconds_count") == len(latencies)
    assert sample(reg, "vllm:aiokv_load_seconds_sum") == pytest.approx(sum(latencies), rel=1e-6)


def test_docs_and_dashboard_name_only_real_series():
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    suffix = {
        metrics.COUNTER: ("_total",),
        metrics.GAUGE: ("",),
        metrics.LEVEL: ("",),
        metrics.HISTOGRAM: ("_bucket", "_sum", "_count", ""),
    }
    real = {f"vllm:aiokv_{r.series}{s}" for r in SERIES for s in suffix[r.kind]}
    with open(os.path.join(root, "docs", "operations.md")) as f:
        ops = f.read()
    with open(os.path.join(root, "docs", "grafana-aiokv.json")) as f:
        dash = f.read()
    for text in (ops, dash):
        named = set(re.findall(r"vllm:aiokv_[a-z_]+", text))
        assert named <= real, named - real
    documented = set(re.findall(r"`(vllm:aiokv_[a-z_]+)", ops))
    assert {
        f"vllm:aiokv_{r.series}{suffix[r.kind][0] if r.kind == metrics.COUNTER else ''}" for r in SERIES
    } <= documented


def test_a_level_adds_up_its_changes_across_ranks_and_steps():
    """memory_held_bytes: each worker reports changes (+ when it keeps blocks, - when it
    drops them); the gauge is their sum over ranks and steps, a return to 0 included."""
    reg = CollectorRegistry()
    pm = prom(reg)
    delta = StatsDelta(ranks=2)
    steps = [[+300, +200], [-100, 0], [0, -200], [-200, 0]]  # (rank 0, rank 1) changes per step
    level = 0
    for changes in steps:
        for c in changes:
            if c:
                delta.add_worker({"memory_held_bytes": c})
        pm.observe(AioKVStats(delta.take({})).data, 0)
        level += sum(changes)
        assert sample(reg, "vllm:aiokv_memory_bytes") == level
    assert level == 0


def test_what_the_connector_hands_out_are_rows_of_the_table(tmp_path):
    """counters() and the stats vLLM is handed name only counters of the table."""
    import types

    from aiokv.connector.adapters import Adapters
    from aiokv.connector.figures import SchedulerFigures
    from aiokv.connector.scheduler_role import SchedulerRole
    from aiokv.connector.worker_role import WorkerRole
    from aiokv.scheduler.side import SchedulerSide
    from aiokv.store import Store
    from tests.conftest import NS, PAYLOAD

    st = Store(str(tmp_path / "s"), capacity="1GiB")
    role = object.__new__(SchedulerRole)  # the real methods over a real store, without vLLM's configs
    role.sched = SchedulerSide(st, st.namespace(NS, PAYLOAD, fields={"model": "t"}), 16)
    role.figures, role.offer_hits, role.adapters = SchedulerFigures(1), True, Adapters(1.0)
    try:
        role.figures.add_worker({k: 1 for k in transfer.COUNTERS})
        assert set(role.figures.totals) <= set(table.ROWS)
        got = set(role.counters()) | set(role.get_kv_connector_stats().data)
        assert got and got <= set(table.ROWS), got - set(table.ROWS)
    finally:
        role.shutdown()
    worker = object.__new__(WorkerRole)
    worker.worker = types.SimpleNamespace(in_flight=0, staging_in_use=0, breaches=0)
    worker._layers = types.SimpleNamespace(counts={"staged_loads": 1, "copied_blocks": 2})
    assert set(worker.counters()) <= set(table.ROWS), set(worker.counters()) - set(table.ROWS)


def test_a_figure_that_cannot_be_recorded_never_reaches_vllm(caplog):
    """observe runs in vLLM's stat logger: a value Prometheus refuses (a string where a number
    belongs, in a gauge, a histogram and the per-tenant figures) is skipped and logged once per
    series; the figures beside it are recorded, and the next good value of that series too."""
    reg = CollectorRegistry()
    pm = prom(reg)
    bad = {
        "disk_bytes": "lots",
        bucket_key("load", 3): "3",
        "tenant_bytes": {"acme": "many"},
        "hit_tokens": 64,
    }
    with caplog.at_level("WARNING", logger="aiokv"):
        pm.observe(bad, 0)
        pm.observe(bad, 0)
    assert sample(reg, "vllm:aiokv_hit_tokens_total") == 128
    failed = [r.getMessage() for r in caplog.records if "could not be recorded" in r.getMessage()]
    assert len(failed) == 3 and all(any(k in m for m in failed) for k in ("disk_bytes", "load", "tenant_bytes")), failed
    pm.observe({"disk_bytes": 5, "tenant_bytes": {"acme": 7}}, 0)
    assert sample(reg, "vllm:aiokv_disk_bytes") == 5
    assert sample(reg, "vllm:aiokv_tenant_bytes", tenant="acme") == 7
