"""The block store: namespaces of fixed-size slots on local disk, an index that
survives crashes, a capacity bound with LRU eviction.

Roles:
- An engine (any number of them on one directory at once, each holding the
  lock of its engine number, lock.py) owns its own data files and journal: it
  reserves slots there, commits keys once their data is written, evicts its
  own blocks, and persists all of it (journal.py). It follows the other
  engines' journals (`refresh` once per step, and lookups; at most every
  FOLLOW_INTERVAL), so their blocks are hits here too: `entries` and the
  locations it hands out name the engine whose file holds the block
  (format.loc). In vLLM this is the scheduler side, in the EngineCore process.
- Data writers/readers (BlockIO, blockio.py) move slot bytes; in vLLM these are
  the worker processes, told locations by their engine.
- Read-only openers (`aiokv inspect`) follow every engine without a lock and
  never write.

Several engines: capacity and LRU are the directory's. `_used` counts every
engine's files; over the capacity, each engine evicts its own blocks while they
are the oldest in the directory (an engine holding older ones sheds those at
its next refresh); a hit on another engine's block is a TOUCH record in our
journal, so its holder sees it as recently used. An engine short of room whose own blocks are newer than
another's may overshoot the capacity by SHARE_SLACK (1/16) meanwhile, and past
that evicts its own. Another engine may evict and rewrite a slot we are about
to read: the reader verifies the slot header and payload CRC, so that is a
miss, never wrong bytes.

Failure contract: EIO/ENOSPC fail only the operation in question and are
counted; a block that does not verify is a miss, is dropped and counted; a key
is visible to lookups only after `commit`, which the caller calls only after its
data is fully written.

File-system calls: with `io_thread` (the engine's scheduler side), once the
store has opened, every file-system call runs on the store's own I/O thread
(fsthread.py), in order, with a deadline: journal writes (journalq.py), the
look at the other engines every follow_interval (following.py, on the I/O
thread's own clock), grow, punch, free-space checks, a dead engine's blocks
(reclaim.py), namespaces opened, close. The owner's thread works from the
in-memory index and applies finished outcomes at its next call (`refresh`,
`lookup`, `flush_if_due`); it waits on the file system only for a grow that
a reservation needs now, at most WAIT_PER_STEP per step and never while the
file system is stalled. A commit is in the index at once (its data is written)
and reaches the journal, so other engines and restarts, when the I/O thread
writes it; one that cannot be written is taken back. `stalled` says the file
system has not answered for the deadline. `close` lets what is queued be written
while the file system answers: at most CLOSE_WAIT without an answer, CLOSE_MAX
in all. Without io_thread (tools, inspect, unit tests) every call runs at once on the
caller's thread, as before.

The facade (this module): opening, lookups, reservations, commits, pins and
drops. The rest is one job per module, each a mixin of Store sharing the
attributes set in __init__: meta.py (aiokv.json, the setup lock, namespaces),
replay.py (our own index at opening, rebuilt from the slots if damaged),
space.py (capacity, grow and punch, eviction choice, a full disk), scan.py
(scan and verify of our slots), persist.py (syncs, checkpoints, close),
following.py (the other engines' journals), reclaim.py (a dead engine's blocks).

Threading contract: one thread calls a Store (the owner's thread); its I/O
thread runs only the file-system parts of what the owner queued. The Store
reads and writes no slot: that is BlockIO's (tests and benchmarks that do both
in one process use tools/storeio.py).
"""
from __future__ import annotations

import errno
import logging
import os
import time

from aiokv.data import format as fmt
from aiokv.config import parse_size
from aiokv.data.dirs import NotAStore  # noqa: F401  (re-exported: aiokv.store)
from aiokv.store.following import Following
from aiokv.store.fsthread import FsThread
from aiokv.store.index import Index, Namespace
from aiokv.store.journal import Follower, IndexLog
from aiokv.store.journalq import JournalQueue
from aiokv.store.lock import DirLock
from aiokv.store.meta import Meta, ns_dir  # noqa: F401  (ns_dir: callers name a namespace's directory)
from aiokv.store.persist import Persist
from aiokv.store.reclaim import Reclaim
from aiokv.store.replay import Replay
from aiokv.store.scan import Scan
from aiokv.store import space
from aiokv.store.space import Space
from aiokv.util import counters

FOLLOW_INTERVAL = 0.1  # seconds between looks at the other engines' journals
TOUCH_EVERY_NS = 10**9  # a hit on another engine's block is recorded at most this often per key
WAIT_PER_STEP = 0.05  # seconds the owner may wait per step for a grow in flight (io_thread)
log = logging.getLogger("aiokv")


# what the store counts: one int per STORE row of the table of counters, named
# less "store_". Loads are counted where they happen: the workers' reports (the
# Store is not on the load path).
StoreStats = counters.record("StoreStats", counters.STORE, __name__, prefix=counters.STORE_PREFIX)


