"""Weights that change in place are a new cache: no block of the old weights is served.

Bug: RL frameworks load new weights into a running engine
(`collective_rpc("reload_weights")`) and then reset the prefix cache with
`reset_prefix_cache(reset_connector=True)`. aiokv fingerprints the weight files
once at start and did not implement `reset_cache()`, so vLLM's reset reported
success while aiokv went on serving the blocks computed under the old weights:
the same prompts hit them and produced other tokens than an engine started on
the new weights.
Invariant: after `reset_cache()` no block stored before it is served (the memory
tier is dropped, every key is rooted in a fresh, never-reused epoch); requests
alive at the reset never save again; blocks computed under the in-memory weights
are never served after a restart that loads the files again, while the blocks of
the file weights stay hits.
Fix: AioKVConnector.reset_cache (connector.py), SchedulerSide.new_epoch
(scheduler.py), the workers' memory tier dropped at the next step (StepPlan.reset).
"""
from __future__ import annotations

import pytest

from tests.e2e import assert_clean, prompts, run

pytestmark = pytest.mark.vllm


def test_reload_weights_then_reset_serves_no_old_block(tmp_path, tiny_model):
    from aiokv.demo.tiny_model import build

    other = build(str(tmp_path / "other"), layers=2, hidden=128, heads=2, kv_heads=2, intermediate=256, seed=1)
    cache = str(tmp_path / "cache")
    p = prompts(3, 200, seed=5)   # stored under the file weights, then asked again under the others
    q = prompts(2, 150, seed=6)   # only ever computed under the in-memory (other) weights
    reset = {"reset_connector": True}
    life = run({"model": tiny_model, "cache": cache, "phases": [
        {"prompts": p},
        {"prompts": p, "settle": True, "reload_weights": other, "reset_prefix_cache": reset},
        {"prompts": q, "settle": True}]})
    fresh_other = run({"model": other, "cache": None, "phases": [{"prompts": p}, {"prompts": q}]})
    files = run({"model": tiny_model, "cache": None, "phases": [{"prompts": p}, {"prompts": q}]})

    assert life["reset"] == [True]
    assert life["tokens"][0] == files["tokens"][0]
    assert fresh_other["tokens"][0] != files["tokens"][0], "the other weights must change the tokens"
    # after the reset: the tokens of an engine started on the new weights, nothing from the old blocks
    assert life["cached"][1] == [0, 0, 0], life["cached"]
    assert life["tokens"][1] == fresh_other["tokens"][0]
    assert life["tokens"][2] == fresh_other["tokens"][1]
    assert life["counters"]["hit_blocks"] == 0, life["counters"]
    assert life["counters"]["saves_committed"] > 0
    assert_clean(life)

    # a restart loads the files again: their blocks are hits, the in-memory weights' never
    again = run({"model": tiny_model, "cache": cache, "phases": [{"prompts": p}, {"prompts": q}]})
    assert again["cached"][0] == [192, 192, 192], again["cached"]
    assert again["cached"][1] == [0, 0], again["cached"]
    assert again["tokens"] == files["tokens"]
    assert again["counters"]["hit_blocks"] == 18, again["counters"]
    assert_clean(again)
