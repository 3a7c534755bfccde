# SPDX-License-Identifier: Apache-2.0
"""A foreign or corrupt object under a block's bucket name does not block its upload for good.

Bug: uploads are write-once PUTs (If-None-Match: *), and "already there" was
taken as success whatever was there. A truncated upload, a tampered object, an
object of another key or layout under this block's name made the block a
bucket-tier miss forever: every engine's PUT found the name taken.
Invariant: after an upload, the object under the block's name verifies as that
block (BlockIO.verify, as a load from the bucket checks it): a valid object already
there is left alone (counted upload_already_there), any other is replaced
(upload_replaced_bad); two engines uploading the same block onto a bad object
at once leave a valid one.
Fix: Uploader._holds_valid (GET and verify on "already there", then a plain PUT).
"""

from __future__ import annotations

import asyncio
import ctypes
import os

from aiokv.bucket.client import BucketClient
from aiokv.bucket.loader import OK, BucketLoader
from aiokv.bucket.naming import object_name
from aiokv.bucket.uploader import Uploader
from aiokv.data import format as fmt
from tests.conftest import NS, PAYLOAD, key
from tools.storeio import StoreIO

SB = fmt.slot_bytes(PAYLOAD)


async def test_bad_objects_are_replaced_valid_ones_kept(tmp_path, blocks, s3env):
    st = StoreIO(tmp_path / "s", capacity="1GiB")
    ns = st.namespace(NS, PAYLOAD, fields={"model": "t"})
    io = st.blockio(ns)
    for i in range(6):
        blocks.fill(i, key(i))
        io.stamp(key(i), blocks.addr(i))
    image = {i: ctypes.string_at(blocks.addr(i), SB) for i in range(6)}
    client = BucketClient(s3env.url("replace"), timeout=5)
    name = lambda i: object_name(client.prefix, NS, 0, key(i))  # noqa: E731
    tampered = bytearray(image[0])
    tampered[fmt.HEADER_BYTES + 100] ^= 1
    bad = {0: bytes(tampered), 1: image[1][:-4096], 2: image[3], 3: os.urandom(SB)}  # flipped, cut, other key, noise
    for i, data in bad.items():
        s3env.put_raw(name(i), data)
    s3env.put_raw(name(4), image[4])  # a valid copy another engine uploaded

    up = Uploader(client, 64 << 20, verify=io.verify)
    for i in range(5):
        assert up.offer(name(i), image[i])
    assert await up.flush(30) == 0
    assert up.counters["upload_replaced_bad"] == 4 and up.counters["upload_already_there"] == 1, up.counters
    loader = BucketLoader(client, NS, 0, SB)
    for i in range(5):
        blocks.clear(20 + i)
        assert await loader.fetch(key(i), blocks.addr(20 + i), io.verify) == OK, i
        assert blocks.holds(20 + i, key(i))
    assert s3env.get_raw(name(4)) == image[4]  # the valid one was left alone

    # two engines upload the same block onto a bad object at once: a valid block stays
    s3env.put_raw(name(5), os.urandom(SB))
    blocks.fill(30, key(5))
    io.stamp(key(5), blocks.addr(30))  # the other engine's copy: same key, its own header
    ups = [Uploader(client, 64 << 20, verify=io.verify) for _ in range(2)]
    assert ups[0].offer(name(5), image[5]) and ups[1].offer(name(5), ctypes.string_at(blocks.addr(30), SB))
    assert await asyncio.gather(*(u.flush(30) for u in ups)) == [0, 0]
    assert sum(u.counters["upload_replaced_bad"] + u.counters["upload_already_there"] for u in ups) == 2
    assert s3env.get_raw(name(5)) in (image[5], ctypes.string_at(blocks.addr(30), SB))
    assert await loader.fetch(key(5), blocks.addr(31), io.verify) == OK
    st.close()