class Store(Meta, Replay, Space, Scan, Persist, Following, Reclaim):
    def __init__(self, root: str, capacity=None, readonly: bool = False, sync_interval: float = 1.0,
                 checkpoint_every: int = 200_000, engine: int | None = None, io_thread: bool = False,
                 fs_timeout: float = 2.0):
        """engine: the engine number to own (default: the lowest free one); io_thread: after
        opening, file-system calls run on the store's I/O thread (fs_timeout: its deadline)."""
        self.root = os.path.abspath(root)
        self.readonly = readonly
        self.capacity = parse_size(capacity) if capacity is not None else None
        self.limit = self.capacity  # the capacity, or lower while the disk is full
        self.space_check_interval = 1.0  # seconds between free-space checks while lowered
        self._space_checked = 0.0
        self.sync_interval = sync_interval
        self.checkpoint_every = checkpoint_every
        self.stats = StoreStats()
        self.index = Index()
        self.logs: dict[bytes, IndexLog] = {}
        self._rank_fds: dict[tuple[bytes, int], int] = {}
        self.lock = None
        self._root_fd: int | None = None
        self._ns_fd: int | None = None
        self._dir_fds: dict[bytes, int] = {}  # namespace directories
        self._own_fds: dict[bytes, int] = {}  # our engine's directory in each namespace
        self.engine: int | None = None
        self.follow_interval = FOLLOW_INTERVAL
        self._followed = 0.0
        self.followers: dict[tuple[bytes, int], Follower] = {}  # (nsid, engine) -> its files
        self._peer_fds: dict[tuple[bytes, int], int] = {}       # (nsid, engine) -> its directory
        self._peer_bytes: dict[tuple[bytes, int], int] = {}     # (nsid, engine) -> bytes its files take
        # engines found dead whose oldest blocks we evict: engine -> (its lock, {(nsid, what): fd or IndexLog})
        self._reclaimed: dict[int, tuple[DirLock, dict]] = {}  # the I/O thread's (reclaim.py)
        self._reclaiming: set[int] = set()  # those engines, as the owner knows them
        self._reclaim_checked = 0.0
        self.journals: dict[bytes, JournalQueue] = {}  # our journals, as the owner writes them
        self._spaces: tuple[Namespace, ...] = ()  # the namespaces, for the I/O thread (following.py)
        self.fs = FsThread(None)  # opening runs on the caller's thread
        self._punching = 0      # bytes of slots queued for punching (not counted as used)
        self._growing: dict[bytes, object] = {}  # nsid -> the grow in flight
        self._close_by: float | None = None
        self.skipped_fs_busy = 0  # reservations skipped: the space for them was still being reserved
        try:
            self._open(readonly, engine)
        except BaseException:
            self.close(checkpoint=False)
            raise
        if io_thread and not readonly:
            self.fs.start(f"aiokv-fs{self.engine}", deadline=fs_timeout)
            self._start_following()

    @property
    def stalled(self) -> bool:
        """The file system has not answered an operation of ours within its deadline."""
        return self.fs.stalled

    def refresh(self) -> None:
        """Follow the other engines on the directory (their new blocks become hits,
        their evicted ones misses), then give back space over the capacity if ours
        are the directory's oldest blocks. For the scheduler, once per step (it may
        evict, like reserve). Cheap: without the I/O thread follows at most every
        follow_interval seconds; with it, applies the I/O thread's last finished look.
        Errors are logged, never raised (a stale view is only misses)."""
        self.fs.poll()
        self.fs.new_step(WAIT_PER_STEP)
        if self.fs.inline:
            self._follow_all()
        if not self.readonly and self.limit is not None and self._used() > self.limit:
            try:
                self._shrink_to_limit()
                self._reclaim()
            except OSError as e:
                log.warning("aiokv: %s", f"giving back space failed ({os.strerror(e.errno or 0)}); trying again later")

    # ---- lookups and commits (owner) ----
    def lookup(self, ns: Namespace, keys, limit: int | None = None) -> int:
        # an engine idle for a while sees the others' blocks at its first lookup
        # (following only: evicting waits for the step's refresh); with the I/O thread
        # that looked on its own meanwhile, its last finished look is applied
        if not self.fs.inline:
            self.fs.poll()
        elif time.monotonic() - self._followed >= self.follow_interval:
            self._follow_all()
        return self.index.lookup(ns, keys, limit)

    def reserve(self, ns: Namespace, key: bytes) -> int | None:
        """A location (in our engine's files) for `key`, evicting if needed; None if
        present (in any engine's files), pending, or no space."""
        if key in ns.entries or key in ns.pending:
            return None
        slot = ns.alloc.take()
        while slot is None:
            grown = self._grow(ns)
            if grown is None:  # space is being reserved: this save is skipped, not evicted for
                self.skipped_fs_busy += 1
                return None
            if not grown:
                victim = self.index.victim()
                # another namespace's slot is no use here: its space must be punched
                if victim is None or not self._evict(*victim, punch=victim[0] is not ns):
                    self.stats.skipped_no_space += 1
                    return None
            slot = ns.alloc.take()
        if (not self.fs.inline and ns.nsid not in self._growing
                and len(ns.alloc.free) < max(space.GROW_AHEAD, space.GROW_BYTES // ns.slot_cost // 2)):
            self._grow(ns, ahead=True)  # more space, before it is needed
        ns.pending[key] = where = fmt.loc(self.engine, slot)
        return where

    def commit(self, ns: Namespace, items) -> None:
        """Make written (key, location) pairs visible to lookups, durably."""
        now = time.time_ns()
        recs, done = [], []
        for key, where in items:
            if ns.pending.get(key) != where:
                continue  # aborted meanwhile
            del ns.pending[key]
            slot = where & fmt.SLOT_MASK
            self.index.commit(ns, key, slot, now)
            done.append(key)
            recs.append(fmt.pack_record(fmt.REC_COMMIT, key, slot, now))
        jq = self.journals[ns.nsid]
        if not recs:
            return
        self.stats.commits += len(recs)
        failed = []

        def undo(e):
            failed.append(e)
            # Not durable, so not committed: undo; only a full disk needs room.
            self.stats.commits -= len(recs)
            written = set(done)
            for key, where in items:
                if key in written and ns.own.get(key) == where & fmt.SLOT_MASK:
                    ns.alloc.release(self.index.remove(ns, key))
            self.stats.save_failures += len(recs)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                self.stats.enospc += 1
                self._make_room()
            else:
                log.warning("aiokv: %s", f"journal write failed ({os.strerror(e.errno or 0)}); "
                            f"{len(recs)} block(s) not committed")
        jq.append(recs, undo)
        if not failed and jq.records > self.checkpoint_every and jq.records > len(ns.own):
            jq.checkpoint(self._snapshot(ns), self._checkpoint_failed)

    @staticmethod
    def _checkpoint_failed(e) -> None:
        if not isinstance(e, OSError):
            raise e
        # the journal still holds everything: try again later
        log.warning("aiokv: %s", f"checkpoint failed ({os.strerror(e.errno or 0)}); the journal keeps growing")

    def abort(self, ns: Namespace, items, failed: bool = True) -> None:
        """Give back reservations whose data was not (fully) written."""
        for key, where in items:
            if ns.pending.get(key) == where:
                del ns.pending[key]
                ns.alloc.release(where & fmt.SLOT_MASK)
                self.stats.save_failures += failed

    def pin(self, ns: Namespace, keys) -> list[int | None]:
        """Locations of committed keys, protected from eviction (by this engine; another
        engine may evict its own: a miss on read) until unpin; refreshes LRU."""
        out = []
        for k in keys:
            slot = ns.entries.get(k)
            if slot is not None:
                self.index.pins[(ns.nsid, k)] += 1
            out.append(slot)
        now = time.time_ns()
        self.index.touch(ns, keys, now)
        self._touch_peers(ns, [k for k, w in zip(keys, out) if w is not None and w >> fmt.ENGINE_SHIFT != self.engine],
                          now)
        return out

    def _touch_peers(self, ns: Namespace, keys, now: int) -> None:
        """Tell the engines holding these keys that we used them (TOUCH records in
        our journal, best effort), so the directory's LRU sees hits from every
        engine. At most once a second per key."""
        if self.readonly or not keys:
            return
        recs = []
        for k in keys:
            where = ns.entries.get(k)
            e = where >> fmt.ENGINE_SHIFT
            got = ns.peers.get(e, {}).get(k)
            if got is not None and now - got[1] >= TOUCH_EVERY_NS:
                ns.peer_touch(k, now)
                recs.append(fmt.pack_record(fmt.REC_TOUCH, k, 0, now))
        self._append_drops(ns, recs)

    def unpin(self, ns: Namespace, keys) -> None:
        pins = self.index.pins
        for k in keys:
            pk = (ns.nsid, k)
            if pins[pk] > 1:
                pins[pk] -= 1
            elif pins.pop(pk, None):
                self.index.unpinned(ns, k)

    def drop(self, ns: Namespace, keys, corrupt: bool = True) -> None:
        """Forget keys whose blocks did not verify; our slots are reused, and another
        engine's copy is not offered again here (unless it commits the key anew)."""
        recs = []
        for k in keys:
            where = ns.entries.get(k)
            if where is None:
                continue
            e, _ = fmt.split(where)
            if e != self.engine:
                ns.peer_drop(e, k)
                self.stats.corrupt_dropped += corrupt
                continue
            slot = self.index.remove(ns, k)
            if slot is not None:
                self.index.release_dropped(ns, k, slot)
                recs.append(fmt.pack_record(fmt.REC_DROP, k, slot, 0))
                self.stats.corrupt_dropped += corrupt
        self._append_drops(ns, recs)
