# SPDX-License-Identifier: Apache-2.0
"""Layer-by-layer loads (`layerwise: true`) on real vLLM (CPU).

Bug guarded against: loaded KV used by the forward before it is in place or
before it is verified; a copy landing in blocks vLLM has freed (an aborted
request) or racing the recompute of a block that failed; staging buffers or pins
leaked by the deferred copy.
Invariant: tokens identical to a run without aiokv, with full hits and with
hits on half the prompt (compute beside the copy), with corrupted blocks
(recomputed) and with requests aborted while their load runs or waits in
staging; every hit block counted loaded or failed, staged and copied blocks
agree, nothing leaks (tests/e2e.py: happened). A model with several
KV-cache groups falls back to whole-request loads and stays identical.
Fix: aiokv/worker/layerwise.py; docs/design.md, "Layer-by-layer loads".
"""

from __future__ import annotations

import json
import shutil

import pytest

from aiokv.data.faults import ACK
from tests.e2e import happened, part, prompts, run

pytestmark = pytest.mark.vllm

PS = prompts(4, 230, seed=71)
FULL = 229 // 32  # blocks a warm request loads
# the first 128 tokens (4 blocks) of each stored prompt, then something new
HALF = [p[:128] + q[128:] for p, q in zip(PS, prompts(4, 230, seed=72))]
LW = {"layerwise": True}


@pytest.fixture(scope="module")
def stored(tiny_model, tmp_path_factory):
    """A cache holding PS (saved with layerwise on), and the tokens without aiokv
    of HALF then PS."""
    d = tmp_path_factory.mktemp("layerwise")
    base = run(dict(model=tiny_model, phases=[dict(prompts=HALF), dict(prompts=PS)]))
    cold = run(dict(model=tiny_model, cache=str(d / "c"), extra=LW, phases=[dict(prompts=PS)]))
    happened(cold, part(base, [1]), saves_committed=f">={4 * FULL}")
    return str(d / "c"), base["tokens"], base


def _copy(stored, tmp_path) -> str:
    mine = str(tmp_path / "c")
    shutil.copytree(stored[0], mine)
    return mine


def test_full_and_half_hits_identical_and_copied_layer_by_layer(tiny_model, stored, tmp_path):
    # HALF first: 4 blocks each from disk, the rest computed beside the copies; then PS:
    # those 4 blocks from vLLM's own cache, the other FULL - 4 from disk
    res = run(
        dict(model=tiny_model, cache=_copy(stored, tmp_path), extra=LW, phases=[dict(prompts=HALF), dict(prompts=PS)])
    )
    hits = 4 * 4 + 4 * (FULL - 4)
    # the forward waited for each layer (2 layers)
    happened(
        res,
        stored[2],
        hit_blocks=hits,
        loads_ok_blocks=hits,
        layerwise_staged_blocks=hits,
        layerwise_copied_blocks=hits,
        layerwise_layer_waits=">=2",
    )
    assert res["cached"][0] == [128] * 4 and res["cached"][1] == [FULL * 32] * 4


def test_corrupted_blocks_are_recomputed(tiny_model, stored, tmp_path):
    mine = _copy(stored, tmp_path)
    env = {"AIOKV_FAULTS": json.dumps([{"op": "read", "kind": "flip", "every": 3}]), "AIOKV_FAULTS_ACK": ACK}
    res = run(dict(model=tiny_model, cache=mine, extra=LW, phases=[dict(prompts=PS)]), env=env)
    assert "FAULT INJECTION ACTIVE" in res["log"] and res["faults_fired"].get("read:flip", 0) > 0
    happened(
        res,
        part(stored[2], [1]),
        allow_load_errors=True,
        load_bad_blocks=">0",
        load_failed_blocks=">0",
        hit_blocks=4 * FULL,
    )
    c = res["counters"]
    assert c.get("loads_ok_blocks", 0) + c["load_failed_blocks"] == c["hit_blocks"] == 4 * FULL, c
    # only blocks before a request's first bad one are staged, and all of them are copied
    assert c["layerwise_staged_blocks"] == c["layerwise_copied_blocks"] == c["loads_ok_blocks"], c
    again = run(dict(model=tiny_model, cache=mine, extra=LW, phases=[dict(prompts=PS)]))
    happened(again, part(stored[2], [1]), hit_requests=">0")


