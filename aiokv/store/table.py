# SPDX-License-Identifier: Apache-2.0
"""One engine's blocks of one namespace, in a few bytes a block: the compact index.

Per slot, in numpy arrays indexed by slot: the 64-bit tag of the key stored there
(`tag`, 0: none; aiokv._index.tag), its last access in ns since the epoch (`atime`),
its tenant (`tenant`, uint16: the store's id of a request's cache_salt, 0: none;
aiokv/store/tenants.py) and flags (`flags`, uint8: PINNED, never a victim) — 19
bytes; and an open-addressing hash
of tags to slots (a uint32 a position, slot + 1, at most 3/4 full: 5.3-10.7 bytes a
block). No Python object per block, and no key: the slot header on disk holds the
whole key, and every read checks it, so a tag that two keys share is a miss after
that check, never a wrong block; the files (checkpoint, journal) hold the keys for
whoever needs them (aiokv/store/readkeys.py, `read_keys`).

Eviction order: exact LRU on (atime, then slot), per tenant: aiokv._index.Order
(native/order.c) keeps, for each tenant, its blocks that may be victims (not PINNED) in that
order, as they come, go, are used, pinned and unpinned (10 bytes a slot, built at the first
search or by `build_order`). `oldest` asks it for the least recently used block of every tenant,
of one (`filt=("only", tid)`), or of all but some (`filt=("except", mask)`: quotas.py); a block a
load holds (`skip`) is passed over and keeps its place. One search reads one entry per tenant
holding blocks (and each held block it passes): `examined` counts them. Every change to a slot's
tag, atime, tenant or flags goes through the methods here, or is followed by `changed(slots)`
(journal.apply_records) before the next search; a table filled in bulk is ordered anew by
`build_order` (on the thread that built it, before handing it over: a stable radix sort,
O(blocks)), or else at its first search.

Counts: blocks per tenant (`tenant_blocks`), pinned blocks (`pinned`) and pinned blocks per
tenant (`tenant_pinned`: the bound on a tenant's request pins, aiokv/store/pins.py), kept as
blocks come and go (put, put_many, clear, journal.apply_records) or counted again
after a bulk build (`recount`): TableCounts (tablecounts.py).

An order applied over several steps (applying.py) watches which slots get a new block
meanwhile (`fresh`: sets the puts add to): those blocks came after the order, and stay.

Threading contract: a Table is changed by one thread (the store's owner, or the
thread that builds it before handing it over). A checkpoint on the store's I/O
thread reads `tag` and `atime` while the owner changes them (journal.py says why
any value it reads is fine); arrays are replaced, never resized in place, so a
reader keeps the ones it took. The eviction order is the changing thread's alone (its
build releases the GIL: only reads of the arrays go on meanwhile).
"""

from __future__ import annotations

import numpy as np

from aiokv import _index
from aiokv.store.tablecounts import PINNED, TableCounts

MIN_HASH = 1 << 10
GROW = 1 / 8  # slot arrays grow by this fraction (at least MIN_GROW slots) when a slot past them is used
MIN_GROW = 1 << 12

tag_of = _index.tag


def give_back_scratch() -> None:
    """Hand the memory a bulk load freed back to the system (glibc keeps freed heap memory
    for reuse: tens of MB of a load's temporaries would stay in the process's RSS)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # another C library: its own policy


def hash_size(n: int) -> int:
    """The hash's size for n blocks: a power of two at most 3/4 full."""
    size = MIN_HASH
    while size * 3 < n * 4:
        size *= 2
    return size


