# SPDX-License-Identifier: Apache-2.0
"""One namespace as one engine sees it (`Namespace`): its own blocks, its
reservations and slot allocator, the other engines' blocks as followed from
their journals, and the union that lookups read. The bookkeeping over all
namespaces (LRU clock, commits, victims, pins) is the Index's (index.py).

Pure bookkeeping, no files: the Store persists what changes here (journal.py)
and follows the other engines (following.py), which hands their records to
`peer_apply` and `peer_reset`.

Every engine's blocks of a namespace are a Table (table.py: a few bytes a
block, tags not keys). Lookups take keys and work on their tags; what only a
slot names (a block another engine evicted) is said by slot. The keys of the
blocks are in the files, and `keys` reads them there through the namespace's
`keys_of` (set by the store; nskeys.py).

Threading contract: one thread (the Store's owner) calls everything here.
"""

from __future__ import annotations

import collections

import numpy as np

from aiokv import _index
from aiokv.data.format import loc
from aiokv.store import nskeys
from aiokv.store.allocator import SlotAllocator
from aiokv.store.journal import KeyMap, apply_records, record_tags
from aiokv.store.table import Table


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
