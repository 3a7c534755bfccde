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
whoever needs them (aiokv/store/journal.py, `read_keys`).

Eviction order: exact LRU on (atime, slot), taken in batches. `oldest` hands out
the oldest live slot; a batch of the oldest ~1/64 of the blocks (at least 256) is
picked at once (a sampled threshold and one pass over the arrays), sorted, and
handed out in order; a slot whose atime changed since (touched, freed, reused) is
skipped. atimes only grow, and new blocks are the youngest, so the batch stays
the oldest blocks until it is used up. Pinned blocks are never in a batch. A batch
may leave out the blocks of some tenants (`oldest(filt=...)`: a tenant's own LRU,
or every tenant but those a quota protects; aiokv/store/quotas.py): the same pass
over the blocks that filter lets through, one batch kept per filter.

Counts: blocks per tenant (`tenant_blocks`) and pinned blocks (`pinned`), kept as
blocks come and go (put, put_many, clear, journal.apply_records) or counted again
after a bulk build (`recount`).

An order applied over several steps (applying.py) watches which slots get a new block
meanwhile (`fresh`: sets the puts add to): those blocks came after the order, and stay.

Threading contract: a Table is changed by one thread (the store's owner, or the
thread that builds it before handing it over). A checkpoint on the store's I/O
thread reads `tag` and `atime` while the owner changes them (journal.py says why
any value it reads is fine); arrays are replaced, never resized in place, so a
reader keeps the ones it took.
"""

from __future__ import annotations

import numpy as np

from aiokv import _index

PINNED = 1  # flags: pinned (an operator's pin, a request's: issue 34), never a victim (format.FLAG_PINNED)
MAX_BATCHES = 16  # victim batches kept at once (one per filter)
MIN_HASH = 1 << 10
GROW = 1 / 8  # slot arrays grow by this fraction (at least MIN_GROW slots) when a slot past them is used
MIN_GROW = 1 << 12
BATCH_SHIFT = 6  # a victim batch is about count >> BATCH_SHIFT blocks
MIN_BATCH = 256

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


class Table:
    def __init__(self, slots: int = 0):
        self.tag = np.zeros(slots, np.uint64)
        self.atime = np.zeros(slots, np.uint64)
        self.tenant = np.zeros(slots, np.uint16)
        self.flags = np.zeros(slots, np.uint8)
        self.hash = np.zeros(MIN_HASH, np.uint32)
        self.count = 0
        self.tenant_blocks = np.zeros(1, np.int64)  # blocks per tenant id
        self.pinned = 0  # blocks with PINNED
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
        self._batches: dict = {}  # filter key -> [slots, their atimes, next index]: the victims in order

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
        return t

    # ---- counts ----
    def recount(self) -> None:
        """Blocks per tenant and pinned blocks, counted from the arrays (after a bulk build)."""
        live = self.tag != 0
        self.tenant_blocks = np.bincount(self.tenant[live], minlength=1).astype(np.int64)
        self.pinned = int(np.count_nonzero(self.flags[live] & PINNED))

    def count_blocks(self, tenants, flags, sign: int) -> None:
        """Blocks of these tenants (ids) and flags came (sign 1) or went (-1)."""
        tenants = np.asarray(tenants, np.int64)
        if not len(tenants):
            return
        n = int(tenants.max()) + 1
        if n > len(self.tenant_blocks):
            self.tenant_blocks = np.concatenate([self.tenant_blocks, np.zeros(n - len(self.tenant_blocks), np.int64)])
        self.tenant_blocks[:n] += sign * np.bincount(tenants, minlength=n)
        self.pinned += sign * int(np.count_nonzero(np.asarray(flags) & PINNED))

    def blocks_of(self, tenant: int) -> int:
        return int(self.tenant_blocks[tenant]) if tenant < len(self.tenant_blocks) else 0

    def _count1(self, tenant: int, flags: int, sign: int) -> None:
        if tenant >= len(self.tenant_blocks):
            self.tenant_blocks = np.concatenate(
                [self.tenant_blocks, np.zeros(tenant + 1 - len(self.tenant_blocks), np.int64)]
            )
        self.tenant_blocks[tenant] += sign
        if flags & PINNED:
            self.pinned += sign

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
        batches = self._batches
        self._bind()  # the hash is unchanged (slots keep their numbers): bound to the new arrays
        self._batches = batches

    def _rehash(self, size: int) -> None:
        self.hash = np.zeros(size, np.uint32)
        batches = self._batches
        self._bind()
        self._batches = batches
        self.probe.build(self.live().astype(np.uint64))

    def put(self, slot: int, tag: int, atime: int, tenant: int = 0, flags: int = 0) -> int:
        """Hold the block of `tag` (of `tenant`, with `flags`) in `slot`; returns the slot it
        leaves (the same tag was elsewhere: one slot a key) or -1. Whatever `slot` held
        before is gone."""
        self._cover(slot)
        old = self.probe.find_tag(tag)
        if old == slot:
            self._atimes[slot] = atime
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
        return tag

    def set_flags(self, slot: int, flags: int) -> bool:
        """The block in `slot` has these flags from now on; False if there is none or they did not change."""
        if slot >= len(self._tags) or not self._tags[slot] or self.flags[slot] == flags:
            return False
        self.pinned += bool(flags & PINNED) - bool(self.flags[slot] & PINNED)
        self.flags[slot] = flags
        return True

    def touch(self, slot: int, atime: int) -> bool:
        """The block in `slot` was used at atime (kept if older than what it has)."""
        if atime > self._atimes[slot]:
            self._atimes[slot] = atime
            return True
        return False

    # ---- eviction order ----
    def oldest(self, skip=None, filt: tuple | None = None) -> int:
        """The slot of the least recently used block (atime, then slot) that is not pinned,
        passes `filt` and of which skip(slot) is not true; -1 if none. filt: (a hashable
        key naming it, a uint8 array over tenant ids: 1 leaves that tenant's blocks out;
        ids past its end are in). Does not take it: the caller clears it (or not)."""
        tags, atimes, flags = self._tags, self._atimes, self.flags
        key = None if filt is None else filt[0]
        b = self._batches.get(key)
        refills = 0
        while True:
            if b is None or b[2] >= len(b[0]):
                if refills == 2:  # every candidate skipped twice over (held by loads): none now
                    return -1
                refills += 1
                b = self._refill(filt)
                if b is None:
                    return -1
            s = int(b[0][b[2]])
            if (
                s < len(tags)
                and tags[s]
                and atimes[s] == b[1][b[2]]
                and not flags[s] & PINNED
                and (skip is None or not skip(s))
            ):
                return s
            b[2] += 1

    def _eligible(self, sel: np.ndarray, excluded: np.ndarray | None) -> np.ndarray:
        """Which of the slots `sel` hold a block that may be a victim under the filter."""
        ok = (self.tag[sel] != 0) & ((self.flags[sel] & PINNED) == 0)
        if excluded is not None and len(excluded):
            ten = self.tenant[sel]
            inr = ten < len(excluded)
            ok[inr] &= excluded[ten[inr]] == 0
        return ok

    def _refill(self, filt: tuple | None):
        """The next batch of the oldest blocks the filter lets through (kept under its key);
        None if there are none."""
        key, excluded = (None, None) if filt is None else filt
        self._batches.pop(key, None)
        if not self.count:
            return None
        est = self.count - self.pinned
        if excluded is not None and len(excluded):
            m = min(len(excluded), len(self.tenant_blocks))
            est -= int(self.tenant_blocks[:m][excluded[:m] != 0].sum())
        if est <= 0 and self.pinned == 0:
            return None
        est = max(est, 1)
        want = max(MIN_BATCH, est >> BATCH_SHIFT)
        n = len(self.tag)
        ex = np.zeros(0, np.uint8) if excluded is None else np.ascontiguousarray(excluded, np.uint8)
        sel = None
        if est > 4 * want:
            # a threshold from a sample, then one pass: the blocks at most that old
            rng = np.random.default_rng()
            idx = rng.integers(0, n, size=min(n, 1 << 16))
            seen = self.atime[idx][self._eligible(idx, excluded)]
            if len(seen) >= 64:
                thr = np.quantile(seen, min(1.0, 2.0 * want / est), method="higher")
                out = np.empty(8 * want, np.int64)
                # one pass, no temporaries
                k = _index.older_of(self.tag, self.atime, self.tenant, self.flags, ex, int(thr), out)
                sel = out[:k] if k >= want // 4 else None  # too few or too many: an unlucky sample
        if sel is None:
            live = self.live()
            sel = live[self._eligible(live, excluded)]
        if not len(sel):
            return None
        at = self.atime[sel]
        if len(sel) > want:
            part = np.argpartition(at, want - 1)[:want]
            sel, at = sel[part], at[part]
        order = np.lexsort((sel, at))
        if len(self._batches) >= MAX_BATCHES:
            self._batches.pop(next(iter(self._batches)))
        b = self._batches[key] = [sel[order], at[order], 0]
        return b

    def forget_order(self) -> None:
        """Blocks changed in bulk: the next victim comes from a new batch."""
        self._batches = {}

    def oldest_atime(self, filt: tuple | None = None) -> int | None:
        """The atime of the least recently used block that may be a victim (under filt), or None."""
        s = self.oldest(filt=filt)
        return None if s < 0 else self._atimes[s]

    def in_order(self) -> np.ndarray:
        """Every live slot, least recently used first (atime, then slot): for tools and tests."""
        live = self.live()
        return live[np.lexsort((live, self.atime[live]))]
