# SPDX-License-Identifier: Apache-2.0
"""End to end: partial prefix hits and block-boundary prompts.

Invariant: a request hits exactly the stored blocks whose whole prefix it
shares (a shared system prompt hits only its full blocks, never the block its
own suffix starts in), at least one token is always left to compute, and
tokens equal those of a run without aiokv.
"""

from __future__ import annotations

import pytest

from tests.e2e import happened, part, prompts, run

pytestmark = pytest.mark.vllm

BS = 32


def test_shared_system_prompt_and_boundaries(tiny_model, tmp_path):
    system = prompts(1, 101, seed=7)[0][1:]  # 100 tokens: 3 full blocks and 4 more
    cold_ps = prompts(2, 250, seed=1, prefix=system)
    cold_ps += [prompts(1, 64, seed=2)[0], prompts(1, 65, seed=3)[0], prompts(1, 20, seed=4)[0]]
    warm_ps = prompts(3, 240, seed=11, prefix=system)  # same system prompt, other suffixes
    warm_ps += cold_ps[2:]  # exactly 2 blocks, 2 blocks + 1 token, shorter than a block
    cache = str(tmp_path / "c")
    cold = run(dict(model=tiny_model, cache=cache, phases=[dict(prompts=cold_ps)]))
    base = run(dict(model=tiny_model, phases=[dict(prompts=cold_ps), dict(prompts=warm_ps)]))
    happened(cold, part(base, [0]), saves_committed=">=10", hit_blocks=0)
    warm = run(dict(model=tiny_model, cache=cache, phases=[dict(prompts=warm_ps, stagger=True)]))
    # The staggered warm run: the first system-prompt request loads 3 blocks; the
    # next ones find them in vLLM's own prefix cache (local hits) or load them.
    cached = warm["cached"][0]
    assert cached[:3] == [3 * BS] * 3, cached
    assert cached[3] == 1 * BS, "64 tokens: the second block holds the last token, recomputed"
    assert cached[4] == 2 * BS, "65 tokens: both full blocks hit"
    assert cached[5] == 0, "shorter than a block: nothing to hit"
    happened(warm, part(base, [1]), hit_blocks=">=6")
    assert warm["counters"]["hit_blocks"] <= 3 * 3 + 1 + 2
