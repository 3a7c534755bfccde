# SPDX-License-Identifier: Apache-2.0
"""`aiokv warm PATH [PATH ...] --bucket s3://BUCKET/PREFIX`: copy blocks from the fleet's
bucket to a node's cache directories before it takes traffic (docs/operations.md, "Warm-up").

Beside running engines: the warm is an engine of the directory for as long as it runs
(store.py): it holds the lock of an engine number of its own (the lowest free one), writes
only that engine's data files, journal and labels, and the engines running on the directory
follow its journal as they follow each other's (a block it committed is a hit for them
within a follow interval). When it exits its files stay, as a stopped engine's do: running
engines serve from them, and the next engine to start adopts them (docs/design.md, "Several
engines on one directory").

A block: reserved on the drive its key is placed on (the Store's rules), its object of every
rank fetched and verified with the checks a load makes (format.check_slot: header CRC, magic,
version, namespace, rank, key, length, payload CRC32C, and with a secret the MAC; not the
layout tag, which only an engine knows: one that differs is a miss at its first load),
written to the reserved slot byte for byte as fetched, its label (where the bucket has one:
bucket/meta.py) appended to this engine's labels file, then committed. An object that does
not verify, is gone or has the wrong size is skipped and counted, and its reservation given
back. Only blocks written whole on every rank are committed, so an interrupt (Ctrl-C, kill
-9) leaves committed blocks and nothing else that any engine serves (slots reserved and not
committed are given back when these files are next opened), and the next run skips every key
the directory already holds.

Tenants: each block is committed as its tenant's, the tag its slot header carries (stamped by
the engine that saved it: format.header_tenant), so quotas, clears and pins treat a warmed block
as the engines' own. `tenant` keeps one tenant's blocks: a ranged GET of each candidate's header
says whose it is before its objects are fetched.

Bounds: `limit` bytes copied (a block costs its slot on every rank), the capacity (the
engines' `capacity` setting) and the file system's free space: the warm evicts nothing; a
drive without room takes no more.
Order: the newest blocks first (by their objects' upload times), across the namespaces chosen.

The blocks are copied by aiokv/cli/warmcopy.py (Warm, a block at a time); this module opens the
drives, plans the namespaces and their blocks, runs the copy and sums it up.

Threading: one thread (the CLI's) runs an asyncio loop: the store's calls on it, the fetches on
obstore's runtime, verification and writes on worker threads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time

from aiokv.cli.warmcopy import Target, Warm
from aiokv.config import AioKVConfig
from aiokv.store.drives import Drives, open_drives
from aiokv.store.store import Store

SCHEMA = 1
CONCURRENCY = 16  # blocks fetched at once
PLAIN_EVERY = 10.0  # seconds between progress lines when stderr is not a terminal
MISSING_SECRET = (
    "aiokv: warming from a bucket needs the fleet's secret in AIOKV_SECRET (the engines' `secret`), "
    "or --unsigned for a bucket whose engines run with bucket_unsigned"
)


class WarmError(Exception):
    """One line for the user; `code` is the exit status."""

    def __init__(self, msg: str, code: int = 2):
        super().__init__(msg)
        self.code = code


def secret_from_env(unsigned: bool) -> str | None:
    secret = os.environ.get("AIOKV_SECRET") or None
    if secret is not None and len(secret) < 16:
        raise WarmError("aiokv: AIOKV_SECRET must be at least 16 characters (the engines' `secret`)")
    if secret is None and not unsigned:
        raise WarmError(MISSING_SECRET)
    return secret


def model_matches(fields: dict, name: str) -> bool:
    """Whether a namespace's model (its namespace.json field `model`: the name or path vLLM was
    given) is `name`: the same string, or a path or repository id whose last parts are `name`."""
    model = fields.get("model")
    if not isinstance(model, str) or not name.strip("/"):
        return False
    model, name = model.rstrip("/"), name.strip("/")
    return model == name or model.endswith("/" + name)


def _open(paths: list[str], capacity: int, secret: str | None) -> Drives:
    try:
        drives, _ = open_drives(paths, lambda p, n: (Store(p, capacity=capacity // n, secret=secret), []), 60.0)
    except OSError as e:
        raise WarmError(f"aiokv: cannot use {', '.join(paths)} ({e.strerror or e})") from None
    return drives


async def _plan(client, drives: Drives, key, model: str | None, out: dict) -> list[Target]:
    """The namespaces to warm: the bucket's, described (by the bucket, or by this directory), of `model`."""
    from aiokv.bucket import catalog

    targets = []
    found = await catalog.namespaces(client, key)
    for b in found:
        local = next((s.index.namespaces[b.nsid] for s in drives.stores.values() if b.nsid in s.index.namespaces), None)
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
        targets.append(Target(ns, fields.get("model") if isinstance(fields.get("model"), str) else None))
    if model is not None and not targets:
        models = sorted({str(b.fields.get("model")) for b in found if b.payload_bytes is not None})
        raise WarmError(
            f"aiokv: no namespace in {client.url} holds model {model!r} "
            f"(it holds: {', '.join(models) if models else 'no described namespace'})"
        )
    return targets


