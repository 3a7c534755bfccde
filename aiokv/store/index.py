# SPDX-License-Identifier: Apache-2.0
"""The in-memory index: which key sits in which slot, LRU order (slot allocation:
allocator.py).

Pure bookkeeping, no files: the Store persists what this decides (journal.py)
and does the I/O. Kept apart so property tests can drive it fast.

Every engine's blocks of a namespace are a Table (table.py: a few bytes a
block, tags not keys). Lookups, commits and drops take keys and work on their
tags; what only a slot names (an eviction) is said by slot and tag. The keys
of the blocks are in the files, and the calls that hand out keys (`Namespace.keys`,
`Index.lru`: tools and tests) read them there through the namespace's `keys_of` (set by
the store; nskeys.py).

Threading contract: one thread (the Store's owner) calls everything here.
"""

from __future__ import annotations

import collections
import time

import numpy as np

from aiokv import _index
from aiokv.data.format import loc
from aiokv.store import nskeys
from aiokv.store.allocator import SlotAllocator
from aiokv.store.journal import KeyMap, apply_records, record_tags
from aiokv.store.table import Table, tag_of


class Namespace:
    """One namespace as one engine sees it: its own blocks (`table`), pending
    reservations and allocator, the blocks of the other engines on the directory
    (`tables`, followed from their journals), and the union that lookups read
    (`has`, `where`): our own copy first, else the lowest-numbered engine's.

    `engine` is this engine's number (None for a read-only opener, which owns
    nothing). Own slots are plain slot numbers; `where` and `pending` hold
    locations (format.loc: engine << 32 | slot), which for engine 0 are the slots.
    `ready` is False while its index loads in the background (store.py): no hits,
    no saves meanwhile; `load_failed` once that load failed (it stays not ready).
    """

    def __init__(
        self, nsid: bytes, payload_bytes: int, slot_bytes: int, ranks: int, fields: dict, engine: int | None = 0
    ):
        self.nsid = nsid
        self.payload_bytes = payload_bytes
        self.slot_bytes = slot_bytes
        self.ranks = ranks
        self.fields = fields
        self.engine = engine
        self.base = loc(engine, 0) if engine is not None else 0  # our slot s is at location base | s
        self.table = Table()  # this engine's blocks
        self.tables: dict[int, Table] = {}  # other engines' blocks, by engine number
        self.pending: dict[bytes, int] = {}  # key -> location reserved, not yet committed
        self.alloc = SlotAllocator()
        self.pinned_tags: collections.Counter = collections.Counter()  # tags of keys loads hold pinned
        self.ready = True
        self.load_failed = False
        self.rebuilt = False  # our index was rebuilt from the slot headers at this opening (replay.py)
        self.mark = 0  # the control orders our index of it has applied (control.py)
        # a watcher's list (the connector's KV events sets it): (True, tag, key or None) when a
        # block becomes a hit here, (False, tag, None) when it stops being one; None: not watched
        self.changes: list[tuple[bool, int, bytes | None]] | None = None
        # keys_of(engine) -> journal.KeyMap: the keys an engine's files name (set by the store)
        self.keys_of = lambda engine: KeyMap()
        # the engines whose tables a lookup asks, in its order (ours first, then by number), and
        # those tables' probes (locate.py and run_of read them; _reorder sets them): read-only
        self.engines: tuple = ()
        self.probes: tuple = ()
        self._reorder()

    def _reorder(self) -> None:
        peers = sorted(self.tables)
        own = [] if self.engine is None else [self.engine]
        self.engines = tuple(own + peers)
        self.probes = tuple(self.table_of(e).probe for e in self.engines)

    def table_of(self, engine: int) -> Table:
        return self.table if engine == self.engine else self.tables[engine]

    @property
    def slot_cost(self) -> int:
        """Bytes on disk one slot takes across all ranks."""
        return self.slot_bytes * self.ranks

    @property
    def hex(self) -> str:
        return self.nsid.hex()

    # ---- lookups ----
    def has(self, key: bytes) -> bool:
        """Whether any engine's committed block of key is a hit here (as `where` finds it)."""
        return isinstance(key, bytes) and _index.locate(self.probes, key) is not None

    @staticmethod
    def run_of(spaces: list[Namespace], keys, limit: int | None = None) -> int:
        """Length of the run of keys at the start of `keys` (at most `limit`) each held by one of
        `spaces` (as `has` answers): one call into aiokv._index, no Python per key."""
        probes = tuple(p for n in spaces for p in n.probes)
        return _index.run(probes, keys, -1 if limit is None else limit) if probes else 0

    def reserved(self, key: bytes) -> bool:
        """Whether key has a reservation of ours not yet committed (`pending`)."""
        return key in self.pending

    def where(self, key: bytes) -> int | None:
        """The location lookups should use for key: our own copy first, else another
        engine's (the lowest-numbered; a newer commit elsewhere may also take its place)."""
        got = _index.locate(self.probes, key)
        return None if got is None else loc(self.engines[got[0]], got[1])

    def held(self, tag: int, but: int | None = None) -> bool:
        """Whether any engine (other than `but`) holds a block of this tag."""
        return any(e != but and self.table_of(e).find_tag(tag) >= 0 for e in self.engines)

    def count(self, engine: int | None = None) -> int:
        """Blocks every engine holds (a block two engines hold counts twice); or, given an
        engine's number, that engine's blocks."""
        if engine is None:
            return self.table.count + sum(t.count for t in self.tables.values())
        return self.table_of(engine).count if engine in self.engines else 0

    def block(self, key: bytes, engine: int | None = None) -> tuple[int, int] | None:
        """(slot, access time) of an engine's block of key (default: ours), None: it holds none."""
        e = self.engine if engine is None else engine
        t = self.table if e == self.engine else self.tables.get(e)
        s = t.find(key) if t is not None and isinstance(key, bytes) else -1
        return None if s < 0 else (s, t.atime_at(s))

    def keys(self, engine: int | None = None) -> list[bytes]:
        """The keys of the blocks here, read from the files (tools and tests: not for the
        owner's hot paths): every engine's, ours first, each once; or, given an engine's
        number (ours: ns.engine), that engine's (nskeys.py)."""
        return nskeys.keys(self, engine)

    def peers(self) -> list[int]:
        """The other engines holding blocks of this namespace, by number."""
        return sorted(self.tables)

    def still_loading(self) -> bool:
        """Whether the index is on its way: not in and not failed."""
        return not self.ready and not self.load_failed

    # ---- changes, for a watcher ----
    def _added(self, tag: int, key: bytes | None, engine: int) -> None:
        if self.changes is not None and not self.held(tag, but=engine):
            self.changes.append((True, tag, key))

    def _gone(self, tag: int) -> None:
        if self.changes is not None and not self.held(tag):
            self.changes.append((False, tag, None))

    # ---- other engines ----
    def _peer(self, engine: int) -> Table:
        t = self.tables.get(engine)
        if t is None:
            t = self.tables[engine] = Table()
            self._reorder()
        return t

    def peer_apply(self, engine: int, records, max_slot: int, tenants=None) -> tuple[np.ndarray, np.ndarray]:
        """Apply another engine's journal records (a numpy array: journal.parse_records),
        in order; a slot at or past max_slot (beyond the file system) is damage and
        skipped; tenants: the records' tenant ids as ours (tenants.py). Returns its TOUCH
        records of keys it does not hold, (tags, atimes), for touch_tags once every engine's
        records of the look are in (whoever holds the key saw it used)."""
        t, tags = self._peer(engine), record_tags(records)
        touch, changes = apply_records(t, records, tags, max_slot, watch=self.changes is not None, tenants=tenants)
        for tag, added in changes:
            self._added(tag, None, engine) if added else self._gone(tag)
        return tags[touch], records["atime"][touch].astype(np.uint64)

    def touch_tags(self, tags: np.ndarray, atimes: np.ndarray, own: bool = True) -> None:
        """Blocks of these tags were used at these times (another engine's hits): every engine's
        copy (ours too, unless `own` is False) to at least that time, in bulk (Table.touch_tags)."""
        for e in self.engines:
            if own or e != self.engine:
                self.table_of(e).touch_tags(tags, atimes)

    def peer_drop(self, engine: int, key: bytes) -> None:
        t = self.tables.get(engine)
        if t is not None:
            s = t.find(key)
            if s >= 0:
                self._gone(t.clear(s))

    def peer_free(self, engine: int, slot: int) -> None:
        """The block in another engine's `slot` is gone (we evicted it for that engine)."""
        t = self.tables.get(engine)
        if t is not None:
            tag = t.clear(slot)
            if tag:
                self._gone(tag)

    def peer_reset(self, engine: int, table: Table | None) -> None:
        """Replace what we know of `engine` by a full replay of its files (a Table)."""
        old = self.tables.pop(engine, None)
        if table is not None and table.count:
            self.tables[engine] = table
        self._reorder()
        if self.changes is None:
            return
        # a watcher hears of the blocks that came and went (by tag)
        for t, was_there in ((old, True), (table, False)):
            if t is None or not t.count:
                continue
            tags = t.tag[t.live()]
            for tag in tags.tolist():
                if was_there and not self.held(tag):
                    self.changes.append((False, tag, None))
                elif not was_there and (old is None or old.find_tag(tag) < 0) and not self.held(tag, but=engine):
                    self.changes.append((True, tag, None))

    def oldest_peer(self) -> tuple[int, int, int] | None:
        """(atime, engine, slot) of the oldest block another engine holds."""
        best = None
        for e, t in self.tables.items():
            s = t.oldest()
            if s >= 0 and (best is None or t.atime_at(s) < best[0]):
                best = (t.atime_at(s), e, s)
        return best

    def oldest_peer_atime(self) -> int | None:
        """Access time of the oldest block another engine holds."""
        got = self.oldest_peer()
        return None if got is None else got[0]


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
