# SPDX-License-Identifier: Apache-2.0
"""A block saved: a slot reserved for a key, then committed once its data is written, or given back.

`reserve` finds a slot in our engine's files (evicting, within the tenant's quota: quotas.py;
growing our files: space.py); `commit` makes the written blocks visible to lookups at once and
durable when the journal record is written (one that cannot be written is taken back: `undo`);
`abort` gives back reservations whose data was not (fully) written. A save of a namespace whose
index is still loading is dropped (the stats' `skipped_loading`), one whose space is still being
reserved is skipped (`skipped_fs_busy`), one with no free slot and nothing evictable (every block
held pinned or still being written) is dropped (`skipped_no_space`). Reservations made before a
clear we have taken are given back at commit (control.py).

Threading contract: the owner's (the Store's thread), like the index it changes; the journal
records go to the Store's I/O thread (persist.py), and `undo` runs back on the owner's thread
when the I/O thread says a write failed. No file-system call here.
"""

from __future__ import annotations

import errno
import logging
import os
import time

from aiokv import _index
from aiokv.data import format as fmt
from aiokv.store.namespace import Namespace
from aiokv.store.table import PINNED
from aiokv.store.tenantsfile import TenantsNotWritten

log = logging.getLogger("aiokv")


class Saves:
    def __init__(self, dirs, index, tenants, stats, space, persist, pins, control):
        self.dirs, self.index, self.tenants, self.stats = dirs, index, tenants, stats
        self.space, self.persist, self.pins, self.control = space, persist, pins, control
        self.quotas = None  # bytes per tenant (quotas.py; the store's set_quotas)
        self.wear = None  # bytes committed (wear.py; None read-only)

    def reserve(self, ns: Namespace, key: bytes, tenant: str | bytes = "") -> int | None:
        """A location (in our engine's files) for `key` of `tenant` (a cache_salt, or a tenant's
        tag), evicting if needed; None if present (in any engine's files), pending, no space,
        or no tenant id free for a new tenant (tenants.py)."""
        if not ns.ready:
            self.stats.skipped_loading += 1  # the index is loading: the save is dropped
            return None
        if key in ns.pending or ns.where(key) is not None:
            return None
        tag, tid = self.tenants.for_save(tenant)
        if tag is None:  # a new tenant and no id free (tenants.py)
            self.stats.skipped_tenants += 1
            return None
        if self.quotas is not None and not self.quotas.make_room(ns, tid, tag):
            self.stats.skipped_quota += 1
            return None
        space = self.space
        slot = ns.alloc.take()
        while slot is None:
            grown = space.grow(ns)
            if grown is None:  # space is being reserved: this save is skipped, not evicted for
                self.stats.skipped_fs_busy += 1
                return None
            if not grown:
                victim = self.quotas.victim(tid) if self.quotas is not None else self.index.victim()
                # another namespace's slot is no use here: its space must be punched
                if victim is None or not space.evict(*victim, punch=victim[0] is not ns):
                    self.stats.skipped_no_space += 1
                    return None
            slot = ns.alloc.take()
        space.grow_ahead(ns)
        ns.pending[key] = where = fmt.loc(self.dirs.engine, slot)
        if self.quotas is not None:
            self.quotas.reserving(ns.nsid, key, tid, tag, ns.slot_cost)
        return where

    def commit(
        self, ns: Namespace, items, tenant: str | bytes = "", pinned: bool = False, request: bool = False
    ) -> None:
        """Make written (key, location) pairs of `tenant` (a cache_salt, or a tenant's tag)
        visible to lookups, durably; pinned: never evicted (bounded by pin_capacity; `request`:
        a request's pin, bounded by request_pins too: pins.py). A new tenant is registered here
        (tenants.py); without an id free its blocks are given back."""
        if self.control.doomed:  # reserved before a clear we have taken: computed before it, given back
            kept = self.control.admit(ns, items, self.tenants.of(tenant)[0])
            if self.quotas is not None and len(kept) < len(items):
                for key in {k for k, _ in items} - {k for k, _ in kept}:
                    self.quotas.settled(ns.nsid, key)
            items = kept
        tag, tid = self.tenants.register(tenant) if items else (None, None)
        if tid is None:  # no id free (tenants.py): given back
            self.stats.skipped_tenants += sum(ns.pending.get(k) == w for k, w in items)
            return self.abort(ns, items, failed=False)
        now = time.time_ns()
        done, slots = [], []
        pending = ns.pending
        for key, where in items:
            if pending.get(key) != where:
                continue  # aborted meanwhile
            del pending[key]
            if self.quotas is not None:
                self.quotas.settled(ns.nsid, key)
            done.append(key)
            slots.append(where & fmt.SLOT_MASK)
        if not done:
            return
        if self.control.orders and self.control.pinned(ns.nsid, tag):  # pinned by `aiokv pin`: its new blocks too
            pinned, request = True, False
        k = self.pins.room(ns, len(done), tid, request) if pinned else 0  # the first k pinned (pins.py)
        # in memory a few ns apart (ties keep their order); the records say `now`
        recs = b""
        for part, flags in ((slice(0, k), PINNED), (slice(k, None), 0)):
            if done[part]:
                self.index.commit_many(ns, done[part], slots[part], now, tid, flags)
                recs += _index.commit_records(done[part], slots[part], now, tid, flags)  # (format.pack_record)
        nrecs = len(done)
        self.stats.commits += nrecs
        failed = []

        def undo(e):
            failed.append(e)
            # Not durable, so not committed: undo; only a full disk needs room.
            self.stats.commits -= nrecs
            self.wear.count(-nrecs * ns.slot_cost)
            written = set(done)
            for key, where in items:
                if key in written and ns.table.find(key) == where & fmt.SLOT_MASK:
                    ns.alloc.release(self.index.remove(ns, key))
            self.stats.save_failures += nrecs
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                self.stats.enospc += 1
                self.space.make_room()
            elif isinstance(e, TenantsNotWritten):
                self.tenants.not_written(e, nrecs)
            else:
                log.warning(
                    "aiokv: %s",
                    f"journal write failed ({os.strerror(e.errno or 0)}); {nrecs} block(s) not committed",
                )

        self.wear.count(nrecs * ns.slot_cost)
        self.persist.append(ns, recs, undo, before=self.tenants.writer(tid))  # (its tenants record first)
        if not failed:
            self.persist.checkpoint_if_due(ns)

    def abort(self, ns: Namespace, items, failed: bool = True) -> None:
        """Give back reservations whose data was not (fully) written."""
        for key, where in items:
            if ns.pending.get(key) == where:
                del ns.pending[key]
                if self.quotas is not None:
                    self.quotas.settled(ns.nsid, key)
                ns.alloc.release(where & fmt.SLOT_MASK)
                self.stats.save_failures += failed
