# SPDX-License-Identifier: Apache-2.0
"""The in-memory index: the namespaces of a store (each a `Namespace`,
namespace.py), our LRU clock, commits, removals, victims and the slots of keys
dropped while pinned (slot allocation: allocator.py).

Pure bookkeeping, no files: the Store persists what this decides (journal.py)
and does the I/O. Kept apart so property tests can drive it fast.

Commits and removals take keys and work on their tags (table.py); what only a
slot names (an eviction) is said by slot and tag. `Index.lru` (tools and tests)
reads the keys of our blocks from the files through each namespace's `keys_of`.

Threading contract: one thread (the Store's owner) calls everything here.
"""

from __future__ import annotations

import collections
import time

import numpy as np

from aiokv import _index
from aiokv.store.allocator import SlotAllocator
from aiokv.store.namespace import Namespace
from aiokv.store.table import Table, tag_of


class Index:
    """All namespaces of a store plus the eviction order over this engine's blocks."""

    def __init__(self):
        self.namespaces: dict[bytes, Namespace] = {}
        self.pins: collections.Counter = collections.Counter()
        # slots of keys dropped while pinned: in use until the key is unpinned (release_dropped)
        self.dropped_pinned: dict[tuple[bytes, bytes], list[int]] = {}
        self.clock = 0  # the last access time handed out: every one is later (ties keep their order)

    def now(self, now: int | None = None) -> int:
        """An access time for our blocks: the wall clock, later than every one handed out."""
        now = max(now or time.time_ns(), self.clock + 1)
        self.clock = now
        return now

    def release_dropped(self, ns: Namespace, key: bytes, slot: int) -> None:
        """The slot of a dropped key goes back to the free list, or, while a load still holds
        the key pinned, once it is unpinned: handed out at once, the slot would take the key's
        next copy, and that load's late bad-block report (naming key and slot) would drop it."""
        if self.pins[(ns.nsid, key)]:
            self.dropped_pinned.setdefault((ns.nsid, key), []).append(slot)
        else:
            ns.alloc.release(slot)

    def unpinned(self, ns: Namespace, key: bytes) -> None:
        """The key's last pin is gone: slots it was dropped from are free now."""
        for slot in self.dropped_pinned.pop((ns.nsid, key), ()):
            ns.alloc.release(slot)

    @property
    def physical_bytes(self) -> int:
        return sum(ns.alloc.backed * ns.slot_cost for ns in self.namespaces.values())

    def tenant_bytes(self) -> np.ndarray:
        """Bytes per tenant id in the directory: every engine's blocks, as followed (quotas,
        inspect, the per-tenant metric)."""
        tables = [
            (t.tenant_blocks, ns.slot_cost) for ns in self.namespaces.values() for t in (ns.table, *ns.tables.values())
        ]
        if len(tables) == 1:  # (one engine, one namespace: a victim's filter asks this per save)
            return tables[0][0] * tables[0][1]
        out = np.zeros(max([1] + [len(c) for c, _ in tables]), np.int64)
        for c, cost in tables:
            out[: len(c)] += c * cost
        return out

    def load(self, ns: Namespace, table: Table) -> None:
        """Install this engine's blocks replayed from disk."""
        ns.table = table  # (ordered by the loader: Table.build_order)
        used = np.zeros(table.slots, bool)
        used[table.live()] = True
        last = np.flatnonzero(used)
        ns.alloc = SlotAllocator.of_mask(used[: int(last[-1]) + 1] if len(last) else used[:0])
        ns._reorder()
        self.namespaces[ns.nsid] = ns
        if table.count:
            self.clock = max(self.clock, int(table.atime.max()))

    def lookup(self, ns: Namespace, keys, limit: int | None = None) -> int:
        """Length of the run of committed keys at the start of `keys` (at most `limit`).
        No side effects."""
        if not ns.ready:
            return 0
        return _index.run(ns.probes, keys, -1 if limit is None else limit)

    def commit(self, ns: Namespace, key: bytes, slot: int, now: int, tenant: int = 0, flags: int = 0) -> int:
        """Our block of key (of `tenant`, with `flags`) is in slot now; returns its access time."""
        tag = tag_of(key)
        if ns.changes is not None:
            ns._added(tag, key, ns.engine)
        at = self.now(now)
        ns.table.put(slot, tag, at, tenant, flags)
        return at

    def commit_many(
        self, ns: Namespace, keys: list[bytes], slots: list[int], now: int, tenant: int = 0, flags: int = 0
    ) -> None:
        """commit, for a batch (their access times now, now + 1, ...: later than any before)."""
        tags = np.frombuffer(_index.tags(keys), np.uint64)
        if ns.changes is not None:
            for tag, key in zip(tags.tolist(), keys):
                ns._added(tag, key, ns.engine)
        first = max(now, self.clock + 1)
        self.clock = first + len(keys) - 1
        ns.table.put_many(
            np.array(slots, np.uint64), tags, np.arange(first, first + len(keys), dtype=np.uint64), tenant, flags
        )

    def remove(self, ns: Namespace, key: bytes) -> int | None:
        """Forget one of our committed keys; return its slot (still in use) or None.
        Another engine's copy of the key, if any, becomes the one lookups see."""
        s = ns.table.find(key)
        if s < 0:
            return None
        ns._gone(ns.table.clear(s))
        return s

    def remove_slot(self, ns: Namespace, slot: int) -> int:
        """Forget our block in `slot`; returns its tag (0: none)."""
        tag = ns.table.clear(slot)
        if tag:
            ns._gone(tag)
        return tag

    def victim(self, filt: tuple | None = None) -> tuple[Namespace, int] | None:
        """Our least recently used committed block that is not pinned (by a load, or for good)
        and passes filt (table.Table.oldest), as (namespace, slot) (other engines evict their own)."""
        best = None
        for ns in self.namespaces.values():
            t, pinned = ns.table, ns.pinned_tags
            s = t.oldest((lambda s, t=t, p=pinned: p[t.tag_at(s)] > 0) if pinned else None, filt)
            if s >= 0 and (best is None or t.atime_at(s) < best[0]):
                best = (t.atime_at(s), ns, s)
        return None if best is None else (best[1], best[2])

    def victim_atime(self, victim: tuple[Namespace, int]) -> int:
        ns, slot = victim
        return ns.table.atime_at(slot)

    @property
    def lru(self):
        """(nsid, key) of our blocks, least recently used first (reads the keys from the files)."""
        items = []
        for ns in self.namespaces.values():
            if ns.engine is None:
                continue
            t = ns.table
            order = t.in_order()
            for s, k in zip(order.tolist(), ns.keys_of(ns.engine).keys_of(order, t.tag[order])):
                if k is not None:
                    items.append((t.atime_at(s), s, ns.nsid, k))
        items.sort(key=lambda x: (x[0], x[1]))
        return [(n, k) for _, _, n, k in items]
