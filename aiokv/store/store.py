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
while the file system answers: at most max(CLOSE_WAIT, fs_timeout) without an
answer (as long as the deadline calls it answering), CLOSE_MAX in all whatever
fs_timeout says (persist.py). Without io_thread (tools, inspect, unit tests) every call runs at once on the
caller's thread, as before.

Opening with io_thread (the engine's scheduler side): each namespace's index is
read on a loader thread (`Loader`, loading.py), and until the owner installs it the
namespace is not `ready`. Without io_thread everything is read at once, as before.

The facade (this module): `Store` holds the parts, one job per module, and
forwards to them; it does lookups itself; it implements the store's interface
(api.StoreApi, as drives.Drives does: one Store is one drive). The parts are made,
wired and opened by assembly.py. The parts, each owning its own state
and handed the others it reads: `Dirs` and `Opener` (meta.py: aiokv.json, the
setup lock, the directories, our engine's lock; namespaces opened), `Replay`
(replay.py: our own index at opening, rebuilt from the slots if damaged), `Space`
(space.py: capacity and limit, our data files, grow and punch, eviction choice, a
full disk), `Scan` (scan.py: scan and verify of our slots), `Persist` (persist.py:
our journals, syncs, checkpoints, close), `Following` (following.py: the other
engines' journals and bytes), `Reclaim` (reclaim.py: a dead engine's blocks),
`Labels` (labels.py: a description per key for the KV events), `Saves` (saves.py:
reservations, commits, aborts), `Drops` (drops.py: keys that did not verify),
`Pins` (pins.py: pins that last) and `LoadPins` (loadpins.py: the keys loads hold), `Quotas`
(quotas.py: bytes per tenant, its victims), `Loader` (loading.py: indexes read in
the background). The index, the stats and the I/O thread are the Store's, handed
to the parts.

Threading contract: one thread calls a Store (the owner's thread); its I/O
thread runs only the file-system parts of what the owner queued. The Store
reads and writes no slot: that is BlockIO's (tests and benchmarks that do both
in one process use tools/storeio.py).
"""

from __future__ import annotations

import logging
import os
import time

from aiokv.data import format as fmt
from aiokv.data.dirs import NotAStore  # noqa: F401  (re-exported: aiokv.store)
from aiokv.store import assembly
from aiokv.store import quotas as quotas_mod
from aiokv.store.fsthread import FsThread
from aiokv.store.index import Index
from aiokv.store.locate import holders
from aiokv.store.meta import ns_dir  # noqa: F401  (callers name a namespace's directory)
from aiokv.store.namespace import Namespace
from aiokv.store.quotas import Quotas
from aiokv.util import counters, counting

WAIT_PER_STEP = 0.05  # seconds the owner may wait per step for a grow in flight (io_thread)
log = logging.getLogger("aiokv")


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
    engine = _part("dirs", "engine")  # our engine's number (None until the directory is open)
    lock = _part("dirs", "lock")
    capacity = _part("space", "capacity")
    limit = _part("space", "limit")  # the capacity, or lower while the disk is full
    pin_capacity = _part("pins", "capacity")  # bytes pinned blocks may take (None: capacity / PIN_SHARE)
    space_check_interval = _part("space", "check_interval")  # seconds between free-space checks while lowered
    follow_interval = _part("following", "interval")  # seconds between looks at the other engines
    followers = _part("following", "followers")  # (nsid, engine) -> its files
    logs = _part("persist", "logs")  # nsid -> our journal
    _loader = _part("loader", "thread")  # the loader thread (loading.py), None without one
    quotas = _part("saves", "quotas")  # bytes per tenant (quotas.py; set_quotas), None: no quota
    wear = _part("saves", "wear")  # bytes committed (wear.py), None read-only

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
        opening, file-system calls run on the store's I/O thread (fs_timeout: its deadline,
        and how long close waits for an answer, at least persist.CLOSE_WAIT);
        secret: the `secret` setting (tenants are named on disk by tags keyed by it)."""
        self.root = os.path.abspath(root)
        self.readonly = readonly
        self.stats = StoreStats()
        self.index = Index()
        self.fs = FsThread(None)  # opening runs on the caller's thread
        assembly.make_parts(self, capacity, sync_interval, checkpoint_every, secret, fs_timeout)
        assembly.make_orders(self, sync_interval)
        background = io_thread and not readonly
        try:
            shells = assembly.open_dirs(self, engine, background)
        except BaseException:
            self.close(checkpoint=False)
            raise
        if background:
            self.fs.start(f"aiokv-fs{self.engine}", deadline=fs_timeout)
            self.following.start()
        if shells:
            self.loader.start(shells, self.engine)

    @property
    def loading(self) -> int:
        """Namespaces whose index is still loading (no hits, no saves from them meanwhile)."""
        return self.loader.loading()

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
        self.space.victims = lambda: quotas_mod.capacity_victim(self.quotas, self.index)

    def tenant_bytes(self, top: int | None) -> dict[str, int]:
        """Bytes per tenant in the directory: the `top` tenants holding most, the others as "other" (quotas.py)."""
        return quotas_mod.tenant_bytes(self.index, self.tenants, top)

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

    def served(self, ns: Namespace, keys) -> list[bool]:
        """Whether each key's block is a hit now (the other engines' last look applied, as by
        lookup): one call into aiokv._index."""
        self.lookup(ns, (), 0)
        return (holders([ns], keys) >= 0).tolist()

    def holds(self, ns: Namespace, key: bytes, where: int) -> bool:
        """Whether key's committed copy is the one at location `where`."""
        return ns.where(key) == where

    def namespaces(self) -> list[Namespace]:
        return list(self.index.namespaces.values())

    def blocks(self) -> int:
        return sum(ns.count() for ns in self.index.namespaces.values())

    def used(self) -> int:
        return self.space.used()

    @property
    def fs_bytes(self) -> int:
        return self.dirs.fs_bytes

    def drives(self) -> list[tuple[int, str, Store]]:
        """One drive: this directory (api.StoreApi)."""
        return [(0, self.root, self)]

    def parts(self, ns: Namespace) -> list[tuple[int, Store, Namespace]]:
        return [(0, self, ns)]

    def record(self, drives: dict) -> None:
        """One drive: the workers' verdicts are the scheduler side's breaker's (api.StoreApi)."""

    def reserve(self, ns: Namespace, key: bytes, tenant: str | bytes = "") -> int | None:
        """A location (in our engine's files) for `key` of `tenant`, evicting if needed (saves.py)."""
        return self.saves.reserve(ns, key, tenant)

    def commit(
        self, ns: Namespace, items, tenant: str | bytes = "", pinned: bool = False, request: bool = False
    ) -> None:
        """Make written (key, location) pairs of `tenant` visible to lookups, durably (saves.py)."""
        self.saves.commit(ns, items, tenant, pinned, request)

    def abort(self, ns: Namespace, items, failed: bool = True) -> None:
        """Give back reservations whose data was not (fully) written (saves.py)."""
        self.saves.abort(ns, items, failed)

    def pin(self, ns: Namespace, keys) -> list[int | None]:
        """Locations of committed keys, held for a load until unpin (loadpins.py LoadPins)."""
        return self.load_pins.pin(ns, keys)

    def unpin(self, ns: Namespace, keys) -> None:
        self.load_pins.unpin(ns, keys)

    def load_pinned(self) -> int:
        """Keys loads hold pinned now (loadpins.py LoadPins)."""
        return len(self.index.pins)

    # ---- pins that last: blocks never evicted (issue 34), bounded by pin_capacity (pins.py) ----
    def pinned_bytes(self) -> int:
        """Bytes of pinned blocks in the directory: ours and the other engines' (as followed)."""
        return self.pins.pinned_bytes()

    def set_request_pins(self, spec: dict[str, int | None] | None) -> None:
        """The `request_pins` setting: the tenants whose requests may pin, and their bounds (pins.py)."""
        self.pins.set_requests(spec)

    def pin_blocks(self, ns: Namespace, keys, tenant: int | None = None, request: bool = False) -> int:
        """Pin our stored blocks of these keys; how many were pinned now (pins.py)."""
        return self.pins.pin_blocks(ns, keys, tenant, request)

    def drop(self, ns: Namespace, keys, corrupt: bool = True) -> None:
        """Forget keys whose blocks did not verify (drops.py)."""
        self.drops.drop(ns, keys, corrupt)

    def drop_at(self, ns: Namespace, items, corrupt: bool = True) -> int:
        """drop() of each (key, location) whose key still sits there; how many were dropped (drops.py)."""
        return self.drops.drop_at(ns, items, corrupt)

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
        close_wait, max(CLOSE_WAIT, fs_timeout), without an answer and CLOSE_MAX in all). A
        load in progress is not installed; it is waited for, after the journals, at most
        close_wait within that bound: one still reading then keeps our data files, directories
        and lock, and gives them back when it ends (never our lock while it may write our files)."""
        self.loader.closing = True
        lock = self.dirs.lock
        self.persist.close(
            checkpoint and not self.readonly and lock is not None and lock.fd is not None, self._close_files
        )
        self.loader.wait(self.persist.close_wait, self.persist.close_deadline(), self.root)

    def _close_dirs(self) -> None:
        """Our data files and directories closed, our engine's lock given back (by the last of
        close and the loader: Loader.release)."""
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
        self.loader.release()
