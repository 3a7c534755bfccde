# SPDX-License-Identifier: Apache-2.0
"""One engine's blocks of one namespace, in a few bytes a block: the compact index.

Per slot, in numpy arrays indexed by slot: the 64-bit tag of the key stored there
(`tag`, 0: none; aiokv._index.tag), its last access in ns since the epoch (`atime`),
a tenant (`tenant`, uint16, 0 until issue 34's quotas use it) and flags (`flags`,
uint8: PINNED reserved for issue 34's pins) — 19 bytes; and an open-addressing hash
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
the oldest blocks until it is used up. A tenant's own LRU (issue 34) is the same
pass restricted to `tenant == t`.

Threading contract: a Table is changed by one thread (the store's owner, or the
thread that builds it before handing it over). A checkpoint on the store's I/O
thread reads `tag` and `atime` while the owner changes them (journal.py says why
any value it reads is fine); arrays are replaced, never resized in place, so a
reader keeps the ones it took.
"""

from __future__ import annotations

import numpy as np

from aiokv import _index

PINNED = 1  # flags: pinned by an operator (issue 34): never a victim
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
        self._bind()

    def _bind(self) -> None:
        # one Probe for the table's life, bound again to new arrays: a namespace keeps it
        if getattr(self, "probe", None) is None:
            self.probe = _index.Probe(self.tag, self.hash)
        else:
            self.probe.__init__(self.tag, self.hash)
        self._tags = memoryview(self.tag)  # scalar access, faster than numpy's
        self._atimes = memoryview(self.atime)
        self._cand = np.zeros(0, np.int64)
        self._cand_at = np.zeros(0, np.uint64)
        self._ci = 0

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
        cand, at, ci = self._cand, self._cand_at, self._ci
        self._bind()  # the hash is unchanged (slots keep their numbers): bound to the new arrays
        self._cand, self._cand_at, self._ci = cand, at, ci

    def _rehash(self, size: int) -> None:
        self.hash = np.zeros(size, np.uint32)
        cand, at, ci = self._cand, self._cand_at, self._ci
        self._bind()
        self._cand, self._cand_at, self._ci = cand, at, ci
        self.probe.build(self.live().astype(np.uint64))

    def put(self, slot: int, tag: int, atime: int) -> int:
        """Hold the block of `tag` in `slot`; returns the slot it leaves (the same tag was
        elsewhere: one slot a key) or -1. Whatever `slot` held before is gone."""
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
        self.probe.insert(slot)
        self.count += 1
        return old

    def put_many(self, slots: np.ndarray, tags: np.ndarray, ats: np.ndarray) -> None:
        """put, for many blocks at once (uint64 arrays; new blocks: tenant and flags 0)."""
        if not len(slots):
            return
        self._cover(int(slots.max()))
        if (self.count + len(slots)) * 4 > len(self.hash) * 3:
            self._rehash(hash_size(self.count + len(slots)))
        self.count += self.probe.put_many(slots, tags, ats, self.atime)
        self.tenant[slots] = 0
        self.flags[slots] = 0

    def clear(self, slot: int) -> int:
        """Forget the block in `slot`; returns its tag (0: there was none)."""
        if slot >= len(self._tags):
            return 0
        tag = self._tags[slot]
        if tag:
            self.probe.erase(slot)
            self._tags[slot] = 0
            self._atimes[slot] = 0
            self.tenant[slot] = 0
            self.flags[slot] = 0
            self.count -= 1
        return tag

    def touch(self, slot: int, atime: int) -> bool:
        """The block in `slot` was used at atime (kept if older than what it has)."""
        if atime > self._atimes[slot]:
            self._atimes[slot] = atime
            return True
        return False

    # ---- eviction order ----
    def oldest(self, skip=None) -> int:
        """The slot of the least recently used block (atime, then slot), skip(slot) not
        true of it; -1 if none. Does not take it: the caller clears it (or not)."""
        tags, atimes = self._tags, self._atimes
        while True:
            if self._ci >= len(self._cand) and not self._refill():
                return -1
            s = int(self._cand[self._ci])
            if s < len(tags) and tags[s] and atimes[s] == self._cand_at[self._ci] and (skip is None or not skip(s)):
                return s
            self._ci += 1

    def _refill(self) -> bool:
        """The next batch of the oldest blocks; False if there are none."""
        if not self.count:
            return False
        want = max(MIN_BATCH, self.count >> BATCH_SHIFT)
        n = len(self.tag)
        sel = None
        if self.count > 4 * want:
            # a threshold from a sample, then one pass: the blocks at most that old
            rng = np.random.default_rng()
            idx = rng.integers(0, n, size=min(n, 1 << 16))
            seen = self.atime[idx][self.tag[idx] != 0]
            if len(seen) >= 64:
                thr = np.quantile(seen, min(1.0, 2.0 * want / self.count), method="higher")
                out = np.empty(8 * want, np.int64)
                k = _index.older(self.tag, self.atime, int(thr), out)  # one pass, no temporaries
                sel = out[:k] if k >= want // 4 else None  # too few or too many: an unlucky sample
        if sel is None:
            sel = self.live()
        at = self.atime[sel]
        if len(sel) > want:
            part = np.argpartition(at, want - 1)[:want]
            sel, at = sel[part], at[part]
        order = np.lexsort((sel, at))
        self._cand, self._cand_at, self._ci = sel[order], at[order], 0
        return len(sel) > 0

    def forget_order(self) -> None:
        """Blocks changed in bulk: the next victim comes from a new batch."""
        self._cand = np.zeros(0, np.int64)
        self._cand_at = np.zeros(0, np.uint64)
        self._ci = 0

    def oldest_atime(self) -> int | None:
        """The atime of the least recently used block, or None."""
        s = self.oldest()
        return None if s < 0 else self._atimes[s]

    def in_order(self) -> np.ndarray:
        """Every live slot, least recently used first (atime, then slot): for tools and tests."""
        live = self.live()
        return live[np.lexsort((live, self.atime[live]))]
