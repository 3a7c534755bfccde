# SPDX-License-Identifier: Apache-2.0
"""A KV cache whose block count equals another dimension of its KV tensors, on real vLLM (CPU).

The bug: the worker guessed each KV tensor's block dimension as the one whose size is the
block count. The CPU backend's tensors are [blocks, KV heads, block size, 2 x head size]; with
the tiny model (head size 64) a cache of 128 blocks made two dimensions 128 long, and aiokv
turned itself off ("cannot tell the block dimension") though nothing was wrong with the layout.
Invariant: any block count vLLM accepts is served: tokens identical to a run without aiokv,
blocks saved cold and hit warm.
Fix: the worker-role connector asks vLLM how it lays out each layer's KV tensor for two probe
block counts (vllm.v1.kv_cache_interface.compute_layer_kv_cache_shape_bytes, which both model
runners allocate by) and hands the worker the dimension that moved (worker_role.block_dims);
the guess by size is left only for what vLLM does not describe.
"""

from __future__ import annotations

import pytest

from tests.e2e import happened, prompts, run

pytestmark = pytest.mark.vllm


def test_a_block_count_equal_to_the_head_dimension_is_served(tiny_model, tmp_path):
    cache = str(tmp_path / "c")
    # 128 blocks: the CPU backend's last dimension is 2 x 64 (the tiny model's head size)
    spec = dict(model=tiny_model, num_gpu_blocks=128, phases=[dict(prompts=prompts(3, 230, seed=91), max_tokens=8)])
    base = run(spec)
    cold = run(dict(spec, cache=cache))
    happened(cold, base, saves_committed=3 * (229 // 32), hit_blocks=0)
    warm = run(dict(spec, cache=cache))
    happened(warm, base, hit_blocks=3 * (229 // 32), loads_ok_blocks=3 * (229 // 32))
