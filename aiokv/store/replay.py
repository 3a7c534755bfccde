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

from aiokv import _native
from aiokv.data import format as fmt
from aiokv.store.index import Namespace
from aiokv.store.journal import IndexLog
from aiokv.store.meta import ns_dir

_log = logging.getLogger("aiokv")  # (`log` names a journal here)


class Replay:
    def __init__(self, dirs, index, space, persist, scan):
        self.dirs, self.index, self.space, self.persist, self.scan = dirs, index, space, persist, scan

    def load_own(self, ns: Namespace) -> None:
        """Replay our own engine's files of a namespace as their owner."""
        nsid, dirs = ns.nsid, self.dirs
        d = os.path.join(ns_dir(dirs.root, nsid), fmt.engine_dir(dirs.engine)).rstrip("/")
        dfd = dirs.own_dir_fd(nsid)
        log = IndexLog(d, dfd, readonly=False, sync_interval=self.persist.sync_interval)
        try:
            entries = log.load()
        except fmt.BadBlock as e:
            # The index is lost but the blocks describe themselves: rebuild from them.
            _log.warning("aiokv: %s", f"{e}; rebuilding the index from the data files")
            entries = self.scan.scan(ns)
            gens = [n.split(".")[1] for n in os.listdir(dfd) if n.startswith("journal.")]
            log.gen = 1 + max([int(g) for g in gens if g.isdigit()] + [log.gen])
            log.checkpoint([(k, s, a) for k, (s, a) in entries.items()])
        # A slot beyond the size of the file system never held a block: such a
        # record is damage, and would make the allocator count billions of holes.
        beyond = [k for k, (s, _) in entries.items() if s >= dirs.max_slots(ns)]
        if beyond:
            _log.warning(
                "aiokv: %s", f"{d}: {len(beyond)} index record(s) name slots beyond the file system's size; dropped"
            )
            for k in beyond:
                del entries[k]
        self.index.load(ns, entries)
        self.persist.add(nsid, log)
        # Space the index does not account for (free slots of the last life,
        # a tail past the last used slot) is given back to the file system.
        try:
            self.space.fallocate(
                ns, _native.FALLOC_FL_PUNCH_HOLE | _native.FALLOC_FL_KEEP_SIZE, ns.alloc.holes, punch=True
            )
        except OSError:
            ns.alloc.grow(list(ns.alloc.holes))  # they may still hold space: counted, and reused first
        for rank in range(ns.ranks):
            os.ftruncate(self.space.rank_fd(ns, rank), ns.alloc.hwm * ns.slot_bytes)
