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

Threading contract: one thread calls a Store (the owner's thread); its I/O
thread runs only the file-system parts of what the owner queued. The async
`save`/`load` helpers must run on an event loop in the owner's thread.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import fcntl
import logging
import os
import time

from aiokv import _native
from aiokv.data.backend import open_backend
from aiokv.data import format as fmt
from aiokv.data.blockio import BlockIO
from aiokv.store.index import Index, Namespace
from aiokv.data.dirs import (FILE_FLAGS, NotAStore, _exists, _read_json, _write_json,  # noqa: F401
                              check_private, open_dir, parse_size)
from aiokv.store.following import Following
from aiokv.store.fsthread import FsThread, FsTimeout
from aiokv.store.journal import Follower, IndexLog  # noqa: F401
from aiokv.store.journalq import JournalQueue
from aiokv.store.lock import DirLock
from aiokv.store.reclaim import PUNCH, Reclaim

GROW_BYTES = 64 << 20  # disk space is reserved for new slots this much at a time
HEADROOM = 4 << 20  # left to the file system (journal, other users) when the disk is full
FOLLOW_INTERVAL = 0.1  # seconds between looks at the other engines' journals
SHARE_SLACK = 16  # overshoot allowed while another engine holds older blocks: capacity / this
TOUCH_EVERY_NS = 10**9  # a hit on another engine's block is recorded at most this often per key
RECLAIM_INTERVAL = 5.0  # seconds between looks for a dead engine holding the directory's oldest blocks
WAIT_PER_STEP = 0.05  # seconds the owner may wait per step for a grow in flight (io_thread)
CLOSE_WAIT = 5.0  # seconds close (and the last verifications) wait for the file system to answer (io_thread)
CLOSE_MAX = 30.0  # seconds close waits in all for a file system that answers, slowly (io_thread)
NAMESPACE_WAIT = 60.0  # seconds opening a namespace may take on the I/O thread (at start)
GROW_AHEAD = 16  # free slots left when a grow for more starts (io_thread)
log = logging.getLogger("aiokv")


def log_warning(msg: str) -> None:
    log.warning("aiokv: %s", msg)


@dataclasses.dataclass
class StoreStats:
    commits: int = 0
    save_failures: int = 0      # reservations aborted (I/O error in a writer)
    skipped_no_space: int = 0   # saves skipped: nothing evictable or disk full
    enospc: int = 0             # ENOSPC seen while reserving disk space
    evictions: int = 0
    corrupt_dropped: int = 0    # blocks that failed verification or I/O on read
    # Loads are counted where they happen: the workers' reports (inside vLLM,
    # Store.load is not on the load path).


SETUP_WAIT = 30.0  # seconds an engine waits for another one creating the store or a namespace


@contextlib.contextmanager
def _setup_lock(root_fd: int, root: str = "the cache directory"):
    """Held while creating or migrating the store or a namespace (moments, at start).
    Waited for at most SETUP_WAIT: an engine hung there must not hang the others."""
    end = time.monotonic() + SETUP_WAIT
    while True:
        try:
            fcntl.flock(root_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > end:
                raise NotAStore(f"aiokv: {root}: another engine has been creating files there for {SETUP_WAIT:.0f} s "
                                "(a hung disk?); check it, or give this engine its own path") from None
            time.sleep(0.01)
    try:
        yield
    finally:
        fcntl.flock(root_fd, fcntl.LOCK_UN)


def ns_dir(root: str, nsid: bytes) -> str:
    return os.path.join(root, "ns", nsid.hex())


class Store(Following, Reclaim):
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
        self._io: dict[tuple[bytes, int], BlockIO] = {}
        self._backend = None
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

    def _open(self, readonly: bool, engine: int | None) -> None:
        # The root itself is not followed if it is a symlink, nor is anything below it.
        if readonly:
            if not os.path.isdir(self.root):
                raise NotAStore(f"aiokv: {self.root} is not an aiokv store (no aiokv.json)")
            self._root_fd = open_dir(self.root)
            if not _exists("aiokv.json", self._root_fd):
                raise NotAStore(f"aiokv: {self.root} is not an aiokv store (no aiokv.json)")
            self._check_meta(_read_json("aiokv.json", self._root_fd, self.root))
        else:
            os.makedirs(os.path.dirname(self.root) or "/", exist_ok=True)
            self._root_fd = open_dir(self.root, create=True)
            check_private(self._root_fd, self.root)
            # Creating or migrating the store, and creating namespaces, is done
            # under an flock of the root directory: engines starting together.
            with _setup_lock(self._root_fd, self.root):
                if not _exists("aiokv.json", self._root_fd) and os.listdir(self._root_fd):
                    raise NotAStore(f"aiokv: {self.root} is not empty and not an aiokv store; "
                                    "give aiokv an empty or new directory")
                self.lock = DirLock(self.root, self._root_fd, engine)
                self.engine = self.lock.engine
                if not _exists("aiokv.json", self._root_fd):
                    _write_json("aiokv.json", {"magic": fmt.STORE_MAGIC, "format": fmt.FORMAT_VERSION}, self._root_fd)
                if self._check_meta(_read_json("aiokv.json", self._root_fd, self.root)) != fmt.FORMAT_VERSION:
                    # format 1 is format 2 with engine 0 alone: nothing moves (docs/format.md)
                    _write_json("aiokv.json", {"magic": fmt.STORE_MAGIC, "format": fmt.FORMAT_VERSION}, self._root_fd)
                    log.info("aiokv: %s migrated to format %d (several engines)", self.root, fmt.FORMAT_VERSION)
        ns_path = os.path.join(self.root, "ns")
        self._ns_fd = open_dir(ns_path, self._root_fd, create=not readonly)
        if not readonly:
            check_private(self._ns_fd, ns_path)
        st = os.fstatvfs(self._root_fd)
        # a file system that reports no size (ramfs) lives in memory: bounded by it
        self._fs_bytes = st.f_blocks * st.f_frsize or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        for name in sorted(os.listdir(self._ns_fd)):
            try:
                nsid = bytes.fromhex(name)
            except ValueError:
                continue  # not ours
            if len(nsid) != fmt.NSID_BYTES:
                continue
            dfd = self._ns_dir_fd(nsid)
            # a namespace whose namespace.json never made it (a crash at creation) holds nothing
            if _exists("namespace.json", dfd):
                self._load_namespace(nsid)
        if not readonly:
            self._shrink_to_limit()

    def _check_meta(self, meta) -> int:
        if not isinstance(meta, dict) or meta.get("magic") != fmt.STORE_MAGIC:
            raise NotAStore(f"aiokv: {self.root} is not an aiokv store (bad aiokv.json)")
        if meta.get("format") not in fmt.READS_FORMATS:
            raise NotAStore(f"aiokv: {self.root} has format {meta.get('format')}, this aiokv reads "
                            f"{fmt.FORMAT_VERSION}; use a new directory")
        return meta["format"]

    # ---- namespaces ----
    def _ns_dir_fd(self, nsid: bytes, create: bool = False) -> int:
        fd = self._dir_fds.get(nsid)
        if fd is None:
            path = ns_dir(self.root, nsid)
            fd = self._dir_fds[nsid] = open_dir(path, self._ns_fd, create=create)
            if not self.readonly:
                check_private(fd, path)
        return fd

    def _own_dir_fd(self, nsid: bytes) -> int:
        """Our engine's directory in a namespace (created 0700 if missing)."""
        fd = self._own_fds.get(nsid)
        if fd is None:
            sub = fmt.engine_dir(self.engine)
            if not sub:
                fd = self._ns_dir_fd(nsid)
            else:
                path = os.path.join(ns_dir(self.root, nsid), sub)
                fd = open_dir(path, self._ns_dir_fd(nsid), create=True)
                check_private(fd, path)
            self._own_fds[nsid] = fd
        return fd

    def _load_namespace(self, nsid: bytes) -> Namespace:
        d, nfd = ns_dir(self.root, nsid), self._ns_dir_fd(nsid)
        try:
            pb, sb, ranks, fields = fmt.check_namespace(_read_json("namespace.json", nfd, d), nsid)
        except fmt.BadBlock as e:
            raise NotAStore(f"aiokv: {d}/namespace.json is damaged ({e}); remove {d} (its blocks are lost) "
                            "or give aiokv a new directory") from None
        ns = Namespace(nsid, pb, sb, ranks, fields, self.engine)
        if not self.readonly:
            self._load_own(ns)
        self.index.namespaces[nsid] = ns
        self._spaces = tuple(self.index.namespaces.values())  # replaced, never changed: the I/O thread reads it
        self._follow(ns)
        return ns

    def _load_own(self, ns: Namespace) -> None:
        """Replay our own engine's files of a namespace as their owner."""
        nsid = ns.nsid
        d = os.path.join(ns_dir(self.root, nsid), fmt.engine_dir(self.engine)).rstrip("/")
        dfd = self._own_dir_fd(nsid)
        log = IndexLog(d, dfd, readonly=False, sync_interval=self.sync_interval)
        try:
            entries = log.load()
        except fmt.BadBlock as e:
            # The index is lost but the blocks describe themselves: rebuild from them.
            log_warning(f"{e}; rebuilding the index from the data files")
            entries = self._scan(ns)
            gens = [n.split(".")[1] for n in os.listdir(dfd) if n.startswith("journal.")]
            log.gen = 1 + max([int(g) for g in gens if g.isdigit()] + [log.gen])
            log.checkpoint([(k, s, a) for k, (s, a) in entries.items()])
        # A slot beyond the size of the file system never held a block: such a
        # record is damage, and would make the allocator count billions of holes.
        beyond = [k for k, (s, _) in entries.items() if s >= self._max_slots(ns)]
        if beyond:
            log_warning(f"{d}: {len(beyond)} index record(s) name slots beyond the file system's size; dropped")
            for k in beyond:
                del entries[k]
        self.index.load(ns, entries)
        self.logs[nsid] = log
        self.journals[nsid] = JournalQueue(log, self.fs)
        if not self.readonly:
            # Space the index does not account for (free slots of the last life,
            # a tail past the last used slot) is given back to the file system.
            try:
                self._fallocate(ns, _native.FALLOC_FL_PUNCH_HOLE | _native.FALLOC_FL_KEEP_SIZE, ns.alloc.holes,
                                punch=True)
            except OSError:
                ns.alloc.grow(list(ns.alloc.holes))  # they may still hold space: counted, and reused first
            for rank in range(ns.ranks):
                os.ftruncate(self._rank_fd(ns, rank), ns.alloc.hwm * ns.slot_bytes)

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
                log_warning(f"giving back space failed ({os.strerror(e.errno or 0)}); trying again later")

    def namespace(self, nsid: bytes, payload_bytes: int, ranks: int = 1, fields: dict | None = None) -> Namespace:
        """Open or create a namespace. nsid is derived by the caller from all that changes the bytes.
        With the I/O thread it opens there (waited for at most NAMESPACE_WAIT: at start)."""
        if self.fs.inline:
            return self._namespace(nsid, payload_bytes, ranks, fields)
        return self.fs.call(lambda: self._namespace(nsid, payload_bytes, ranks, fields), NAMESPACE_WAIT,
                            deadline=NAMESPACE_WAIT)

    def _namespace(self, nsid: bytes, payload_bytes: int, ranks: int, fields: dict | None) -> Namespace:
        if len(nsid) != fmt.NSID_BYTES:
            raise ValueError(f"aiokv: namespace ids are {fmt.NSID_BYTES} bytes")
        ns = self.index.namespaces.get(nsid)
        if ns is None:
            if self.readonly:
                raise KeyError(nsid.hex())
            info = {"nsid": nsid.hex(), "payload_bytes": payload_bytes, "ranks": ranks, "fields": fields or {},
                    "slot_bytes": fmt.slot_bytes(payload_bytes) if type(payload_bytes) is int else None}
            try:
                fmt.check_namespace(info, nsid)
            except fmt.BadBlock as e:
                raise ValueError(f"aiokv: cannot create namespace {nsid.hex()}: {e}") from None
            with _setup_lock(self._root_fd, self.root):  # another engine may be creating it right now
                dfd = self._ns_dir_fd(nsid, create=True)
                if not _exists("namespace.json", dfd):
                    _write_json("namespace.json", dict(info, created=time.time()), dfd)
            ns = self._load_namespace(nsid)
            if not self.fs.inline and len(ns.alloc.free) < GROW_AHEAD:
                self._grow(ns, ahead=True)  # space for the first saves, reserved at start (on the I/O thread)
        if ns.payload_bytes != payload_bytes or ns.ranks != ranks:
            raise ValueError(f"aiokv: namespace {nsid.hex()} holds {ns.payload_bytes}-byte blocks on "
                             f"{ns.ranks} ranks, not {payload_bytes} on {ranks}: its id must cover the layout")
        return ns

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
                and len(ns.alloc.free) < max(GROW_AHEAD, GROW_BYTES // ns.slot_cost // 2)):
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
                log_warning(f"journal write failed ({os.strerror(e.errno or 0)}); {len(recs)} block(s) not committed")
        jq.append(recs, undo)
        if not failed and jq.records > self.checkpoint_every and jq.records > len(ns.own):
            jq.checkpoint(self._snapshot(ns), self._checkpoint_failed)

    @staticmethod
    def _checkpoint_failed(e) -> None:
        if not isinstance(e, OSError):
            raise e
        # the journal still holds everything: try again later
        log_warning(f"checkpoint failed ({os.strerror(e.errno or 0)}); the journal keeps growing")

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

    # ---- dead engines ----
    def _reclaim(self) -> None:
        """Over the capacity, with the directory's oldest blocks in the files of an
        engine that is not running: take that engine's lock (a new engine then
        takes another number) and evict its oldest blocks as its owner would — a
        DROP in its journal, its slots punched — while they are the oldest and the
        directory is over the capacity. Looks for such an engine at most every
        RECLAIM_INTERVAL seconds; a running engine (idle or not) is never touched."""
        while self._used() > self.limit and self._peers_older() and not self.fs.busy("reclaim"):
            ns, e, key = self._oldest_peer()
            if e not in self._reclaiming:
                now = time.monotonic()
                if now - self._reclaim_checked < RECLAIM_INTERVAL:
                    return
                self._reclaim_checked = now
            slot = ns.peers[e][key][0]
            op = self.fs.once("reclaim", lambda ns=ns, e=e, key=key, slot=slot: self._evict_dead_io(ns, e, key, slot),
                              lambda r, err, ns=ns, e=e, key=key: self._evict_dead_done(ns, e, key, r, err))
            if not op.finished or op.result is None:
                return

    # ---- space ----
    def _used(self) -> int:
        """Bytes the directory takes on disk: our backed slots (less those queued for
        punching), journals and checkpoints, and the other engines' files (as of the
        last refresh)."""
        return (self.index.physical_bytes - self._punching + sum(jq.disk_bytes for jq in self.journals.values())
                + sum(self._peer_bytes.values()))

    def _peers_older(self) -> bool:
        """Whether another engine holds a block older than our LRU victim (it, not
        we, should give space back)."""
        victim = self.index.victim()
        oldest = [a for a in (n.oldest_peer_atime() for n in self.index.namespaces.values()) if a is not None]
        if not oldest:
            return False
        return victim is None or min(oldest) < victim[0].atime.get(victim[1], 0)

    def _evict(self, ns: Namespace, key: bytes, punch: bool) -> bool:
        """Forget the LRU entry `key`; False if its space was to be punched and could not be."""
        slot = self.index.remove(ns, key)
        self._append_drops(ns, [fmt.pack_record(fmt.REC_DROP, key, slot, 0)])
        self.stats.evictions += 1
        if punch:
            return self._unback(ns, slot)
        ns.alloc.release(slot)
        return True

    def _unback(self, ns: Namespace, slot: int) -> bool:
        """Give an in-use slot's disk space back. Where punching fails (a file
        system without hole punching, an I/O error) the slot stays backed and
        counted, on the free list, and False says so (at once, or, with the I/O
        thread, when the punch ran: the slot is neither free nor a hole meanwhile)."""
        cost = ns.slot_cost
        self._punching += cost

        def done(ok, e):
            self._punching -= cost
            if ok:
                ns.alloc.punch(slot)
            else:
                ns.alloc.release(slot)
        op = self.fs.submit(lambda: self._punch(ns, slot), done)
        return not op.finished or bool(op.result)

    def _append_drops(self, ns: Namespace, recs: list[bytes]) -> None:
        # Best effort: a DROP that is not persisted resurrects an entry whose slot
        # was punched or reused; its header then fails verification: a miss. A
        # TOUCH that is not persisted only leaves a block older in the LRU.
        self.journals[ns.nsid].append(recs)

    def _shrink_to(self, target: int, oldest_only: bool = False) -> None:
        """Punch free slots, then LRU blocks, until at most `target` bytes are used
        or nothing more can be given back; with oldest_only, only while our LRU
        block is the directory's oldest."""
        while self._used() > target:
            for ns in self.index.namespaces.values():
                while ns.alloc.free and self._used() > target:  # unused backed slots go first
                    if not self._unback(ns, ns.alloc.take()):
                        return
            if self._used() <= target or (oldest_only and self._peers_older()):
                return
            victim = self.index.victim()
            if victim is None or not self._evict(*victim, punch=True):
                return

    def _make_room(self, nbytes: int = HEADROOM) -> None:
        """Punch LRU blocks worth nbytes and cap the capacity at what remains,
        until the file system has room again (_regain_space)."""
        self._shrink_to(max(self._used() - nbytes, 0))
        self.limit = self._used()
        self._space_checked = time.monotonic()

    def _shrink_to_limit(self) -> None:
        if self.limit is not None and self._used() > self.limit:
            self._shrink_to(self.limit, oldest_only=True)

    def _regain_space(self) -> None:
        """While a full disk holds the limit under the capacity: raise it again as
        far as the file system has room now (checked at most every space_check_interval)."""
        now = time.monotonic()
        if self.limit == self.capacity or now - self._space_checked < self.space_check_interval:
            return
        self._space_checked = now
        root_fd = self._root_fd

        def done(st, e):
            if e is not None:
                if not isinstance(e, OSError):
                    raise e
                if self.fs.inline:
                    raise e
                return
            avail = st.f_bavail * st.f_frsize - HEADROOM
            if avail <= 0 or self.limit == self.capacity:
                return
            new = self._used() + avail
            if self.capacity is None:
                self.limit = None
            elif new > self.limit:
                self.limit = min(new, self.capacity)
        self.fs.once("space", lambda: os.fstatvfs(root_fd), done)

    def _rank_fd(self, ns: Namespace, rank: int) -> int:
        fd = self._rank_fds.get((ns.nsid, rank))
        if fd is None:
            fd = os.open(f"rank{rank}.data", os.O_RDWR | os.O_CREAT | FILE_FLAGS, 0o600,
                         dir_fd=self._own_dir_fd(ns.nsid))
            self._rank_fds[(ns.nsid, rank)] = fd
        return fd

    def _fallocate(self, ns: Namespace, mode: int, slots, ignore_errors: bool = False, punch: bool = False) -> None:
        sb = ns.slot_bytes
        runs: list[list[int]] = []  # [first, count] of consecutive slots: one call each
        for s in sorted(slots):
            if runs and runs[-1][0] + runs[-1][1] == s:
                runs[-1][1] += 1
            else:
                runs.append([s, 1])
        for rank in range(ns.ranks):
            fd = self._rank_fd(ns, rank)
            for first, count in runs:
                try:
                    _native.fallocate(fd, mode, first * sb, count * sb)
                except OSError as e:
                    if ignore_errors:
                        continue
                    if punch or e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
                        raise
                    if not mode:  # no fallocate here: extend the file sparsely
                        os.ftruncate(fd, max(os.fstat(fd).st_size, (first + count) * sb))

    def _punch(self, ns: Namespace, slot: int) -> bool:
        """Punch one slot on every rank; False if any rank refused."""
        try:
            self._fallocate(ns, PUNCH, [slot], punch=True)
        except OSError:
            return False
        return True

    def _grow(self, ns: Namespace, ahead: bool = False) -> bool | None:
        """Reserve disk space for more slots: a chunk, halved on ENOSPC down to one slot.
        None: a grow is in flight on the I/O thread (not waited for past this step's
        budget); ahead: only if there is room, and without waiting."""
        if self.limit is not None and self.limit != self.capacity:
            self._regain_space()
        op = self._growing.get(ns.nsid)
        if op is None:
            room = (self.limit - self._used()) if self.limit is not None else GROW_BYTES
            n = min(max(1, GROW_BYTES // ns.slot_cost), room // ns.slot_cost)
            if n <= 0 and self._peers_older() and not ahead:
                # another engine holds older blocks and sheds them at its next refresh:
                # overshoot by a slot rather than evict our newer ones, up to a bound
                n = 1 if room + max(self.limit // SHARE_SLACK, ns.slot_cost) >= ns.slot_cost else 0
            if n <= 0:
                return False
            plans = []
            while n > 0:  # planned here: the allocator is the owner's
                plans.append(ns.alloc.plan_grow(n))
                n //= 2
            hwm = ns.alloc.hwm
            op = self.fs.submit(lambda: self._grow_io(ns, plans, hwm), lambda r, e: self._grow_done(ns, r, e))
            if op.applied:  # ran at once (inline, or from an operation on the I/O thread)
                return bool(op.result and op.result[0])
            # (finished on the I/O thread but not applied yet counts as in flight: its slots
            # are not free until _grow_done, and must not be planned again meanwhile)
            self._growing[ns.nsid] = op
        if ahead or not self.fs.wait_in_step(op):
            return None
        return bool(op.result and op.result[0])

    def _grow_io(self, ns: Namespace, plans: list[list[int]], hwm: int):
        """The I/O of _grow: (slots backed or None, ENOSPC count, errno of another failure)."""
        enospc = 0
        for slots in plans:
            try:
                self._fallocate(ns, 0, slots)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    return None, enospc, e.errno or errno.EIO
                # a failed fallocate may have allocated part of the range: give it back
                self._fallocate(ns, PUNCH, slots, ignore_errors=True)
                for rank in range(ns.ranks):
                    os.ftruncate(self._rank_fd(ns, rank), hwm * ns.slot_bytes)
                enospc += 1
                continue
            return slots, enospc, 0
        return None, enospc, 0

    def _grow_done(self, ns: Namespace, r, e) -> None:
        self._growing.pop(ns.nsid, None)
        if e is not None:
            if not isinstance(e, OSError):
                raise e
            r = (None, 0, e.errno or errno.EIO)
        slots, enospc, err = r
        self.stats.enospc += enospc
        if slots:
            ns.alloc.grow(slots)
        elif err:
            # EIO, EROFS, EFBIG...: no new space now; evicting may still make room
            log_warning(f"reserving disk space failed ({os.strerror(err)}); saves reuse evicted slots")
        else:
            # the disk is full below our capacity: leave the file system some room
            # (journal, other users) and cap ourselves there
            self._make_room()

    def _scan(self, ns: Namespace) -> dict[bytes, tuple[int, int]]:
        """key -> (slot, write time) for every slot whose header verifies on every rank."""
        found: dict[bytes, tuple[int, int]] | None = None
        sb = ns.slot_bytes
        for rank in range(ns.ranks):
            fd = self._rank_fd(ns, rank)
            here = {}
            for slot in range(min(os.fstat(fd).st_size // sb, self._max_slots(ns))):
                try:
                    h = fmt.check_header(os.pread(fd, fmt.HDR_USED, slot * sb), ns.nsid, rank, ns.payload_bytes)
                except fmt.BadBlock:
                    continue
                here[(h["key"], slot)] = h["seq"]
            found = here if found is None else {ks: t for ks, t in here.items() if ks in found}
        return {k: (s, t) for (k, s), t in sorted((found or {}).items(), key=lambda x: x[1])}

    def verify_slot(self, ns: Namespace, key: bytes, where: int) -> bool:
        """Whether our location `where` holds a complete, verifying block of `key` on
        every rank (whatever layout tag it was written with; the reader checks its own)."""
        if not self.fs.inline:  # at close: bounded, and False if the file system does not answer
            if self.fs.stalled:
                return False
            try:
                op = self.fs.submit(lambda: self._verify_io(ns, key, where))
            except FsTimeout:
                return False
            return self.fs.drain(op, CLOSE_WAIT, self._close_deadline()) and op.error is None and bool(op.result)
        return self._verify_io(ns, key, where)

    def _verify_io(self, ns: Namespace, key: bytes, where: int) -> bool:
        sb, slot = ns.slot_bytes, where & fmt.SLOT_MASK
        for rank in range(ns.ranks):
            raw = os.pread(self._rank_fd(ns, rank), sb, slot * sb)
            if len(raw) != sb:
                return False
            try:
                fmt.check_slot(raw, ns.nsid, rank, ns.payload_bytes, key)
            except fmt.BadBlock:
                return False
        return True

    def _max_slots(self, ns: Namespace) -> int:
        """Slots that can exist: a data file never holds more than its file system."""
        return self._fs_bytes // ns.slot_bytes

    # ---- persistence ----
    def _snapshot(self, ns: Namespace):
        return [(k, s, ns.atime.get(k, 0)) for k, s in ns.own.items()]

    def flush_if_due(self) -> None:
        """fdatasync journals whose last sync is older than sync_interval (call often; cheap)."""
        self.fs.poll()
        now = time.monotonic()
        for jq in self.journals.values():
            jq.sync_if_due(now, self._sync_failed)

    @staticmethod
    def _sync_failed(e) -> None:
        if not isinstance(e, OSError):
            raise e
        log_warning(f"journal fdatasync failed ({os.strerror(e.errno or 0)})")

    def checkpoint(self) -> None:
        """Checkpoint every journal (queued with the I/O thread)."""
        for nsid, jq in self.journals.items():
            jq.checkpoint(self._snapshot(self.index.namespaces[nsid]), self._reraise)

    @staticmethod
    def _reraise(e) -> None:
        raise e

    def _close_deadline(self) -> float:
        """With the I/O thread: when close stops waiting for the file system in all (set at the first call)."""
        if self._close_by is None:
            self._close_by = time.monotonic() + CLOSE_MAX
        return self._close_by

    def close(self, checkpoint: bool = True) -> None:
        """Checkpoint and close everything. With the I/O thread: what was queued is
        written first; returns once the file system has not answered for CLOSE_WAIT,
        or CLOSE_MAX after the first close-time call (verify_slot or this), whatever
        the file system does; records not written by then are lost, and said so (their
        blocks are misses after a restart: the journal never named them)."""
        for io in self._io.values():
            io.close()
        self._io.clear()
        if self._backend is not None:
            self._backend.close()
            self._backend = None
        fs = self.fs
        if not fs.inline and fs._closed:
            return  # closed already
        snaps = None
        if checkpoint and not self.readonly and self.lock is not None and self.lock.fd is not None:
            snaps = [(log, self._snapshot(self.index.namespaces[nsid])) for nsid, log in self.logs.items()]
        if fs.inline:
            self._close_files(snaps)
            return
        fs.poll()
        queued = fs.pending
        op = fs.submit(lambda: self._close_files(snaps), lambda r, e: None)
        if not fs.drain(op, CLOSE_WAIT, self._close_deadline()):
            log.warning("aiokv: the cache directory's file system did not answer at shutdown (%.0f s without an "
                        "answer, or %.0f s in all); %d queued operation(s) may not be written (blocks committed "
                        "since are misses after a restart) and its files are left to the process exit",
                        CLOSE_WAIT, CLOSE_MAX, queued)
            fs.close(0)
            return
        fs.close(1.0)
        if op.error is not None:
            log.warning("aiokv: closing the store failed (%s)", op.error)

    def _close_files(self, snaps) -> None:
        for log, snap in snaps or ():
            try:
                log.checkpoint(snap)
            except OSError as e:  # EIO, EROFS, ENOSPC: the journal still holds every record
                log_warning(f"checkpoint at close failed ({os.strerror(e.errno or 0)}); the journal keeps its records")
        for log in self.logs.values():
            log.close()
        self._release_reclaimed()
        for fl in self.followers.values():
            fl.close()
        self.followers.clear()
        own = [fd for nsid, fd in self._own_fds.items() if fd != self._dir_fds.get(nsid)]
        for fd in [*self._rank_fds.values(), *own, *self._peer_fds.values(), *self._dir_fds.values(), self._ns_fd,
                   self._root_fd]:
            if fd is not None:
                os.close(fd)
        self._rank_fds.clear()
        self._own_fds.clear()
        self._peer_fds.clear()
        self._dir_fds.clear()
        self._ns_fd = self._root_fd = None
        if self.lock is not None:
            self.lock.release()

    # ---- standalone data path (one process owns index and data) ----
    def blockio(self, ns: Namespace, rank: int = 0) -> BlockIO:
        loop = asyncio.get_running_loop()
        if self._backend is None:
            self._backend = open_backend(loop)
        io = self._io.get((ns.nsid, rank))
        if io is None:
            io = self._io[(ns.nsid, rank)] = BlockIO(self._backend, ns_dir(self.root, ns.nsid), ns.nsid, rank,
                                                     ns.payload_bytes)
        return io

    async def save(self, ns: Namespace, items, rank: int = 0) -> list[int]:
        """Store (key, addr) staging slots; per item 0, -EEXIST, -ENOSPC or -errno."""
        if ns.ranks != 1:
            raise ValueError("aiokv: Store.save is for one-rank namespaces; ranks commit through the owner")
        res = [0] * len(items)
        todo = []
        for i, (key, addr) in enumerate(items):
            fmt.check_key(key)
            slot = self.reserve(ns, key)
            if slot is None:
                res[i] = -errno.EEXIST if (key in ns.entries or key in ns.pending) else -errno.ENOSPC
            else:
                todo.append((i, slot, key, addr))
        try:
            out = await self.blockio(ns, rank).write([(s, k, a) for _, s, k, a in todo])
        except BaseException:
            self.abort(ns, [(k, s) for _, s, k, _ in todo], failed=False)
            raise
        self.commit(ns, [(k, s) for (_, s, k, _), r in zip(todo, out) if r == 0])
        self.abort(ns, [(k, s) for (_, s, k, _), r in zip(todo, out) if r != 0])
        for (i, _, k, _), r in zip(todo, out):
            res[i] = r if r or k in ns.entries else -errno.EIO  # written but not committed
        return res

    async def load(self, ns: Namespace, items, rank: int = 0) -> list[int]:
        """Read (key, addr) into staging slots; per item 0, -ENOENT, -EBADMSG or -errno."""
        keys = [k for k, _ in items]
        slots = self.pin(ns, keys)
        try:
            todo = [(s, k, a) for s, (k, a) in zip(slots, items) if s is not None]
            out = iter(await self.blockio(ns, rank).read(todo))
        finally:
            # only the pins taken above: a key committed and pinned by another
            # reader meanwhile keeps its pin
            self.unpin(ns, [k for k, s in zip(keys, slots) if s is not None])
        res = [next(out) if s is not None else -errno.ENOENT for s in slots]
        self.drop(ns, [k for k, r in zip(keys, res) if r not in (0, -errno.ENOENT)])
        return res
