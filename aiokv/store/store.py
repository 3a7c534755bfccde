# SPDX-License-Identifier: Apache-2.0
"""The block store: namespaces of fixed-size slots on local disk, an index that
survives crashes, a capacity bound with LRU eviction.

Roles:
- An engine (any number of them on one directory at once, each holding the
  lock of its engine number, lock.py) owns its own data files and journal: it
  reserves slots there, commits keys once their data is written, evicts its
  own blocks, and persists all of it (journal.py). It follows the other
  engines' journals (`refresh` once per step, and lookups; at most every
  following.FOLLOW_INTERVAL), so their blocks are hits here too: `entries` and the
  locations it hands out name the engine whose file holds the block
  (format.loc). In vLLM this is the scheduler side, in the EngineCore process.
- Data writers/readers (BlockIO, blockio.py) move slot bytes; in vLLM these are
  the worker processes, told locations by their engine.
- Read-only openers (`aiokv inspect`) follow every engine without a lock and
  never write.

Several engines: capacity and LRU are the directory's. `Space.used` counts every
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

Opening with io_thread (the engine's scheduler side): the directory, our lock and
the namespaces are opened at once; each namespace's index is read on a loader
thread of its own (`_load`), and until the owner installs it (at a poll) the
namespace is not `ready`: its lookups are misses and its saves are dropped
(`skipped_loading`). So opening does not grow with the cache. Without io_thread
everything is read at once, as before. Our data files, directories and lock are
given back by the last of close and the loader to be done with them (`_users`,
under `_users_lock`): never while the loader may still read or write our files.

The facade (this module): `Store` holds the parts, one job per module, and
forwards to them; it does lookups, reservations, commits, pins and drops
itself. The parts, each owning its own state and handed the others it reads:
`Dirs` and `Opener` (meta.py: aiokv.json, the setup lock, the directories,
our engine's lock; namespaces opened), `Replay` (replay.py: our own index at
opening, rebuilt from the slots if damaged), `Space` (space.py: capacity and
limit, our data files, grow and punch, eviction choice, a full disk), `Scan`
(scan.py: scan and verify of our slots), `Persist` (persist.py: our journals,
syncs, checkpoints, close), `Following` (following.py: the other engines'
journals and bytes), `Reclaim` (reclaim.py: a dead engine's blocks), `Labels`
(labels.py: a description per key for the layers above, the KV events'). The
index, the stats and the I/O thread are the Store's, handed to the parts.

Threading contract: one thread calls a Store (the owner's thread); its I/O
thread runs only the file-system parts of what the owner queued. The Store
reads and writes no slot: that is BlockIO's (tests and benchmarks that do both
in one process use tools/storeio.py).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from array import array

import numpy as np

from aiokv import _index
from aiokv.config import parse_size
from aiokv.data import format as fmt
from aiokv.data.dirs import NotAStore  # noqa: F401  (re-exported: aiokv.store)
from aiokv.store import persist as persist_mod
from aiokv.store.control import Control
from aiokv.store.following import Following
from aiokv.store.fsthread import FsThread
from aiokv.store.index import Index, Namespace
from aiokv.store.labels import Labels
from aiokv.store.meta import Dirs, Opener, ns_dir  # noqa: F401  (ns_dir: callers name a namespace's directory)
from aiokv.store.persist import Persist
from aiokv.store.pins import Pins
from aiokv.store.quotas import Quotas
from aiokv.store.reclaim import Reclaim
from aiokv.store.replay import Replay
from aiokv.store.scan import Scan
from aiokv.store.space import Space
from aiokv.store.table import PINNED, give_back_scratch, tag_of
from aiokv.store.tenants import Tenants
from aiokv.store.tenantsfile import TenantsNotWritten
from aiokv.store.wear import Wear
from aiokv.util import counters, counting

TOUCH_EVERY_NS = 10**9  # a hit on another engine's block is recorded at most this often per key
WAIT_PER_STEP = 0.05  # seconds the owner may wait per step for a grow in flight (io_thread)
log = logging.getLogger("aiokv")
_log = log  # (`log` names a journal in some methods)


# what the store counts: one int per STORE row of the table of counters, named
# less "store_". Loads are counted where they happen: the workers' reports (the
# Store is not on the load path).
StoreStats = counting.record("StoreStats", counters.STORE, __name__, prefix=counting.STORE_PREFIX)


def _part(part: str, name: str) -> property:
    """A Store attribute that is one of its parts' (read and set through the facade)."""
    return property(
        lambda self: getattr(getattr(self, part), name), lambda self, v: setattr(getattr(self, part), name, v)
    )


