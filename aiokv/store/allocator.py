# SPDX-License-Identifier: Apache-2.0
"""Slot allocation of one namespace: which slots are in use, free (backed by disk space) or holes.

Pure bookkeeping, no files: the Store punches and grows the files (space.py) and
tells the allocator what it did.

Threading contract: one thread (the Store's owner) calls everything here.
"""

from __future__ import annotations

from array import array

import numpy as np

HOLES_INLINE = 1 << 18  # holes in the array (2 MiB) past which a bulk punch parks more


class SlotAllocator:
    """Slots of one namespace: free (backed by disk space), holes (punched), and a high-water mark.

    Every slot below `hwm` is exactly one of: in use (given out), free, or a hole
    (but while the owner punches a slot it is none: space.py `_unback`, loading.py `Loader.loaded`).
    `backed` counts slots that hold disk space (in use + free). `free` and `holes`
    are arrays of slot numbers (8 bytes each), taken from their ends. Holes a clear
    punches in bulk past HOLES_INLINE wait in `parked` (numpy arrays) and move into
    `holes` as grows need them: growing a large array copies it, and the clear's
    steps stay short (applying.py).
    """

    def __init__(self, hwm: int = 0, in_use=None):
        in_use = set(in_use or ())
        self.hwm = max([hwm, *(s + 1 for s in in_use)])
        self.free = array("q")
        self.holes = array("q", (s for s in range(self.hwm - 1, -1, -1) if s not in in_use))
        self.parked: list[np.ndarray] = []
        self.in_use = len(in_use)

    @classmethod
    def of_mask(cls, used: np.ndarray) -> SlotAllocator:
        """Slots in use where `used` (a bool array over 0..hwm-1) is true; the rest are holes."""
        a = cls()
        a.hwm = len(used)
        a.holes = array("q", np.flatnonzero(~used)[::-1].astype(np.int64).tobytes())
        a.in_use = int(used.sum())
        return a

    @property
    def backed(self) -> int:
        return self.in_use + len(self.free)

    def take(self) -> int | None:
        """A backed free slot, or None."""
        if not self.free:
            return None
        self.in_use += 1
        return self.free.pop()

    @property
    def hole_count(self) -> int:
        return len(self.holes) + sum(len(p) for p in self.parked)

    def plan_grow(self, n: int) -> list[int]:
        """Slots that would become backed by growing n: holes first, then new ones."""
        while len(self.holes) < n and self.parked:
            self.holes.frombytes(self.parked.pop().tobytes())
        out = list(self.holes[-n:][::-1]) if n > 0 else []
        return out + list(range(self.hwm, self.hwm + n - len(out)))

    def grow(self, slots) -> None:
        """The planned slots now have disk space: they become free."""
        slots = list(slots)
        k = len(self.holes)
        tail = [s for s in slots if s < self.hwm]
        if tail and list(self.holes[k - len(tail) :][::-1]) == tail:
            del self.holes[k - len(tail) :]  # plan_grow's holes: the end of the array
        elif tail:
            gone = set(tail)
            self.holes = array("q", (h for h in self.holes if h not in gone))
        if slots:
            self.hwm = max(self.hwm, max(slots) + 1)
        self.free.extend(sorted(slots, reverse=True))

    def release(self, slot: int) -> None:
        """An in-use slot goes back to the free list (keeps its disk space)."""
        self.in_use -= 1
        self.free.append(slot)

    def punch(self, slot: int) -> None:
        """An in-use slot loses its disk space."""
        self.in_use -= 1
        self.holes.append(slot)

    def release_many(self, slots: np.ndarray) -> None:
        """release, for many (a clear's: applying.py)."""
        self.in_use -= len(slots)
        self.free.frombytes(memoryview(np.ascontiguousarray(slots, np.int64)).cast("B"))

    def punch_many(self, slots: np.ndarray) -> None:
        """punch, for many (a clear's: applying.py)."""
        self.in_use -= len(slots)
        if len(self.holes) + len(slots) <= HOLES_INLINE:
            self.holes.frombytes(memoryview(np.ascontiguousarray(slots, np.int64)).cast("B"))
        else:
            self.parked.append(np.asarray(slots, np.int64))
