"""End to end: preemption, aborts at several points, many concurrent requests,
repeated generate calls in one engine.

Invariant: no crash; tokens of every request that was not aborted equal a run
without aiokv; every block goes back to vLLM; no staging slot, pin, pending
save or in-flight job is left; no save is ever read from a block that changed
owner (a later warm run with the same prompts hits and still matches).
"""
from __future__ import annotations

import pytest

from tests.e2e import assert_clean, prompts, run

pytestmark = pytest.mark.vllm


def test_preemption_under_tiny_kv_cache(tiny_model, tmp_path):
    ps = prompts(6, 230, seed=21)
    spec = dict(model=tiny_model, num_gpu_blocks=26, max_num_seqs=6, max_model_len=512,
                phases=[dict(prompts=ps, max_tokens=40)])
    base = run(spec)
    cold = run({**spec, "cache": str(tmp_path / "c")})
    assert cold["preemptions"] > 0, "the KV cache must be small enough to preempt"
    assert cold["tokens"] == base["tokens"]
    assert_clean(cold)
    warm = run({**spec, "cache": str(tmp_path / "c")})
    assert warm["tokens"] == base["tokens"]
    assert warm["counters"]["hit_blocks"] > 0
    assert_clean(warm)


def test_aborts_queued_loading_mid_save(tiny_model, tmp_path):
    cache = str(tmp_path / "c")
    ps = prompts(6, 260, seed=31)
    cold = run(dict(model=tiny_model, cache=cache, phases=[dict(prompts=ps[:3])]))
    assert_clean(cold)
    # warm: 0,1,2 hit (loads); 3,4,5 are new (saves). Abort: 0 before its first step
    # (queued), 1 after one step (its load in flight), 3 after its prefill step (mid-save).
    base = run(dict(model=tiny_model, phases=[dict(prompts=ps)]))
    warm = run(dict(model=tiny_model, cache=cache,
                    phases=[dict(prompts=ps, abort_after={0: 0, 1: 1, 3: 1})]))
    assert warm["finish"][0][0] == "aborted" and warm["finish"][0][1] == "aborted"
    assert warm["finish"][0][3] == "aborted"
    for i in (2, 4, 5):
        assert warm["tokens"][0][i] == base["tokens"][0][i]
    assert_clean(warm)
    again = run(dict(model=tiny_model, cache=cache, phases=[dict(prompts=ps)]))
    assert again["tokens"] == base["tokens"]
    assert_clean(again)


def test_many_concurrent_and_repeated_generate(tiny_model, tmp_path):
    system = prompts(1, 70, seed=41)[0][1:]
    ps = prompts(16, 180, seed=42, prefix=system)
    phases = [dict(prompts=ps[:8]), dict(prompts=ps[8:], stagger=True), dict(prompts=ps[:8])]
    base = run(dict(model=tiny_model, phases=phases))
    res = run(dict(model=tiny_model, cache=str(tmp_path / "c"), phases=phases))
    assert res["tokens"] == base["tokens"]
    assert res["counters"]["saves_committed"] > 16
    assert_clean(res)
    warm = run(dict(model=tiny_model, cache=str(tmp_path / "c"), phases=phases))
    assert warm["tokens"] == base["tokens"]
    assert warm["counters"]["hit_blocks"] >= 16
    assert_clean(warm)


def test_aborts_at_every_point(tiny_model, tmp_path):
    """Queued, waiting for a load, mid-load (reads made slow), mid-save, in the
    step it finishes, and while preempted under a tiny KV cache."""
    import json

    from aiokv.io.faults import ACK

    cache = str(tmp_path / "c")
    ps = prompts(12, 230, seed=33)
    spec = dict(model=tiny_model, num_gpu_blocks=30, max_num_seqs=6, max_model_len=512)
    cold = run(dict(spec, cache=cache, phases=[dict(prompts=ps[:6], max_tokens=6)]))
    assert_clean(cold)
    slow = {"AIOKV_FAULTS": json.dumps([{"op": "read", "kind": "late", "delay": 0.3}]), "AIOKV_FAULTS_ACK": ACK}
    # 0-5 hit (slow loads), 6-11 are new. max_tokens=6: a request finishes about 6 steps after its prefill.
    aborts = {0: 0, 1: 1, 2: 3, 3: 6, 4: 7, 6: 1, 7: 5, 8: 6, 9: 7, 10: 12, 11: 20}
    base = run(dict(spec, phases=[dict(prompts=ps, max_tokens=6)]))
    res = run(dict(spec, cache=cache, phases=[dict(prompts=ps, max_tokens=6, abort_after=aborts, stagger=True)]),
              env=slow)
    for i, fin in enumerate(res["finish"][0]):
        if fin != "aborted":
            assert res["tokens"][0][i] == base["tokens"][0][i], i
    assert res["finish"][0].count("aborted") >= 3
    c = res["counters"]
    assert c["loads_cancelled"] >= 1, "some abort must land while its load is in flight"
    assert_clean(res, allow_load_errors=True)
    again = run(dict(spec, cache=cache, phases=[dict(prompts=ps, max_tokens=6)]))
    assert again["tokens"] == base["tokens"]
    assert_clean(again)
