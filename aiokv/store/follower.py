# SPDX-License-Identifier: Apache-2.0
"""Another engine's index files followed as they grow (Follower).

Other engines on the same directory follow an engine's files with a Follower:
a full replay (a read-only IndexLog) whenever the checkpoint changes, and in
between only the records appended since the last look (one fstat when nothing
changed). A record being appended right now fails its CRC and is read again
at the next look.

Threading contract: a Follower is used by one thread, the Store's owner; it only
reads, and tolerates the owning engine writing beside it.
"""

from __future__ import annotations

import os

import numpy as np

from aiokv.data import format as fmt
from aiokv.data.dirs import FILE_FLAGS
from aiokv.store.indeximage import index_image_bytes
from aiokv.store.journal import IndexLog
from aiokv.store.logrecords import REC, cat, parse_records


class Follower:
    """Another engine's checkpoint + journal of one namespace, read-only, followed
    as it grows. `poll` returns what changed since the last call.

    When the engine writes a checkpoint, a follower that had applied all of the
    old journal does not replay the new checkpoint (seconds per million blocks,
    on the scheduler thread): it reads what is left of the old journal through
    its open descriptor (the owner appends nothing after its checkpoint), checks
    the new checkpoint's generation and record count against what it holds
    (`roll`), and follows the new journal. Anything else is a full replay."""

    def __init__(self, ns_dir: str, dir_fd: int):
        self.dir = ns_dir
        self.dir_fd = dir_fd  # owned by the caller
        self.fd: int | None = None  # journal.<gen>, read-only
        self.off = 0  # bytes of it applied (whole, verified records)
        self.gen = 0  # generation followed
        self.ckpt = None  # identity of the checkpoint (inode, size, mtime) or None
        self.ckpt_bytes = 0
        self.replayed = False
        self.log: IndexLog | None = None  # the last full replay (torn bytes, touches)
        self.broken: tuple | None = None  # checkpoint identity that did not verify: not retried until it changes
        self.records = 0  # records of the current generation seen (replayed or tailed)
        self.max_slot = 1 << 32  # slots at or past it are damage (the caller's file system's size)
        self.image_bytes = 0  # its index image's size, as of the last replay or roll

    def _ckpt_ident(self):
        try:
            st = os.stat("checkpoint", dir_fd=self.dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns

    @property
    def disk_bytes(self) -> int:
        return self.off + self.ckpt_bytes + self.image_bytes

    def poll(self, max_slot: int = 1 << 32):
        """What changed since the last call: ("reset", Table) after a full replay
        (first call, or the engine restarted its files; slots at or past max_slot left
        out); ("tail", records) for records appended since (a numpy array of them:
        parse_records); ("roll", records, count) when the engine wrote a checkpoint of
        `count` entries after those records (the caller checks it holds `count` of that
        engine's blocks, else calls `forget` for a full replay next time); None when
        nothing changed. Raises fmt.BadBlock for a corrupt checkpoint (once per version
        of it)."""
        self.max_slot = max_slot
        ident = self._ckpt_ident()
        if self.replayed and ident == self.ckpt:
            if self.fd is None:  # the journal did not exist yet at the last look
                self._open(self.gen)
                if self.fd is None:
                    return None
            if os.fstat(self.fd).st_size < self.off:  # cut or recreated by a new owner of those files
                return self._replay(ident)
            recs = self._tail()
            return ("tail", recs) if len(recs) else None
        if ident is not None and ident == self.broken:
            return None
        if self.replayed and self.fd is not None and ident is not None:
            rolled = self._roll(ident)
            if rolled is not None:
                return rolled
        return self._replay(ident)

    def forget(self) -> None:
        """The caller's view disagrees with the files: replay them at the next poll."""
        self.replayed = False

    def _tail(self):
        size = os.fstat(self.fd).st_size
        if size <= self.off:
            return np.zeros(0, REC)
        raw = os.pread(self.fd, size - self.off, self.off)
        recs, _ = parse_records(raw)  # up to the first record that does not verify (yet)
        self.off += len(recs) * fmt.REC_BYTES
        self.records += len(recs)
        return recs

    def _roll(self, ident):
        recs = self._tail()  # the rest of the old journal, still readable through our descriptor
        try:
            fd = os.open("checkpoint", os.O_RDONLY | FILE_FLAGS, dir_fd=self.dir_fd)
        except FileNotFoundError:
            return None
        try:
            gen, count, _ = fmt.unpack_file_header(os.pread(fd, fmt.FILE_HDR_BYTES, 0), fmt.CKPT_MAGIC)
            if gen != self.gen + 1 or os.fstat(fd).st_ino != ident[0]:
                return None
        except fmt.BadBlock:
            return None
        finally:
            os.close(fd)
        self.close()
        self.gen, self.ckpt, self.ckpt_bytes, self.records = gen, ident, fmt.FILE_HDR_BYTES + count * fmt.REC_BYTES, 0
        self.image_bytes = index_image_bytes(self.dir_fd)
        self._open(gen)
        if self.fd is not None:
            recs = cat([recs, self._tail()])
        return "roll", recs, count

    def _replay(self, ident):
        log = IndexLog(self.dir, self.dir_fd, readonly=True)
        try:
            table = log.load_table(self.max_slot)
        except fmt.BadBlock:
            self.broken = ident
            raise
        table.mark = log.mark  # (the control orders its owner has applied: control.py)
        self.log, self.ckpt, self.replayed = log, ident, True
        self.image_bytes = log.image_bytes
        self.gen, self.ckpt_bytes, self.records = log.gen, log.ckpt_bytes, log.records
        self.close()
        self._open(log.gen)
        if self.fd is not None and log.size:
            self.off = log.size  # the records the replay applied; the rest is tailed
        return "reset", table

    def _open(self, gen: int) -> None:
        try:
            self.fd = os.open(IndexLog._journal_name(gen), os.O_RDONLY | FILE_FLAGS, dir_fd=self.dir_fd)
        except FileNotFoundError:
            self.fd = None
            return
        self.off = fmt.FILE_HDR_BYTES

    def close(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None  # (gone even if close reports an error)
            os.close(fd)
