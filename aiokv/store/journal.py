# SPDX-License-Identifier: Apache-2.0
"""Crash-consistent persistence of one namespace's index: checkpoint + journal (IndexLog).

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

IndexLog is the facade: it holds the files' state (generation, sizes, the journal's
descriptor) and appends, syncs and closes the journal itself; the records are parsed in
logrecords.py, replayed in logreplay.py, the checkpoint written and read in checkpoint.py
(its index image: indeximage.py). Other engines follow these files with a Follower
(follower.py); read_keys (readkeys.py) reads their keys by slot.

Threading contract: an IndexLog is used by one thread, the Store's owner (its checkpoints
and appends by the I/O thread the owner hands them to, in order). A read-only IndexLog
(inspect, a Follower) never writes and tolerates a writer beside it.
"""

from __future__ import annotations

import errno
import logging
import os
import time

import numpy as np

from aiokv import _index
from aiokv.data import format as fmt
from aiokv.data.dirs import FILE_FLAGS
from aiokv.store import checkpoint as ckpt_file
from aiokv.store.indeximage import index_image_bytes, read_image
from aiokv.store.logrecords import REC, marks, parse_records, read_file, record_tags
from aiokv.store.logrecords import KeyMap as KeyMap  # (namespace.py reads it here)
from aiokv.store.logreplay import apply_records, entries_of, table_of
from aiokv.store.table import Table

