# SPDX-License-Identifier: Apache-2.0
"""The keys loads hold (`LoadPins`: the store's `pin` and `unpin`), a scheduler call's keys at
once: located, counted, used and told to the other engines in a few calls into aiokv._index and
numpy, no Python per key (the scheduler thread's step: docs/design.md).

A key a load is reading is held in memory (Index.pins: (nsid, key) -> how many loads hold it;
Namespace.pinned_tags: a key tag -> the holds of its keys; counted by native/holds.c) and not
evicted by this engine until its last unpin (Index.victim passes over our blocks of a held tag;
the slots a held key was dropped from wait for it: Index.release_dropped, Index.unpinned). A
pin is a use: each of our blocks the keys find is made young, in the keys' order, at access
times later than any before (Index.now); a hit on another engine's block is told to it by a
TOUCH record in our journal, at most once a second per block (TOUCH_EVERY_NS), and our view of
its copies made young at once.

Threading contract: the owner's (the Store's thread), like the index it changes; the TOUCH
records go to our journal through persist (written on the Store's I/O thread).
"""

from __future__ import annotations

import time

import numpy as np

from aiokv import _index
from aiokv.data import format as fmt
from aiokv.store.locate import first_holders
from aiokv.store.namespace import Namespace

TOUCH_EVERY_NS = 10**9  # a hit on another engine's block is recorded at most this often per key


def objects(keys) -> np.ndarray:
    """The keys as a numpy array of objects, to take some of them in one call."""
    out = np.empty(len(keys), object)
    out[:] = keys
    return out


def as_list(where: np.ndarray) -> list[int | None]:
    """Locations (int64, -1: none) as `pin` answers them: a list, None for a miss."""
    out = where.astype(object)
    out[where < 0] = None
    return out.tolist()


class LoadPins:
    """pin and unpin for a Store (pins on several drives: drives.py asks each drive's). Threading
    contract: the owner's (the Store's thread); TOUCH records written by the I/O thread."""

    def __init__(self, index, persist, dirs, readonly: bool):
        self.index, self.persist, self.dirs, self.readonly = index, persist, dirs, readonly

    def pin(self, ns: Namespace, keys) -> list[int | None]:
        """Locations of committed keys (None: a miss), protected from eviction (by this engine;
        another engine may evict its own: a miss on read) until unpin; refreshes LRU."""
        return as_list(self.locations(ns, keys))

    def locations(self, ns: Namespace, keys, where: np.ndarray | None = None) -> np.ndarray:
        """pin, its answer as int64 locations (-1: a miss): for Drives.pin, no Python per key.
        where: the keys' locations in ns already found (locate.first_holders), else found here."""
        if not ns.ready:
            return np.full(len(keys), -1, np.int64)
        if where is None:
            where = first_holders([ns], keys)[1]
        _index.hold(self.index.pins, ns.pinned_tags, ns.nsid, keys, where)
        now = time.time_ns()
        self.touch_own(ns, keys, where, now)
        self.touch_peers(ns, keys, where, now)
        return where

    def touch_own(self, ns: Namespace, keys, where: np.ndarray, now: int) -> None:
        """Our blocks of these keys were used now: each at an access time later than any before
        (Index.now), in the keys' order (a key asked twice: its later one)."""
        t = ns.table
        if ns.engine is not None:  # (ours first in `where`: a key we hold is located in our table)
            slots = where[(where >= 0) & (where >> fmt.ENGINE_SHIFT == ns.engine)] & fmt.SLOT_MASK
        else:
            found = np.full(len(keys), -1, np.int64)
            t.probe.find_many(np.frombuffer(_index.tags(keys), np.uint64), found)
            slots = found[found >= 0]
        if not len(slots):
            return
        first = self.index.now(now)
        self.index.clock = first + len(slots) - 1
        np.maximum.at(t.atime, slots, np.arange(first, first + len(slots), dtype=np.uint64))
        t.changed(slots)

    def touch_peers(self, ns: Namespace, keys, where: np.ndarray, now: int) -> None:
        """Tell the engines holding these keys that we used them (TOUCH records in our journal,
        best effort), so the directory's LRU sees hits from every engine: a block whose holder
        last used it (as we know) a second ago or more (TOUCH_EVERY_NS), once a call."""
        if self.readonly:
            return
        eng = where >> fmt.ENGINE_SHIFT
        peer = np.flatnonzero((where >= 0) & (eng != self.dirs.engine))
        if not len(peer):
            return
        _, first = np.unique(where[peer], return_index=True)  # a block once (a key asked again)
        peer = peer[np.sort(first)]
        slot, due, tags = where[peer] & fmt.SLOT_MASK, np.zeros(len(peer), bool), np.zeros(len(peer), np.uint64)
        for e in np.unique(eng[peer]).tolist():
            t, mine = ns.tables[e], eng[peer] == e
            due[mine] = t.atime[slot[mine]] <= np.uint64(now - TOUCH_EVERY_NS)
            tags[mine] = t.tag[slot[mine]]
        if not due.any():
            return
        # every other engine's copy of them made young at once (our view; theirs at their next look)
        ns.touch_tags(tags[due], np.full(int(due.sum()), now, np.uint64), own=False)
        told = objects(keys)[peer[due]].tolist()
        self.persist.append(ns, _index.commit_records(told, [0] * len(told), now, 0, 0, fmt.REC_TOUCH))

    def unpin(self, ns: Namespace, keys) -> None:
        """Give back the loads' holds of these keys (the last one's: evictable again; a key held
        by none is left as it is)."""
        for k in _index.release(self.index.pins, ns.pinned_tags, ns.nsid, keys, self.index.dropped_pinned):
            self.index.unpinned(ns, k)  # (a key dropped while held: its slots free now)