class Table(TableCounts):
    def __init__(self, slots: int = 0):
        self.tag = np.zeros(slots, np.uint64)
        self.atime = np.zeros(slots, np.uint64)
        self.tenant = np.zeros(slots, np.uint16)
        self.flags = np.zeros(slots, np.uint8)
        self.hash = np.zeros(MIN_HASH, np.uint32)
        self.count = 0
        self.tenant_blocks = np.zeros(1, np.int64)  # blocks per tenant id
        self.pinned = 0  # blocks with PINNED
        self.tenant_pinned = np.zeros(1, np.int64)  # blocks with PINNED per tenant id (request pins' bound)
        self._order = None
        self._ordered = slots == 0  # the order is kept (an empty table's from the start); else built when needed
        self.fresh: list[set] = []  # the watchers of new blocks (applying.py): each put adds its slot
        self._bind()

    def _bind(self) -> None:
        # one Probe for the table's life, bound again to new arrays: a namespace keeps it
        if getattr(self, "probe", None) is None:
            self.probe = _index.Probe(self.tag, self.hash)
        else:
            self.probe.__init__(self.tag, self.hash)
        self._tags = memoryview(self.tag)  # scalar access, faster than numpy's
        self._atimes = memoryview(self.atime)
        if self._order is None:
            self._order = _index.Order(self.tag, self.atime, self.tenant, self.flags)
        else:
            self._order.bind(self.tag, self.atime, self.tenant, self.flags)

    @classmethod
    def of(cls, slots, tags, atimes, tenants=None, flags=None) -> Table:
        """A table holding the given blocks (slots distinct, tags non-zero and distinct)."""
        slots = np.asarray(slots, np.uint64)
        t = cls(int(slots.max()) + 1 if len(slots) else 0)
        t.tag[slots] = tags
        t.atime[slots] = atimes
        if tenants is not None:
            t.tenant[slots] = tenants
        if flags is not None:
            t.flags[slots] = flags
        t.count = len(slots)
        t.hash = np.zeros(hash_size(t.count), np.uint32)
        t._bind()
        t.probe.build(slots)
        t.recount()
        t.forget_order()
        return t

    @property
    def slots(self) -> int:
        """Slots the arrays cover."""
        return len(self.tag)

    @property
    def nbytes(self) -> int:
        return self.tag.nbytes + self.atime.nbytes + self.tenant.nbytes + self.flags.nbytes + self.hash.nbytes

    def live(self) -> np.ndarray:
        """The slots holding a block, ascending."""
        return np.flatnonzero(self.tag)

    # ---- lookups ----
    def find(self, key: bytes) -> int:
        """The slot of key, or -1."""
        return self.probe.find(key)

    def find_tag(self, tag: int) -> int:
        return self.probe.find_tag(tag)

    def tag_at(self, slot: int) -> int:
        return self._tags[slot] if slot < len(self._tags) else 0

    def atime_at(self, slot: int) -> int:
        return self._atimes[slot]

    # ---- changes ----
    def _cover(self, slot: int) -> None:
        """Arrays past `slot` (grown by GROW, replaced: never resized in place)."""
        n = len(self.tag)
        if slot < n:
            return
        new = max(slot + 1, n + max(int(n * GROW), MIN_GROW))
        for name in ("tag", "atime", "tenant", "flags"):
            old = getattr(self, name)
            arr = np.zeros(new, old.dtype)
            arr[:n] = old
            setattr(self, name, arr)
        self._bind()  # the hash is unchanged (slots keep their numbers): bound to the new arrays

    def _rehash(self, size: int) -> None:
        self.hash = np.zeros(size, np.uint32)
        self._bind()
        self.probe.build(self.live().astype(np.uint64))

    def put(self, slot: int, tag: int, atime: int, tenant: int = 0, flags: int = 0) -> int:
        """Hold the block of `tag` (of `tenant`, with `flags`) in `slot`; returns the slot it
        leaves (the same tag was elsewhere: one slot a key) or -1. Whatever `slot` held
        before is gone."""
        self._cover(slot)
        old = self.probe.find_tag(tag)
        if old == slot:
            self._atimes[slot] = atime
            self._sync(slot)
            return -1
        if old >= 0:
            self.clear(old)
        if self._tags[slot]:
            self.clear(slot)
        if (self.count + 1) * 4 > len(self.hash) * 3:
            self._rehash(len(self.hash) * 2)
        self._tags[slot] = tag
        self._atimes[slot] = atime
        self.tenant[slot] = tenant
        self.flags[slot] = flags
        for f in self.fresh:
            f.add(slot)
        self._count1(tenant, flags, 1)
        self.probe.insert(slot)
        self.count += 1
        self._sync(slot)
        return old

    def put_many(self, slots: np.ndarray, tags: np.ndarray, ats: np.ndarray, tenant: int = 0, flags: int = 0) -> None:
        """put, for many blocks at once (uint64 arrays; all of `tenant`, with `flags`)."""
        if not len(slots):
            return
        self._cover(int(slots.max()))
        if (self.count + len(slots)) * 4 > len(self.hash) * 3:
            self._rehash(hash_size(self.count + len(slots)))
        # blocks this replaces (in these slots, or these tags elsewhere) are counted out first
        where = np.full(len(tags), -1, np.int64)
        self.probe.find_many(np.ascontiguousarray(tags, np.uint64), where)
        gone = np.unique(np.concatenate([where[where >= 0], slots.astype(np.int64)[self.tag[slots] != 0]]))
        self.count_blocks(self.tenant[gone], self.flags[gone], -1)
        self.tenant[gone] = 0
        self.flags[gone] = 0
        self.count += self.probe.put_many(slots, tags, ats, self.atime)
        self.tenant[slots] = tenant
        self.flags[slots] = flags
        for f in self.fresh:
            f.update(slots.tolist())
        self.count_blocks(np.full(len(slots), tenant), np.full(len(slots), flags, np.uint8), 1)
        self.changed(np.concatenate([gone, slots.astype(np.int64)]))

    def clear(self, slot: int) -> int:
        """Forget the block in `slot`; returns its tag (0: there was none)."""
        if slot >= len(self._tags):
            return 0
        tag = self._tags[slot]
        if tag:
            self.probe.erase(slot)
            self._count1(int(self.tenant[slot]), int(self.flags[slot]), -1)
            self._tags[slot] = 0
            self._atimes[slot] = 0
            self.tenant[slot] = 0
            self.flags[slot] = 0
            self.count -= 1
            self._sync(slot)
        return tag

    def set_flags(self, slot: int, flags: int) -> bool:
        """The block in `slot` has these flags from now on; False if there is none or they did not change."""
        if slot >= len(self._tags) or not self._tags[slot] or self.flags[slot] == flags:
            return False
        change = bool(flags & PINNED) - bool(self.flags[slot] & PINNED)
        if change:
            self.pinned += change
            self._pin1(int(self.tenant[slot]), change)
        self.flags[slot] = flags
        self._sync(slot)
        return True

    def touch(self, slot: int, atime: int) -> bool:
        """The block in `slot` was used at atime (kept if older than what it has)."""
        if atime > self._atimes[slot]:
            self._atimes[slot] = atime
            self._sync(slot)
            return True
        return False

    def touch_tags(self, tags: np.ndarray, atimes: np.ndarray) -> None:
        """touch() of the blocks of these tags (uint64) at these times (uint64), in bulk: one
        probe call, each block kept at the latest of its time and theirs (a tag twice: its
        latest), and only the blocks that moved resorted."""
        found = np.full(len(tags), -1, np.int64)
        self.probe.find_many(tags, found)
        hit = found >= 0
        if not hit.any():
            return
        slots, times = found[hit], atimes[hit]
        later = times > self.atime[slots]
        if not later.any():
            return
        slots, times = slots[later], times[later]
        self.atime[slots] = times  # a slot named twice keeps the last write here...
        short = self.atime[slots] < times
        if short.any():  # ...and the later of its times (rare: a key touched twice in one batch)
            np.maximum.at(self.atime, slots[short], times[short])
        self.changed(slots)  # (it takes a slot named twice once)

    def retenant(self, tenants: np.ndarray) -> None:
        """Every slot's tenant id renamed (another engine's ids as ours: each old id to one new)."""
        self.tenant[:] = tenants
        self.recount()
        if self._ordered:
            self._order.relabel()

    # ---- eviction order ----
    def _sync(self, slot: int) -> None:
        if self._ordered:
            self._order.sync(slot)

    def changed(self, slots: np.ndarray) -> None:
        """The blocks in these slots changed other than through the methods here (tag, atime,
        tenant or flags): each goes to its place in the eviction order, or out of it."""
        if self._ordered and len(slots):
            self._order.changed(np.ascontiguousarray(slots, np.int64))

    def emptied(self) -> None:
        """Every block was forgotten at once (new zeroed columns: bulk.empty): the order holds
        none, without a pass over the slots."""
        self._order.clear()
        self._ordered = True

    def build_order(self) -> None:
        """Order every block now (after a bulk build; the thread building the table, before it
        hands it over: the GIL is released meanwhile)."""
        self._order.build()
        self._ordered = True

    def forget_order(self) -> None:
        """The arrays were filled in bulk: the order is built again at the next search."""
        self._ordered = False

    @property
    def examined(self) -> int:
        """Entries the victim searches have read (tests and benchmarks: the work per call)."""
        return self._order.examined

    def oldest(self, skip=None, filt: tuple | None = None) -> int:
        """The slot of the least recently used block (atime, then slot) that is not pinned,
        passes `filt` and of which skip(slot) is not true (a load holds it); -1 if none. filt:
        None (every tenant), ("only", tenant id) or ("except", a uint8 array over tenant ids:
        1 leaves that tenant's blocks out; ids past its end are in). Does not take it: the
        caller clears it (or not). Reads one entry per tenant it looks at, and each skipped."""
        if not self._ordered:
            self.build_order()
        order, held = self._order, None
        only = filt is not None and filt[0] == "only"
        excluded = None if filt is None or only else filt[1]
        while True:
            s = order.front(filt[1], held) if only else order.first(excluded, held)
            if s < 0 or skip is None or not skip(s):
                return s
            held = np.union1d(held if held is not None else np.zeros(0, np.uint32), [s]).astype(np.uint32)

    def oldest_atime(self, filt: tuple | None = None) -> int | None:
        """The atime of the least recently used block that may be a victim (under filt), or None."""
        s = self.oldest(filt=filt)
        return None if s < 0 else self._atimes[s]

    def in_order(self) -> np.ndarray:
        """Every live slot, least recently used first (atime, then slot): for tools and tests."""
        live = self.live()
        return live[np.lexsort((live, self.atime[live]))]
