# SPDX-License-Identifier: Apache-2.0
"""The bucket tier's objects are write-once copies of self-verifying slots.

Bug guarded against: a block loaded from a bucket is trusted because its name
matched: a truncated upload, a tampered object, one written by another model
(namespace), rank or key, would then put wrong KV into a request.
Invariant: uploads are write-once (a second PUT of the same block is "already
there", a success); a GET fills a staging buffer that passes exactly the check a
local read passes (BlockIO.verify), or the block is a miss (MISSING / BAD);
the prober answers "not yet" (None) while it asks the server, then from its
caches, and never counts a truncated object as present.
Fix: aiokv/bucket/ (uploader, loader, prober) on a real S3 server (SeaweedFS).
"""

from __future__ import annotations

import ctypes
import time

from aiokv.bucket.client import BucketClient
from aiokv.bucket.loader import BAD, MISSING, OK, BucketLoader
from aiokv.bucket.naming import object_name
from aiokv.bucket.prober import Prober
from aiokv.bucket.uploader import Uploader
from aiokv.config import parse_bucket_url as parse_url
from aiokv.data import format as fmt
from tests.conftest import NS, PAYLOAD, key
from tools.storeio import StoreIO

NS2 = bytes(range(1, 17))
SB = fmt.slot_bytes(PAYLOAD)


def test_bucket_urls_are_checked():
    assert parse_url("s3://my-bucket/a/b/") == ("my-bucket", "a/b")
    assert parse_url("s3://my-bucket") == ("my-bucket", "")
    for bad in ("my-bucket/x", "s3://B/x", "s3://ab/x", None):
        try:
            parse_url(bad)
        except ValueError as e:
            assert "s3://BUCKET/PREFIX" in str(e) or "bucket name" in str(e)
        else:
            raise AssertionError(bad)
    assert object_name("p", NS, 3, key(1)) == f"p/{NS.hex()}/r3/{key(1).hex()}"


async def _stamped(tmp_path, blocks, n):
    st = StoreIO(tmp_path / "s", capacity="1GiB")
    ns = st.namespace(NS, PAYLOAD, fields={"model": "t"})
    io = st.blockio(ns)
    for i in range(n):
        blocks.fill(i, key(i))
        io.stamp(key(i), blocks.addr(i))
    return st, io


async def test_upload_once_then_load_verified(tmp_path, blocks, s3env):
    st, io = await _stamped(tmp_path, blocks, 8)
    client = BucketClient(s3env.url("verify"), timeout=5)
    up = Uploader(client, 64 << 20)
    name = lambda k, ns=NS, rank=0: object_name(client.prefix, ns, rank, k)  # noqa: E731
    for i in range(8):
        assert up.offer(name(key(i)), ctypes.string_at(blocks.addr(i), SB))
    assert await up.flush(30) == 0
    assert up.counters["uploaded"] == 8 and up.counters["upload_bytes"] == 8 * SB, up.counters
    # write-once: the same block again is "already there", and the object is unchanged
    first = s3env.get_raw(name(key(0)))
    blocks.fill(8, key(0))
    io.stamp(key(0), blocks.addr(8))  # a later stamp (new sequence number): other bytes
    assert up.offer(name(key(0)), ctypes.string_at(blocks.addr(8), SB))
    assert await up.flush(30) == 0
    assert up.counters["upload_already_there"] == 1 and up.counters["uploaded"] == 8
    assert s3env.get_raw(name(key(0))) == first

    loader = BucketLoader(client, NS, 0, SB)
    for i in range(8):
        blocks.clear(20 + i)
        assert await loader.fetch(key(i), blocks.addr(20 + i), io.verify) == OK
        assert blocks.holds(20 + i, key(i))
    assert await loader.fetch(key(99), blocks.addr(30), io.verify) == MISSING

    good = s3env.get_raw(name(key(1)))
    tampered = bytearray(good)
    tampered[fmt.HEADER_BYTES + 100] ^= 1
    cases = {
        "tampered payload": (name(key(2)), bytes(tampered)),  # another key's name too
        "truncated": (name(key(3)), good[:-4096]),
        "key swapped": (name(key(4)), good),
    }
    for _what, (obj, data) in cases.items():
        s3env.put_raw(obj, data)
    for k in (2, 3, 4):
        assert await loader.fetch(key(k), blocks.addr(30), io.verify) == BAD, k
    # well-formed slots (every checksum right) of another model's namespace, another rank, another layout
    h = fmt.unpack_header(good)
    for k, (nsid, rank, layout) in zip((5, 6, 7), ((NS2, 0, 0), (NS, 1, 0), (NS, 0, 12345))):
        hdr = fmt.pack_header(nsid, rank, key(k), PAYLOAD, h["payload_crc"], h["seq"], layout)
        s3env.put_raw(name(key(k)), hdr.ljust(fmt.HEADER_BYTES, b"\0") + good[fmt.HEADER_BYTES :])
        assert await loader.fetch(key(k), blocks.addr(30), io.verify) == BAD, k
    # the same bytes under this namespace's header do load: the checks above are what refused them
    hdr = fmt.pack_header(NS, 0, key(8), PAYLOAD, h["payload_crc"], h["seq"], 0)
    s3env.put_raw(name(key(8)), hdr.ljust(fmt.HEADER_BYTES, b"\0") + good[fmt.HEADER_BYTES :])
    assert await loader.fetch(key(8), blocks.addr(30), io.verify) == OK
    st.close()


async def test_prober_answers_not_yet_then_from_its_caches(tmp_path, blocks, s3env):
    st, io = await _stamped(tmp_path, blocks, 6)
    client = BucketClient(s3env.url("probe"), timeout=5)
    up = Uploader(client, 64 << 20)
    names = [object_name(client.prefix, NS, 0, key(i)) for i in range(6)]
    for i in range(4):
        up.offer(names[i], ctypes.string_at(blocks.addr(i), SB))
    s3env.put_raw(names[4], ctypes.string_at(blocks.addr(4), SB)[:-1])  # truncated: absent
    await up.flush(30)
    prober = Prober(client, timeout=10)
    try:
        want = [[(n, SB)] for n in names]
        # asks the server; "not yet" unless the probe answers within the lookup's 2 ms wait
        n = prober.lookup("r1", want)
        end = time.monotonic() + 10
        while n is None and time.monotonic() < end:
            time.sleep(0.01)
            n = prober.lookup("r1", want)
        assert n == 4 and prober.counters["probes"] == 1
        probes = prober.counters["probes"]
        assert prober.lookup("r2", want) == 4  # from the caches: no new probe
        assert prober.lookup("r3", want[:2]) == 2
        assert prober.counters["probes"] == probes
        # a block a load found bad is absent from then on
        prober.mark_absent([names[1]])
        assert prober.lookup("r4", want) == 1
    finally:
        prober.close()
        st.close()