@pytest.mark.parametrize("delay", [0.0, 0.3])
def test_aborted_requests_mid_load(tiny_model, stored, tmp_path, delay):
    """Requests 0-2 aborted 1, 2 and 3 steps after they were added: while their
    load runs (reads made late by `delay`), once it is reported, or once staged;
    request 3 runs to the end. Then every prompt again: nothing was spoiled."""
    mine = _copy(stored, tmp_path)
    env = {}
    if delay:
        env = {"AIOKV_FAULTS": json.dumps([{"op": "read", "kind": "late", "delay": delay}]), "AIOKV_FAULTS_ACK": ACK}
    res = run(
        dict(
            model=tiny_model,
            cache=mine,
            extra=LW,
            ready_file=str(tmp_path / "ready"),  # (the index loaded first: the aborts land while loads run)
            phases=[dict(prompts=PS, abort_after={0: 1, 1: 2, 2: 3}), dict(prompts=PS)],
        ),
        env=env,
    )
    # phase 2: every prompt again; a block written by an aborted request's late copy would show here
    assert res["finish"][0][:3] == ["aborted"] * 3
    c = res["counters"]
    assert (
        c["loads_ok_blocks"] + c.get("load_failed_blocks", 0) + c.get("load_cancelled_blocks", 0) == c["hit_blocks"]
    ), c
    if delay:  # request 0 is aborted one step in, while its late reads still run: cancelled
        assert c["loads_cancelled"] >= 1 and c["load_cancelled_blocks"] >= FULL, c
    assert c["layerwise_copied_blocks"] + c["layerwise_dropped_blocks"] == c["layerwise_staged_blocks"], c
    if delay:
        assert res["faults_fired"].get("read:late", 0) > 0
    happened(res, dict(tokens=[stored[1][1], stored[1][1]]), hit_requests=">0")


def test_several_groups_fall_back_to_whole_loads(tmp_path_factory, tmp_path):
    from aiokv.demo import tiny_model

    model = tiny_model.build_gemma2(str(tmp_path_factory.mktemp("gemma2") / "m"))
    ps = prompts(3, 200, seed=73)
    spec = dict(model=model, phases=[dict(prompts=ps)])
    base = run(spec)
    cache = str(tmp_path / "c")
    happened(run(dict(spec, cache=cache, extra=LW)), base, saves_committed=">0")
    warm = run(dict(spec, cache=cache, extra=LW))
    happened(warm, base, hit_blocks=">0")
    assert not any(k.startswith("layerwise_") for k in warm["counters"]), "no layerwise copies: several groups"
    assert "loads whole requests" in warm["log"]


def test_layerwise_setting_must_be_true_or_false():
    from aiokv.config import AioKVConfig, ConfigError

    assert AioKVConfig.from_extra({"path": "/tmp/x", "layerwise": True}).layerwise
    assert not AioKVConfig.from_extra({"path": "/tmp/x"}).layerwise
    with pytest.raises(ConfigError, match="aiokv: layerwise must be true or false"):
        AioKVConfig.from_extra({"path": "/tmp/x", "layerwise": "yes"})


def test_tensor_parallel_ranks_copy_their_own_shards(tiny_model, tmp_path):
    """TP 2 (each rank's worker in its own process, one core each): every rank stages and
    copies its shard; tokens identical, every block loaded on both ranks, nothing pinned."""
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    ps = prompts(4, 230, seed=81)
    spec = dict(model=tiny_model, tp=2, phases=[dict(prompts=ps, max_tokens=8)])
    base = run(spec, env=env)
    cache = str(tmp_path / "c")
    happened(run(dict(spec, cache=cache, extra=LW), env=env), base, saves_committed=">0")
    warm = run(dict(spec, cache=cache, extra=LW), env=env)
    happened(warm, base, hit_blocks=4 * FULL, loads_ok_blocks=2 * 4 * FULL)
    assert warm["cached"] == [[FULL * 32] * 4]
    # each rank staged and copied its own shard of every block, layer by layer
    for rank in warm["rank_counters"]:
        assert rank["layerwise_staged_blocks"] == rank["layerwise_copied_blocks"] == 4 * FULL, rank
