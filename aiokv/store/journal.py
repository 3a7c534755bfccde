# SPDX-License-Identifier: Apache-2.0
"""Crash-consistent persistence of one namespace's index: checkpoint + journal.

Why a journal of fixed 64-byte records and not SQLite: commits come in batches
from one thread, a replay must be fast for millions of entries, and a torn tail
must simply end the replay. Each record carries its own CRC32C, so replay stops
at the first record that does not verify and the owner truncates the file there
(docs/format.md, "Index"). Bench: tools/bench_index.py.

Durability: records reach the kernel with write(2) at every commit batch, so a
kill -9 loses nothing committed; fdatasync runs at most every `sync_interval`
seconds and at close, so a power cut loses at most that window. Data blocks
verify themselves, so an index record whose block never reached the disk is a
miss on read, never wrong bytes.

Other engines on the same directory follow an engine's files with a Follower:
a full replay (a read-only IndexLog) whenever the checkpoint changes, and in
between only the records appended since the last look (one fstat when nothing
changed). A record being appended right now fails its CRC and is read again
at the next look.

Threading contract: an IndexLog or Follower is used by one thread, the Store's
owner. A read-only IndexLog (inspect) never writes and tolerates a writer beside it.
"""

from __future__ import annotations

import errno
import logging
import os
import time

from aiokv import _native
from aiokv.data import format as fmt

O_FLAGS = os.O_CLOEXEC | os.O_NOFOLLOW


