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
it (the labels the first engine published beside its blocks); each block stays its tenant's
(the cache_salt its request had), and `--tenant` warms only that tenant's blocks.
Fix: aiokv/ops/warm.py (the copy), aiokv/bucket/publisher.py (namespace descriptions and labels
published by engines), aiokv/bucket/catalog.py (read back by the warm).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import pytest

from aiokv.data import format as fmt
from aiokv.store import Store
from tests.e2e import ROOT, events_socket, happened, prompts, run, vllm_hashes

pytestmark = pytest.mark.vllm
BS = 32
LEN = 300
FULL = (LEN - 1) // BS
PS = prompts(4, LEN, seed=71)
PA = prompts(2, LEN, seed=73)  # a tenant's: requested with cache_salt "alice"
TAIL = prompts(1, 20, seed=72)  # less than a block: its steps publish what came before
SECRET = "fleet-secret-0123456789"


def test_a_warmed_node_hits_locally_at_once_and_announces_the_warmed_blocks(tiny_model, tmp_path, s3server):
    env = s3server.env()
    bucket = {"bucket": s3server.url("warm"), "secret": SECRET}
    spec = dict(
        model=tiny_model,
        block_size=BS,
        phases=[
            dict(prompts=PS, max_tokens=8),
            dict(prompts=PA, max_tokens=8, salts=["alice"] * 2),
            dict(prompts=TAIL, max_tokens=4, settle=True),
        ],
    )
    base = run(spec)
    # a node of the fleet computes the prompts: uploads the blocks, the namespace, their labels
    a = run({**spec, "cache": str(tmp_path / "a"), "extra": bucket, "kv_events": events_socket()}, env=env)
    happened(a, base, uploaded=">0", saves_committed=6 * FULL)

    # a new node is warmed from the bucket before it serves
    def warm(path, *more):
        w = subprocess.run(
            [sys.executable, "-m", "aiokv", "warm", str(path), "--bucket", bucket["bucket"], "--format", "json", *more],
            env=dict(os.environ, **env, AIOKV_SECRET=SECRET, PYTHONPATH=ROOT),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert w.returncode == 0, w.stderr
        return json.loads(w.stdout)

    doc = warm(tmp_path / "c")
    assert doc["warmed_blocks"] == 6 * FULL and doc["bad_objects"] == 0, doc
    assert [n["labelled"] for n in doc["namespaces"]] == [6 * FULL], doc
    assert doc["namespaces"][0]["model"] == tiny_model
    # each block is its tenant's here as on the node that computed it (quotas, clears, pins)
    st = Store(str(tmp_path / "c"), readonly=True, secret=SECRET)
    (ns,) = st.index.namespaces.values()
    (t,) = ns.tables.values()
    tags = collections.Counter(st.tenant_tag(int(t.tenant[t.find(k)])) for k in ns.keys())
    st.close()
    tk = fmt.tenant_key(SECRET)
    assert tags == {fmt.tenant_tag("", tk): 4 * FULL, fmt.tenant_tag("alice", tk): 2 * FULL}, tags
    # --tenant: one tenant's blocks only
    doc = warm(tmp_path / "d", "--tenant", "alice")
    assert doc["warmed_blocks"] == 2 * FULL and doc["namespaces"][0]["other_tenant"] == 4 * FULL, doc

    # its engine: every block of its first requests from the local disk, none from the bucket; its
    # start announcement all published before it stops (announce: its labels are read on the I/O
    # thread, behind whatever a busy disk holds there)
    last = dict(spec["phases"][-1], announce=True)
    warmed = {**spec, "phases": spec["phases"][:-1] + [last]}
    c = run({**warmed, "cache": str(tmp_path / "c"), "extra": bucket, "kv_events": events_socket()}, env=env)
    happened(
        c,
        base,
        hit_blocks=6 * FULL,
        loads_ok_blocks=6 * FULL,
        bucket_hit_blocks=0,
        bucket_loaded_blocks=0,
        bucket_probes=0,
        saves_committed=0,
    )
    assert c["cached"][:2] == [[FULL * BS] * 4, [FULL * BS] * 2]
    # its start announcement names the warmed blocks as vLLM hashes them
    want = {**vllm_hashes(PS, BS), **vllm_hashes(PA, BS, salt="alice")}
    stored = {e[3][0]: e for e in c["events"] if e[0] == "stored" and e[1] == "STORAGE"}
    assert set(stored) == set(want), (len(stored), len(want))
    for h, e in stored.items():
        assert (e[5], e[4]) == (list(want[h][0]), want[h][1])
