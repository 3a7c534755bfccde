# SPDX-License-Identifier: Apache-2.0
"""End to end on real vLLM (CPU): a cache that survives a restart.

Bug class: a "persistent" cache whose keys change at every start never hits
after a restart; one that hits but serves the wrong blocks
changes the output.
Invariant: across a process restart on the same directory, tokens equal those
of a run without aiokv, external hits > 0, no load errors or save failures,
nothing leaked.
"""

from __future__ import annotations

import pytest

from tests.e2e import happened, prompts, run

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("block_size,dtype", [(32, "float32"), (64, "float32"), (32, "bfloat16"), (64, "bfloat16")])
def test_restart_hits_and_tokens_identical(tiny_model, tmp_path, block_size, dtype):
    ps = prompts(4, 300, seed=block_size)
    spec = dict(model=tiny_model, block_size=block_size, dtype=dtype, phases=[dict(prompts=ps, max_tokens=12)])
    base = run(spec)
    cold = run({**spec, "cache": str(tmp_path / "c")})
    warm = run({**spec, "cache": str(tmp_path / "c")})
    full = 299 // block_size  # blocks a hit may cover: one token is always left to compute
    happened(cold, base, saves_committed=f">={4 * full}", hit_blocks=0)
    happened(warm, base, hit_blocks=4 * full, loads_ok_blocks=4 * full)
    assert warm["cached"][0] == [full * block_size] * 4
