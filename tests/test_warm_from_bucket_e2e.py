# SPDX-License-Identifier: Apache-2.0
"""A node warmed from the fleet's bucket (`aiokv warm`), end to end on real vLLM (CPU) and a
real S3 server (SeaweedFS).

Bug guarded against: a new node's first requests load every block from the bucket (a GET each,
on the request's path) or recompute them; or a warmed node's disk holds blocks its engines do
not announce, so routers send it nothing.
Invariants: after `aiokv warm` copied what a first engine uploaded, an engine on the warmed
directory hits every block of its first requests on its local disk, with zero bucket reads
(no probe, no bucket hit, no load from it), tokens identical to vLLM without aiokv; its KV-event
start announcement names each warmed block with the hash, parent and tokens vLLM computes for
it (the labels the first engine published beside its blocks).
Fix: aiokv/cli/warm.py (the copy), aiokv/bucket/publisher.py (namespace descriptions and labels
published by engines), aiokv/bucket/catalog.py (read back by the warm).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.e2e import ROOT, events_socket, happened, prompts, run, vllm_hashes

pytestmark = pytest.mark.vllm
BS = 32
LEN = 300
FULL = (LEN - 1) // BS
PS = prompts(4, LEN, seed=71)
TAIL = prompts(1, 20, seed=72)  # less than a block: its steps publish what came before
SECRET = "fleet-secret-0123456789"


def test_a_warmed_node_hits_locally_at_once_and_announces_the_warmed_blocks(tiny_model, tmp_path, s3server):
    env = s3server.env()
    bucket = {"bucket": s3server.url("warm"), "secret": SECRET}
    spec = dict(
        model=tiny_model,
        block_size=BS,
        phases=[dict(prompts=PS, max_tokens=8), dict(prompts=TAIL, max_tokens=4, settle=True)],
    )
    base = run(spec)
    # a node of the fleet computes the prompts: uploads the blocks, the namespace, their labels
    a = run({**spec, "cache": str(tmp_path / "a"), "extra": bucket, "kv_events": events_socket()}, env=env)
    happened(a, base, uploaded=">0", saves_committed=4 * FULL)

    # a new node is warmed from the bucket before it serves
    w = subprocess.run(
        [sys.executable, "-m", "aiokv", "warm", str(tmp_path / "c"), "--bucket", bucket["bucket"], "--format", "json"],
        env=dict(os.environ, **env, AIOKV_SECRET=SECRET, PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert w.returncode == 0, w.stderr
    doc = json.loads(w.stdout)
    assert doc["warmed_blocks"] == 4 * FULL and doc["bad_objects"] == 0, doc
    assert [n["labelled"] for n in doc["namespaces"]] == [4 * FULL], doc
    assert doc["namespaces"][0]["model"] == tiny_model

    # its engine: every block of its first requests from the local disk, none from the bucket
    c = run({**spec, "cache": str(tmp_path / "c"), "extra": bucket, "kv_events": events_socket()}, env=env)
    happened(
        c,
        base,
        hit_blocks=4 * FULL,
        loads_ok_blocks=4 * FULL,
        bucket_hit_blocks=0,
        bucket_loaded_blocks=0,
        bucket_probes=0,
        saves_committed=0,
    )
    assert c["cached"][0] == [FULL * BS] * 4
    # its start announcement names the warmed blocks as vLLM hashes them
    want = vllm_hashes(PS, BS)
    stored = {e[3][0]: e for e in c["events"] if e[0] == "stored" and e[1] == "STORAGE"}
    assert set(stored) == set(want), (len(stored), len(want))
    for h, e in stored.items():
        assert (e[5], e[4]) == (list(want[h][0]), want[h][1])
