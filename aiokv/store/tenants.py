# SPDX-License-Identifier: Apache-2.0
"""Tenants: which tenant each block belongs to, by a small id (issue 34).

A tenant is a request's cache_salt (none: the tenant "", id 0). On disk a tenant is named by
its tag (format.tenant_tag: BLAKE2b of the name, keyed under a `secret`, so that the name never
reaches disk where one is set); each engine keeps its own table of tag -> id in DIR/tenants.<E>
(format.pack_tenant), and its COMMIT and checkpoint records carry the id (2 bytes). The index
keeps the id per block (table.py's `tenant` column).

`Tenants` is the store's registry: tag <-> id for every tenant it has met, in one id space for
the store: our own engine's ids are those of our file (so our records carry them as they are),
and each other engine's ids are mapped into ours when its blocks are followed (`adopt`,
`remap`). Ids are never reused; past MAX_TENANT_ID every new tenant shares OVERFLOW_TENANT
(counted together, not told apart: docs/operations.md, "Operating the cache").

Threading contract: the registry (`id`, `of_tag`, `adopt`, `remap`, the names) is the owner's
(the Store's thread); `persist` queues the write of our file's records to the store's I/O
thread, in order before the journal records that name them; `read_peer_io` runs on the I/O
thread and keeps its own state (`_peer_seen`).
"""

from __future__ import annotations

import logging
import os

import numpy as np

from aiokv.data import format as fmt

log = logging.getLogger("aiokv")
O_FLAGS = os.O_CLOEXEC | os.O_NOFOLLOW
MAX_FILE = 16 << 20  # bytes read of one tenants file (a hostile file stays bounded)


def read_file(root_fd: int, engine: int) -> list[tuple[bytes, int, bool, str | None]]:
    """The records of an engine's tenants file: [(tag, id, keyed, name)], in order (none if
    there is no file or its header is not ours)."""
    try:
        fd = os.open(fmt.tenants_name(engine), os.O_RDONLY | O_FLAGS, dir_fd=root_fd)
    except FileNotFoundError:
        return []
    try:
        buf = os.pread(fd, MAX_FILE, 0)
    finally:
        os.close(fd)
    try:
        fmt.unpack_file_header(buf, fmt.TENANTS_MAGIC)
    except fmt.BadBlock:
        return []
    out, ids, tags = [], set(), set()
    for tag, tid, keyed, name in fmt.iter_tenants(buf[fmt.FILE_HDR_BYTES :]):
        if tid in ids or tag in tags:
            continue  # given twice: the first record holds
        ids.add(tid)
        tags.add(tag)
        out.append((tag, tid, keyed, name))
    return out


