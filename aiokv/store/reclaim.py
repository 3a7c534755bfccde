# SPDX-License-Identifier: Apache-2.0
"""Evicting a dead engine's blocks.

Over the capacity, with the directory's oldest blocks in the files of an engine
that is not running, a live engine takes that engine's lock and evicts its
oldest blocks as its owner would: a DROP in its journal, its slot punched.

`Reclaim` owns the dead engines' locks and files it took, and which engines
those are as the owner knows it; it is handed the directories (meta.py), the
index, the I/O thread, the stats, the following of the other engines
(following.py: their Followers, and `peer_bytes`, which it corrects) and the
space (space.py: what the directory takes, and whose blocks are oldest).

Two halves: `_evict_dead_io` takes the lock, opens and writes the dead engine's
files (the file-system half, on the store's I/O thread where it has one);
`_evict_dead_done` changes the in-memory view of that engine (the owner's
thread, at its next poll).

The operators' orders (control.py) reach the files we hold as their owner would apply
them at its next start: the orders past each namespace's MARK, at once when we take its
files, and each new one as the owner takes it (`orders`): its blocks cleared (FREE records,
slots punched) or pinned, then a MARK (bulk.apply_to_files, on the I/O thread, from the
files as they are then and the engine's own tenant ids). Our view of its blocks follows
those records like any other engine's.

Threading contract: `run` and `orders` are the owner's (from refresh, and as orders come);
`_reclaimed` (the locks and files taken) and the Followers are the I/O thread's;
`_reclaiming` (the engines taken, as the owner knows it), the index and `peer_bytes` are
the owner's. The I/O half is handed its inputs (slot, used slots, the orders) by value and
returns its findings by value.
"""

from __future__ import annotations

import logging
import os
import time

from aiokv import _native
from aiokv.data import format as fmt
from aiokv.data.slotfile import open_data_file
from aiokv.store import bulk
from aiokv.store.following import data_bytes
from aiokv.store.journal import IndexLog
from aiokv.store.lock import DirLock, StoreLocked
from aiokv.store.namespace import Namespace
from aiokv.store.tenants import read_file

PUNCH = _native.FALLOC_FL_PUNCH_HOLE | _native.FALLOC_FL_KEEP_SIZE
RECLAIM_INTERVAL = 5.0  # seconds between looks for a dead engine holding the directory's oldest blocks
log = logging.getLogger("aiokv")


