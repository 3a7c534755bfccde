"""The block store: namespaces of fixed-size slots on local disk, an index that
survives crashes, a capacity bound with LRU eviction.

Roles:
- The owner (one per directory, holds DIR/lock) keeps the index: it reserves
  slots, commits keys once their data is written, evicts, and persists all of it
  (journal.py). In vLLM this is the scheduler side, in the EngineCore process.
- Data writers/readers (BlockIO, blockio.py) move slot bytes; in vLLM these are
  the worker processes, each on its own rank's data file, told slot numbers by
  the owner.
- Read-only openers (`aiokv inspect`) replay the index without the lock and
  never write.

Failure contract: EIO/ENOSPC fail only the operation in question and are
counted; a block that does not verify is a miss, is dropped and counted; a key
is visible to lookups only after `commit`, which the caller calls only after its
data is fully written.

Threading contract: one thread calls a Store (the owner's thread). The async
`save`/`load` helpers must run on an event loop in that same thread.
"""
from __future__ import annotations

import asyncio
import dataclasses
import errno
import json
import logging
import os
import time

from aiokv import _native
from aiokv.io.backend import open_backend
from aiokv.store import format as fmt
from aiokv.store.blockio import BlockIO, data_path
from aiokv.store.index import Index, Namespace
from aiokv.store.journal import IndexLog, fsync_dir
from aiokv.store.lock import DirLock

GROW_BYTES = 64 << 20  # disk space is reserved for new slots this much at a time
HEADROOM = 4 << 20  # left to the file system (journal, other users) when the disk is full
log = logging.getLogger("aiokv")


def log_warning(msg: str) -> None:
    log.warning("aiokv: %s", msg)


class NotAStore(ValueError):
    pass


@dataclasses.dataclass
class StoreStats:
    commits: int = 0
    save_failures: int = 0      # reservations aborted (I/O error in a writer)
    skipped_no_space: int = 0   # saves skipped: nothing evictable or disk full
    enospc: int = 0             # ENOSPC seen while reserving disk space
    evictions: int = 0
    corrupt_dropped: int = 0    # blocks that failed verification or I/O on read
    loads: int = 0
    load_failures: int = 0


def _mkdir(path: str) -> None:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    if os.path.islink(path) or not os.path.isdir(path):
        raise NotAStore(f"aiokv: {path} is not a directory (symlinks are not followed)")


def _write_json(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def _read_json(path: str) -> dict:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd) as f:
        return json.load(f)


def parse_size(v) -> int:
    """Bytes from an int or a string like '200GiB', '1.5 TB', '512M'."""
    if isinstance(v, bool):
        raise ValueError(f"not a size: {v!r}")
    if isinstance(v, (int, float)):
        return int(v)
    s = str(v).strip().replace(" ", "")
    units = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
             "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12,
             "tib": 1 << 40}
    num = s.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unit = s[len(num):].lower()
    if unit not in units or not num:
        raise ValueError(f"not a size: {v!r} (use bytes or a unit like 200GiB)")
    return int(float(num) * units[unit])


def ns_dir(root: str, nsid: bytes) -> str:
    return os.path.join(root, "ns", nsid.hex())


