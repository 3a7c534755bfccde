# SPDX-License-Identifier: Apache-2.0
"""The scheduler side's view of the bucket tier: how many blocks past the
local hit the bucket holds, for every group and rank.

A block counts only when the objects of every KV-cache group's namespace and
every rank that stores it are there (a TP rank whose upload was dropped makes
the block a miss for all). Only models whose groups are all full attention
use the bucket for loads (sliding-window and recurrent-state groups need
other blocks per hit; they still upload).

It also holds the engine's Publisher (publisher.py): the namespaces' descriptions and
the blocks' labels written beside the blocks, for nodes warmed from the bucket.

Threading contract: vLLM's scheduler thread (the Prober runs its probes, and the
Publisher its uploads, on the prober's loop thread).
"""

from __future__ import annotations

from aiokv.bucket import meta
from aiokv.bucket.client import BucketClient, bucket_breaker
from aiokv.bucket.naming import object_name
from aiokv.bucket.prober import Prober
from aiokv.bucket.publisher import Publisher


class BucketLookup:
    def __init__(
        self,
        url: str,
        timeout: float,
        probe_timeout: float,
        groups: list[tuple[bytes, int, int]],
        secret: str | None = None,
    ):
        """groups: (namespace id, ranks that store it, slot bytes) per KV-cache group; secret:
        the fleet's (the MAC of what the publisher writes beside the blocks)."""
        self.client = BucketClient(url, timeout, bucket_breaker())
        self.prober = Prober(self.client, probe_timeout)
        # namespace descriptions and block labels, for nodes warmed from the bucket (publisher.py)
        self.publisher = Publisher(self.client, self.prober.lt, meta.meta_key(secret))
        self.groups = groups
        self.prefix = self.client.prefix

    def _objects(self, key: bytes) -> list[tuple[str, int]]:
        return [(object_name(self.prefix, nsid, r, key), sb) for nsid, ranks, sb in self.groups for r in range(ranks)]

    def extend(self, req_id: str, keys: list[bytes], start: int, usable: int) -> int | None:
        """Blocks start..start+n-1 are in the bucket: n; None: not known yet (ask again next step)."""
        if start >= usable:
            return 0
        return self.prober.lookup(req_id, [self._objects(k) for k in keys[start:usable]])

    def missing(self, gi: int, key: bytes) -> None:
        """A load of this block from the bucket failed to verify or was gone: do not offer it for a while."""
        nsid, ranks, _ = self.groups[gi]
        self.prober.mark_absent(object_name(self.prefix, nsid, r, key) for r in range(ranks))

    def forget(self, req_id: str) -> None:
        self.prober.forget(req_id)

    @property
    def counters(self) -> dict[str, int]:
        return {f"bucket_{k}": v for k, v in (self.prober.counters + self.publisher.counters).items()} | {
            "bucket_breaker_opened": self.client.breaker.opens
        }

    def close(self) -> None:
        self.publisher.close(self.client.timeout)
        self.prober.close()
