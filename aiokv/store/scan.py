# SPDX-License-Identifier: Apache-2.0
"""Scan and verify of our own data files: `scan` finds every slot whose header
verifies on every rank (the rebuild of a lost index, replay.py); `verify_slot`
says whether a location holds a complete, verifying block of a key on every
rank (the scheduler side, for saves whose reports can no longer arrive at
shutdown).

`Scan` owns no state: it is handed the directories (meta.py), our data files
(space.py), the I/O thread and the close deadline (persist.py).

Threading contract: `scan` runs where replay runs (the opener's thread or the
I/O thread); `verify_slot` is called on the owner's thread and, with the I/O
thread, reads there (bounded by the store's close_wait and close deadline: persist.py).
"""

from __future__ import annotations

import os

from aiokv.data import format as fmt
from aiokv.data.slotfile import read_slot
from aiokv.store.fsthread import FsTimeout
from aiokv.store.namespace import Namespace


class Scan:
    def __init__(self, dirs, space, fs, persist):
        self.dirs, self.space, self.fs, self.persist = dirs, space, fs, persist

    def scan(self, ns: Namespace) -> dict[bytes, tuple[int, int, bytes]]:
        """key -> (slot, write time, tenant tag) for every slot whose header verifies on every
        rank (the tenant: rank 0's header's, NO_TENANT where it does not verify)."""
        found: dict | None = None
        sb = ns.slot_bytes
        for rank in range(ns.ranks):
            fd = self.space.rank_fd(ns, rank)
            here = {}
            for slot in range(min(os.fstat(fd).st_size // sb, self.dirs.max_slots(ns))):
                try:
                    h = read_slot(fd, slot, ns.nsid, rank, ns.payload_bytes, header_only=True)
                except fmt.BadBlock:
                    continue
                here[(h["key"], slot)] = (h["seq"], h["tenant"] or fmt.NO_TENANT)
            found = here if found is None else {ks: found[ks] for ks in here if ks in found}
        return {k: (s, t, tn) for (k, s), (t, tn) in sorted((found or {}).items(), key=lambda x: x[1][0])}

    def verify_slot(self, ns: Namespace, key: bytes, where: int) -> bool:
        """Whether our location `where` holds a complete, verifying block of `key` on
        every rank (whatever layout tag it was written with; the reader checks its own)."""
        if not self.fs.inline:  # at close: bounded, and False if the file system does not answer
            if self.fs.stalled:
                return False
            try:
                op = self.fs.submit(lambda: self._verify_io(ns, key, where))
            except FsTimeout:
                return False
            done = self.fs.drain(op, self.persist.close_wait, self.persist.close_deadline())
            return done and op.error is None and bool(op.result)
        return self._verify_io(ns, key, where)

    def _verify_io(self, ns: Namespace, key: bytes, where: int) -> bool:
        slot = where & fmt.SLOT_MASK
        for rank in range(ns.ranks):
            try:
                read_slot(self.space.rank_fd(ns, rank), slot, ns.nsid, rank, ns.payload_bytes, key)
            except fmt.BadBlock:
                return False
        return True
