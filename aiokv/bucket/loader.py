# SPDX-License-Identifier: Apache-2.0
"""Loads from the bucket: GET a block's object into a staging buffer and verify it exactly
as a local read is verified (BlockIO.verify: magic, version, namespace, rank,
key, layout, length, CRC32C, and the MAC when a secret is set).

A missing object, one of the wrong size (truncated), one that does not verify
(tampered, another namespace or rank, another layout) or one the server did not
deliver in time is a miss: the caller recomputes the block. Nothing raises.

Threading contract: coroutines on the worker's event loop (TransferWorker).
"""

from __future__ import annotations

import ctypes

import numpy

from aiokv.bucket.client import BucketClient, BucketError
from aiokv.bucket.naming import object_name

OK, MISSING, BAD, UNAVAILABLE = "ok", "missing", "bad", "unavailable"


class BucketLoader:
    def __init__(self, client: BucketClient, nsid: bytes, rank: int, slot_bytes: int):
        self.client = client
        self.nsid = nsid
        self.rank = rank
        self.slot_bytes = slot_bytes

    def name(self, key: bytes) -> str:
        return object_name(self.client.prefix, self.nsid, self.rank, key)

    async def fetch(self, key: bytes, addr: int, verify) -> str:
        """Fill the staging buffer at addr with the block of `key`; OK, MISSING, BAD or UNAVAILABLE."""
        try:
            data = await self.client.get(self.name(key))
        except BucketError:
            return UNAVAILABLE
        if data is None:
            return MISSING
        src = numpy.frombuffer(data, numpy.uint8)  # no copy, read-only buffers too
        if src.nbytes != self.slot_bytes:
            return BAD  # truncated or padded: not a slot of this namespace
        ctypes.memmove(addr, src.ctypes.data, self.slot_bytes)
        return OK if verify(key, addr) else BAD
