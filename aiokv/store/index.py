# SPDX-License-Identifier: Apache-2.0
"""The in-memory index: which key sits in which slot, LRU order, slot allocation.

Pure bookkeeping, no files: the Store persists what this decides (journal.py)
and does the I/O. Kept apart so property tests can drive it fast.

Threading contract: one thread (the Store's owner) calls everything here.
"""

from __future__ import annotations

import collections
import time

from aiokv.data.format import REC_COMMIT, REC_DROP, loc


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
    """One namespace as one engine sees it: its own entries, pending reservations
    and allocator, the entries of the other engines on the directory (followed
    from their journals), and `entries`, the union of both that lookups read.

    `engine` is this engine's number (None for a read-only opener, which owns
    nothing). Own slots are plain slot numbers; `entries` and `pending` hold
    locations (format.loc: engine << 32 | slot), which for engine 0 are the slots.
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
        self.entries: dict[bytes, int] = {}  # key -> location, every engine's blocks
        self.own: dict[bytes, int] = {}  # key -> slot, this engine's blocks
        self.atime: dict[bytes, int] = {}  # own keys -> last access
        self.pending: dict[bytes, int] = {}  # key -> location reserved, not yet committed
        self.alloc = SlotAllocator()
        # other engines: engine -> key -> (slot, last commit or TOUCH time), oldest first
        self.peers: dict[int, collections.OrderedDict[bytes, tuple[int, int]]] = {}
        # a watcher's list (the connector's KV events sets it): (True, key) when key becomes
        # a hit here (in `entries`), (False, key) when it stops being one; None: not watched
        self.changes: list[tuple[bool, bytes]] | None = None

    def _added(self, key: bytes, where: int) -> None:
        if self.changes is not None and key not in self.entries:
            self.changes.append((True, key))
        self.entries[key] = where

    @property
    def slot_cost(self) -> int:
        """Bytes on disk one slot takes across all ranks."""
        return self.slot_bytes * self.ranks

    @property
    def hex(self) -> str:
        return self.nsid.hex()

    def where(self, key: bytes) -> int | None:
        """The location lookups should use for key: our own copy first, else another
        engine's (the lowest-numbered; a newer commit elsewhere may also take its place)."""
        slot = self.own.get(key)
        if slot is not None:
            return self.base | slot
        for e in sorted(self.peers):
            got = self.peers[e].get(key)
            if got is not None:
                return loc(e, got[0])
        return None

    def _resolve(self, key: bytes) -> None:
        where = self.where(key)
        if where is None:
            if self.entries.pop(key, None) is not None and self.changes is not None:
                self.changes.append((False, key))
        else:
            self.entries[key] = where

    def peer_apply(self, engine: int, records, max_slot: int) -> list[tuple[bytes, int]]:
        """Apply another engine's journal records (kind, key, slot, atime), in order;
        a slot at or past max_slot (beyond the file system) is damage and skipped.
        Returns the (key, atime) of TOUCH records for keys we hold (Index.touch them)."""
        d = self.peers.get(engine)
        if d is None:
            d = self.peers[engine] = collections.OrderedDict()
        own, base = self.own, loc(engine, 0)
        touched = []
        for kind, key, slot, atime in records:
            if kind == REC_COMMIT:
                if slot >= max_slot:
                    continue
                d.pop(key, None)  # a new commit time: to the young end
                d[key] = (slot, atime)
                if key not in own:
                    self._added(key, base | slot)
            elif kind == REC_DROP:
                if d.pop(key, None) is not None:
                    self._resolve(key)
            else:  # TOUCH: whoever holds the key saw it used
                touched += self.peer_touches([(key, atime)])
        return touched

    def peer_touches(self, touches) -> list[tuple[bytes, int]]:
        """Apply another engine's hits [(key, atime)]; return those on keys we hold."""
        out = []
        for key, atime in touches:
            self.peer_touch(key, atime)
            if key in self.own:
                out.append((key, atime))
        return out

    def peer_touch(self, key: bytes, atime: int) -> None:
        """Another engine's copies of key were used at atime: to the young end."""
        for d in self.peers.values():
            got = d.get(key)
            if got is not None and got[1] < atime:
                d[key] = (got[0], atime)
                d.move_to_end(key)

    def peer_drop(self, engine: int, key: bytes) -> None:
        d = self.peers.get(engine)
        if d is not None and d.pop(key, None) is not None:
            self._resolve(key)

    def peer_reset(self, engine: int, entries: dict[bytes, tuple[int, int]]) -> None:
        """Replace what we know of `engine` by a full replay of its files."""
        old = self.peers.pop(engine, None) or {}
        for key in old:
            self._resolve(key)
        if entries:
            self.peers[engine] = collections.OrderedDict(sorted(entries.items(), key=lambda kv: kv[1][1]))
            for key, (slot, _) in entries.items():
                if key not in self.own and key not in self.entries:
                    self._added(key, loc(engine, slot))

    def oldest_peer_atime(self) -> int | None:
        """Access time of the oldest block another engine holds (each engine's map is
        kept in commit/TOUCH order)."""
        firsts = [next(iter(d.values()))[1] for d in self.peers.values() if d]
        return min(firsts) if firsts else None


class Index:
    """All namespaces of a store plus one LRU order over this engine's committed entries."""

    def __init__(self):
        self.namespaces: dict[bytes, Namespace] = {}
        self.lru: collections.OrderedDict[tuple[bytes, bytes], None] = collections.OrderedDict()
        self.pins: collections.Counter = collections.Counter()
        # slots of keys dropped while pinned: in use until the key is unpinned (release_dropped)
        self.dropped_pinned: dict[tuple[bytes, bytes], list[int]] = {}

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

    def load(self, ns: Namespace, entries: dict[bytes, tuple[int, int]]) -> None:
        """Install this engine's entries replayed from disk, oldest access first in the LRU."""
        ns.own = {k: s for k, (s, _) in entries.items()}
        ns.atime = {k: a for k, (_, a) in entries.items()}
        ns.alloc = SlotAllocator(0, set(ns.own.values()))
        ns.entries = {k: ns.base | s for k, s in ns.own.items()}
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
            if k in ns.own:
                ns.atime[k] = now
                self.lru.move_to_end((ns.nsid, k))

    def commit(self, ns: Namespace, key: bytes, slot: int, now: int) -> None:
        ns.own[key] = slot
        ns._added(key, ns.base | slot)
        ns.atime[key] = now
        self.lru[(ns.nsid, key)] = None

    def remove(self, ns: Namespace, key: bytes) -> int | None:
        """Forget one of our committed keys; return its slot (still in use) or None.
        Another engine's copy of the key, if any, becomes the one lookups see."""
        slot = ns.own.pop(key, None)
        if slot is not None:
            ns.atime.pop(key, None)
            self.lru.pop((ns.nsid, key), None)
            ns._resolve(key)
        return slot

    def victim(self) -> tuple[Namespace, bytes] | None:
        """Our least recently used committed, unpinned entry (other engines evict their own)."""
        for nsid, key in self.lru:
            if not self.pins[(nsid, key)]:
                return self.namespaces[nsid], key
        return None
