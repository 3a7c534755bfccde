# SPDX-License-Identifier: Apache-2.0
"""What a bucket holds, read by listing it (for `aiokv warm`, aiokv/ops/warmplan.py):

- its namespaces: the folders `PREFIX/<nsid hex>/`, each described by its namespace.json
  (meta.py) when an engine published one;
- a namespace's blocks: the keys whose object is there on every rank with the size of a
  whole slot (naming.py), newest first (by the latest of their objects' times);
- the labels of some of those blocks (meta.py), from every labels object of the namespace.

Nothing here trusts a block: the names and sizes only say what to fetch; each block is
verified when it is fetched. A listing that fails raises BucketError.

Threading contract: coroutines on one asyncio loop.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import re

from aiokv.bucket import meta
from aiokv.bucket.client import BucketClient
from aiokv.data import format as fmt

_NSID = re.compile(r"^[0-9a-f]{32}$")
_KEY = re.compile(rf"^(?:[0-9a-f]{{2}}){{{fmt.MIN_KEY},{fmt.MAX_KEY}}}$")


@dataclasses.dataclass
class BucketNamespace:
    nsid: bytes
    payload_bytes: int | None = None  # None: not described (why says so)
    ranks: int | None = None
    fields: dict = dataclasses.field(default_factory=dict)
    why: str | None = None  # why it has no usable description


def _under(client: BucketClient, *parts: str) -> str:
    return "/".join(p for p in (client.prefix, *parts) if p) + "/"


async def namespaces(client: BucketClient, key: bytes | None) -> list[BucketNamespace]:
    """Every namespace folder of the bucket's prefix, with its description where it has a usable one."""
    out = []
    for name in sorted(await client.folders(_under(client))):
        if not _NSID.match(name):
            continue  # not ours (the prefix may hold other things)
        ns = BucketNamespace(bytes.fromhex(name))
        raw = await client.get(meta.namespace_name(client.prefix, ns.nsid))
        if raw is None:
            ns.why = "no namespace.json (its engines predate aiokv warm)"
        else:
            try:
                ns.payload_bytes, ns.ranks, ns.fields = meta.read_namespace_doc(raw, ns.nsid, key)
            except meta.Foreign as e:
                ns.why = f"its namespace.json is not ours: {e}"
        out.append(ns)
    return out


async def blocks(client: BucketClient, nsid: bytes, ranks: int, slot_bytes: int):
    """([(key, newest time)] newest first, of the blocks whole on every rank; counts: `bad_size`
    objects not a slot long, `incomplete` keys missing on some rank)."""
    seen: dict[bytes, list] = {}  # key -> [ranks found whole, newest time]
    counts: collections.Counter = collections.Counter()
    for rank in range(ranks):
        async for page in client.list(_under(client, nsid.hex(), f"r{rank}")):
            for m in page:
                name = m["path"].rsplit("/", 1)[-1]
                if not _KEY.match(name):
                    continue
                if m["size"] != slot_bytes:
                    counts["bad_size"] += 1
                    continue
                got = seen.setdefault(bytes.fromhex(name), [0, 0.0])
                got[0] += 1
                got[1] = max(got[1], m["last_modified"].timestamp())
    whole = [(k, t) for k, (n, t) in seen.items() if n == ranks]
    counts["incomplete"] += len(seen) - len(whole)
    whole.sort(key=lambda kt: (-kt[1], kt[0]))
    return whole, counts


async def labels(client: BucketClient, nsid: bytes, key: bytes | None, wanted, concurrency: int = 16):
    """({block key: label} for the keys in `wanted`, labels objects that are not ours). The labels
    objects are read newest first (the newest blocks' labels are in them) until every wanted key
    has its label; a key's newest label is the one kept."""
    objs = []
    async for page in client.list(meta.labels_prefix(client.prefix, nsid)):
        objs += page
    objs.sort(key=lambda m: m["last_modified"], reverse=True)
    found: dict[bytes, bytes] = {}
    foreign = 0
    want = set(wanted)
    for i in range(0, len(objs), concurrency):
        if not want:
            break
        part = objs[i : i + concurrency]
        batch = [m for m in part if m["size"] <= meta.MAX_LABELS_BYTES]
        foreign += len(part) - len(batch)  # too large to be ours
        for raw in await asyncio.gather(*(client.get(m["path"]) for m in batch)):
            if raw is None:
                continue  # expired meanwhile
            try:
                got = meta.read_labels_doc(raw, key)
            except meta.Foreign:
                foreign += 1
                continue
            for k in want.intersection(got):
                found[k] = got[k]
            want.difference_update(got)
    return found, foreign
