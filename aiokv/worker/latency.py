# SPDX-License-Identifier: Apache-2.0
"""Latency histograms carried as plain counters (no vLLM, no Prometheus here).

A worker counts each load or save into one bucket of LATENCY_BUCKETS with two
counters, `<kind>_seconds_b<i>` (observations) and `<kind>_seconds_b<i>_ns`
(their sum in nanoseconds). Counters add up across steps and TP ranks, so the
histogram travels in WorkerReport.counters; aiokv/connector/metrics.py turns it back into
a Prometheus histogram with exact bucket counts and sum.

Threading contract: pure functions of their arguments, called from any thread.
"""

from __future__ import annotations

import bisect

# upper bounds in seconds (Prometheus `le`); the bucket after the last is +Inf
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def bucket_key(kind: str, i: int) -> str:
    return f"{kind}_seconds_b{i}"


def latency_counts(kind: str, seconds: float) -> dict[str, int]:
    """The two counter increments for one observation of `kind` ("load", "save")."""
    k = bucket_key(kind, bisect.bisect_left(LATENCY_BUCKETS, seconds))
    return {k: 1, k + "_ns": max(0, int(seconds * 1e9))}
