# SPDX-License-Identifier: Apache-2.0
"""Replay of our own engine's files of a namespace at opening, and the rebuild of
its index from the slot headers when its checkpoint or journal is damaged.

`Replay` owns no state: it is handed the directories (meta.py), the index it
fills, the space that backs the slots (space.py), the journals it adds
(persist.py) and the scan that rebuilds a lost index (scan.py).

The index of a namespace is its checkpoint plus its journal (journal.py); if
they do not verify, the blocks describe themselves: the data files are scanned
(scan.py) and a new checkpoint is written. Records naming slots beyond the file
system's size are damage and dropped. Space the index does not account for is
given back to the file system (space.py).

Threading contract: runs while a namespace is opened (meta.py), on the opener's
thread or the store's I/O thread, before the owner uses the namespace.
"""

from __future__ import annotations

import logging
import os
from array import array

import numpy as np

from aiokv.data import format as fmt
from aiokv.store.journal import IndexLog
from aiokv.store.meta import ns_dir
from aiokv.store.namespace import Namespace
from aiokv.store.table import Table, give_back_scratch, tag_of

_log = logging.getLogger("aiokv")  # (`log` names a journal here)


class Replay:
    def __init__(self, dirs, index, space, persist, scan, tenant_of=lambda tag: 0, own_loaded=lambda table: None):
        """tenant_of(tag): the id our tenants file gave a tenant tag at opening (for a rebuild
        from the slot headers; read only: the loader thread may call it); own_loaded(table): the
        owner's, at install (tenants.py: ids the file does not name)."""
        self.dirs, self.index, self.space, self.persist, self.scan = dirs, index, space, persist, scan
        self.tenant_of, self.own_loaded = tenant_of, own_loaded
        self.orders = None  # orders(ns, table, log): the control orders applied as it is read (store.py)

    def load_own(self, ns: Namespace) -> None:
        """Replay our own engine's files of a namespace as their owner (at once: read_own,
        install, give_back)."""
        table, log = self.read_own(ns)
        self.install(ns, table, log)
        self.give_back(ns)
        give_back_scratch()

    def install(self, ns: Namespace, table, log) -> None:
        """The owner's half: the replayed index in place, the journal ours."""
        self.own_loaded(table)
        self.index.load(ns, table)
        self.persist.add(ns.nsid, log)
        ns.mark = log.mark  # the control orders its index has applied (control.py)

    def give_back(self, ns: Namespace) -> None:
        """After install, at once: space the index does not account for (free slots of the
        last life, a tail past the last used slot) is given back to the file system."""
        holes = array("q", ns.alloc.holes)
        if not self.give_back_io(ns, holes, ns.alloc.hwm):
            ns.alloc.grow(holes)  # they may still hold space: counted, and reused first

    def give_back_io(self, ns: Namespace, holes, hwm: int, truncate: bool = True) -> bool:
        """The file-system half of give_back (the I/O thread's, where there is one: queued
        at install, behind only the first grow, which keeps its own slots and cuts the tail
        itself: truncate False); False if the holes could not be punched. holes (slot
        numbers: an array) and hwm are the owner's, at install; they are punched a run of
        consecutive slots a call (a clear applied at opening leaves millions: no Python
        object each)."""
        ok = self.space.punch_runs(ns, np.sort(np.asarray(holes, np.int64)))
        if truncate:
            self.space.cut(ns, hwm)
        return ok

    def read_own(self, ns: Namespace):
        """(Table, IndexLog) of our own files of a namespace: reads, and writes only those
        files (a torn tail cut, a rebuilt checkpoint): the loader thread's, or the opener's."""
        nsid, dirs = ns.nsid, self.dirs
        d = os.path.join(ns_dir(dirs.root, nsid), fmt.engine_dir(dirs.engine)).rstrip("/")
        dfd = dirs.own_dir_fd(nsid)
        log = IndexLog(d, dfd, readonly=False, sync_interval=self.persist.sync_interval)
        # A slot beyond the size of the file system never held a block: such a
        # record is damage, and would make the allocator count billions of holes.
        max_slot = dirs.max_slots(ns)
        try:
            table = log.load_table(max_slot)
        except fmt.BadBlock as e:
            # The index is lost but the blocks describe themselves: rebuild from them.
            _log.warning("aiokv: %s", f"{e}; rebuilding the index from the data files")
            entries = self.scan.scan(ns)
            gens = [n.split(".")[1] for n in os.listdir(dfd) if n.startswith("journal.")]
            log.gen = 1 + max([int(g) for g in gens if g.isdigit()] + [log.gen])
            # (the control records are applied again to the rebuilt index, to the blocks written
            # before each: store/control.py; the pins are lost with the index)
            log.mark = 0
            rows = [(k, s, a, self.tenant_of(tn)) for k, (s, a, tn) in entries.items()]
            log.checkpoint(rows)
            kept = [r for r in rows if r[1] < max_slot]
            table = Table.of(
                np.array([r[1] for r in kept], np.uint64),
                np.array([tag_of(r[0]) for r in kept], np.uint64),
                np.array([r[2] for r in kept], np.uint64),
                np.array([r[3] for r in kept], np.uint16),
            )
            ns.rebuilt = True
        if log.beyond:
            _log.warning(
                "aiokv: %s", f"{d}: {log.beyond} index record(s) name slots beyond the file system's size; dropped"
            )
        if self.orders is not None:
            self.orders(ns, table, log)
        table.build_order()  # (here, before the owner installs it: O(blocks))
        return table, log
