# SPDX-License-Identifier: Apache-2.0
"""An engine's tenants file, DIR/tenants.<E> (data/format/sidefiles.py, "tenants"): read, and written by its owner.

`read_file` reads any engine's file (the owner's at open, the other engines' as they follow
it, `aiokv inspect`). `TenantsFile` is the owner's writer: what the file holds (`_recs`, as
on disk), a record written whole or not at all (`ensure_io`: a short write goes on, a failed
one is cut off again, so the file never ends in a torn record that would hide the records after
it), the file replaced whole (written beside, synced, renamed over) when an id or a tag is given
anew (a reclaimed id: tenants.py), leaving out the records of every id free at the owner's last
reclaim (so the tenants given those next append: one replacement per reclaim). A record is synced before the journal record naming its id
is written: `ensure_io` runs on the I/O thread inside that journal write (journalq.py), and
raises when the record could not be written, so that write and its commit fail with it.

An id is given anew only while every journal of ours replays to what the index holds: a journal
write that failed (`IndexLog.diverged`, until a checkpoint) may have left a DROP unwritten, whose
block would come back at a restart under the id's new tenant; `ensure_io` refuses then
(`TenantsNotWritten`, `checkpoint` set), and the owner checkpoints.

Threading contract: `open_io` runs at opening (the opener's thread); `ensure_io` on the store's
I/O thread (or inline), which alone owns `_recs`, `_ids` and `_size` afterwards.
"""

from __future__ import annotations

import errno
import logging
import os

from aiokv.data import format as fmt
from aiokv.data.dirs import FILE_FLAGS

log = logging.getLogger("aiokv")
MAX_FILE = 16 << 20  # bytes read of one tenants file (a hostile file stays bounded; 65,534 records fit)


class TenantsNotWritten(OSError):
    """A tenants record was not written: the journal write naming its id is not made."""

    checkpoint = False  # True: refused until our journals are checkpointed (an id given anew)


def read_file(root_fd: int, engine: int, cut: bool = False) -> list[tuple[bytes, int, bool, str | None]]:
    """The records of an engine's tenants file: [(tag, id, keyed, name)], in order (none if
    there is no file or its header is not ours). cut: the owner at open: a torn or damaged
    tail is cut off (a header that is not ours: the file is emptied), so that the next record
    is read after the last good one."""
    try:
        fd = os.open(fmt.tenants_name(engine), (os.O_RDWR if cut else os.O_RDONLY) | FILE_FLAGS, dir_fd=root_fd)
    except FileNotFoundError:
        return []
    try:
        buf = os.pread(fd, MAX_FILE, 0)
        try:
            fmt.unpack_file_header(buf, fmt.TENANTS_MAGIC)
        except fmt.BadBlock as e:
            if cut and buf:  # (a header cut short: a first write that failed; else damage, or not ours)
                if len(buf) >= fmt.FILE_HDR_BYTES:
                    log.warning(
                        "aiokv: %s is not a tenants file this aiokv reads (%s); it is started again",
                        fmt.tenants_name(engine),
                        e,
                    )
                os.ftruncate(fd, 0)
            return []
        out, ids, tags = [], set(), set()
        it = fmt.iter_tenants(buf[fmt.FILE_HDR_BYTES :])
        while True:
            try:
                tag, tid, keyed, name = next(it)
            except StopIteration as stop:
                valid = fmt.FILE_HDR_BYTES + stop.value
                break
            if tid in ids or tag in tags:
                continue  # given twice: the first record holds
            ids.add(tid)
            tags.add(tag)
            out.append((tag, tid, keyed, name))
        if cut and valid < os.fstat(fd).st_size:
            os.ftruncate(fd, valid)  # a torn tail (a kill mid-append), or damage: never before our next record
            os.fdatasync(fd)
        return out
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes, off: int) -> None:
    """pwrite all of data at off (a short write goes on; nothing written: ENOSPC)."""
    view = memoryview(data)
    while view:
        w = os.pwrite(fd, view, off)
        if w <= 0:
            raise OSError(errno.ENOSPC, "no byte written")
        view, off = view[w:], off + w


