# SPDX-License-Identifier: Apache-2.0
"""Persistence and close: our journals (one per namespace: records appended,
syncs due, checkpoints), and closing every file, with the I/O thread bounded by
`close_wait` (the store's own: max(CLOSE_WAIT, fs_timeout)) without an answer
from the file system and CLOSE_MAX in all.

`Persist` owns our journals (the IndexLogs, and the JournalQueues the owner
writes through) and the close deadline; it is handed the I/O thread and the
index (for the snapshots a checkpoint writes). What else close closes (the
other parts' files, our lock) it is handed as a callable, run after the
journals on the same thread.

Threading contract: called on the owner's thread; the writes are queued to the
store's I/O thread (journalq.py, fsthread.py) where it has one, else run at once.
`_close_files` runs on the I/O thread (or inline) as the last operation.

Failure contract at close: what was queued is written while the file system
answers, i.e. as long as the store itself would call it answering: an answer
within `close_wait` = max(CLOSE_WAIT, fs_timeout) (past fs_timeout the store
counts it as hung; never less than CLOSE_WAIT, because giving up at close loses
records, where during serving a stall only pauses hits). Whatever fs_timeout
says, close returns within CLOSE_MAX of its first call: never the
reason the engine hung at shutdown. What is not written by then is lost, and
said (one warning): its blocks are misses after a restart, never wrong.
"""

from __future__ import annotations

import logging
import os
import time

from aiokv.store.journal import IndexLog
from aiokv.store.journalq import JournalQueue
from aiokv.store.namespace import Namespace

CLOSE_WAIT = 5.0  # seconds close (and the last verifications) wait for an answer at least (io_thread)
CLOSE_MAX = 30.0  # seconds close waits in all for a file system that answers, slowly (io_thread)
# Past this many blocks a namespace is not checkpointed at close: a checkpoint writes the whole
# index (about 0.7 µs a block on a 2-core machine: 26 s at 37M blocks, past CLOSE_MAX), where the
# journal it would fold holds at most an eighth of the blocks (checkpoint_if_due), all written, and
# the next start replays it in the background (about 0.67 µs a record). As after a crash.
CLOSE_CHECKPOINT_BLOCKS = 2_000_000
_log = logging.getLogger("aiokv")  # (`log` names a journal here)


