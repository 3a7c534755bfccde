"""The in-memory index: which key sits in which slot, LRU order, slot allocation.

Pure bookkeeping, no files: the Store persists what this decides (journal.py)
and does the I/O. Kept apart so property tests can drive it fast.

Threading contract: one thread (the Store's owner) calls everything here.
"""
from __future__ import annotations

import collections
import time


class SlotAllocator:
    """Slots of one namespace: free (backed by disk space), holes (punched), and a high-water mark.

    Every slot below `hwm` is exactly one of: in use (given out), free, or a hole.
    `backed` counts slots that hold disk space (in use + free).
    """

    def __init__(self, hwm: int = 0, in_use: set[int] | None = None):
        in_use = in_use or set()
        self.hwm = max([hwm, *(s + 1 for s in in_use)])
        self.free: list[int] = []
        self.holes: list[int] = [s for s in range(self.hwm - 1, -1, -1) if s not in in_use]
        self.in_use = len(in_use)

    @property
    def backed(self) -> int:
        return self.in_use + len(self.free)

    def take(self) -> int | None:
        """A backed free slot, or None."""
        if not self.free:
            return None
        self.in_use += 1
        return self.free.pop()

    def plan_grow(self, n: int) -> list[int]:
        """Slots that would become backed by growing n: holes first, then new ones."""
        out = self.holes[-n:][::-1]
        return out + list(range(self.hwm, self.hwm + n - len(out)))

    def grow(self, slots: list[int]) -> None:
        """The planned slots now have disk space: they become free."""
        holes = set(slots)
        self.holes = [h for h in self.holes if h not in holes]
        self.hwm = max([self.hwm, *(s + 1 for s in slots)])
        self.free.extend(sorted(slots, reverse=True))

    def release(self, slot: int) -> None:
        """An in-use slot goes back to the free list (keeps its disk space)."""
        self.in_use -= 1
        self.free.append(slot)

    def punch(self, slot: int) -> None:
        """An in-use slot loses its disk space."""
        self.in_use -= 1
        self.holes.append(slot)


class Namespace:
    """One namespace's entries, pending reservations and allocator."""

    def __init__(self, nsid: bytes, payload_bytes: int, slot_bytes: int, ranks: int, fields: dict):
        self.nsid = nsid
        self.payload_bytes = payload_bytes
        self.slot_bytes = slot_bytes
        self.ranks = ranks
        self.fields = fields
        self.entries: dict[bytes, int] = {}
        self.atime: dict[bytes, int] = {}
        self.pending: dict[bytes, int] = {}
        self.alloc = SlotAllocator()

    @property
    def slot_cost(self) -> int:
        """Bytes on disk one slot takes across all ranks."""
        return self.slot_bytes * self.ranks

    @property
    def hex(self) -> str:
        return self.nsid.hex()


class Index:
    """All namespaces of a store plus one global LRU order over committed entries."""

    def __init__(self):
        self.namespaces: dict[bytes, Namespace] = {}
        self.lru: collections.OrderedDict[tuple[bytes, bytes], None] = collections.OrderedDict()
        self.pins: collections.Counter = collections.Counter()

    @property
    def physical_bytes(self) -> int:
        return sum(ns.alloc.backed * ns.slot_cost for ns in self.namespaces.values())

    def load(self, ns: Namespace, entries: dict[bytes, tuple[int, int]]) -> None:
        """Install entries replayed from disk, oldest access first in the LRU."""
        ns.entries = {k: s for k, (s, _) in entries.items()}
        ns.atime = {k: a for k, (_, a) in entries.items()}
        ns.alloc = SlotAllocator(0, set(ns.entries.values()))
        self.namespaces[ns.nsid] = ns
        merged = sorted(((a, ns.nsid, k) for k, a in ns.atime.items()))
        # re-sort the whole LRU so several namespaces interleave by access time
        old = [(self._atime(n, k), n, k) for (n, k) in self.lru]
        self.lru = collections.OrderedDict(((n, k), None) for _, n, k in sorted(old + merged))

    def _atime(self, nsid: bytes, key: bytes) -> int:
        return self.namespaces[nsid].atime.get(key, 0)

    def lookup(self, ns: Namespace, keys, limit: int | None = None) -> int:
        """Length of the run of committed keys at the start of `keys` (at most `limit`).
        No side effects."""
        entries = ns.entries
        n = 0
        stop = len(keys) if limit is None else min(limit, len(keys))
        while n < stop and keys[n] in entries:
            n += 1
        return n

    def touch(self, ns: Namespace, keys, now: int | None = None) -> None:
        now = now or time.time_ns()
        for k in keys:
            if k in ns.entries:
                ns.atime[k] = now
                self.lru.move_to_end((ns.nsid, k))

    def commit(self, ns: Namespace, key: bytes, slot: int, now: int) -> None:
        ns.entries[key] = slot
        ns.atime[key] = now
        self.lru[(ns.nsid, key)] = None

    def remove(self, ns: Namespace, key: bytes) -> int | None:
        """Forget a committed key; return its slot (still in use) or None."""
        slot = ns.entries.pop(key, None)
        if slot is not None:
            ns.atime.pop(key, None)
            self.lru.pop((ns.nsid, key), None)
        return slot

    def victim(self) -> tuple[Namespace, bytes] | None:
        """The least recently used committed, unpinned entry."""
        for nsid, key in self.lru:
            if not self.pins[(nsid, key)]:
                return self.namespaces[nsid], key
        return None
