# SPDX-License-Identifier: Apache-2.0
"""kv_role and vLLM's MultiConnector, end to end on real vLLM (CPU).

Bug: aiokv ignored kv_role, so a prefill/decode deployment could not say which
engines write the cache and which only read it; next to another connector under
MultiConnector its behaviour was never tested (a double load, or one
connector's failure breaking the other, would change tokens or kill requests).
Invariant: kv_producer saves and offers no hits, even with the prompt on disk;
kv_consumer offers hits and saves nothing; under MultiConnector the first
connector that has a hit loads the request and the other loads nothing, and
aiokv's failing loads are recomputed without touching the other connector;
tokens always equal a run without any connector.
Fix: the connector reads kv_role (aiokv/connector/connector.py and scheduler_role.py: offer_hits, and
SchedulerSide.saves for kv_consumer); docs/operations.md, "Prefill and decode".
"""

from __future__ import annotations

import os

import pytest

from tests.e2e import happened, prompts, run, stored_blocks

pytestmark = pytest.mark.vllm
FAULTS_ACK = "inject I/O faults"
PS = prompts(3, 300, seed=41)  # 300 tokens: 9 full blocks of 32 each, all 9 a possible hit
NEW = prompts(3, 300, seed=42)
BLOCKS = 3 * (299 // 32)


def test_producer_only_saves_and_consumer_only_loads(tiny_model, tmp_path):
    cache, other = str(tmp_path / "c"), str(tmp_path / "empty")
    spec = dict(model=tiny_model, phases=[dict(prompts=PS, max_tokens=8), dict(prompts=NEW, max_tokens=8)])
    base = run(spec)
    # a prefill-side writer: it saves every full block of both phases
    happened(run(dict(spec, cache=cache, kv_role="kv_producer")), base, saves_committed=2 * BLOCKS, hit_blocks=0)
    # restarted, with every block on disk, it still offers none
    again = run(dict(spec, cache=cache, kv_role="kv_producer"))
    happened(again, base, hit_blocks=0, loads_ok_blocks=0)
    assert again["cached"] == [[0] * 3, [0] * 3], again["cached"]
    # a reader: it hits what the producer stored...
    warm = run(dict(spec, cache=cache, kv_role="kv_consumer"))
    happened(warm, base, hit_blocks=2 * BLOCKS, loads_ok_blocks=2 * BLOCKS, saves_committed=0)
    assert warm["cached"] == [[288] * 3, [288] * 3], warm["cached"]
    # ...and on a cache that holds nothing it computes everything and writes nothing
    happened(
        run(dict(spec, cache=other, kv_role="kv_consumer")), base, hit_blocks=0, saves_committed=0, saves_planned=0
    )
    assert stored_blocks(other) == 0 and stored_blocks(cache) == 2 * BLOCKS


def test_next_to_another_connector_one_loads_and_failures_stay_apart(tiny_model, tmp_path):
    cache, example = str(tmp_path / "c"), str(tmp_path / "example")
    os.makedirs(example)
    other = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": example},
    }
    spec = dict(model=tiny_model, phases=[dict(prompts=PS, max_tokens=8)])
    base = run(spec)
    both = dict(spec, cache=cache, with_connector=other)
    # cold: both connectors save
    happened(run(both), base, saves_committed=BLOCKS, hit_blocks=0)
    assert os.listdir(example), "the other connector saved nothing"
    # aiokv listed first: it loads every request, the other connector none
    first = run(both)
    happened(first, base, hit_blocks=BLOCKS, loads_ok_blocks=BLOCKS)
    assert first["cached"] == [[288] * 3], first["cached"]
    # the other connector listed first: it loads them, and aiokv loads nothing (no double load)
    second = run(dict(both, aiokv_first=False))
    happened(second, base, hit_blocks=0, loads_ok_blocks=0, load_blocks=0)
    assert second["cached"] == [[288] * 3], second["cached"]
    # aiokv's reads fail: aiokv had the hit, vLLM recomputes it; the other connector is untouched
    faults = {"AIOKV_FAULTS": '[{"op": "read", "kind": "eio"}]', "AIOKV_FAULTS_ACK": FAULTS_ACK}
    bad = run(both, env=faults)
    happened(bad, base, allow_load_errors=True, hit_blocks=BLOCKS, load_failed_blocks=">0", loads_ok_blocks=0)
    happened(run(dict(both, aiokv_first=False)), base, hit_blocks=0, load_blocks=0)
