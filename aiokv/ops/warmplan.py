# SPDX-License-Identifier: Apache-2.0
"""What `aiokv warm` (warm.py) copies: the bucket's namespaces to warm (described by the
bucket, or by the directory), of a model if one is named, each a `Target` with its counts;
and their blocks not here yet, newest first across the namespaces, with their labels.

Threading: coroutines on the CLI's asyncio loop (the Drives' owner thread); the listings run
on obstore's runtime.
"""

from __future__ import annotations

import dataclasses

from aiokv.ops.errors import WarmError
from aiokv.ops.select import model_matches
from aiokv.store import warming
from aiokv.store.drives import DriveNamespace, Drives


@dataclasses.dataclass
class Target:
    """A namespace being warmed: the local one (every drive's part) and its counts."""

    ns: DriveNamespace
    model: str | None
    in_bucket: int = 0
    warmed: int = 0
    already: int = 0
    bad: int = 0
    missing: int = 0
    no_room: int = 0
    labelled: int = 0
    failed: int = 0  # fetches the bucket did not answer (error, timeout)
    other_tenant: int = 0  # blocks of another tenant than --tenant's
    bad_size: int = 0
    incomplete: int = 0
    labels: dict = dataclasses.field(default_factory=dict)

    def doc(self) -> dict:
        d = {k: v for k, v in vars(self).items() if k not in ("ns", "labels")}
        return {"nsid": self.ns.nsid.hex(), **d}


async def targets(client, drives: Drives, key, model: str | None, out: dict) -> list[Target]:
    """The namespaces to warm: the bucket's, described (by the bucket, or by this directory), of `model`."""
    from aiokv.bucket import catalog

    found_targets = []
    found = await catalog.namespaces(client, key)
    for b in found:
        local = warming.described(drives, b.nsid)
        pb, ranks, fields = b.payload_bytes, b.ranks, b.fields
        if pb is None and local is not None:
            pb, ranks, fields = local.payload_bytes, local.ranks, local.fields  # described here
        if pb is None:
            out["skipped_namespaces"].append({"nsid": b.nsid.hex(), "why": b.why})
            continue
        if model is not None and not model_matches(fields, model):
            continue
        try:
            ns = drives.namespace(b.nsid, pb, ranks, fields)
        except ValueError as e:  # the directory's namespace holds another layout
            out["skipped_namespaces"].append({"nsid": b.nsid.hex(), "why": str(e)})
            continue
        found_targets.append(Target(ns, fields.get("model") if isinstance(fields.get("model"), str) else None))
    if model is not None and not found_targets:
        models = sorted({str(b.fields.get("model")) for b in found if b.payload_bytes is not None})
        raise WarmError(
            f"aiokv: no namespace in {client.url} holds model {model!r} "
            f"(it holds: {', '.join(models) if models else 'no described namespace'})"
        )
    return found_targets


async def work(client, chosen: list[Target], key, out: dict) -> list[tuple[Target, bytes]]:
    """Every target's blocks in the bucket not here yet (counted in its Target; its labels
    fetched), newest first across the namespaces."""
    from aiokv.bucket import catalog

    todo_all: list[tuple[float, Target, bytes]] = []
    for t in chosen:
        ns = t.ns
        got, counts = await catalog.blocks(client, ns.nsid, ns.ranks, ns.slot_bytes)
        t.in_bucket, t.bad_size, t.incomplete = len(got), counts["bad_size"], counts["incomplete"]
        todo = [(k, when) for k, when in got if not warming.stored(ns, k)]
        t.already = len(got) - len(todo)
        t.labels, foreign = await catalog.labels(client, ns.nsid, key, [k for k, _ in todo])
        out["foreign_labels_objects"] += foreign
        todo_all += [(when, t, k) for k, when in todo]
    todo_all.sort(key=lambda w: -w[0])  # newest first, across namespaces
    return [(t, k) for _, t, k in todo_all]