# bytes one write(2) of an append takes at most: Linux writes at most 0x7ffff000 bytes a call
# and says so with a short count; an append of more goes in several writes
WRITE_MAX = 1 << 24


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
        # TOUCH records of keys this journal does not hold: (tags, atimes), uint64 arrays
        self.touches = (np.zeros(0, np.uint64), np.zeros(0, np.uint64))
        self.beyond = 0  # records naming slots past the file system's size, left out (load_table)
        self.image_bytes = index_image_bytes(dir_fd)  # the index image's size (capacity counts it)
        self.mark = 0  # the control records its index has applied (checkpoint header, MARK records)
        # an append failed since the last checkpoint: a replay may differ from the owner's index
        # (a DROP not written brings its block back); a tenant id is given anew only once it is not
        self.diverged = False

    def _journal_path(self, gen: int) -> str:
        return os.path.join(self.dir, self._journal_name(gen))

    @staticmethod
    def _journal_name(gen: int) -> str:
        return f"journal.{gen}"

    def load(self) -> dict[bytes, tuple[int, int]]:
        """Replay checkpoint then journal; return key -> (slot, atime) (tools and tests;
        the store loads a Table: load_table)."""
        ckpt, jrecs = self._read(chunked=False)
        entries, mark, touches = entries_of(ckpt, jrecs)
        self.mark = max(self.mark, mark)
        if touches:
            keys, atimes = zip(*touches)
            self._touched(np.frombuffer(_index.tags(list(keys)), np.uint64), np.array(atimes, np.uint64))
        return entries

    def _touched(self, tags: np.ndarray, atimes: np.ndarray) -> None:
        self.touches = (np.concatenate([self.touches[0], tags]), np.concatenate([self.touches[1], atimes]))

    def load_table(self, max_slot: int) -> Table:
        """Replay checkpoint then journal into a Table (slots at or past max_slot, beyond the
        file system, are damage and left out); TOUCH records of keys it does not hold are
        kept in `touches` (for that key's holder)."""
        got = self._read(chunked=True, max_slot=max_slot)
        commits = got[1][got[1]["kind"] == fmt.REC_COMMIT]
        self.beyond = int((commits["slot"] >= max_slot).sum())
        if not isinstance(got[0], Table):
            self.beyond += int((got[0]["slot"] >= max_slot).sum())
        if isinstance(got[0], Table):
            table, jrecs = got
            touch, _ = apply_records(table, jrecs, record_tags(jrecs), max_slot)
        else:
            table, touch = table_of(got[0], got[1], max_slot)
        jrecs = got[1]
        self.mark = max(self.mark, marks(jrecs))
        if len(touch):
            self._touched(record_tags(jrecs)[touch], jrecs["atime"][touch].astype(np.uint64))
        return table

    def _read(self, chunked: bool, max_slot: int = 1 << 32):
        """Read the checkpoint and journal, set this log's state (generation, sizes, the
        journal open for appends when not read-only); (checkpoint records or a Table built
        from them, journal records)."""
        ckpt = np.zeros(0, REC)
        fd = None
        try:
            fd = os.open("checkpoint", os.O_RDONLY | FILE_FLAGS, dir_fd=self.dir_fd)
        except FileNotFoundError:
            pass
        if fd is not None:
            try:
                image = self._read_image(fd, max_slot) if chunked else None
                ckpt = image if image is not None else self._read_checkpoint(fd, chunked, max_slot)
            except fmt.BadBlock as e:
                raise fmt.BadBlock(
                    f"{self.dir}/checkpoint is corrupt ({e}); the engine rebuilds it from the blocks "
                    f"when it opens the store, or run: aiokv inspect --repair {os.path.dirname(os.path.dirname(self.dir))}"
                ) from e
            finally:
                os.close(fd)
        jpath = self._journal_path(self.gen)
        raw = read_file(self._journal_name(self.gen), self.dir_fd)
        valid = 0
        journal_ok = False
        jrecs = np.zeros(0, REC)
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
                jrecs, valid = parse_records(body)
                self.records += len(jrecs)
                self.torn_bytes = len(body) - valid
                self.size = fmt.FILE_HDR_BYTES + valid
        if not self.readonly:
            self._open_journal(valid, journal_ok)
        return ckpt, jrecs

    def _read_image(self, fd: int, max_slot: int) -> Table | None:
        """The Table of the checkpoint (open as fd) from its index image (indeximage.read_image),
        this log's state set from it; else None (the records are read)."""
        got = read_image(fd, self.dir_fd, max_slot)
        if got is None:
            return None
        table, self.gen, self.mark, self.ckpt_bytes = got
        return table

    def _read_checkpoint(self, fd: int, chunked: bool, max_slot: int):
        """The checkpoint's records, or a Table of them when chunked (checkpoint.read_checkpoint),
        this log's state set from its header."""
        got, self.gen, self.mark, self.ckpt_bytes = ckpt_file.read_checkpoint(fd, chunked, max_slot)
        return got

    def _open_journal(self, valid: int, exists: bool) -> None:
        name, dfd = self._journal_name(self.gen), self.dir_fd
        if exists:
            self.fd = os.open(name, os.O_RDWR | FILE_FLAGS, dir_fd=dfd)
            os.ftruncate(self.fd, fmt.FILE_HDR_BYTES + valid)  # cut a torn tail
            self.size = os.lseek(self.fd, 0, os.SEEK_END)
            head = os.pread(self.fd, fmt.FILE_HDR_BYTES, 0)
            if int.from_bytes(head[8:10], "little") < fmt.JOURNAL_VERSION:
                # an older version's journal, read as it is: what we append is of this version,
                # and its header says so, so a reader of the older version refuses it whole
                # rather than stop at our first record as if it were torn
                os.pwrite(self.fd, fmt.JOURNAL_VERSION.to_bytes(2, "little"), 8)
                os.fsync(self.fd)
        else:
            self.fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_TRUNC | FILE_FLAGS, 0o600, dir_fd=dfd)
            os.write(self.fd, fmt.pack_file_header(fmt.JOURNAL_MAGIC, self.gen))
            os.fsync(self.fd)
            self.size = fmt.FILE_HDR_BYTES
        # journals of other generations are leftovers of an interrupted checkpoint
        for other in os.listdir(dfd):
            if other.startswith("journal.") and other != name:
                os.unlink(other, dir_fd=dfd)
        if not exists:
            os.fsync(dfd)  # the new journal's name (and the old one's removal) survive a power cut

    def append(self, records, mark: int = 0) -> None:
        """Append records (a list, or bytes of records end to end), all or none: a failed write is cut off again,
        so a later append never lands behind a torn record (a kill -9 between two writes of a large
        append leaves whole records of it: each applies alone)."""
        if not records:
            return
        data = records if isinstance(records, (bytes, bytearray)) else b"".join(records)
        count = len(data) // fmt.REC_BYTES
        try:
            view, done = memoryview(data), 0
            while done < len(view):  # (in writes of at most WRITE_MAX bytes)
                w = os.write(self.fd, view[done : done + WRITE_MAX])
                if w <= 0:
                    raise OSError(errno.ENOSPC, "short journal write")
                done += w
        except OSError:
            self.diverged = True
            try:
                os.ftruncate(self.fd, self.size)
            except OSError:
                pass  # the next append overwrites the torn bytes from self.size on
            os.lseek(self.fd, self.size, os.SEEK_SET)
            raise
        self.size += len(data)
        self.records += count
        self.mark = max(self.mark, mark)
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
        return self.size + self.ckpt_bytes + self.image_bytes

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

    def checkpoint(self, entries, progress=None) -> None:
        """Write a snapshot and start an empty journal. `entries`: [(key, slot, atime)], or
        the owner's Table of this namespace, whose keys are found in this log's files (the
        checkpoint and journal now on disk) by slot: see _merged. progress(): after each
        chunk written (checkpoint.write)."""
        gen = self.gen + 1
        dfd = self.dir_fd
        if isinstance(entries, Table):
            live = np.flatnonzero(entries.tag)  # (the image ends at the last block: it counts against the capacity)
            slots, chunks = int(live[-1]) + 1 if len(live) else 0, self._merged(entries)
        else:
            slots, chunks = None, ckpt_file.entry_chunks(entries)
        count, self.image_bytes = ckpt_file.write(dfd, gen, self.mark, chunks, slots, progress)
        os.fsync(dfd)
        self.ckpt_bytes = fmt.FILE_HDR_BYTES + count * fmt.REC_BYTES
        old = self.fd
        self.gen, self.records = gen, 0
        self._open_journal(0, exists=False)
        self.diverged = False
        if old is not None:
            os.close(old)

    def _merged(self, table: Table, raw: bytes | None = None):
        """The checkpoint of the owner's table, a chunk of records at a time, sorted by slot
        (checkpoint.merged: why it equals the owner's state), from this log's files: the
        checkpoint and `raw` (the journal's records; None: read from the journal open here)."""
        if raw is None:
            raw = b""
            if self.fd is not None and self.size > fmt.FILE_HDR_BYTES:
                raw = os.pread(self.fd, self.size - fmt.FILE_HDR_BYTES, fmt.FILE_HDR_BYTES)
        yield from ckpt_file.merged(table, self.dir_fd, raw)

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
