# SPDX-License-Identifier: Apache-2.0
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
Fix: AioKVConnector.reset_cache (connector/scheduler_role.py), SchedulerSide.new_epoch
(scheduler.py), the workers' memory tier dropped at the next step (StepPlan.reset).
"""

from __future__ import annotations

import pytest

from tests.e2e import happened, prompts, run

pytestmark = pytest.mark.vllm


def test_reload_weights_then_reset_serves_no_old_block(tmp_path, tiny_model):
    from aiokv.demo.tiny_model import build

    other = build(str(tmp_path / "other"), layers=2, hidden=128, heads=2, kv_heads=2, intermediate=256, seed=1)
    cache = str(tmp_path / "cache")
    p = prompts(3, 200, seed=5)  # stored under the file weights, then asked again under the others
    q = prompts(2, 150, seed=6)  # only ever computed under the in-memory (other) weights
    reset = {"reset_connector": True}
    life = run(
        {
            "model": tiny_model,
            "cache": cache,
            "phases": [
                {"prompts": p},
                {"prompts": p, "settle": True, "reload_weights": other, "reset_prefix_cache": reset},
                {"prompts": q, "settle": True},
            ],
        }
    )
    fresh_other = run({"model": other, "cache": None, "phases": [{"prompts": p}, {"prompts": q}]})
    files = run({"model": tiny_model, "cache": None, "phases": [{"prompts": p}, {"prompts": q}]})

    assert life["reset"] == [True]
    assert fresh_other["tokens"][0] != files["tokens"][0], "the other weights must change the tokens"
    # before the reset: the files' tokens; after it: those of an engine started on the new weights,
    # nothing from the old blocks
    assert life["cached"][1] == [0, 0, 0], life["cached"]
    happened(
        life,
        {"tokens": [files["tokens"][0], fresh_other["tokens"][0], fresh_other["tokens"][1]]},
        hit_blocks=0,
        saves_committed=">0",
    )

    # a restart loads the files again: their blocks are hits, the in-memory weights' never
    again = run({"model": tiny_model, "cache": cache, "phases": [{"prompts": p}, {"prompts": q}]})
    assert again["cached"][0] == [192, 192, 192], again["cached"]
    assert again["cached"][1] == [0, 0], again["cached"]
    happened(again, files, hit_blocks=18)


def test_requests_alive_at_a_reset_never_load_or_save_into_the_new_epoch(tmp_path):
    """Scheduler side, at the reset: a load in flight is cancelled (the worker reports
    its blocks failed: recomputed) and the workers are told to drop their memory
    tier; a request alive at the reset is not saved again, nor offered a hit, even
    under a new root; a request that arrives after it is saved."""
    from aiokv.scheduler.keys import extend_keys, request_root
    from aiokv.scheduler.layout import FULL, GroupSpec
    from aiokv.scheduler.side import Scheduled, SchedulerSide
    from aiokv.store import Store

    bs, nsid = 32, bytes(16)
    store = Store(str(tmp_path / "c"), capacity="1GiB")
    side = SchedulerSide(store, [(GroupSpec(0, FULL, 4096, ("l0",)), store.namespace(nsid, 4096))], bs)
    old, new = request_root(nsid, []), request_root(nsid, [["epoch", "e1"]])
    tokens = list(range(6 * bs + 1))
    ns = side.groups[0].ns
    store.commit(ns, [(k, store.reserve(ns, k)) for k in extend_keys([], old, tokens, bs, 6)])
    assert side.match("loading", tokens, old, 0) == 6 * bs
    side.on_alloc("loading", tokens, old, ([1, 2, 3, 4, 5, 6, 7],), 6 * bs)
    side.on_alloc("running", tokens, old, ([8, 9, 10, 11, 12, 13, 14],), 0)
    assert len(side.plan([]).loads) == 1
    side.new_epoch()
    plan = side.plan([Scheduled("running", 0, len(tokens), ([8, 9, 10, 11, 12, 13, 14],), True)])
    assert plan.cancel == ["loading"] and plan.reset and not plan.saves
    assert not side.plan([]).reset  # told once
    assert side.match("running", tokens, new, 0) == 0  # no hit for it, whatever the root
    side.on_alloc("running", tokens, new, ([8, 9, 10, 11, 12, 13, 14],), 0)
    assert not side.plan([Scheduled("running", 0, len(tokens), ([8, 9, 10, 11, 12, 13, 14],), True)]).saves
    side.on_alloc("fresh", tokens, new, ([15, 16, 17, 18, 19, 20, 21],), 0)
    plan = side.plan([Scheduled("fresh", 0, len(tokens), ([15, 16, 17, 18, 19, 20, 21],), True)])
    assert [t.req_id for t in plan.saves] == ["fresh"] and plan.saves[0].keys == extend_keys([], new, tokens, bs, 6)
    side.on_report(None, {"loading"})
    assert not store.index.pins
    store.close()