class Store:
    lock = _part("dirs", "lock")
    capacity = _part("space", "capacity")
    limit = _part("space", "limit")  # the capacity, or lower while the disk is full
    pin_capacity = _part("pins", "capacity")  # bytes pinned blocks may take (None: capacity / PIN_SHARE)
    space_check_interval = _part("space", "check_interval")  # seconds between free-space checks while lowered
    follow_interval = _part("following", "interval")  # seconds between looks at the other engines
    followers = _part("following", "followers")  # (nsid, engine) -> its files
    logs = _part("persist", "logs")  # nsid -> our journal

    def __init__(
        self,
        root: str,
        capacity=None,
        readonly: bool = False,
        sync_interval: float = 1.0,
        checkpoint_every: int = 200_000,
        engine: int | None = None,
        io_thread: bool = False,
        fs_timeout: float = 2.0,
        secret: str | bytes | None = None,
    ):
        """engine: the engine number to own (default: the lowest free one); io_thread: after
        opening, file-system calls run on the store's I/O thread (fs_timeout: its deadline);
        secret: the `secret` setting (tenants are named on disk by tags keyed by it)."""
        self.root = os.path.abspath(root)
        self.readonly = readonly
        self.stats = StoreStats()
        self.index = Index()
        self.fs = fs = FsThread(None)  # opening runs on the caller's thread
        self.engine: int | None = None
        self.wear: Wear | None = None
        self.skipped_fs_busy = 0  # reservations skipped: the space for them was still being reserved
        self.skipped_loading = 0  # reservations skipped: the namespace's index was still loading
        self.quotas: Quotas | None = None  # bytes per tenant (quotas.py; set_quotas)
        self.dirs = Dirs(self.root, readonly)
        self.tenants = Tenants(self.dirs, fs, fmt.tenant_key(secret), self.index)  # tenant tags <-> ids (tenants.py)
        self.persist = Persist(fs, self.index, sync_interval, checkpoint_every)
        self.tenants.checkpoint = self.persist.checkpoint
        self.following = Following(self.dirs, self.index, fs, self.tenants)
        self.space = Space(
            parse_size(capacity) if capacity is not None else None,
            self.dirs,
            self.index,
            fs,
            self.stats,
            self.persist,
            self.following.peer_bytes,
        )
        self.pins = Pins(self.index, self.tenants, self.stats, self.space)  # pin_capacity, request_pins (pins.py)
        self.scan = Scan(self.dirs, self.space, fs, self.persist)
        t = self.tenants
        replay = Replay(self.dirs, self.index, self.space, self.persist, self.scan, t.id_at_open, t.own_loaded)
        self.labels = Labels(self.dirs, fs)  # a description per key, for the connector's KV events
        self.reclaim = Reclaim(self.dirs, self.index, fs, self.stats, self.following, self.space, sync_interval)
        self.opener = Opener(self.dirs, self.index, replay, self.following, self.space, fs)
        # the operators' orders (aiokv clear, pin, unpin), read at each look at the other engines
        self.control = Control(
            self.dirs,
            self.index,
            self.tenants,
            self.space,
            self.persist,
            self.stats,
            fs,
            self.pins.free_blocks,
            self.pins.may_pin,
        )
        self.following.control = self.control
        replay.orders = self.control.apply_loaded  # (applied to our index as it is read, before it serves)
        self.control.dead = self.reclaim.orders  # (and to the files of the dead engines we hold)
        self._replay = replay
        self._loader: threading.Thread | None = None
        self._closing = False
        self._users = 1  # what needs our data files, directories and lock: close, and the loader while it runs
        self._users_lock = threading.Lock()
        background = io_thread and not readonly
        shells = []
        try:
            found = self.dirs.open(engine)
            self.engine = self.dirs.engine
            self.tenants.load_own(self.persist.logs)
            self.wear = Wear(self.dirs.root_fd, self.engine) if not readonly else None  # bytes committed
            self.control.orders += self.control.read_io() or []  # (applied as each namespace is in place)
            self.control.last = self.control.orders[-1].number if self.control.orders else 0
            self.control.blind = self.control._unreadable is not None  # (its orders then: control.take)
            for nsid in found:
                if background:  # loaded in the background (below): not ready until then
                    shells.append(self.opener.shell(nsid))
                else:
                    self.control.catch_up(self.opener.load(nsid))
            if not readonly and not background:
                self.space.shrink_to_limit()
        except BaseException:
            self.close(checkpoint=False)
            raise
        if io_thread and not readonly:
            fs.start(f"aiokv-fs{self.engine}", deadline=fs_timeout)
            self.following.start()
        if shells:
            self._loader = threading.Thread(
                target=self._load, args=(shells,), name=f"aiokv-load{self.engine}", daemon=True
            )
            self._users += 1
            self._loader.start()

    # ---- loading in the background (io_thread) ----
    def _load(self, shells: list[Namespace]) -> None:
        """The loader thread: each namespace's own files read into a Table, handed to the
        owner (fs.post). Reads, and writes only those files (journal.py, replay.py): nothing
        else touches them until the owner installs what was read. Our data files, directories
        and lock stay open until it ends (`_release_dirs`)."""
        try:
            for ns in shells:
                if self._closing:
                    return
                t = time.monotonic()
                try:
                    table, log = self._replay.read_own(ns)
                except BaseException as e:
                    self.fs.post(lambda r, err, ns=ns, e=e: self._load_failed(ns, e))
                    continue
                if self._closing:  # (nobody installs it now)
                    with contextlib.suppress(OSError):
                        log.close()
                    return
                self.fs.post(lambda r, err, ns=ns, table=table, log=log, t=t: self._loaded(ns, table, log, t))
        finally:
            self._release_dirs()

    def _loaded(self, ns: Namespace, table, log, started: float) -> None:
        """A namespace's index has loaded (the owner's thread, at poll): hits and saves begin."""
        if self._closing:
            log.close()
            return
        self._replay.install(ns, table, log)
        give_back_scratch()
        self.control.catch_up(ns)  # the orders its index has not applied (before its hits begin)
        ns.ready = True
        # the slots being given back are neither holes nor free until the punch ran (as in
        # Space._unback): a grow planned meanwhile must not take them, or, where the punch is
        # refused, they would become free twice (once here, once by the grow): one slot, two saves
        holes, hwm = ns.alloc.holes, ns.alloc.hwm  # (an array of 8 bytes a slot, replaced below: ours now)
        ns.alloc.holes = array("q")

        def unbacked(ok, e):
            if ok:
                ns.alloc.holes = array("q", holes) + ns.alloc.holes  # at the front: a grow in flight planned the end
            else:
                ns.alloc.free.extend(holes)  # they may still hold space: counted, and reused first

        self.fs.submit(lambda: self._replay.give_back_io(ns, holes, hwm), unbacked)
        _log.info(
            "aiokv: the index of namespace %s is loaded (%d blocks, %.2f s); its hits begin",
            ns.hex[:12],
            table.count,
            time.monotonic() - started,
        )
        if self.space.limit is not None and self.space.used() > self.space.limit:
            try:
                self.space.shrink_to_limit()
            except OSError:
                pass  # tried again at the next refresh

    def _load_failed(self, ns: Namespace, e: BaseException) -> None:
        self.tenants.failed_loads.add(ns.nsid)
        ns.load_failed = True  # (requests waiting for it stop waiting: scheduler/index_wait.py)
        _log.error(
            "aiokv: loading the index of namespace %s failed (%s); it serves no hits and takes no saves",
            ns.hex[:12],
            getattr(e, "strerror", None) or e,
        )

    @property
    def loading(self) -> int:
        """Namespaces whose index is still loading (no hits, no saves from them meanwhile)."""
        return sum(not ns.ready and not ns.load_failed for ns in self.index.namespaces.values())

    def namespace(self, nsid: bytes, payload_bytes: int, ranks: int = 1, fields: dict | None = None) -> Namespace:
        """Open or create a namespace (meta.py). nsid is derived by the caller from all that changes the bytes."""
        ns = self.opener.namespace(nsid, payload_bytes, ranks, fields)
        if ns.ready and ns.engine is not None:
            self.control.catch_up(ns)  # (a new one: the orders so far are behind it)
        return ns

    # ---- quotas (quotas.py) ----
    def set_quotas(self, sizes: dict[str, int] | None) -> None:
        """The `quota` setting: tenant name ("*": every other) -> bytes; None or {}: none."""
        self.quotas = Quotas(self.index, self.tenants, sizes, self.space, self.stats) if sizes else None
        self.space.victims = self._capacity_victim

    def _capacity_victim(self):
        """The block the directory's capacity gives up first: of a tenant not protected by its quota."""
        return self.quotas.victim(None) or self.index.victim() if self.quotas is not None else self.index.victim()

    def tenant_bytes(self, top: int | None) -> dict[str, int]:
        """Bytes per tenant in the directory (every engine's blocks, as followed): the `top`
        tenants holding most by their label (tenants.py), the others together as "other"
        (top None: every tenant)."""
        held = self.index.tenant_bytes()
        ids = np.flatnonzero(held)
        rest = 0  # the bytes of tenants that cannot be among the top: never labelled (a step's metrics)
        if top is not None and len(ids) > top:
            vals = held[ids]
            keep = vals >= np.partition(vals, len(vals) - top)[len(vals) - top]  # the top, ties included
            rest, ids = int(vals[~keep].sum()), ids[keep]
        out: dict[str, int] = {}
        for t in ids.tolist():
            label = self.tenants.label(t)
            out[label] = out.get(label, 0) + int(held[t])
        if top is None:
            return out
        out = counting.top_and_other(out, top)
        if rest:
            out["other"] = out.get("other", 0) + rest
        return out

    # ---- tenants (tenants.py) ----
    def tenant(self, name: str) -> int | None:
        """The id of the tenant a request's cache_salt names ("" or None: 0), if it holds or
        held blocks here (registered at its first commit); None: not registered."""
        return self.tenants.id(name or "")

    def tag(self, name: str) -> bytes:
        """The 16-byte tag of a tenant's name (format.tenant_tag, keyed by the secret): what its
        slot headers carry (Transfer.tenant)."""
        return self.tenants.tag(name or "")

    def tenant_tag(self, tenant: int) -> bytes:
        """The tag of a tenant id (what a slot header carries: Transfer.tenant)."""
        return self.tenants.tag_of(tenant) or fmt.NO_TENANT

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
        self.control.new_step()
        self.fs.poll()
        self.fs.new_step(WAIT_PER_STEP)
        if self.fs.inline:
            self.following.follow_all()
        self.control.step()  # the operators' orders: a bounded share per step
        space = self.space
        if not self.readonly and space.limit is not None and space.used() > space.limit:
            try:
                space.shrink_to_limit()
                self.reclaim.run()
            except OSError as e:
                log.warning("aiokv: %s", f"giving back space failed ({os.strerror(e.errno or 0)}); trying again later")
        if self.quotas is not None and not self.readonly:
            self.quotas.shed()

    # ---- lookups and commits (owner) ----
    def lookup(self, ns: Namespace, keys, limit: int | None = None) -> int:
        # an engine idle for a while sees the others' blocks at its first lookup
        # (following only: evicting waits for the step's refresh); with the I/O thread
        # that looked on its own meanwhile, its last finished look is applied
        following = self.following
        if not self.fs.inline:
            self.fs.poll()
        elif time.monotonic() - following.followed >= following.interval:
            following.follow_all()
        return self.index.lookup(ns, keys, limit)

    def serving(self, ns: Namespace):
        """The blocks of ns that are hits now, as a read-only key -> location mapping (the
        other engines' last look applied, as by lookup)."""
        self.lookup(ns, (), 0)
        return ns.entries

    def holds(self, ns: Namespace, key: bytes, where: int) -> bool:
        """Whether key's committed copy is the one at location `where`."""
        return ns.entries.get(key) == where

    def reserve(self, ns: Namespace, key: bytes, tenant: str | bytes = "") -> int | None:
        """A location (in our engine's files) for `key` of `tenant` (a cache_salt, or a tenant's
        tag), evicting if needed; None if present (in any engine's files), pending, no space,
        or no tenant id free for a new tenant (tenants.py)."""
        if not ns.ready:
            self.skipped_loading += 1  # the index is loading: the save is dropped
            return None
        if key in ns.pending or ns.where(key) is not None:
            return None
        tag, tid = self.tenants.for_save(tenant)
        if tag is None:  # a new tenant and no id free (tenants.py)
            self.stats.skipped_tenants += 1
            return None
        if self.quotas is not None and not self.quotas.make_room(ns, tid, tag):
            self.stats.skipped_quota += 1
            return None
        space = self.space
        slot = ns.alloc.take()
        while slot is None:
            grown = space.grow(ns)
            if grown is None:  # space is being reserved: this save is skipped, not evicted for
                self.skipped_fs_busy += 1
                return None
            if not grown:
                victim = self.quotas.victim(tid) if self.quotas is not None else self.index.victim()
                # another namespace's slot is no use here: its space must be punched
                if victim is None or not space.evict(*victim, punch=victim[0] is not ns):
                    self.stats.skipped_no_space += 1
                    return None
            slot = ns.alloc.take()
        space.grow_ahead(ns)
        ns.pending[key] = where = fmt.loc(self.engine, slot)
        if self.quotas is not None:
            self.quotas.reserving(ns.nsid, key, tid, tag, ns.slot_cost)
        return where

    def commit(
        self, ns: Namespace, items, tenant: str | bytes = "", pinned: bool = False, request: bool = False
    ) -> None:
        """Make written (key, location) pairs of `tenant` (a cache_salt, or a tenant's tag)
        visible to lookups, durably; pinned: never evicted (bounded by pin_capacity; `request`:
        a request's pin, bounded by request_pins too: pins.py). A new tenant is registered here
        (tenants.py); without an id free its blocks are given back."""
        if self.control.doomed:  # reserved before a clear we have taken: computed before it, given back
            kept = self.control.admit(ns, items, self.tenants.of(tenant)[0])
            if self.quotas is not None and len(kept) < len(items):
                for key in {k for k, _ in items} - {k for k, _ in kept}:
                    self.quotas.settled(ns.nsid, key)
            items = kept
        tag, tid = self.tenants.register(tenant) if items else (None, None)
        if tid is None:  # no id free (tenants.py): given back
            self.stats.skipped_tenants += sum(ns.pending.get(k) == w for k, w in items)
            return self.abort(ns, items, failed=False)
        now = time.time_ns()
        done, slots = [], []
        pending = ns.pending
        for key, where in items:
            if pending.get(key) != where:
                continue  # aborted meanwhile
            del pending[key]
            if self.quotas is not None:
                self.quotas.settled(ns.nsid, key)
            done.append(key)
            slots.append(where & fmt.SLOT_MASK)
        if not done:
            return
        if self.control.orders and self.control.pinned(ns.nsid, tag):  # pinned by `aiokv pin`: its new blocks too
            pinned, request = True, False
        k = self.pins.room(ns, len(done), tid, request) if pinned else 0  # the first k pinned (pins.py)
        # in memory a few ns apart (ties keep their order); the records say `now`
        recs = b""
        for part, flags in ((slice(0, k), PINNED), (slice(k, None), 0)):
            if done[part]:
                self.index.commit_many(ns, done[part], slots[part], now, tid, flags)
                recs += _index.commit_records(done[part], slots[part], now, tid, flags)  # (format.pack_record)
        nrecs = len(done)
        self.stats.commits += nrecs
        failed = []

        def undo(e):
            failed.append(e)
            # Not durable, so not committed: undo; only a full disk needs room.
            self.stats.commits -= nrecs
            self.wear.count(-nrecs * ns.slot_cost)
            written = set(done)
            for key, where in items:
                if key in written and ns.table.find(key) == where & fmt.SLOT_MASK:
                    ns.alloc.release(self.index.remove(ns, key))
            self.stats.save_failures += nrecs
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                self.stats.enospc += 1
                self.space.make_room()
            elif isinstance(e, TenantsNotWritten):
                self.tenants.not_written(e, nrecs)
            else:
                log.warning(
                    "aiokv: %s",
                    f"journal write failed ({os.strerror(e.errno or 0)}); {nrecs} block(s) not committed",
                )

        self.wear.count(nrecs * ns.slot_cost)
        self.persist.append(ns, recs, undo, before=self.tenants.writer(tid))  # (its tenants record first)
        if not failed:
            self.persist.checkpoint_if_due(ns)

    def abort(self, ns: Namespace, items, failed: bool = True) -> None:
        """Give back reservations whose data was not (fully) written."""
        for key, where in items:
            if ns.pending.get(key) == where:
                del ns.pending[key]
                if self.quotas is not None:
                    self.quotas.settled(ns.nsid, key)
                ns.alloc.release(where & fmt.SLOT_MASK)
                self.stats.save_failures += failed

    def pin(self, ns: Namespace, keys) -> list[int | None]:
        """Locations of committed keys, protected from eviction (by this engine; another
        engine may evict its own: a miss on read) until unpin; refreshes LRU."""
        out = []
        if not ns.ready:
            return [None] * len(keys)
        for k in keys:
            slot = ns.where(k)
            if slot is not None:
                self.index.pins[(ns.nsid, k)] += 1
                ns.pinned_tags[tag_of(k)] += 1
            out.append(slot)
        now = time.time_ns()
        self.index.touch(ns, keys, now)
        self._touch_peers(
            ns, [k for k, w in zip(keys, out) if w is not None and w >> fmt.ENGINE_SHIFT != self.engine], now
        )
        return out

    # ---- pins that last: blocks never evicted (issue 34), bounded by pin_capacity (pins.py) ----
    def pinned_bytes(self) -> int:
        """Bytes of pinned blocks in the directory: ours and the other engines' (as followed)."""
        return self.pins.pinned_bytes()

    def set_request_pins(self, spec: dict[str, int | None] | None) -> None:
        """The `request_pins` setting: the tenants whose requests may pin, and their bounds (pins.py)."""
        self.pins.set_requests(spec)

    def pin_blocks(self, ns: Namespace, keys, tenant: int | None = None, request: bool = False) -> int:
        """Pin our stored blocks of these keys (FLAGS records; within pin_capacity, and for a
        `request`'s pin within its tenant's request_pins bound: past it the rest stays unpinned,
        said once; refused, said, while the index loads). Another engine's copy is pinned by its
        holder when it saves or hits the key itself. Returns how many were pinned now."""
        if not ns.ready:
            self.pins.loading(ns)
            return 0
        t, recs = ns.table, []
        for k in keys:
            s = t.find(k)
            if s < 0 or t.flags[s] & PINNED:
                continue
            if not self.pins.may_pin(ns, 1, int(t.tenant[s]) if tenant is None else tenant, request):
                break
            t.set_flags(s, int(t.flags[s]) | PINNED)
            recs.append(fmt.pack_flags(s, t.tag_at(s), int(t.flags[s])))
        self.persist.append(ns, recs)
        return len(recs)

    def _touch_peers(self, ns: Namespace, keys, now: int) -> None:
        """Tell the engines holding these keys that we used them (TOUCH records in
        our journal, best effort), so the directory's LRU sees hits from every
        engine. At most once a second per key."""
        if self.readonly or not keys:
            return
        recs = []
        for k in keys:
            where = ns.where(k)
            if where is None:
                continue
            t = ns.tables.get(where >> fmt.ENGINE_SHIFT)
            s = t.find(k) if t is not None else -1
            if s >= 0 and now - t.atime_at(s) >= TOUCH_EVERY_NS:
                ns.peer_touch(k, now)
                recs.append(fmt.pack_record(fmt.REC_TOUCH, k, 0, now))
        self.persist.append(ns, recs)

    def unpin(self, ns: Namespace, keys) -> None:
        pins, tags = self.index.pins, ns.pinned_tags
        for k in keys:
            pk = (ns.nsid, k)
            if pins[pk] > 1:
                pins[pk] -= 1
            elif pins.pop(pk, None):
                self.index.unpinned(ns, k)
            else:
                continue
            t = tag_of(k)
            if tags[t] > 1:
                tags[t] -= 1
            else:
                tags.pop(t, None)

    def drop(self, ns: Namespace, keys, corrupt: bool = True) -> None:
        """Forget keys whose blocks did not verify; our slots are reused, and another
        engine's copy is not offered again here (unless it commits the key anew)."""
        recs = []
        for k in keys:
            where = ns.where(k)
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
        self.persist.append(ns, recs)

    def drop_at(self, ns: Namespace, items, corrupt: bool = True) -> int:
        """drop() of each (key, location) whose key still sits at that location (not a newer
        copy); returns how many were dropped."""
        keys = [k for k, where in items if ns.entries.get(k) == where]
        if keys:
            self.drop(ns, keys, corrupt)
        return len(keys)

    def verify_slot(self, ns: Namespace, key: bytes, where: int) -> bool:
        """Whether our location `where` holds a complete, verifying block of `key` on every rank (scan.py)."""
        return self.scan.verify_slot(ns, key, where)

    def flush_if_due(self) -> None:
        """fdatasync journals whose last sync is older than sync_interval (call often; cheap);
        the wear file every wear.SAVE_EVERY seconds."""
        self.persist.flush_if_due()
        if self.wear is not None and self.wear.due():
            snap = self.wear.snapshot()
            self.fs.submit(lambda: self.wear.save(snap))

    def checkpoint(self) -> None:
        """Checkpoint every journal (queued with the I/O thread)."""
        self.persist.checkpoint()

    def close(self, checkpoint: bool = True) -> None:
        """Checkpoint and close everything (persist.py; with the I/O thread bounded by
        CLOSE_WAIT without an answer and CLOSE_MAX in all). A load in progress is not
        installed; it is waited for, after the journals, at most CLOSE_WAIT within that
        bound: one still reading then keeps our data files, directories and lock, and gives
        them back when it ends (never our lock while it may write our files)."""
        self._closing = True
        lock = self.dirs.lock
        self.persist.close(
            checkpoint and not self.readonly and lock is not None and lock.fd is not None, self._close_files
        )
        loader = self._loader
        if loader is not None and loader is not threading.current_thread() and loader.is_alive():
            left = self.persist.close_deadline() - time.monotonic()
            loader.join(max(0.0, min(persist_mod.CLOSE_WAIT, left)))
            if loader.is_alive():
                _log.warning(
                    "aiokv: the index of %s is still being read at shutdown (a file system that does not "
                    "answer?); the engine's lock is given back once that read ends, or at the process exit",
                    self.root,
                )

    def _release_dirs(self) -> None:
        """Close and the loader each give up our data files and directories when done with them:
        the last of the two closes them and gives our engine's lock back (dirs.close, last)."""
        with self._users_lock:
            self._users -= 1
            if self._users:
                return
        self.space.close()
        self.dirs.close()

    def _close_files(self) -> None:
        """After the journals, on the same thread: every other file, then (with the loader
        ended) our data files, directories and lock."""
        self.reclaim.release()
        if self.wear is not None:
            try:
                self.wear.save(self.wear.snapshot())
            except OSError:
                pass  # its bytes since the last save are lost, never the cache
        self.labels.close()
        self.following.close()
        self._release_dirs()