class TenantsFile:
    def __init__(self, root_fd: int, engine: int):
        self.root_fd, self.engine = root_fd, engine
        self.name = fmt.tenants_name(engine)
        self._recs: dict[int, tuple[bytes, bytes]] = {}  # id -> (tag, record) as in the file
        self._ids: dict[bytes, int] = {}  # tag -> id as in the file
        self._size = 0  # bytes of the file that hold its header and whole records (0: no file yet)
        self._stale_seen: frozenset = frozenset()  # the owner's last set of free ids met
        self._stale: set[int] = set()  # of those, the ones not written since: left out at a replacement
        self.logs = None  # nsid -> IndexLog, our journals (persist.py): whether they replay to the index

    def open_io(self, readonly: bool) -> list[tuple[bytes, int, bool, str | None]]:
        """Our file at opening: its records (a torn tail cut off unless readonly)."""
        recs = read_file(self.root_fd, self.engine, cut=not readonly)
        for tag, tid, keyed, name in recs:
            self._recs[tid] = (tag, fmt.pack_tenant(tag, tid, keyed, name))
            self._ids[tag] = tid
        if recs:
            self._size = fmt.FILE_HDR_BYTES + sum(len(r) for _, r in self._recs.values())
        return recs

    def ensure_io(self, tid: int, tag: bytes, rec: bytes, stale: frozenset = frozenset()) -> None:
        """(The I/O thread's.) The file names tid as tag, written and synced, before the
        caller's journal write; raises TenantsNotWritten if it could not be. stale: the ids
        the owner had free at its last reclaim: a replacement leaves their records out (so the
        next tenants given them append), but those written since."""
        if stale is not self._stale_seen:
            self._stale_seen, self._stale = stale, set(stale)
        self._stale.discard(tid)
        if self._recs.get(tid, (None,))[0] == tag:
            return
        try:
            if tid in self._recs or tag in self._ids:  # given anew: the old record must go
                if any(getattr(lg, "diverged", False) for lg in list((self.logs or {}).values())):
                    e = TenantsNotWritten(errno.EAGAIN, "an id is given anew only once our journals are checkpointed")
                    e.checkpoint = True
                    raise e
                keep = {i: r for i, r in self._recs.items() if i != tid and r[0] != tag and i not in self._stale}
                keep[tid] = (tag, rec)
                self._replace(keep)
            else:
                self._append(tid, tag, rec)
        except TenantsNotWritten:
            raise
        except OSError as e:
            raise TenantsNotWritten(
                e.errno or errno.EIO, f"writing {self.name} failed: {os.strerror(e.errno or 0)}"
            ) from e

    def _append(self, tid: int, tag: bytes, rec: bytes) -> None:
        fd = os.open(self.name, os.O_WRONLY | os.O_CREAT | FILE_FLAGS, 0o600, dir_fd=self.root_fd)
        try:
            start = self._size
            try:
                if start == 0:
                    os.ftruncate(fd, 0)
                    _write_all(fd, fmt.pack_file_header(fmt.TENANTS_MAGIC, 0, version=fmt.TENANTS_VERSION), 0)
                    start = fmt.FILE_HDR_BYTES
                _write_all(fd, rec, start)
                os.fdatasync(fd)
                if self._size == 0:
                    os.fsync(self.root_fd)  # (its name survives a power cut)
            except OSError:
                try:
                    os.ftruncate(fd, self._size)  # whole records only: the next append lands after them
                except OSError:
                    pass  # cut at the next opening (read_file)
                raise
        finally:
            os.close(fd)
        self._size = start + len(rec)
        self._recs[tid] = (tag, rec)
        self._ids[tag] = tid

    def _replace(self, recs: dict[int, tuple[bytes, bytes]]) -> None:
        """The file replaced by one of these records (beside it, synced, renamed over)."""
        tmp = self.name + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | FILE_FLAGS, 0o600, dir_fd=self.root_fd)
        try:
            body = b"".join(r for _, r in recs.values())
            _write_all(fd, fmt.pack_file_header(fmt.TENANTS_MAGIC, 0, version=fmt.TENANTS_VERSION) + body, 0)
            os.fdatasync(fd)
        except OSError:
            os.close(fd)
            try:
                os.unlink(tmp, dir_fd=self.root_fd)
            except OSError:
                pass
            raise
        os.close(fd)
        os.replace(tmp, self.name, src_dir_fd=self.root_fd, dst_dir_fd=self.root_fd)
        os.fsync(self.root_fd)
        self._recs = dict(recs)
        self._ids = {tag: i for i, (tag, _) in recs.items()}
        self._size = fmt.FILE_HDR_BYTES + len(body)
