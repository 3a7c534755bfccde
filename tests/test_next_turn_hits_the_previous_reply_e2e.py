# SPDX-License-Identifier: Apache-2.0
"""Multi-turn chats: after a restart, turn 2 hits the whole previous conversation (prompt and
reply) up to its last full block, on every family (real vLLM, CPU).

Bug: that replies were saved rested on the scheduler side reading vLLM's live token list,
stated and tested nowhere; on the recurrent (hybrid) model a hit also needs a state at
its end, and vLLM keeps those only at prompt ends unless told otherwise, so every reply was
lost to the next turn there, silently.
Invariant: with `save_generated` (the default) turn 2's prompt (turn 1's prompt, its reply,
new text) hits floor((prompt + reply - 1) / block) blocks after a restart on the dense,
Gemma 2-style (window + full), Mistral-style (every layer windowed) and hybrid models (the
hybrid with vLLM's --prefix-cache-retention-interval None; with the default 0 it hits the
previous prompt's last block boundary only, and aiokv says so at start); with
`save_generated: false` only the prompt's blocks are saved; tokens are as without aiokv.
Fix: Req.tokens' contract and save_generated (aiokv/scheduler/state.py, plan.track); the
start warning in aiokv/connector/connector.py; docs/operations.md, "Conversations".
"""

from __future__ import annotations

import pytest

from aiokv.demo import tiny_model as tm
from tests.e2e import happened, prompts, run

pytestmark = pytest.mark.vllm

# family: (dtype, block size (None: vLLM's), turn-1 prompt, reply, extra engine settings)
FAMILIES = {
    "dense": ("float32", 32, 150, 90, {}),
    "gemma2": ("float32", 32, 150, 90, {}),
    "mistral": ("float32", 32, 150, 90, {}),
    # vLLM picks 128-token blocks for the tiny Qwen3-Next: the prompt ends in block 2, the reply in block 3
    "hybrid": ("bfloat16", None, 300, 150, {"retention": "none"}),
}


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("turns")
    return {
        "gemma2": tm.build_gemma2(str(root / "g")),
        "mistral": tm.build_mistral(str(root / "m")),
        "hybrid": tm.build_hybrid(str(root / "h")),
    }


def _turns(model, family, cache, extra=None, engine=None):
    """Turn 1 in one life, turn 2 (its prompt + reply + 20 new tokens) in the next; returns
    (turn-2 life, expected hit tokens), each life checked against a run without aiokv."""
    dtype, bs, plen, reply, eng = FAMILIES[family]
    eng = dict(eng, **(engine or {}))
    spec = dict(model=model, dtype=dtype, block_size=bs, **eng)
    p1 = prompts(2, plen, seed=81)
    one = dict(spec, phases=[dict(prompts=p1, max_tokens=reply)])
    base1 = run(one)
    first = run(dict(one, cache=cache, extra=extra or {}))
    happened(first, base1, saves_committed=">0", hit_blocks=0)
    p2 = [p + r + n for p, r, n in zip(p1, first["tokens"][0], prompts(2, 21, seed=82))]
    two = dict(spec, phases=[dict(prompts=p2, max_tokens=4)])
    second = run(dict(two, cache=cache, extra=extra or {}))
    block = bs or 128
    return second, run(two), block, (plen + reply - 1) // block * block, (plen - 1) // block * block


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_turn_two_hits_the_previous_reply_after_a_restart(tiny_model, family_models, tmp_path, family):
    model = tiny_model if family == "dense" else family_models[family]
    second, base, block, whole, prompt_only = _turns(model, family, str(tmp_path / "c"))
    happened(second, base, hit_requests=2)
    assert whole > prompt_only, "the test must reach past the prompt"
    assert second["cached"][0] == [whole, whole], (family, second["cached"], whole)


def test_without_save_generated_only_the_prompt_is_a_hit(tiny_model, tmp_path):
    second, base, _, whole, prompt_only = _turns(
        tiny_model, "dense", str(tmp_path / "c"), extra={"save_generated": False}
    )
    happened(second, base, hit_requests=2)
    assert second["cached"][0] == [150 // 32 * 32] * 2, second["cached"]


def test_hybrid_states_at_prompt_ends_only_by_default(family_models, tmp_path):
    second, base, _, whole, prompt_only = _turns(
        family_models["hybrid"], "hybrid", str(tmp_path / "c"), engine={"retention": 0}
    )
    happened(second, base, hit_requests=2)
    assert second["cached"][0] == [prompt_only] * 2, second["cached"]
    assert "prefix-cache-retention-interval" in second["log"], "no start line says why replies miss"
