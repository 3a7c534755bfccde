# SPDX-License-Identifier: Apache-2.0
"""End to end on real vLLM (CPU): engines with separate local directories share
a bucket (a real S3 server, SeaweedFS, started here).

Bug guarded against: a bucket tier that does not hit across engines (names
differ), hits but serves wrong KV, or a dead server that stalls or fails
requests.
Invariants: an engine with an empty local directory hits every block a first
engine computed (loaded from the bucket), token-identical to vLLM without
aiokv, and writes them through to its own directory (a restart hits locally);
with the server killed -9 mid-run every request still completes with the same
tokens, and the drops are counted; once the server is back, uploads and hits
work again. A tampered object or one written under another secret is a miss
(recomputed, same tokens).
Fix: aiokv/bucket/ wired in by SchedulerSide.match/on_alloc (probe, reserve),
TransferWorker._save (upload) and _load_from_bucket (GET, verify, write through).
"""

from __future__ import annotations

import re

import obstore
import pytest

from tests.e2e import happened, part, prompts, run

pytestmark = pytest.mark.vllm
BS = 32
LEN = 300
FULL = (LEN - 1) // BS


def _objects(srv, prefix: str) -> list[str]:
    """The block objects under prefix (not the namespace descriptions and labels beside them)."""
    return [
        m["path"]
        for batch in obstore.list(srv._store(), prefix=prefix)
        for m in batch
        if re.search(r"/r[0-9]+/[0-9a-f]+$", m["path"])
    ]


def test_second_engine_hits_what_the_first_uploaded(tiny_model, tmp_path, s3server):
    env = s3server.env()
    ps = prompts(4, LEN, seed=7)
    spec = dict(model=tiny_model, block_size=BS, phases=[dict(prompts=ps, max_tokens=8)])
    bucket = {"bucket": s3server.url("e2e"), "secret": "fleet-secret-0123456789"}  # a fleet's setup
    base = run(spec)
    a = run({**spec, "cache": str(tmp_path / "a"), "extra": bucket, "settle_at_end": True}, env=env)
    # every full block (prompt and output) of every request uploaded before the counters were read
    # (read before the uploads were done, the figure was 0 on a loaded machine: issue 41)
    happened(a, base, uploaded=f">={4 * FULL}")
    assert len(_objects(s3server, "e2e/")) >= 4 * FULL

    b = run({**spec, "cache": str(tmp_path / "b"), "extra": bucket}, env=env)
    happened(
        b, base, bucket_hit_blocks=4 * FULL, bucket_loaded_blocks=4 * FULL, bucket_missed_blocks=0, bucket_bad_blocks=0
    )
    assert b["cached"][0] == [FULL * BS] * 4

    # written through: B's own directory serves them now, with no server at all
    b2 = run({**spec, "cache": str(tmp_path / "b")}, env=env)
    happened(b2, base, hit_blocks=4 * FULL, loads_ok_blocks=4 * FULL, bucket_hit_blocks=0)


def test_tampered_or_foreign_objects_are_misses(tiny_model, tmp_path, s3server):
    env = s3server.env()
    ps = prompts(2, LEN, seed=11)
    spec = dict(model=tiny_model, block_size=BS, phases=[dict(prompts=ps, max_tokens=8)])
    base = run(spec)
    secret = {"bucket": s3server.url("tamper"), "secret": "fleet-secret-0123456789"}
    a = run({**spec, "cache": str(tmp_path / "a"), "extra": secret, "settle_at_end": True}, env=env)
    happened(a, base, uploaded=f">={2 * FULL}")  # (every upload done before the figure is read)
    names = sorted(_objects(s3server, "tamper/"))
    assert len(names) >= 2 * FULL
    raw = bytearray(s3server.get_raw(names[0]))
    raw[4096 + 10] ^= 0xFF
    s3server.put_raw(names[0], bytes(raw))  # one block spoiled (a prefix of some request breaks there)

    # another secret: every object is foreign, nothing loads, everything recomputes
    other = run(
        {**spec, "cache": str(tmp_path / "o"), "extra": {**secret, "secret": "another-secret-987654321"}}, env=env
    )
    # (the objects were found, fetched and refused: not merely absent)
    happened(
        other,
        base,
        allow_load_errors=True,
        bucket_probes=">0",
        bucket_hit_blocks=">0",
        bucket_loaded_blocks=0,
        bucket_bad_blocks=">0",
        bucket_missed_blocks=0,
    )
    # the right secret: all but the spoiled block's request's blocks load; that one recomputes
    b = run({**spec, "cache": str(tmp_path / "b"), "extra": secret}, env=env)
    happened(b, base, allow_load_errors=True, bucket_bad_blocks=1, bucket_missed_blocks=0, bucket_loaded_blocks=">=1")