async def _warm(args, client, drives: Drives, secret, out: dict) -> None:
    from aiokv.bucket import catalog, meta
    from aiokv.cli.slots import Progress

    key = meta.meta_key(secret)
    targets = await _plan(client, drives, key, args.model, out)
    work: list[tuple[float, Target, bytes]] = []
    for t in targets:
        ns = t.ns
        got, counts = await catalog.blocks(client, ns.nsid, ns.ranks, ns.slot_bytes)
        t.in_bucket, t.bad_size, t.incomplete = len(got), counts["bad_size"], counts["incomplete"]
        todo = [(k, when) for k, when in got if k not in ns.entries]
        t.already = len(got) - len(todo)
        t.labels, foreign = await catalog.labels(client, ns.nsid, key, [k for k, _ in todo])
        out["foreign_labels_objects"] += foreign
        work += [(when, t, k) for k, when in todo]
    work.sort(key=lambda w: -w[0])  # newest first, across namespaces
    total = sum(t.ns.slot_bytes * t.ns.ranks for _, t, _ in work)
    limited = min(total, args.limit) if args.limit is not None else total
    bar = Progress(len(work), limited, args.progress, "warming", args.progress_every)
    warm = Warm(client, drives, secret, args.limit, args.concurrency, bar, args.tenant)
    out["targets"] = targets
    out["warm"] = warm
    try:
        await warm.run([(t, k) for _, t, k in work])
    finally:
        bar.end()
        warm.close_files()


@dataclasses.dataclass
class Args:
    paths: list[str]
    bucket: str
    model: str | None = None
    tenant: str | None = None  # a cache_salt ("": requests without one); None: every tenant
    limit: int | None = None
    capacity: int = AioKVConfig.capacity
    unsigned: bool = False
    concurrency: int = CONCURRENCY
    progress: bool | None = None  # None: a bar on a terminal, else a plain line every progress_every s
    progress_every: float = PLAIN_EVERY
    timeout: float = 5.0  # seconds per request to the bucket


def warm(args: Args) -> dict:
    """Run a warm; the summary document. Raises WarmError (one line) for what a user can fix."""
    t0 = time.monotonic()
    secret = secret_from_env(args.unsigned)
    if args.limit is not None and args.limit < 0:
        raise WarmError("aiokv: --limit must be a size of 0 or more")
    if args.concurrency < 1:
        raise WarmError("aiokv: --concurrency must be at least 1")
    try:
        from aiokv.bucket.client import BucketClient, BucketError
    except ImportError:
        raise WarmError("aiokv: warm needs the bucket tier's client: pip install 'aiokv[bucket]'") from None
    try:
        client = BucketClient(args.bucket, args.timeout)
    except ValueError as e:
        raise WarmError(str(e)) from None
    drives = _open(args.paths, args.capacity, secret)
    out: dict = {"skipped_namespaces": [], "foreign_labels_objects": 0, "targets": [], "warm": None}
    code = None
    try:
        asyncio.run(_warm(args, client, drives, secret, out))
    except BucketError as e:
        n = sum(t.warmed for t in out["targets"])
        code = WarmError(
            f"aiokv: the bucket {args.bucket} does not answer ({e}); "
            + (f"{n} block(s) were warmed; run again to resume" if n else "nothing was warmed")
        )
    finally:
        engine = drives.stores[drives.live[0]].engine
        drives.close()
    if code is not None:
        raise code
    w, targets = out["warm"], out["targets"]
    return {
        "schema": SCHEMA,
        "paths": [os.path.abspath(p) for p in args.paths],
        "bucket": args.bucket,
        "engine": engine,
        "namespaces": [t.doc() for t in targets],
        "skipped_namespaces": out["skipped_namespaces"],
        "foreign_labels_objects": out["foreign_labels_objects"],
        "warmed_blocks": sum(t.warmed for t in targets),
        "warmed_bytes": w.warmed_bytes if w is not None else 0,
        "already_blocks": sum(t.already for t in targets),
        "bad_objects": sum(t.bad + t.bad_size for t in targets),
        "missing_objects": sum(t.missing for t in targets),
        "stopped": w.stopped if w is not None else None,
        "seconds": round(time.monotonic() - t0, 3),
    }


def render(doc: dict) -> str:
    lines = []
    for n in doc["namespaces"]:
        lines.append(
            f"namespace {n['nsid'][:12]} ({n['model'] or 'model unknown'}): {n['in_bucket']} block(s) in the bucket, "
            f"{n['warmed']} warmed, {n['already']} here already"
            + (f", {n['bad'] + n['bad_size']} bad object(s) skipped" if n["bad"] + n["bad_size"] else "")
            + (f", {n['missing']} gone" if n["missing"] else "")
            + (f", {n['failed']} not answered" if n["failed"] else "")
            + (f", {n['incomplete']} missing a rank" if n["incomplete"] else "")
            + (f", {n['no_room']} without room" if n["no_room"] else "")
            + (f", {n['other_tenant']} of other tenants" if n["other_tenant"] else "")
            + f"; {n['labelled']} labelled"
        )
    for s in doc["skipped_namespaces"]:
        lines.append(f"namespace {s['nsid'][:12]} skipped: {s['why']}")
    if doc["foreign_labels_objects"]:
        lines.append(f"{doc['foreign_labels_objects']} labels object(s) in the bucket are not ours: skipped")
    stop = {"limit": "; stopped at --limit", "capacity": "; stopped: the capacity is reached"}.get(doc["stopped"], "")
    lines.append(
        f"warmed {doc['warmed_blocks']} block(s), {doc['warmed_bytes'] / (1 << 20):.1f} MiB, as engine "
        f"{doc['engine']} of {', '.join(doc['paths'])} in {doc['seconds']:.1f} s{stop}"
    )
    return "\n".join(lines)