class Reclaim:
    def __init__(self, dirs, index, fs, stats, following, space, sync_interval: float):
        self.dirs, self.index, self.fs, self.stats = dirs, index, fs, stats
        self.following, self.space, self.sync_interval = following, space, sync_interval
        # engines found dead whose oldest blocks we evict: engine -> (its lock, {(nsid, what): fd or IndexLog})
        self._reclaimed: dict[int, tuple[DirLock, dict]] = {}  # the I/O thread's
        self._spaces: dict[tuple[bytes, int], Namespace] = {}  # the I/O thread's: (nsid, engine) of the files held
        self._reclaiming: set[int] = set()  # those engines, as the owner knows them
        self._checked = 0.0

    def run(self) -> None:
        """Over the capacity, with the directory's oldest blocks in the files of an
        engine that is not running: take that engine's lock (a new engine then
        takes another number) and evict its oldest blocks as its owner would — a
        DROP in its journal, its slots punched — while they are the oldest and the
        directory is over the capacity. Looks for such an engine at most every
        RECLAIM_INTERVAL seconds; a running engine (idle or not) is never touched."""
        space = self.space
        while space.used() > space.limit and space.peers_older() and not self.fs.busy("reclaim"):
            ns, e, slot = self._oldest_peer()
            if e not in self._reclaiming:
                now = time.monotonic()
                if now - self._checked < RECLAIM_INTERVAL:
                    return
                self._checked = now
            tag = ns.tables[e].tag_at(slot)
            orders = list(self.following.control.orders) if self.following.control is not None else []
            op = self.fs.once(
                "reclaim",
                lambda ns=ns, e=e, tag=tag, slot=slot, orders=orders: self._evict_dead_io(ns, e, tag, slot, orders),
                lambda r, err, ns=ns, e=e, slot=slot: self._evict_dead_done(ns, e, slot, r, err),
            )
            if not op.finished or op.result is None:
                return

    def _oldest_peer(self) -> tuple[Namespace, int, int] | None:
        """(namespace, engine, slot) of the oldest block another engine holds."""
        best = None
        for ns in self.index.namespaces.values():
            got = ns.oldest_peer()
            if got is not None and (best is None or got[0] < best[0]):
                best = (got[0], ns, got[1], got[2])
        return best[1:] if best else None

    def orders(self, orders: list) -> None:
        """The control orders so far (the owner's, as new ones come): applied to the files of
        every dead engine we hold, on the I/O thread."""
        for e in sorted(self._reclaiming):
            self.fs.submit(lambda e=e: self._orders_io(e, orders), self._orders_done)

    @staticmethod
    def _orders_done(_, err) -> None:
        if err is not None:
            log.warning(
                "aiokv: applying the control orders to a dead engine's files failed (%s); its next opener applies them",
                getattr(err, "strerror", None) or err,
            )

    def _orders_io(self, e: int, orders: list) -> None:
        held = self._reclaimed.get(e)
        for (nsid, what), jlog in list(held[1].items()) if held is not None else ():
            if what == "log":
                self._apply_dead(self._spaces[(nsid, e)], e, jlog, held[1], orders)

    def _apply_dead(self, ns: Namespace, e: int, jlog: IndexLog, files: dict, orders: list, table=None) -> None:
        """The orders past its journal's MARK applied to a dead engine's files of ns (its
        table: `table`, else read from them now), its own tenant ids naming the tenants."""
        if not any(o.number > jlog.mark for o in orders):
            return
        if table is None:
            fl = self.following.followers.get((ns.nsid, e))
            table = IndexLog(fl.dir, fl.dir_fd, readonly=True).load_table(self.dirs.max_slots(ns))
        ids = {tag: tid for tag, tid, _, _ in read_file(self.dirs.root_fd, e)}
        ids[fmt.NO_TENANT] = 0

        def mask_of(o):
            return bulk.ALL if o.tenants is None else bulk.tenant_mask({ids[t] for t in o.tenants if t in ids})

        sb, fds = ns.slot_bytes, [files[(ns.nsid, r)] for r in range(ns.ranks)]

        def punch(slots):
            for fd in fds:
                for first, count in zip(*bulk.runs(slots)):
                    _native.fallocate(fd, PUNCH, first * sb, count * sb)

        bulk.apply_to_files(ns.nsid, table, jlog, orders, mask_of, punch=punch)

    def _evict_dead_io(self, ns: Namespace, e: int, tag: int, slot: int, orders: list = ()):
        """None if the engine runs, or its files could not be used; ("first", its bytes,
        its blocks (a Table)) after taking its files and punching the space no block of
        it uses; ("dropped",) after a FREE of its block in slot (of tag) and a punch of it."""
        fl = self.following.followers.get((ns.nsid, e))
        if fl is None:
            return None
        if e not in self._reclaimed:
            try:
                lock = DirLock(self.dirs.root, self.dirs.root_fd, engine=e, wait=False)
            except StoreLocked:
                return None  # it runs: it sheds its own blocks when it steps
            self._reclaimed[e] = (lock, {})
            log.info("aiokv: engine %d of %s is not running; evicting its oldest blocks", e, self.dirs.root)
        files = self._reclaimed[e][1]
        sb = ns.slot_bytes
        try:
            jlog = files.get((ns.nsid, "log"))
            if jlog is None:
                jlog = IndexLog(fl.dir, fl.dir_fd, sync_interval=self.sync_interval)
                # as its owner: cuts a torn tail so that our records are read; its blocks are what
                # its journal says, not our view of it (which may lag behind it or be damaged)
                table = jlog.load_table(self.dirs.max_slots(ns))
                files[(ns.nsid, "log")] = jlog
                self._spaces[(ns.nsid, e)] = ns
                fds = [open_data_file(fl.dir_fd, r, write=True)[0] for r in range(ns.ranks)]
                files.update({(ns.nsid, r): fd for r, fd in enumerate(fds)})
                self._apply_dead(ns, e, jlog, files, orders, table)  # (its cleared slots are punched below)
                table.build_order()  # (here on the I/O thread, not the owner's: O(blocks))
                table.mark = jlog.mark
                # first its space that no block uses (free slots, an unfinished save's), by its
                # journal; our view of it is replaced by the journal's on the owner's thread
                used = table.live().tolist()
                for fd in fds:
                    end = os.fstat(fd).st_size // sb
                    for first, stop in zip([0] + [u + 1 for u in used], used + [max(end, 0)]):
                        if stop > first:  # the run of unused slots between two used ones
                            _native.fallocate(fd, PUNCH, first * sb, (stop - first) * sb)
                return "first", fl.disk_bytes + data_bytes(fl.dir_fd, ns), table
            jlog.append([fmt.pack_free(slot, tag)])
            for rank in range(ns.ranks):
                _native.fallocate(files[(ns.nsid, rank)], PUNCH, slot * sb, sb)
        except (OSError, fmt.BadBlock):
            return None
        return ("dropped",)

    def _evict_dead_done(self, ns: Namespace, e: int, slot: int, r, err) -> None:
        if err is not None:
            raise err
        if r is None:
            return
        self._reclaiming.add(e)
        peer_bytes = self.following.peer_bytes
        if r[0] == "first":
            peer_bytes[(ns.nsid, e)] = r[1]
            table = r[2]
            table.retenant(self.following.tenants.remap(e, table.tenant))  # its tenant ids, as ours
            if self.following.control is not None:  # what its files have not cleared yet, left out
                self.following.control.filter_peer(ns, table, getattr(table, "mark", 0))
            ns.peer_reset(e, table)
            return
        ns.peer_free(e, slot)
        peer_bytes[(ns.nsid, e)] -= ns.slot_cost
        self.stats.evictions += 1

    def release(self) -> None:
        """Close the dead engines' files and give their locks back (the I/O thread, at close)."""
        for lock, files in self._reclaimed.values():
            for f in files.values():
                f.close() if isinstance(f, IndexLog) else os.close(f)
            lock.release()
        self._reclaimed.clear()