def test_killed_server_mid_run_then_back(tiny_model, tmp_path, s3server):
    env = s3server.env()
    # generous time limits: exact counts below must not hang on how fast a loaded machine answers
    # (a server killed -9 refuses or resets at once: no limit is what ends those requests)
    bucket = {"bucket": s3server.url("kill"), "bucket_unsigned": True, "probe_timeout": 30.0}
    ps1, ps2, ps3 = prompts(3, LEN, seed=21), prompts(3, LEN, seed=22), prompts(1, 100, seed=23)
    spec = dict(
        model=tiny_model,
        block_size=BS,
        phases=[dict(prompts=ps1, max_tokens=8), dict(prompts=ps2, max_tokens=8), dict(prompts=ps3, max_tokens=16)],
    )
    base = run(spec)
    # mid-upload: the server dies as the second phase starts, once the first phase's uploads
    # are done (settle); the second phase's blocks cannot be uploaded (the third phase starts once
    # those uploads have failed and been reported: settle; a life ended before that, on a loaded
    # machine, counted no failure)
    killed = {
        **spec,
        "phases": [
            spec["phases"][0],
            {**spec["phases"][1], "settle": True, "kill_at_step": [0, s3server.proc.pid]},
            {**spec["phases"][2], "settle": True},
        ],
    }
    a = run({**killed, "cache": str(tmp_path / "a"), "extra": bucket}, env=env)
    s3server.proc.wait()
    s3server.proc = None
    happened(a, base, uploaded=3 * FULL)
    c = a["counters"]
    dropped = sum(v for k, v in c.items() if k.startswith("upload_dropped") or k == "upload_failed")
    assert dropped >= 1, c

    # mid-load: a fresh engine loads phase 1's blocks from the bucket; the server dies at the first
    # step that starts with one of those loads in flight
    s3server.log.close()
    s3server.start()
    loadkill = {**spec, "phases": [{**spec["phases"][0], "stagger": True, "kill_when_loading": s3server.proc.pid}]}
    b = run({**loadkill, "cache": str(tmp_path / "b"), "extra": bucket}, env=env)
    s3server.proc.wait()
    s3server.proc = None
    assert "killed_at_step" in b, "no load from the bucket was ever in flight"
    happened(b, part(base, [0]), allow_load_errors=True, bucket_hit_blocks=">0")
    c = b["counters"]  # every block promised from the bucket loaded, or failed and was recomputed
    assert c.get("bucket_loaded_blocks", 0) + c.get("bucket_missed_blocks", 0) <= c["bucket_hit_blocks"], c

    # back: the same server, its data kept; what the dead server missed is not there
    s3server.log.close()
    s3server.start()
    assert len(_objects(s3server, "kill/")) == 3 * FULL  # phase 1 only
    # uploads and hits resume
    c2 = run({**spec, "cache": str(tmp_path / "c"), "extra": bucket, "settle_at_end": True}, env=env)
    happened(c2, base, bucket_hit_blocks=3 * FULL)  # its uploads: the hits of d below
    d = run({**spec, "cache": str(tmp_path / "d"), "extra": bucket}, env=env)
    happened(d, base, bucket_hit_blocks=6 * FULL + 100 // BS)
