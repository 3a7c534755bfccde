# SPDX-License-Identifier: Apache-2.0
"""End to end: nothing that changes the KV bytes may share keys.

Invariant: on the same cache directory, a change of block size, dtype or model
weights at the same path gives zero hits, no error and the baseline's tokens; a
different cache_salt never hits another salt's blocks; a different
PYTHONHASHSEED still hits (keys do not depend on Python's hash seed).
"""

from __future__ import annotations

import pytest

from aiokv.demo.tiny_model import build
from tests.e2e import happened, prompts, run

pytestmark = pytest.mark.vllm


def test_layout_and_weights_changes_never_hit(tmp_path):
    model = build(str(tmp_path / "m"), layers=2, hidden=128, heads=2, kv_heads=2, intermediate=256, seed=1)
    cache = str(tmp_path / "c")
    ps = prompts(3, 200, seed=5)
    phase = [dict(prompts=ps)]
    first = run(dict(model=model, phases=phase))
    cold = run(dict(model=model, cache=cache, phases=phase), env={"PYTHONHASHSEED": "1"})
    happened(cold, first, saves_committed=">0")
    # a different hash seed still hits
    warm = run(dict(model=model, cache=cache, phases=phase), env={"PYTHONHASHSEED": "2"})
    happened(warm, first, hit_blocks=3 * (199 // 32))
    for change in (dict(block_size=64), dict(dtype="bfloat16")):
        base = run(dict(model=model, phases=phase, **change))
        other = run(dict(model=model, cache=cache, phases=phase, **change))
        happened(other, base, hit_blocks=0, saves_committed=">0")
    # new weights at the same path
    build(model, layers=2, hidden=128, heads=2, kv_heads=2, intermediate=256, seed=2)
    base = run(dict(model=model, phases=phase))
    other = run(dict(model=model, cache=cache, phases=phase))
    assert base["tokens"] != cold["tokens"], "the new weights must change the output for this test to mean anything"
    happened(other, base, hit_blocks=0, saves_committed=">0")


def test_cache_salt_isolates(tiny_model, tmp_path):
    cache = str(tmp_path / "c")
    ps = prompts(2, 160, seed=9)
    base = run(dict(model=tiny_model, phases=[dict(prompts=ps)] * 3))
    cold = run(dict(model=tiny_model, cache=cache, phases=[dict(prompts=ps, salts=["alice"] * 2)]))
    happened(cold, dict(base, tokens=base["tokens"][:1]), saves_committed=">=8")
    warm = run(
        dict(
            model=tiny_model,
            cache=cache,
            phases=[
                dict(prompts=ps, salts=["bob"] * 2),  # another tenant: no hits
                dict(prompts=ps, salts=[None] * 2),  # no salt: no hits either
                dict(prompts=ps, salts=["alice"] * 2),  # the same tenant: hits
            ],
        )
    )
    assert warm["cached"][0] == [0, 0] and warm["cached"][1] == [0, 0]
    assert warm["cached"][2] == [4 * 32] * 2
    happened(warm, base, hit_blocks=2 * 4)
