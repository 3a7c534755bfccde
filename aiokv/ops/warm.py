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

A block (`Warm`, a block at a time and several at once): reserved on the drive its key is
placed on (the Store's rules: store/warming.py), its object of every rank fetched and verified
with the checks a load makes (format.check_slot: header CRC, magic, version, namespace, rank,
key, length, payload CRC32C, and with a secret the MAC; not the layout tag, which only an
engine knows: one that differs is a miss at its first load), written to the reserved slot byte
for byte as fetched (data/slotimages.py), its label (where the bucket has one: bucket/meta.py)
appended to this engine's labels file, then committed. An object that does not verify, is gone
or has the wrong size is skipped and counted in its namespace's Target, and its reservation
given back. Only blocks written whole on every rank are committed, so an interrupt (Ctrl-C,
kill -9) leaves committed blocks and nothing else that any engine serves (slots reserved and
not committed are given back when these files are next opened), and the next run skips every
key the directory already holds.

Tenants: each block is committed as its tenant's, the tag its slot header carries (stamped by
the engine that saved it: format.header_tenant), so quotas, clears and pins treat a warmed block
as the engines' own. `tenant` keeps one tenant's blocks: a ranged GET of each candidate's header
says whose it is before its objects are fetched.

Bounds: `limit` bytes copied (a block costs its slot on every rank), the capacity (the
engines' `capacity` setting) and the file system's free space: the warm evicts nothing; a
drive without room takes no more. Order: the newest blocks first (by their objects' upload
times), across the namespaces chosen (warmplan.py plans them). Errors a user can fix are
WarmError (errors.py), one line.

Threading contract: one thread (the CLI's) runs an asyncio loop: the store's calls and Warm's
methods on it, the fetches on obstore's runtime; slot checks and writes go to worker threads
(asyncio.to_thread), which touch only the block's buffers and this run's data files.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import mmap
import os
import time

from aiokv.bucket.naming import object_name
from aiokv.config import AioKVConfig
from aiokv.data import format as fmt
from aiokv.data.slotimages import SlotImages
from aiokv.ops import warmplan
from aiokv.ops.errors import WarmError
from aiokv.ops.warmplan import Target
from aiokv.store import warming
from aiokv.store.drives import Drives

CONCURRENCY = 16  # blocks fetched at once
REFRESH_EVERY = 1.0  # seconds between looks at the other engines (their bytes count against the capacity)


class Warm:
    """One run's copy: the bucket's client, the local drives (this run's engine), what is warmed.
    Threading: used on the asyncio loop's thread only (the module's docstring)."""

    def __init__(
        self,
        client,
        drives: Drives,
        secret: str | None,
        limit: int | None,
        concurrency: int,
        bar,
        tenant: str | None = None,
    ):
        """tenant: only blocks of this tenant (a cache_salt; "": requests without one), or None: every block."""
        from aiokv.bucket.client import BucketError  # (obstore: the bucket extra, imported once needed)

        self.unanswered = BucketError
        # the tenant's tag, as the engines stamp it in slot headers (keyed by the secret)
        self.tenant = None if tenant is None else fmt.tenant_tag(tenant, fmt.tenant_key(secret))
        self.tenant_name = tenant
        self.client, self.drives, self.limit, self.concurrency, self.bar = client, drives, limit, concurrency, bar
        self.mac_key = fmt.mac_key(secret) if secret else None
        self.bytes = 0  # reserved or committed by this run (the limit's count)
        self.warmed_bytes = 0
        self.full: set[int] = set()  # drives without room
        self.stopped: str | None = None  # "limit", "capacity": why the run ended before the list did
        self.images = SlotImages()  # the slots written, as fetched (data/slotimages.py)
        self._refreshed = 0.0
        self._flying: collections.Counter = collections.Counter()  # (drive, nsid) -> blocks in flight
        self._flying_bytes: collections.Counter = collections.Counter()  # drive -> their bytes

    # ---- the store (the loop's thread) ----
    def _room(self, d: int, t: Target) -> bool:
        """Whether drive d takes one more block of t, beside those in flight (fetched before
        they are reserved), without evicting anything (store/warming.py)."""
        return warming.room_for(self.drives, d, t.ns, self._flying[(d, t.ns.nsid)], self._flying_bytes[d])

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._refreshed >= REFRESH_EVERY:
            self._refreshed = now
            self.drives.refresh()
            self.drives.flush_if_due()

    def close_files(self) -> None:
        self.images.close()

    # ---- a block ----
    async def _fetch(self, t: Target, key: bytes, rank: int):
        """The object of key's rank in an aligned buffer, verified; None (counted) if it is gone or not the block."""
        ns = t.ns
        raw = await self.client.get(object_name(self.client.prefix, ns.nsid, rank, key))
        if raw is None:
            t.missing += 1
            return None
        view = memoryview(raw)
        if view.nbytes != ns.slot_bytes:
            t.bad += 1
            return None
        buf = mmap.mmap(-1, ns.slot_bytes)  # page-aligned: written with O_DIRECT
        buf[:] = view
        try:
            await asyncio.to_thread(fmt.check_slot, buf, ns.nsid, rank, ns.payload_bytes, key, None, self.mac_key)
        except fmt.BadBlock:
            buf.close()
            t.bad += 1
            return None
        return buf

    async def _tenant_ok(self, t: Target, key: bytes) -> bool:
        """With --tenant: whether the block is that tenant's, by a ranged GET of its header's
        tenant tag (counted: other_tenant, missing), before its whole objects are fetched."""
        head = await self.client.head_bytes(object_name(self.client.prefix, t.ns.nsid, 0, key), fmt.TENANT_END)
        if head is None:
            t.missing += 1
            return False
        if (fmt.header_tenant(head) or fmt.NO_TENANT) != self.tenant:
            t.other_tenant += 1
            return False
        return True

    async def _one(self, t: Target, key: bytes) -> int:
        """Warm one block if it is to be; the bytes it took (0: not warmed)."""
        ns = t.ns
        if warming.held(ns, key):
            t.already += 1
            return 0
        d = warming.placed(self.drives, key)
        cost = ns.slot_bytes * ns.ranks
        if self.limit is not None and self.bytes + cost > self.limit:
            self.stopped = "limit"
            return 0
        if d in self.full or not self._room(d, t):
            self.full.add(d)
            t.no_room += 1
            if len(self.full) == len(self.drives.live):
                self.stopped = "capacity"
            return 0
        self.bytes += cost  # (in flight: counted against the limit until it is known not warmed)
        self._flying[(d, ns.nsid)] += 1
        self._flying_bytes[d] += cost
        bufs: list = []
        where, done = None, False
        try:
            try:
                if self.tenant is not None and not await self._tenant_ok(t, key):
                    return 0
                bufs = await asyncio.gather(*(self._fetch(t, key, r) for r in range(ns.ranks)))
            except self.unanswered:
                t.failed += 1
                if self.client.breaker.in_cooldown:
                    raise  # the bucket stopped answering: the run ends (run again to resume)
                return 0
            if any(b is None for b in bufs):
                return 0
            tag = fmt.header_tenant(bufs[0]) or fmt.NO_TENANT  # (damaged: outside the MAC, the tenant "")
            if self.tenant is not None and tag != self.tenant:
                t.other_tenant += 1  # (replaced since its header was read)
                return 0
            tenant = tag if self.tenant is None else self.tenant_name  # (its name: kept where no secret)
            where = self.drives.reserve(ns, key, tenant)
            if where is None:  # committed meanwhile (an engine beside us), or no space after all
                if warming.held(ns, key):
                    t.already += 1
                else:
                    self.full.add(d)
                    t.no_room += 1
                return 0
            ns_dir, engine = warming.slot_files(self.drives, d, ns.nsid)
            await asyncio.to_thread(self.images.write, ns_dir, engine, fmt.drive_of(where)[1], bufs, ns.slot_bytes)
            label = t.labels.get(key)
            if label is not None:
                warming.label(self.drives, d, ns.nsid, key, label)
                t.labelled += 1
            self.drives.commit(ns, [(key, where)], tenant)
            done = True
            t.warmed += 1
            self.warmed_bytes += cost
            return cost
        except asyncio.CancelledError:
            # a thread may still be checking or writing the slot: it stays reserved (never
            # committed, given back when these files are next opened), its buffers to the GC
            done, bufs = True, []
            raise
        finally:
            self._flying[(d, ns.nsid)] -= 1
            self._flying_bytes[d] -= cost
            for b in bufs:
                if b is not None:
                    b.close()
            if not done:
                self.bytes -= cost
                if where is not None:
                    self.drives.abort(ns, [(key, where)], failed=False)

    async def run(self, work: list[tuple[Target, bytes]]) -> None:
        it = iter(work)

        async def worker():
            for t, key in it:
                if self.stopped:
                    return
                self._refresh()
                self.bar.add(1, await self._one(t, key))  # (warmed, here already or skipped)

        tasks = [asyncio.ensure_future(worker()) for _ in range(self.concurrency)]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise


@dataclasses.dataclass
class WarmRequest:
    """What to warm, and within which bounds (the module's docstring)."""

    paths: list[str]
    bucket: str
    model: str | None = None
    tenant: str | None = None  # a cache_salt ("": requests without one); None: every tenant
    limit: int | None = None
    capacity: int = AioKVConfig.capacity  # the engines' `capacity` setting
    concurrency: int = CONCURRENCY
    timeout: float = 5.0  # seconds per request to the bucket


class _NoProgress:
    def add(self, blocks: int, nbytes: int) -> None:
        pass

    def end(self) -> None:
        pass


async def _warm(req: WarmRequest, client, drives: Drives, secret, progress, out: dict) -> None:
    from aiokv.bucket import meta

    key = meta.meta_key(secret)
    targets = await warmplan.targets(client, drives, key, req.model, out)
    work = await warmplan.work(client, targets, key, out)
    total = sum(t.ns.slot_bytes * t.ns.ranks for t, _ in work)
    limited = min(total, req.limit) if req.limit is not None else total
    bar = progress(len(work), limited) if progress is not None else _NoProgress()
    warm = Warm(client, drives, secret, req.limit, req.concurrency, bar, req.tenant)
    out["targets"] = targets
    out["warm"] = warm
    try:
        await warm.run(work)
    finally:
        bar.end()
        warm.close_files()


def warm(req: WarmRequest, secret: str | None, progress=None) -> dict:
    """Run a warm; what it did (JSON-ready). secret: the fleet's (None: an unsigned bucket);
    progress(blocks, bytes): a progress display (add(blocks, bytes), end()) or None. Raises
    WarmError (one line) for what a user can fix."""
    t0 = time.monotonic()
    if req.limit is not None and req.limit < 0:
        raise WarmError("aiokv: --limit must be a size of 0 or more")
    if req.concurrency < 1:
        raise WarmError("aiokv: --concurrency must be at least 1")
    try:
        from aiokv.bucket.client import BucketClient, BucketError
    except ImportError:
        raise WarmError("aiokv: warm needs the bucket tier's client: pip install 'aiokv[bucket]'") from None
    try:
        client = BucketClient(req.bucket, req.timeout)
    except ValueError as e:
        raise WarmError(str(e)) from None
    try:
        drives = warming.open_for_warm(req.paths, req.capacity, secret)
    except OSError as e:
        raise WarmError(f"aiokv: cannot use {', '.join(req.paths)} ({e.strerror or e})") from None
    out: dict = {"skipped_namespaces": [], "foreign_labels_objects": 0, "targets": [], "warm": None}
    code = None
    try:
        asyncio.run(_warm(req, client, drives, secret, progress, out))
    except BucketError as e:
        n = sum(t.warmed for t in out["targets"])
        code = WarmError(
            f"aiokv: the bucket {req.bucket} does not answer ({e}); "
            + (f"{n} block(s) were warmed; run again to resume" if n else "nothing was warmed")
        )
    finally:
        engine = warming.engine(drives)
        drives.close()
    if code is not None:
        raise code
    w, targets = out["warm"], out["targets"]
    return {
        "paths": [os.path.abspath(p) for p in req.paths],
        "bucket": req.bucket,
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
