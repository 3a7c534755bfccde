# SPDX-License-Identifier: Apache-2.0
"""End to end: preemption, aborts at several points (one while preempted), many
concurrent requests, repeated generate calls in one engine.

Invariant: no crash; tokens of every request that was not aborted equal a run
without aiokv; every block goes back to vLLM; no staging buffer, pin, pending
save or in-flight job is left; no save is ever read from a block that changed
owner (a later warm run with the same prompts hits and still matches).
"""

from __future__ import annotations

import pytest

from tests.e2e import happened, part, prompts, run

pytestmark = pytest.mark.vllm


def test_preemption_under_tiny_kv_cache(tiny_model, tmp_path):
    """Requests preempted mid-block and resumed, many times (replies long against a tiny KV
    cache), then the next turn of each conversation, which hits the blocks that hold its reply.
    Every step's saves are checked against vLLM's own scheduler output (tests/vllm_run.py
    audit_saves): from the current life's table, from the block its life starts at, none of its
    blocks left unsaved; with every third write failing too, so that a resumed life must save
    again what its first life could not.
    The bugs (issue 37 item 11): a resumed request's saves taken from its first life's table
    (other tokens' KV under its keys), and its first life's save offset kept (blocks whose first
    save failed never saved again); with 230-token prompts and 40-token replies this test passed
    with either (two preemptions, each resumed into the blocks it had before), and only the
    first showed, in a 170 s test. Engine-free: test_resumed_request_saves_only_its_new_life.py."""
    import json

    from aiokv.data.faults import ACK

    ps = [prompts(1, n, seed=21 + i)[0] for i, n in enumerate([100, 110, 90, 105, 95, 115])]
    turn = [p[1:] for p in prompts(6, 18, seed=22)]  # the next turns: each conversation goes on
    phases = [dict(prompts=ps, max_tokens=120), dict(prompts=turn, follow=True, max_tokens=24)]
    spec = dict(model=tiny_model, num_gpu_blocks=26, max_num_seqs=6, max_model_len=512, phases=phases)
    base = run(spec)
    cold = run({**spec, "cache": str(tmp_path / "c"), "audit_saves": True})
    happened(cold, base, preemptions=">=4", saves_committed=">0")  # the KV cache is small enough to preempt
    assert not cold["save_violations"], cold["save_violations"][:4]
    warm = run({**spec, "cache": str(tmp_path / "c"), "audit_saves": True})
    happened(warm, base, hit_blocks=">0", preemptions=">0")
    assert not warm["save_violations"], warm["save_violations"][:4]
    # every third write fails (the breaker off, so saves go on): what a resumed life computes again
    # and is not stored is saved again
    sick = {"AIOKV_FAULTS": json.dumps([{"op": "write", "kind": "eio", "every": 3}]), "AIOKV_FAULTS_ACK": ACK}
    failing = run({**spec, "cache": str(tmp_path / "f"), "audit_saves": True, "extra": {"breaker_failures": 0}}, sick)
    happened(failing, base, allow_save_errors=True, save_failures=">0", preemptions=">=4", saves_committed=">0")
    assert not failing["save_violations"], failing["save_violations"][:4]
    # an abort that lands while its request is preempted (its blocks already back with vLLM)
    ab = run({**spec, "cache": str(tmp_path / "c"), "phases": [dict(phases[0], abort_preempted=1)]})
    assert ab["aborted_while"] == {"PREEMPTED": 1}, ab["aborted_while"]
    happened(ab, part(base, [0]), hit_blocks=">0", preemptions=">0")


def test_aborts_queued_loading_mid_save(tiny_model, tmp_path):
    cache = str(tmp_path / "c")
    ps = prompts(6, 260, seed=31)
    base = run(dict(model=tiny_model, phases=[dict(prompts=ps)]))
    cold = run(dict(model=tiny_model, cache=cache, phases=[dict(prompts=ps[:3])]))
    happened(cold, dict(base, tokens=[base["tokens"][0][:3]]), saves_committed=">=3", hit_blocks=0)
    # warm: 0,1,2 hit (loads); 3,4,5 are new (saves). Abort: 0 before its first step
    # (queued), 1 after one step (its load in flight), 3 after its prefill step (mid-save).
    warm = run(dict(model=tiny_model, cache=cache, phases=[dict(prompts=ps, abort_after={0: 0, 1: 1, 3: 1})]))
    assert warm["finish"][0][0] == "aborted" and warm["finish"][0][1] == "aborted"
    assert warm["finish"][0][3] == "aborted"
    happened(warm, base, hit_requests=">=1")
    again = run(dict(model=tiny_model, cache=cache, phases=[dict(prompts=ps)]))
    happened(again, base, hit_requests=">=3")


def test_many_concurrent_and_repeated_generate(tiny_model, tmp_path):
    system = prompts(1, 70, seed=41)[0][1:]
    ps = prompts(16, 180, seed=42, prefix=system)
    phases = [dict(prompts=ps[:8]), dict(prompts=ps[8:], stagger=True), dict(prompts=ps[:8])]
    base = run(dict(model=tiny_model, phases=phases))
    res = run(dict(model=tiny_model, cache=str(tmp_path / "c"), phases=phases))
    happened(res, base, saves_committed=">16")
    warm = run(dict(model=tiny_model, cache=str(tmp_path / "c"), phases=phases))
    happened(warm, base, hit_blocks=">=16")


def test_aborts_at_every_point(tiny_model, tmp_path):
    """Queued, waiting for a load, mid-load (reads made slow), mid-save and in the
    step it finishes (while preempted: test_preemption_under_tiny_kv_cache)."""
    import json

    from aiokv.data.faults import ACK

    cache = str(tmp_path / "c")
    ps = prompts(12, 230, seed=33)
    spec = dict(model=tiny_model, num_gpu_blocks=30, max_num_seqs=6, max_model_len=512)
    base = run(dict(spec, phases=[dict(prompts=ps, max_tokens=6)]))
    cold = run(dict(spec, cache=cache, phases=[dict(prompts=ps[:6], max_tokens=6)]))
    happened(cold, dict(base, tokens=[base["tokens"][0][:6]]), saves_committed=">=6")
    slow = {"AIOKV_FAULTS": json.dumps([{"op": "read", "kind": "late", "delay": 0.3}]), "AIOKV_FAULTS_ACK": ACK}
    # 0-5 hit (slow loads), 6-11 are new. max_tokens=6: a request finishes about 6 steps after its prefill.
    # abort_loading: the first request seen waiting for its load is aborted then (the step counts
    # alone hoped a 0.3 s read was still in flight at steps 1 and 3 after a request came)
    aborts = {0: 0, 1: 1, 2: 3, 3: 6, 4: 7, 6: 1, 7: 5, 8: 6, 9: 7, 10: 12, 11: 20}
    phase = dict(prompts=ps, max_tokens=6, abort_after=aborts, abort_loading=1, stagger=True)
    res = run(dict(spec, cache=cache, phases=[phase]), env=slow)
    assert res["finish"][0].count("aborted") >= 3
    w = res["aborted_while"]
    assert w.get("WAITING_FOR_REMOTE_KVS", 0) >= 1 and w.get("RUNNING", 0) >= 1, w  # mid-load and mid-save
    # some abort lands while its load is in flight; the slow reads were injected
    happened(res, base, allow_load_errors=True, loads_cancelled=">=1", hit_requests=">=1")
    assert res["faults_fired"].get("read:late", 0) > 0
    again = run(dict(spec, cache=cache, phases=[dict(prompts=ps, max_tokens=6)]))
    happened(again, base, hit_requests=">=6")