class Store:
    def __init__(self, root: str, capacity=None, readonly: bool = False, sync_interval: float = 1.0,
                 checkpoint_every: int = 200_000):
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
        marker = os.path.join(self.root, "aiokv.json")
        if readonly:
            if not os.path.isfile(marker):
                raise NotAStore(f"aiokv: {self.root} is not an aiokv store (no aiokv.json)")
        else:
            if os.path.isdir(self.root) and not os.path.islink(self.root):
                if not os.path.exists(marker) and os.listdir(self.root):
                    raise NotAStore(f"aiokv: {self.root} is not empty and not an aiokv store; "
                                    "give aiokv an empty or new directory")
            else:
                os.makedirs(os.path.dirname(self.root) or "/", exist_ok=True)
                _mkdir(self.root)
            self.lock = DirLock(self.root)
            if not os.path.exists(marker):
                _write_json(marker, {"magic": fmt.STORE_MAGIC, "format": fmt.FORMAT_VERSION})
            _mkdir(os.path.join(self.root, "ns"))
        meta = _read_json(marker)
        if meta.get("magic") != fmt.STORE_MAGIC:
            raise NotAStore(f"aiokv: {self.root} is not an aiokv store (bad aiokv.json)")
        if meta.get("format") != fmt.FORMAT_VERSION:
            raise NotAStore(f"aiokv: {self.root} has format {meta.get('format')}, this aiokv reads "
                            f"{fmt.FORMAT_VERSION}; use a new directory")
        for name in sorted(os.listdir(os.path.join(self.root, "ns"))):
            # a namespace whose namespace.json never made it (a crash at creation) holds nothing
            if os.path.exists(os.path.join(self.root, "ns", name, "namespace.json")):
                self._load_namespace(bytes.fromhex(name))
        if not readonly:
            self._shrink_to_limit()

    # ---- namespaces ----
    def _load_namespace(self, nsid: bytes) -> Namespace:
        d = ns_dir(self.root, nsid)
        info = _read_json(os.path.join(d, "namespace.json"))
        ns = Namespace(nsid, info["payload_bytes"], info["slot_bytes"], info["ranks"], info.get("fields", {}))
        log = IndexLog(d, readonly=self.readonly, sync_interval=self.sync_interval)
        try:
            entries = log.load()
        except fmt.BadBlock as e:
            if self.readonly:
                raise
            # The index is lost but the blocks describe themselves: rebuild from them.
            log_warning(f"{e}; rebuilding the index from the data files")
            entries = self._scan(ns)
            log.gen = 1 + max([int(n.split(".")[1]) for n in os.listdir(d) if n.startswith("journal.")] + [0])
            log.checkpoint([(k, s, a) for k, (s, a) in entries.items()])
        self.index.load(ns, entries)
        self.logs[nsid] = log
        if not self.readonly:
            # Space the index does not account for (free slots of the last life,
            # a tail past the last used slot) is given back to the file system.
            self._fallocate(ns, _native.FALLOC_FL_PUNCH_HOLE | _native.FALLOC_FL_KEEP_SIZE, ns.alloc.holes,
                            ignore_errors=True)
            for rank in range(ns.ranks):
                os.ftruncate(self._rank_fd(ns, rank), ns.alloc.hwm * ns.slot_bytes)
        return ns

    def namespace(self, nsid: bytes, payload_bytes: int, ranks: int = 1, fields: dict | None = None) -> Namespace:
        """Open or create a namespace. nsid is derived by the caller from all that changes the bytes."""
        if len(nsid) != fmt.NSID_BYTES:
            raise ValueError(f"aiokv: namespace ids are {fmt.NSID_BYTES} bytes")
        ns = self.index.namespaces.get(nsid)
        if ns is None:
            if self.readonly:
                raise KeyError(nsid.hex())
            d = ns_dir(self.root, nsid)
            _mkdir(d)
            _write_json(os.path.join(d, "namespace.json"), {
                "nsid": nsid.hex(), "payload_bytes": payload_bytes, "slot_bytes": fmt.slot_bytes(payload_bytes),
                "ranks": ranks, "fields": fields or {}, "created": time.time()})
            ns = self._load_namespace(nsid)
        if ns.payload_bytes != payload_bytes or ns.ranks != ranks:
            raise ValueError(f"aiokv: namespace {nsid.hex()} holds {ns.payload_bytes}-byte blocks on "
                             f"{ns.ranks} ranks, not {payload_bytes} on {ranks}: its id must cover the layout")
        return ns

    # ---- lookups and commits (owner) ----
    def lookup(self, ns: Namespace, keys, limit: int | None = None) -> int:
        return self.index.lookup(ns, keys, limit)

    def reserve(self, ns: Namespace, key: bytes) -> int | None:
        """A slot for `key`, evicting if needed; None if present, pending, or no space."""
        if key in ns.entries or key in ns.pending:
            return None
        slot = ns.alloc.take()
        while slot is None:
            if not self._grow(ns):
                victim = self.index.victim()
                # another namespace's slot is no use here: its space must be punched
                if victim is None or not self._evict(*victim, punch=victim[0] is not ns):
                    self.stats.skipped_no_space += 1
                    return None
            slot = ns.alloc.take()
        ns.pending[key] = slot
        return slot

    def commit(self, ns: Namespace, items) -> None:
        """Make written (key, slot) pairs visible to lookups, durably."""
        now = time.time_ns()
        recs, done = [], []
        for key, slot in items:
            if ns.pending.get(key) != slot:
                continue  # aborted meanwhile
            del ns.pending[key]
            self.index.commit(ns, key, slot, now)
            done.append(key)
            recs.append(fmt.pack_record(fmt.REC_COMMIT, key, slot, now))
        log = self.logs[ns.nsid]
        try:
            log.append(recs)
        except OSError as e:
            # Not durable, so not committed: undo; only a full disk needs room.
            for key in done:
                ns.alloc.release(self.index.remove(ns, key))
            self.stats.save_failures += len(recs)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                self.stats.enospc += 1
                self._make_room()
            else:
                log_warning(f"journal write failed ({os.strerror(e.errno or 0)}); {len(recs)} block(s) not committed")
            return
        self.stats.commits += len(recs)
        if log.records > self.checkpoint_every and log.records > len(ns.entries):
            try:
                log.checkpoint(self._snapshot(ns))
            except OSError as e:  # the journal still holds everything: try again later
                log_warning(f"checkpoint failed ({os.strerror(e.errno or 0)}); the journal keeps growing")

    def abort(self, ns: Namespace, items, failed: bool = True) -> None:
        """Give back reservations whose data was not (fully) written."""
        for key, slot in items:
            if ns.pending.get(key) == slot:
                del ns.pending[key]
                ns.alloc.release(slot)
                self.stats.save_failures += failed

    def pin(self, ns: Namespace, keys) -> list[int | None]:
        """Slots of committed keys, protected from eviction until unpin; refreshes LRU."""
        out = []
        for k in keys:
            slot = ns.entries.get(k)
            if slot is not None:
                self.index.pins[(ns.nsid, k)] += 1
            out.append(slot)
        self.index.touch(ns, keys)
        return out

    def unpin(self, ns: Namespace, keys) -> None:
        pins = self.index.pins
        for k in keys:
            pk = (ns.nsid, k)
            if pins[pk] > 1:
                pins[pk] -= 1
            else:
                pins.pop(pk, None)

    def drop(self, ns: Namespace, keys, corrupt: bool = True) -> None:
        """Forget keys whose blocks did not verify; their slots are reused."""
        recs = []
        for k in keys:
            slot = self.index.remove(ns, k)
            if slot is not None:
                ns.alloc.release(slot)
                recs.append(fmt.pack_record(fmt.REC_DROP, k, slot, 0))
                self.stats.corrupt_dropped += corrupt
        self._append_drops(ns, recs)

    # ---- space ----
    def _used(self) -> int:
        """Bytes the store takes on disk: backed slots, journals and checkpoints."""
        return self.index.physical_bytes + sum(jl.disk_bytes for jl in self.logs.values())

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
        counted, on the free list, and False says so."""
        if self._punch(ns, slot):
            ns.alloc.punch(slot)
            return True
        ns.alloc.release(slot)
        return False

    def _append_drops(self, ns: Namespace, recs: list[bytes]) -> None:
        # Best effort: a DROP that is not persisted resurrects an entry whose slot
        # was punched or reused; its header then fails verification: a miss.
        try:
            self.logs[ns.nsid].append(recs)
        except OSError:
            pass

    def _shrink_to(self, target: int) -> None:
        """Punch free slots, then LRU blocks, until at most `target` bytes are used
        or nothing more can be given back."""
        while self._used() > target:
            for ns in self.index.namespaces.values():
                while ns.alloc.free and self._used() > target:  # unused backed slots go first
                    if not self._unback(ns, ns.alloc.take()):
                        return
            if self._used() <= target:
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
        if self.limit is not None:
            self._shrink_to(self.limit)

    def _regain_space(self) -> None:
        """While a full disk holds the limit under the capacity: raise it again as
        far as the file system has room now (checked at most every space_check_interval)."""
        now = time.monotonic()
        if self.limit == self.capacity or now - self._space_checked < self.space_check_interval:
            return
        self._space_checked = now
        st = os.statvfs(self.root)
        avail = st.f_bavail * st.f_frsize - HEADROOM
        if avail <= 0:
            return
        new = self._used() + avail
        if self.capacity is None:
            self.limit = None
        elif new > self.limit:
            self.limit = min(new, self.capacity)

    def _rank_fd(self, ns: Namespace, rank: int) -> int:
        fd = self._rank_fds.get((ns.nsid, rank))
        if fd is None:
            fd = os.open(data_path(ns_dir(self.root, ns.nsid), rank),
                         os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
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
            self._fallocate(ns, _native.FALLOC_FL_PUNCH_HOLE | _native.FALLOC_FL_KEEP_SIZE, [slot], punch=True)
        except OSError:
            return False
        return True

    def _grow(self, ns: Namespace) -> bool:
        """Reserve disk space for more slots: a chunk, halved on ENOSPC down to one slot."""
        if self.limit is not None and self.limit != self.capacity:
            self._regain_space()
        room = (self.limit - self._used()) if self.limit is not None else GROW_BYTES
        n = min(max(1, GROW_BYTES // ns.slot_cost), room // ns.slot_cost)
        if n <= 0:
            return False
        while n > 0:
            slots = ns.alloc.plan_grow(n)
            try:
                self._fallocate(ns, 0, slots)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    # EIO, EROFS, EFBIG...: no new space now; evicting may still make room
                    log_warning(f"reserving disk space failed ({os.strerror(e.errno or 0)}); saves reuse evicted slots")
                    return False
                # a failed fallocate may have allocated part of the range: give it back
                self._fallocate(ns, _native.FALLOC_FL_PUNCH_HOLE | _native.FALLOC_FL_KEEP_SIZE, slots,
                                ignore_errors=True)
                for rank in range(ns.ranks):
                    os.ftruncate(self._rank_fd(ns, rank), ns.alloc.hwm * ns.slot_bytes)
                self.stats.enospc += 1
                n //= 2
                continue
            ns.alloc.grow(slots)
            return True
        # the disk is full below our capacity: leave the file system some room
        # (journal, other users) and cap ourselves there
        self._make_room()
        return False

    def _scan(self, ns: Namespace) -> dict[bytes, tuple[int, int]]:
        """key -> (slot, write time) for every slot whose header verifies on every rank."""
        found: dict[bytes, tuple[int, int]] | None = None
        sb = ns.slot_bytes
        for rank in range(ns.ranks):
            fd = self._rank_fd(ns, rank)
            here = {}
            for slot in range(os.fstat(fd).st_size // sb):
                try:
                    h = fmt.check_header(os.pread(fd, fmt.HDR_USED, slot * sb), ns.nsid, rank, ns.payload_bytes)
                except fmt.BadBlock:
                    continue
                here[(h["key"], slot)] = h["seq"]
            found = here if found is None else {ks: t for ks, t in here.items() if ks in found}
        return {k: (s, t) for (k, s), t in sorted((found or {}).items(), key=lambda x: x[1])}

    def verify_slot(self, ns: Namespace, key: bytes, slot: int) -> bool:
        """Whether `slot` holds a complete, verifying block of `key` on every rank
        (whatever layout tag it was written with; the reader checks its own)."""
        sb = ns.slot_bytes
        for rank in range(ns.ranks):
            raw = os.pread(self._rank_fd(ns, rank), sb, slot * sb)
            if len(raw) != sb:
                return False
            try:
                h = fmt.check_header(raw[:fmt.HDR_USED], ns.nsid, rank, ns.payload_bytes, key)
            except fmt.BadBlock:
                return False
            if _native.crc32c_bytes(raw[fmt.HEADER_BYTES:fmt.HEADER_BYTES + ns.payload_bytes]) != h["payload_crc"]:
                return False
        return True

    # ---- persistence ----
    def _snapshot(self, ns: Namespace):
        return [(k, s, ns.atime.get(k, 0)) for k, s in ns.entries.items()]

    def flush_if_due(self) -> None:
        """fdatasync journals whose last sync is older than sync_interval (call often; cheap)."""
        for jlog in self.logs.values():
            try:
                jlog.sync_if_due()
            except OSError as e:
                log_warning(f"journal fdatasync failed ({os.strerror(e.errno or 0)})")

    def checkpoint(self) -> None:
        for nsid, log in self.logs.items():
            log.checkpoint(self._snapshot(self.index.namespaces[nsid]))

    def close(self) -> None:
        for io in self._io.values():
            io.close()
        self._io.clear()
        if self._backend is not None:
            self._backend.close()
            self._backend = None
        if not self.readonly and self.lock is not None and self.lock.fd is not None:
            self.checkpoint()
        for log in self.logs.values():
            log.close()
        for fd in self._rank_fds.values():
            os.close(fd)
        self._rank_fds.clear()
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
            self.unpin(ns, keys)
        res = [next(out) if s is not None else -errno.ENOENT for s in slots]
        bad = [k for k, r in zip(keys, res) if r not in (0, -errno.ENOENT)]
        self.drop(ns, bad)
        self.stats.loads += sum(r == 0 for r in res)
        self.stats.load_failures += len(bad)
        return res