def _read_file(name: str, dir_fd: int) -> bytes | None:
    try:
        fd = os.open(name, os.O_RDONLY | O_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    try:
        chunks = []
        while True:
            b = os.read(fd, 1 << 24)
            if not b:
                return b"".join(chunks)
            chunks.append(b)
    finally:
        os.close(fd)


class IndexLog:
    """Checkpoint + journal files of one namespace directory, opened relative to
    its descriptor `dir_fd` (owned by the caller; dirs.py)."""

    def __init__(self, ns_dir: str, dir_fd: int, readonly: bool = False, sync_interval: float = 1.0):
        self.dir = ns_dir  # for messages
        self.dir_fd = dir_fd
        self.readonly = readonly
        self.sync_interval = sync_interval
        self.gen = 0
        self.records = 0  # records in the current journal
        self.fd: int | None = None
        self.size = 0  # bytes of the journal file that hold whole records
        self._last_sync = time.monotonic()
        self.torn_bytes = 0  # bytes dropped from a torn journal tail at open
        self.lost_journal = 0  # bytes of a journal whose header did not verify (read-only openers drop it)
        self.ckpt_bytes = 0  # size of the current checkpoint file
        self._dirty = False
        self.sync_failures = 0  # fdatasync failures in a row (sync_if_due)
        self.touches: list[tuple[bytes, int]] = []  # TOUCH records of keys this journal does not hold

    def _journal_path(self, gen: int) -> str:
        return os.path.join(self.dir, self._journal_name(gen))

    @staticmethod
    def _journal_name(gen: int) -> str:
        return f"journal.{gen}"

    def load(self) -> dict[bytes, tuple[int, int]]:
        """Replay checkpoint then journal; return key -> (slot, atime)."""
        entries: dict[bytes, tuple[int, int]] = {}
        raw = _read_file("checkpoint", self.dir_fd)
        if raw is not None:
            try:
                gen, count, crc = fmt.unpack_file_header(raw, fmt.CKPT_MAGIC)
                body = raw[fmt.FILE_HDR_BYTES : fmt.FILE_HDR_BYTES + count * fmt.REC_BYTES]
                if len(body) != count * fmt.REC_BYTES or _native.crc32c_bytes(body) != crc:
                    raise fmt.BadBlock("checkpoint checksum")
                for _kind, key, slot, atime in fmt.iter_records(body, verify_each=False):
                    entries[key] = (slot, atime)
                self.gen = gen
                self.ckpt_bytes = fmt.FILE_HDR_BYTES + len(body)
            except fmt.BadBlock as e:
                raise fmt.BadBlock(
                    f"{self.dir}/checkpoint is corrupt ({e}); the engine rebuilds it from the blocks "
                    f"when it opens the store, or run: aiokv inspect --repair {os.path.dirname(os.path.dirname(self.dir))}"
                ) from e
        jpath = self._journal_path(self.gen)
        raw = _read_file(self._journal_name(self.gen), self.dir_fd)
        valid = 0
        journal_ok = False
        if raw is not None and len(raw) >= fmt.FILE_HDR_BYTES:
            try:
                gen, _, _ = fmt.unpack_file_header(raw, fmt.JOURNAL_MAGIC)
            except fmt.BadBlock:
                gen = -1
            if gen != self.gen and not self.readonly:
                # The owner must not drop these records and then reclaim their
                # slots as unused: it rebuilds the index from the slot headers.
                raise fmt.BadBlock(f"{jpath} has a bad header")
            if gen != self.gen:
                self.lost_journal = len(raw)
                logging.getLogger("aiokv").warning(
                    "aiokv: %s has a bad header; the %d index records in it since the last checkpoint are "
                    "dropped (their blocks become misses)",
                    jpath,
                    (len(raw) - fmt.FILE_HDR_BYTES) // fmt.REC_BYTES,
                )
            if gen == self.gen:
                journal_ok = True
                body = raw[fmt.FILE_HDR_BYTES :]
                it = fmt.iter_records(body)
                while True:
                    try:
                        kind, key, slot, atime = next(it)
                    except StopIteration as stop:
                        valid = stop.value
                        break
                    self.records += 1
                    if kind == fmt.REC_COMMIT:
                        entries[key] = (slot, atime)
                    elif kind == fmt.REC_DROP:
                        entries.pop(key, None)
                    elif key in entries:  # TOUCH: our key was used by us or another engine
                        entries[key] = (entries[key][0], max(atime, entries[key][1]))
                    else:  # a hit on another engine's block: for that engine's followers
                        self.touches.append((key, atime))
                self.torn_bytes = len(body) - valid
                self.size = fmt.FILE_HDR_BYTES + valid
        if not self.readonly:
            self._open_journal(valid, journal_ok)
        # A slot claimed twice means a bug or a hand-made file: keep the newest claim only.
        by_slot: dict[int, tuple[int, bytes]] = {}
        for key, (slot, atime) in entries.items():
            if slot in by_slot and by_slot[slot][0] >= atime:
                continue
            by_slot[slot] = (atime, key)
        keep = {k for _, k in by_slot.values()}
        return {k: v for k, v in entries.items() if k in keep}

    def _open_journal(self, valid: int, exists: bool) -> None:
        name, dfd = self._journal_name(self.gen), self.dir_fd
        if exists:
            self.fd = os.open(name, os.O_RDWR | O_FLAGS, dir_fd=dfd)
            os.ftruncate(self.fd, fmt.FILE_HDR_BYTES + valid)  # cut a torn tail
            self.size = os.lseek(self.fd, 0, os.SEEK_END)
        else:
            self.fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_TRUNC | O_FLAGS, 0o600, dir_fd=dfd)
            os.write(self.fd, fmt.pack_file_header(fmt.JOURNAL_MAGIC, self.gen))
            os.fsync(self.fd)
            self.size = fmt.FILE_HDR_BYTES
        # journals of other generations are leftovers of an interrupted checkpoint
        for other in os.listdir(dfd):
            if other.startswith("journal.") and other != name:
                os.unlink(other, dir_fd=dfd)
        if not exists:
            os.fsync(dfd)  # the new journal's name (and the old one's removal) survive a power cut

    def append(self, records: list[bytes]) -> None:
        """Append records, all or none: a failed or short write is cut off again,
        so a later append never lands behind a torn record."""
        if not records:
            return
        data = b"".join(records)
        try:
            if os.write(self.fd, data) != len(data):
                raise OSError(errno.ENOSPC, "short journal write")
        except OSError:
            try:
                os.ftruncate(self.fd, self.size)
            except OSError:
                pass  # the next append overwrites the torn bytes from self.size on
            os.lseek(self.fd, self.size, os.SEEK_SET)
            raise
        self.size += len(data)
        self.records += len(records)
        self._dirty = True
        try:
            self.sync_if_due()
        except OSError as e:
            # The records are written (a kill -9 keeps them); only power-cut
            # durability is in doubt, and the blocks verify themselves. The
            # batch stands; the sync is tried again later.
            logging.getLogger("aiokv").warning("aiokv: journal fdatasync failed (%s)", os.strerror(e.errno or 0))

    @property
    def disk_bytes(self) -> int:
        """Bytes the journal and checkpoint files take (capacity counts them)."""
        return self.size + self.ckpt_bytes

    def sync_if_due(self) -> None:
        """fdatasync if the last one is sync_interval old. A failing disk is tried once per
        interval, not at every call; only the first failure of a run raises (the caller says
        it: one line), later ones are counted in `sync_failures` until a sync succeeds."""
        if self._dirty and self.fd is not None:
            now = time.monotonic()
            if now - self._last_sync >= self.sync_interval:
                self._last_sync = now  # (a failing one is tried again an interval later)
                try:
                    self.sync()
                except OSError:
                    self.sync_failures += 1
                    if self.sync_failures == 1:
                        raise

    def sync(self) -> None:
        """fdatasync what was appended since the last sync (nothing if nothing was)."""
        if self._dirty and self.fd is not None:
            os.fdatasync(self.fd)
            self._last_sync = time.monotonic()
            self._dirty = False
            self.sync_failures = 0

    def checkpoint(self, entries) -> None:
        """Write a snapshot of (key, slot, atime) and start an empty journal."""
        gen = self.gen + 1
        body = b"".join(fmt.pack_record(fmt.REC_COMMIT, k, s, a) for k, s, a in entries)
        count = len(body) // fmt.REC_BYTES
        dfd = self.dir_fd
        fd = os.open("checkpoint.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_FLAGS, 0o600, dir_fd=dfd)
        try:
            os.write(fd, fmt.pack_file_header(fmt.CKPT_MAGIC, gen, count, _native.crc32c_bytes(body)))
            view = memoryview(body)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace("checkpoint.tmp", "checkpoint", src_dir_fd=dfd, dst_dir_fd=dfd)
        os.fsync(dfd)
        self.ckpt_bytes = fmt.FILE_HDR_BYTES + len(body)
        old = self.fd
        self.gen, self.records = gen, 0
        self._open_journal(0, exists=False)
        if old is not None:
            os.close(old)

    def close(self) -> None:
        """Never raises: a last fdatasync that fails is said (the records are written; only
        their power-cut durability is in doubt) and the descriptor is closed either way."""
        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:
                if self._dirty:
                    os.fdatasync(fd)
            except OSError as e:
                if not self.sync_failures:  # (a run of failures is said once)
                    logging.getLogger("aiokv").warning(
                        "aiokv: journal fdatasync at close failed (%s)", os.strerror(e.errno or 0)
                    )
            finally:
                os.close(fd)


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

    def _ckpt_ident(self):
        try:
            st = os.stat("checkpoint", dir_fd=self.dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns

    @property
    def disk_bytes(self) -> int:
        return self.off + self.ckpt_bytes

    def poll(self):
        """What changed since the last call: ("reset", {key: (slot, atime)}) after a
        full replay (first call, or the engine restarted its files); ("tail",
        [(kind, key, slot, atime)]) for records appended since; ("roll", records,
        count) when the engine wrote a checkpoint of `count` entries after those
        records (the caller checks it holds `count` of that engine's keys, else
        calls `forget` for a full replay next time); None when nothing changed.
        Raises fmt.BadBlock for a corrupt checkpoint (once per version of it)."""
        ident = self._ckpt_ident()
        if self.replayed and ident == self.ckpt:
            if self.fd is None:  # the journal did not exist yet at the last look
                self._open(self.gen)
                if self.fd is None:
                    return None
            if os.fstat(self.fd).st_size < self.off:  # cut or recreated by a new owner of those files
                return self._replay(ident)
            recs = self._tail()
            return ("tail", recs) if recs else None
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

    def _tail(self) -> list:
        size = os.fstat(self.fd).st_size
        if size <= self.off:
            return []
        raw = os.pread(self.fd, size - self.off, self.off)
        recs = list(fmt.iter_records(raw))  # up to the first record that does not verify (yet)
        self.off += len(recs) * fmt.REC_BYTES
        self.records += len(recs)
        return recs

    def _roll(self, ident):
        recs = self._tail()  # the rest of the old journal, still readable through our descriptor
        try:
            fd = os.open("checkpoint", os.O_RDONLY | O_FLAGS, dir_fd=self.dir_fd)
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
        self._open(gen)
        if self.fd is not None:
            recs += self._tail()
        return "roll", recs, count

    def _replay(self, ident):
        log = IndexLog(self.dir, self.dir_fd, readonly=True)
        try:
            entries = log.load()
        except fmt.BadBlock:
            self.broken = ident
            raise
        self.log, self.ckpt, self.replayed = log, ident, True
        self.gen, self.ckpt_bytes, self.records = log.gen, log.ckpt_bytes, log.records
        self.close()
        self._open(log.gen)
        if self.fd is not None and log.size:
            self.off = log.size  # the records the replay applied; the rest is tailed
        return "reset", entries

    def _open(self, gen: int) -> None:
        try:
            self.fd = os.open(IndexLog._journal_name(gen), os.O_RDONLY | O_FLAGS, dir_fd=self.dir_fd)
        except FileNotFoundError:
            self.fd = None
            return
        self.off = fmt.FILE_HDR_BYTES

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
