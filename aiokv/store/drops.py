# SPDX-License-Identifier: Apache-2.0
"""Keys forgotten because their blocks did not verify (a load's checks, verify, a slot rewritten).

Our block is removed from the index, its slot reused and a DROP record queued to our journal;
another engine's copy is only no longer offered here (its holder drops or rewrites it), until
that engine commits the key anew. Counted in `corrupt_dropped` where the block was corrupt.

Threading contract: the owner's (the Store's thread), like the index it changes; the DROP records
are written by the Store's I/O thread (persist.py), never on this thread.
"""

from __future__ import annotations

from aiokv.data import format as fmt
from aiokv.store.namespace import Namespace


class Drops:
    def __init__(self, dirs, index, stats, persist):
        self.dirs, self.index, self.stats, self.persist = dirs, index, stats, persist

    def drop(self, ns: Namespace, keys, corrupt: bool = True) -> None:
        """Forget keys whose blocks did not verify; our slots are reused, and another
        engine's copy is not offered again here (unless it commits the key anew)."""
        recs = []
        for k in keys:
            where = ns.where(k)
            if where is None:
                continue
            e, _ = fmt.split(where)
            if e != self.dirs.engine:
                ns.peer_drop(e, k)
                self.stats.corrupt_dropped += corrupt
                continue
            slot = self.index.remove(ns, k)
            if slot is not None:
                self.index.release_dropped(ns, k, slot)
                recs.append(fmt.pack_record(fmt.REC_DROP, k, slot, 0))
                self.stats.corrupt_dropped += corrupt
        self.persist.append(ns, recs)

    def drop_at(self, ns: Namespace, items, corrupt: bool = True) -> int:
        """drop() of each (key, location) whose key still sits at that location (not a newer
        copy); returns how many were dropped."""
        keys = [k for k, where in items if ns.where(k) == where]
        if keys:
            self.drop(ns, keys, corrupt)
        return len(keys)
