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
"""
from __future__ import annotations

import json
import os

import pytest

from aiokv.demo.tiny_model import build_mla
from tests.e2e import prompts, run

pytestmark = pytest.mark.vllm
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def test_mla_latent_is_stored_once_and_loaded_by_every_rank(tmp_path):
    model = build_mla(str(tmp_path / "mla"))
    cache = str(tmp_path / "c")
    ps = prompts(3, 200, seed=2)
    spec = dict(model=model, dtype="bfloat16", max_num_seqs=1, tp=2, phases=[dict(prompts=ps, max_tokens=10)])
    hot = run(dict(spec, phases=[dict(prompts=ps, max_tokens=10)] * 2), env=TP_ENV)  # vLLM's own prefix hit
    assert hot["cached"][1] == [192] * 3
    cold = run(dict(spec, cache=cache), env=TP_ENV)
    assert cold["tokens"][0] == hot["tokens"][0]
    c = cold["counters"]
    assert c["saves_committed"] == 3 * 6 and c["saves_ok_blocks"] == c["saves_committed"], c  # rank 0 only
    (ns,) = os.listdir(os.path.join(cache, "ns"))
    d = os.path.join(cache, "ns", ns)
    assert sorted(f for f in os.listdir(d) if f.endswith(".data")) == ["rank0.data"]
    meta = json.load(open(os.path.join(d, "namespace.json")))
    assert meta["ranks"] == 1 and meta["fields"]["groups"][0]["replicated"] is True
    warm = run(dict(spec, cache=cache), env=TP_ENV)
    assert warm["tokens"][0] == hot["tokens"][1]
    w = warm["counters"]
    assert w["hit_blocks"] == 18 and w["loads_ok_blocks"] == 2 * 18 and w.get("load_failed_blocks", 0) == 0, w
    assert w["pending_saves"] == 0 and w["pinned"] == 0
    assert warm["free_blocks"] == warm["total_blocks"] - 1 and warm["requests_left"] == 0
