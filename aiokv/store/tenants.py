# SPDX-License-Identifier: Apache-2.0
"""Tenants: which tenant each block belongs to, by a small id (issues 34, 40).

A tenant is a request's cache_salt (none: the tenant "", id 0). On disk a tenant is named by
its tag (format.tenant_tag: BLAKE2b of the name, keyed under a `secret`, so that the name never
reaches disk where one is set); each engine keeps its own table of tag -> id in DIR/tenants.<E>
(tenantsfile.py), and its COMMIT and checkpoint records carry the id (2 bytes). The index
keeps the id per block (table.py's `tenant` column).

`Tenants` is the store's registry: tag <-> id for the tenants whose blocks it holds or sees, in
one id space for the store: our own engine's ids are those of our file (so our records carry
them as they are), and each other engine's ids are mapped into ours as its blocks are followed
(`adopt`, `remap`). The rules:

- a tenant is registered when its first block is committed (`register`), never for a request
  alone; its record is written and synced inside the journal write of that commit, before its
  records (`writer`, tenantsfile.py): a record that cannot be written fails that commit, and
  the next commit tries again. So every id our journals name is in our file;
- ids no block carries (ours or any other engine's, as followed) are reclaimed when no id is
  left (`_reclaim`, at most every RECLAIM_EVERY seconds): the tenant is forgotten, the id given
  to the next new tenant; the file is then replaced without the old record. Never while an
  index of ours loads (its blocks' ids are not known yet) or failed to load;
- past MAX_TENANT_ID tenants holding blocks, with none to reclaim, a new tenant gets no id: its
  blocks are not stored (Store.reserve and commit count them: skipped_tenants) until an id is
  free, so a clear, a quota or a pin of a tenant never reaches another's blocks. Another engine's
  blocks whose tenant has no id here (ids past ours, or ids its file does not name) count for
  no tenant: OVERFLOW_TENANT, which no clear or pin of a named tenant matches and no quota counts;
- blocks of ours whose id the file did not name at opening (a damaged or lost file, or an
  older aiokv's failed write) count for no tenant either (`own_loaded`), and their ids are not
  given out in this life (`_blocked`; another engine's tenant given one while our index loaded
  moves to a new id, `_move_off`): the next checkpoint writes them as no tenant's.

Threading contract: the owner's (the Store's thread), except `at_open` (the loader thread
reads it: never changed after opening), the file's `ensure_io` (the I/O thread: tenantsfile.py)
and `read_peer_io` (the I/O thread, with its own `_peer_seen`).
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np

from aiokv.data import format as fmt
from aiokv.store.tenantsfile import TenantsFile, TenantsNotWritten, read_file  # noqa: F401  (read_file: the CLI's)

log = logging.getLogger("aiokv")
RECLAIM_EVERY = 1.0  # seconds between looks for ids no block carries, while no id is free
SAY_EVERY = 60.0  # seconds between log lines of tenants not registered or written
MEMO = 1024  # names whose tags are kept (a tag is a BLAKE2b: the scheduler asks per block)


class Tenants:
    def __init__(self, dirs, fs, key: bytes | None, index):
        """key: format.tenant_key(secret) (None: no secret: tags unkeyed, names written)."""
        self.dirs, self.fs, self.key, self.index = dirs, fs, key, index
        self.file: TenantsFile | None = None  # ours (load_own; None without an engine)
        self._id: dict[bytes, int] = {fmt.NO_TENANT: 0}
        self._tag: dict[int, bytes] = {0: fmt.NO_TENANT}
        self._name: dict[int, str | None] = {0: ""}
        self._next = 1  # ids from here were never given out in this life
        self._free: list[int] = []  # ids reclaimed, to give out
        self._stale: frozenset[int] = frozenset()  # the ids free at the last reclaim (their records may go)
        self._blocked: set[int] = set()  # ids our journals name that the file at opening did not
        self.at_open: dict[bytes, int] = {fmt.NO_TENANT: 0}  # our file at opening (the loader's rebuild)
        self._peers: dict[int, dict[int, tuple[bytes, str | None]]] = {}  # engine -> its file: id -> (tag, name)
        self._remaps: dict[int, np.ndarray] = {}  # engine -> its ids -> ours (-1: not resolved yet)
        self._peer_seen: dict[int, tuple] = {}  # the I/O thread's: engine -> (inode, size, times) read
        self._memo: dict[str, bytes] = {}
        self._looked = -RECLAIM_EVERY  # time.monotonic() of the last look for ids to reclaim
        self._said: dict[str, float] = {}  # what was said -> when, last
        self.epoch = 0  # changes whenever an id is given or taken back (quotas.py caches per id)
        self.failed_loads: set[bytes] = set()  # our namespaces whose index failed to load (the store's)
        self.checkpoint = lambda: None  # checkpoint our journals (the store's: persist.py)

    # ---- the owner's ----
    def load_own(self, logs) -> None:
        """Our engine's file, read at open (a torn tail cut): its ids are ours. logs: our
        journals (persist.py; whether they replay to the index: tenantsfile.py)."""
        if self.dirs.engine is None:
            return
        self.file = TenantsFile(self.dirs.root_fd, self.dirs.engine)
        self.file.logs = logs
        for tag, tid, _keyed, name in self.file.open_io(self.dirs.readonly):
            self._set(tid, tag, name)
            self.at_open[tag] = tid
            self._next = max(self._next, tid + 1)

    def id_at_open(self, tag: bytes) -> int:
        """The id our file gave a tag at opening (OVERFLOW_TENANT: none; the loader's rebuild)."""
        return self.at_open.get(tag, fmt.OVERFLOW_TENANT)

    def loading(self) -> tuple[bool, bool]:
        """(an index of ours is still loading, one failed to load): new ids wait for the first,
        and none is reclaimed while either holds."""
        failed = self.failed_loads
        return any(not ns.ready and k not in failed for k, ns in self.index.namespaces.items()), bool(failed)

    def own_loaded(self, table) -> None:
        """An index of ours is in place: its blocks whose ids the file at opening did not name
        count for no tenant, and those ids are not given out in this life."""
        named = set(self.at_open.values()) | {fmt.OVERFLOW_TENANT}
        orphans = [int(t) for t in np.flatnonzero(table.tenant_blocks) if int(t) not in named]
        if not orphans:
            return
        self._blocked.update(orphans)
        self._move_off([t for t in orphans if t in self._tag])
        mask = (table.tag != 0) & np.isin(table.tenant, orphans)
        table.tenant[mask] = fmt.OVERFLOW_TENANT
        table.recount()
        log.warning(
            "aiokv: %d block(s) name tenant ids that %s does not (a damaged or lost tenants file); "
            "they count for no tenant",
            int(mask.sum()),
            fmt.tenants_name(self.dirs.engine),
        )

    def _move_off(self, ids: list[int]) -> None:
        """Other engines' tenants given these ids in this life (`remap`, while our index loaded)
        that our journals name for blocks of no tenant (own_loaded): given new ids, the other
        engines' blocks here and their mappings with them (none free: no tenant's for now)."""
        if not ids:
            return
        to = np.arange(fmt.OVERFLOW_TENANT + 1, dtype=np.int64)
        for tid in ids:
            tag, name = self._tag.pop(tid), self._name.pop(tid, None)
            del self._id[tag]
            new = self._new_id(reclaim=False)
            if new is not None:
                self._set(new, tag, name)
            to[tid] = fmt.OVERFLOW_TENANT if new is None else new
        for r in self._remaps.values():
            hit = np.isin(r, ids)
            r[hit] = np.where(to[r[hit]] == fmt.OVERFLOW_TENANT, -1, to[r[hit]])  # (-1: resolved again)
        for ns in self.index.namespaces.values():
            for t in ns.tables.values():
                t.tenant[:] = to[t.tenant]
                t.recount()
                t.forget_order()
        self.epoch += 1

    def _set(self, tid: int, tag: bytes, name: str | None) -> None:
        self._id[tag], self._tag[tid], self._name[tid] = tid, tag, name
        self.epoch += 1

    def tag(self, name: str) -> bytes:
        got = self._memo.get(name)
        if got is None:
            if len(self._memo) >= MEMO:
                self._memo.clear()
            got = self._memo[name] = fmt.tenant_tag(name, self.key)
        return got

    def of(self, tenant: str | bytes) -> tuple[bytes, str | None]:
        """(tag, name or None) of a tenant given by its name (a cache_salt) or its tag."""
        if isinstance(tenant, str):
            return self.tag(tenant), tenant
        return bytes(tenant) if tenant else fmt.NO_TENANT, None

    def lookup(self, tag: bytes) -> int | None:
        """The id of a registered tenant, else None (registers nothing)."""
        return self._id.get(tag)

    def id(self, name: str) -> int | None:
        """The id of a tenant named by its cache_salt, if registered (0 for ""; None: not)."""
        return self._id.get(self.tag(name or ""))

    def for_save(self, tenant: str | bytes) -> tuple[bytes | None, int | None]:
        """(tag, id or None if not registered) of a tenant (a name or a tag) about to save a
        block (Store.reserve); (None, None): a new tenant and no id free: not stored (said)."""
        tag = self.of(tenant)[0]
        tid = self._id.get(tag)
        if tid is not None and tid not in self._blocked:
            return tag, tid
        if tid is None and not self.loading()[0] and (self._free or self._next <= fmt.MAX_TENANT_ID or self._reclaim()):
            return tag, None
        self._say_skipped()
        return None, None

    def register(self, tenant: str | bytes) -> tuple[bytes, int | None]:
        """(tag, the id a committed block of a tenant, a name or a tag, carries: registered if
        new); None: there is none free (past MAX_TENANT_ID tenants holding blocks), or not while
        an index of ours loads, or its id is one our journals may name for another (_blocked)."""
        tag, name = self.of(tenant)
        tid = self._id.get(tag)
        if tid is None:
            tid = None if self.loading()[0] else self._new_id()
            if tid is None:
                self._say_skipped()
                return tag, None
            self._set(tid, tag, name)
        elif name is not None and self._name.get(tid) is None:
            self._name[tid] = name
        if tid in self._blocked:
            self._say_skipped()
            return tag, None
        return tag, tid

    def _new_id(self, reclaim: bool = True) -> int | None:
        if self._free:
            return self._free.pop()
        while self._next <= fmt.MAX_TENANT_ID:
            tid, self._next = self._next, self._next + 1
            if tid not in self._blocked:
                return tid
        return self._free.pop() if reclaim and self._reclaim() else None

    def _reclaim(self) -> bool:
        """Forget the tenants no block carries (every engine's, as followed), their ids free
        again; True if any was. At most every RECLAIM_EVERY seconds; never while an index of
        ours loads or failed to (the ids its blocks carry are not known)."""
        now = time.monotonic()
        if now - self._looked < RECLAIM_EVERY or any(self.loading()):
            return False
        self._looked = now
        held = self.index.tenant_bytes()
        ids = np.fromiter(self._tag, np.int64, len(self._tag))
        ids = ids[(ids != 0) & (ids != fmt.OVERFLOW_TENANT)]
        carried = np.zeros(len(ids), bool)
        inside = ids < len(held)
        carried[inside] = held[ids[inside]] != 0
        freed = [t for t in ids[~carried].tolist() if t not in self._blocked]
        if not freed:
            return False
        for tid in freed:
            del self._id[self._tag.pop(tid)]
            self._name.pop(tid, None)
        self._free.extend(sorted(freed, reverse=True))
        self._stale = frozenset(self._free)  # (the file's next replacement leaves their records out)
        for r in self._remaps.values():
            r[np.isin(r, freed)] = -1  # another engine's ids that named them: resolved again
        self.epoch += 1
        return True

    def writer(self, tid: int):
        """What the journal write of a commit naming tid runs first (None: nothing): our
        file's record of tid, written and synced there (tenantsfile.py)."""
        if tid == 0 or self.file is None or self.dirs.readonly:
            return None
        f, tag, stale = self.file, self._tag[tid], self._stale
        rec = fmt.pack_tenant(tag, tid, self.key is not None, self._name.get(tid))
        return lambda: f.ensure_io(tid, tag, rec, stale)

    def not_written(self, e: TenantsNotWritten, n: int) -> None:
        """A commit's tenants record was not written (its blocks are not committed)."""
        if e.checkpoint:
            self.checkpoint()  # (an id given anew waits for it: tenantsfile.py)
        if self._due("written"):
            log.warning("aiokv: %s; %d block(s) not committed (tried again at the next save)", e.strerror, n)

    def _say_skipped(self) -> None:
        """Blocks of a tenant without an id are not stored (one line a minute at most)."""
        if self._due("skipped"):
            log.warning(
                "aiokv: blocks of new tenants are not stored: %s (counted: save_dropped_blocks cause tenants)",
                "an index of ours is still loading"
                if self.loading()[0]
                else f"every tenant id ({fmt.MAX_TENANT_ID}) is held by tenants with blocks; "
                "ids come free as those blocks go",
            )

    def _due(self, what: str) -> bool:
        """Whether a line about `what` may be said now (one a minute at most)."""
        now = time.monotonic()
        if now - self._said.get(what, -SAY_EVERY) < SAY_EVERY:
            return False
        self._said[what] = now
        return True

    def tag_of(self, tid: int) -> bytes | None:
        return self._tag.get(tid)

    def name_of(self, tid: int) -> str | None:
        """The tenant's name where known (this process met it, or a file names it), else None."""
        return self._name.get(tid)

    def label(self, tid: int) -> str:
        """How a tenant is shown (inspect, metrics): its name, or its tag's first 12 hex
        digits (a keyed tag: the name is not known without the secret)."""
        if tid == fmt.OVERFLOW_TENANT:
            return "(no tenant)"
        name = self._name.get(tid)
        if name is not None and self.key is None:  # (under a secret names are shown nowhere)
            return name
        tag = self._tag.get(tid)
        return "#" + tag.hex()[:12] if tag is not None else f"#id{tid}"

    def ids(self) -> list[int]:
        return sorted(self._tag)

    # ---- the other engines' ids ----
    def adopt(self, engine: int, records) -> None:
        """Another engine's tenants file, read anew (read_peer_io): its ids are resolved into
        ours again as its blocks come (an id it reclaimed names its new tenant)."""
        self._peers[engine] = {tid: (tag, name) for tag, tid, _keyed, name in records}
        r = self._remaps.get(engine)
        if r is not None:
            r[1 : fmt.OVERFLOW_TENANT] = -1

    def remap(self, engine: int, ids) -> np.ndarray:
        """Another engine's tenant ids as ours (ids its file does not name, or tenants without
        an id here: OVERFLOW_TENANT, no tenant's)."""
        if engine == self.dirs.engine:
            return np.asarray(ids, np.uint16)
        r = self._remaps.get(engine)
        if r is None:
            r = self._remaps[engine] = np.full(fmt.OVERFLOW_TENANT + 1, -1, np.int32)
            r[0], r[fmt.OVERFLOW_TENANT] = 0, fmt.OVERFLOW_TENANT
        ids = np.asarray(ids, np.int64)
        out = r[ids]
        todo = out < 0
        if todo.any():
            peer = self._peers.get(engine, {})
            if not self._free and self._next > fmt.MAX_TENANT_ID:
                self._reclaim()  # (before: an id given below holds no block yet)
            for pid in np.unique(ids[todo]).tolist():
                got = peer.get(pid)
                if got is None:
                    r[pid] = fmt.OVERFLOW_TENANT  # (not named: damage, or an older aiokv's lost write)
                    continue
                tid = self._id.get(got[0])
                if tid is None:
                    tid = self._new_id(reclaim=False)
                    if tid is None:
                        continue  # no id free: no tenant's for now, resolved again next time
                    self._set(tid, got[0], got[1])
                elif got[1] is not None and self._name.get(tid) is None:
                    self._name[tid] = got[1]
                r[pid] = tid
            out = r[ids]
            out[out < 0] = fmt.OVERFLOW_TENANT
        return out.astype(np.uint16)

    # ---- the I/O thread's ----
    def read_peer_io(self, engine: int):
        """Another engine's tenants file if it changed since the last read (else None)."""
        try:
            st = os.stat(fmt.tenants_name(engine), dir_fd=self.dirs.root_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        ident = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)  # (replaced whole: tenantsfile.py)
        if self._peer_seen.get(engine) == ident:
            return None
        got = read_file(self.dirs.root_fd, engine)
        self._peer_seen[engine] = ident  # (once read: a read that failed is tried again)
        return got

    def reread_peer_io(self, engine: int) -> None:
        """Another engine's tenants file is read again at the next look (what was read was not applied)."""
        self._peer_seen.pop(engine, None)