class Persist:
    def __init__(self, fs, index, sync_interval: float, checkpoint_every: int, fs_timeout: float):
        """fs_timeout: the store's I/O-thread deadline, from which close_wait is derived (the
        module's failure contract)."""
        self.fs, self.index = fs, index
        self.sync_interval = sync_interval
        self.checkpoint_every = checkpoint_every
        self.fs_timeout = fs_timeout
        self.logs: dict[bytes, IndexLog] = {}  # our journals (the I/O thread's once it has started)
        self.journals: dict[bytes, JournalQueue] = {}  # our journals, as the owner writes them
        self._close_by: float | None = None

    @property
    def close_wait(self) -> float:
        """Seconds close waits for the file system to answer: as long as the store would still
        call it answering (fs_timeout), and never less than CLOSE_WAIT."""
        return max(CLOSE_WAIT, self.fs_timeout)

    def add(self, nsid: bytes, log: IndexLog) -> None:
        """A namespace's journal, replayed (replay.py)."""
        self.logs[nsid] = log
        self.journals[nsid] = JournalQueue(log, self.fs)

    def append(self, ns: Namespace, recs, failed=None, mark: int = 0, before=None) -> None:
        """Queue records to a namespace's journal; failed(OSError) if they were not written
        (before: run first where they are written, journalq.py).
        Without `failed`, best effort: a DROP that is not persisted resurrects an entry whose
        slot was punched or reused; its header then fails verification: a miss. A TOUCH that
        is not persisted only leaves a block older in the LRU."""
        self.journals[ns.nsid].append(recs, failed, mark, before)

    def disk_bytes(self) -> int:
        """Bytes our journals and checkpoints take, queued records included."""
        return sum(jq.disk_bytes for jq in self.journals.values())

    @staticmethod
    def _snapshot(ns: Namespace):
        """What a checkpoint of ns writes: its table, read where the checkpoint runs, the keys
        taken from the files it replaces (checkpoint.py, `merged`)."""
        return ns.table

    def _checkpoint_at_close(self, nsid: bytes, log: IndexLog) -> bool:
        """Whether close checkpoints this namespace: a small one (CLOSE_CHECKPOINT_BLOCKS), one whose
        journal missed a write, or one whose journal holds more than its checkpoints allow (records
        that came without a commit, which checks: TOUCHes of the blocks other engines loaded)."""
        n = self.index.namespaces[nsid].table.count
        return n <= CLOSE_CHECKPOINT_BLOCKS or log.diverged or self._due(self.journals[nsid].records, n)

    def _due(self, records: int, n: int) -> bool:
        """A journal of `records` over an index of n blocks is due a checkpoint: past
        checkpoint_every and the blocks it indexes, or an eighth of them for a large index."""
        return records > self.checkpoint_every and records > min(n, max(self.checkpoint_every, n // 8))

    def checkpoint_if_due(self, ns: Namespace) -> None:
        """After a commit: checkpoint a journal grown past checkpoint_every records and past
        the blocks it indexes, or past an eighth of them for a large index (a replay after a
        crash reads at most that many records)."""
        jq = self.journals[ns.nsid]
        if self._due(jq.records, ns.table.count):
            jq.checkpoint(self._snapshot(ns), self._checkpoint_failed)

    @staticmethod
    def _checkpoint_failed(e) -> None:
        if not isinstance(e, OSError):
            raise e
        # the journal still holds everything: try again later
        _log.warning("aiokv: %s", f"checkpoint failed ({os.strerror(e.errno or 0)}); the journal keeps growing")

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
        _log.warning("aiokv: %s", f"journal fdatasync failed ({os.strerror(e.errno or 0)})")

    def checkpoint(self) -> None:
        """Checkpoint every journal (queued with the I/O thread)."""
        for nsid, jq in self.journals.items():
            jq.checkpoint(self._snapshot(self.index.namespaces[nsid]), self._reraise)

    @staticmethod
    def _reraise(e) -> None:
        raise e

    def close_deadline(self) -> float:
        """With the I/O thread: when close stops waiting for the file system in all (set at the first call)."""
        if self._close_by is None:
            self._close_by = time.monotonic() + CLOSE_MAX
        return self._close_by

    def close(self, checkpoint: bool, close_rest) -> None:
        """Checkpoint (if asked; namespaces of at most CLOSE_CHECKPOINT_BLOCKS blocks, or
        whose journal missed a write) and close the journals, then close_rest(), the other
        files. With the I/O thread: what was queued is written first (a checkpoint making
        progress counts as the file system answering); returns once the file system has
        not answered for close_wait, or CLOSE_MAX after the first close-time call
        (verify_slot or this), whatever the file system does; records not written by then
        are lost, and said so (their blocks are misses after a restart: the journal never
        named them)."""
        fs = self.fs
        if not fs.inline and fs._closed:
            return  # closed already
        snaps = None
        if checkpoint:
            snaps = [
                (log, self._snapshot(self.index.namespaces[nsid]))
                for nsid, log in self.logs.items()
                if self._checkpoint_at_close(nsid, log)
            ]
        if fs.inline:
            self._close_files(snaps, close_rest)
            return
        fs.poll()
        queued = fs.pending
        op = fs.submit(lambda: self._close_files(snaps, close_rest), lambda r, e: None)
        if not fs.drain(op, self.close_wait, self.close_deadline()):
            _log.warning(
                "aiokv: the cache directory's file system did not answer at shutdown (%g s without an "
                "answer, or %g s in all); %d queued operation(s) may not be written (blocks committed "
                "since are misses after a restart) and its files are left to the process exit",
                min(self.close_wait, CLOSE_MAX),
                CLOSE_MAX,
                queued,
            )
            fs.close(0)
            return
        fs.close(1.0)
        if op.error is not None:
            _log.warning("aiokv: closing the store failed (%s)", op.error)

    def _close_files(self, snaps, close_rest) -> None:
        for log, snap in snaps or ():
            try:
                log.checkpoint(snap, self.fs.progress)  # (a long one is answering: close waits for it)
            except OSError as e:  # EIO, EROFS, ENOSPC: the journal still holds every record
                _log.warning(
                    "aiokv: %s",
                    f"checkpoint at close failed ({os.strerror(e.errno or 0)}); the journal keeps its records",
                )
        for log in self.logs.values():
            log.close()
        close_rest()
