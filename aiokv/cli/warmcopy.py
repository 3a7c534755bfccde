# SPDX-License-Identifier: Apache-2.0
"""The copy of `aiokv warm` (aiokv/cli/warm.py): blocks from the fleet's bucket to the drive
each key is placed on, a block at a time and several at once: reserved, each rank's object
fetched and verified, written to the slot byte for byte, its label appended, committed; or
skipped and counted in its namespace's Target, its reservation given back. Bounded by the
run's limit, the capacity and the file system's free space, evicting nothing.

Threading contract: Warm's methods run on the thread of the CLI's asyncio loop (the store's
calls there), the fetches on obstore's runtime; slot checks and writes go to worker threads
(asyncio.to_thread), which touch only the block's buffers and this run's data files.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import errno
import mmap
import os
import time

from aiokv.bucket.naming import object_name
from aiokv.data import format as fmt
from aiokv.data.slotfile import open_data_file, open_engine_dir
from aiokv.store.drives import DriveNamespace, Drives, place
from aiokv.store.meta import ns_dir
from aiokv.store.space import HEADROOM

REFRESH_EVERY = 1.0  # seconds between looks at the other engines (their bytes count against the capacity)


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


class Warm:
    """One run: the bucket's client, the local drives (this run's engine), what is warmed.
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
        self._fds: dict[tuple[int, bytes, int], int] = {}
        self._refreshed = 0.0
        self._flying: collections.Counter = collections.Counter()  # (drive, nsid) -> blocks in flight
        self._flying_bytes: collections.Counter = collections.Counter()  # drive -> their bytes

    # ---- the store (the loop's thread) ----
    def _room(self, d: int, t: Target) -> bool:
        """Whether drive d takes one more block of t, beside those in flight (fetched before
        they are reserved), without evicting anything: a free slot for each, or room under the
        capacity and on the file system (HEADROOM left to it: a full file system would make the
        store evict, space.py) for all of them."""
        st, part = self.drives.stores[d], t.ns.on[d]
        if len(part.alloc.free) > self._flying[(d, part.nsid)]:
            return True
        need = part.slot_cost + self._flying_bytes[d]
        lim = st.space.limit
        if lim is not None and lim - st.space.used() < need:
            return False
        fs = os.statvfs(st.root)
        return fs.f_bavail * fs.f_frsize - HEADROOM >= need

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._refreshed >= REFRESH_EVERY:
            self._refreshed = now
            self.drives.refresh()
            self.drives.flush_if_due()

    def _fd(self, d: int, nsid: bytes, rank: int) -> int:
        fd = self._fds.get((d, nsid, rank))
        if fd is None:
            st = self.drives.stores[d]
            dfd = open_engine_dir(ns_dir(st.root, nsid), st.engine)
            try:
                fd = open_data_file(dfd, rank, write=True, create=True, direct=True)[0]
            finally:
                os.close(dfd)
            self._fds[(d, nsid, rank)] = fd
        return fd

    def close_files(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

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

    def _write(self, d: int, t: Target, where: int, bufs) -> None:
        slot = where & fmt.SLOT_MASK
        for rank, buf in enumerate(bufs):
            n = os.pwrite(self._fd(d, t.ns.nsid, rank), buf, slot * t.ns.slot_bytes)
            if n != t.ns.slot_bytes:
                raise OSError(errno.EIO, f"short write ({n} of {t.ns.slot_bytes} bytes)")

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
        if key in ns.entries or key in ns.pending:
            t.already += 1
            return 0
        d = place(key, self.drives.seeds, self.drives.live)
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
                if key in ns.entries or key in ns.pending:
                    t.already += 1
                else:
                    self.full.add(d)
                    t.no_room += 1
                return 0
            await asyncio.to_thread(self._write, d, t, fmt.drive_of(where)[1], bufs)
            label = t.labels.get(key)
            if label is not None:
                self.drives.stores[d].labels.append(ns.nsid, [(key, label)])
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