class Tenants:
    def __init__(self, dirs, fs, key: bytes | None):
        """key: format.tenant_key(secret) (None: no secret: tags unkeyed, names written)."""
        self.dirs, self.fs, self.key = dirs, fs, key
        self._id: dict[bytes, int] = {fmt.NO_TENANT: 0}
        self._tag: dict[int, bytes] = {0: fmt.NO_TENANT}
        self._name: dict[int, str | None] = {0: ""}
        self._next = 1
        self._ours: set[int] = set()  # ids in our own file (written, or queued)
        self._remaps: dict[int, np.ndarray] = {}  # engine -> its ids -> ours
        self._peer_seen: dict[int, tuple[int, int]] = {}  # the I/O thread's: engine -> (inode, size) read
        self._failed = False

    # ---- the owner's ----
    def load_own(self) -> None:
        """Our engine's file, read at open: its ids are ours."""
        if self.dirs.engine is None:
            return
        for tag, tid, _keyed, name in read_file(self.dirs.root_fd, self.dirs.engine):
            self._id[tag] = tid
            self._tag[tid] = tag
            self._name[tid] = name
            self._ours.add(tid)
            self._next = max(self._next, tid + 1)

    def tag(self, name: str) -> bytes:
        return fmt.tenant_tag(name, self.key)

    def id(self, name: str) -> int:
        """The id of a tenant named by its cache_salt (registered if new; its name is kept in
        memory, and on disk only without a secret, once our records name it)."""
        if not name:
            return 0
        tid = self.of_tag(self.tag(name))
        if self._name.get(tid) is None:
            self._name[tid] = name
        return tid

    def of_tag(self, tag: bytes, name: str | None = None) -> int:
        """The id of a tenant named by its tag (registered if new)."""
        tid = self._id.get(tag)
        if tid is not None:
            return tid
        if self._next > fmt.MAX_TENANT_ID:
            return fmt.OVERFLOW_TENANT
        tid = self._next
        self._next += 1
        self._id[tag], self._tag[tid], self._name[tid] = tid, tag, name
        return tid

    def known(self, tag: bytes) -> int:
        """The id of a tenant tag already registered, else 0 (reads only: any thread)."""
        return self._id.get(tag, 0)

    def tag_of(self, tid: int) -> bytes | None:
        return self._tag.get(tid)

    def name_of(self, tid: int) -> str | None:
        """The tenant's name where known (this process met it, or a file names it), else None."""
        return self._name.get(tid)

    def label(self, tid: int) -> str:
        """How a tenant is shown (inspect, metrics): its name, or its tag's first 12 hex
        digits (a keyed tag: the name is not known without the secret)."""
        if tid == fmt.OVERFLOW_TENANT:
            return "(overflow)"
        name = self._name.get(tid)
        if name is not None and self.key is None:  # (under a secret names are shown nowhere)
            return name
        tag = self._tag.get(tid)
        return "#" + tag.hex()[:12] if tag is not None else f"#id{tid}"

    def ids(self) -> list[int]:
        return sorted(self._tag)

    def persist(self, tid: int) -> None:
        """Before our records name the id: its record in our file (queued to the I/O thread,
        written and synced there before what is queued after it)."""
        if tid == 0 or tid == fmt.OVERFLOW_TENANT or tid in self._ours or self.dirs.readonly:
            return
        self._ours.add(tid)
        rec = fmt.pack_tenant(self._tag[tid], tid, self.key is not None, self._name.get(tid))
        try:
            self.fs.submit(lambda: self._write(rec), self._written)
        except OSError:
            pass  # the store is closed

    def _written(self, _, e) -> None:
        if e is not None and not self._failed:
            self._failed = True
            log.warning(
                'aiokv: writing the tenants file failed (%s); blocks of new tenants read as the tenant "" '
                "after a restart",
                os.strerror(e.errno or 0) if isinstance(e, OSError) else e,
            )

    def _write(self, rec: bytes) -> None:
        """(The I/O thread's.) Append a record to our file, creating it; fdatasync."""
        name = fmt.tenants_name(self.dirs.engine)
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_APPEND | O_FLAGS, 0o600, dir_fd=self.dirs.root_fd)
        try:
            if os.fstat(fd).st_size < fmt.FILE_HDR_BYTES:
                os.ftruncate(fd, 0)
                os.write(fd, fmt.pack_file_header(fmt.TENANTS_MAGIC, 0))
            os.write(fd, rec)
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def adopt(self, engine: int, records) -> None:
        """Another engine's tenants file (read_peer_io): its ids mapped into ours."""
        r = self._remaps.get(engine)
        if r is None:
            r = np.zeros(fmt.OVERFLOW_TENANT + 1, np.uint16)
            r[fmt.OVERFLOW_TENANT] = fmt.OVERFLOW_TENANT
            self._remaps[engine] = r
        for tag, tid, _keyed, name in records:
            ours = self.of_tag(tag, name)
            if name is not None and self._name.get(ours) is None:
                self._name[ours] = name
            r[tid] = ours

    def remap(self, engine: int, ids) -> np.ndarray:
        """Another engine's tenant ids as ours (ids its file does not name: 0, the tenant "")."""
        if engine == self.dirs.engine:
            return np.asarray(ids, np.uint16)
        r = self._remaps.get(engine)
        if r is None:
            return np.zeros(len(ids), np.uint16)
        return r[np.asarray(ids, np.int64)]

    # ---- the I/O thread's ----
    def read_peer_io(self, engine: int):
        """Another engine's tenants file if it changed since the last read (else None)."""
        try:
            st = os.stat(fmt.tenants_name(engine), dir_fd=self.dirs.root_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        ident = (st.st_ino, st.st_size)
        if self._peer_seen.get(engine) == ident:
            return None
        got = read_file(self.dirs.root_fd, engine)
        self._peer_seen[engine] = ident  # (once read: a read that failed is tried again)
        return got

    def reread_peer_io(self, engine: int) -> None:
        """Another engine's tenants file is read again at the next look (what was read was not applied)."""
        self._peer_seen.pop(engine, None)
