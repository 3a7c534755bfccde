# SPDX-License-Identifier: Apache-2.0
"""Our engine's journal of one namespace, written on the store's I/O thread.

The Store appends COMMIT, DROP and TOUCH records, syncs and checkpoints its
journal (journal.py's IndexLog) from the scheduler's thread; with the store's
I/O thread (fsthread.py) those calls are queued here and run there, in the
order they were made (a DROP before the COMMIT that reuses its slot; a
checkpoint after the records it covers, and before the records made after it).
What the Store needs to know about the journal while the I/O thread writes it
(how many records it holds, how many bytes it takes, whether a sync is due) it
reads from this object's own counts, kept on its thread, never from the
IndexLog that the I/O thread is changing.

A batch of records that cannot be written is reported to `failed(error)` on
the owner's thread (Store.commit takes those blocks back: a commit that is not
in the journal is not a hit after a restart). Without the I/O thread every call
runs at once, as before.

Threading contract: every method and count is the owner's (the Store's
thread); the IndexLog belongs to the I/O thread once it has started (before:
to the opener). The two meet only through FsThread's queue and done list.
"""

from __future__ import annotations

import time

from aiokv.data import format as fmt
from aiokv.store.fsthread import FsThread
from aiokv.store.journal import IndexLog

# seconds a checkpoint may take before the file system counts as hung: it writes
# the whole index (64 bytes a block), not a stall before this
CHECKPOINT_DEADLINE = 30.0


class JournalQueue:
    def __init__(self, log: IndexLog, fs: FsThread):
        self.log, self.fs = log, fs
        self.records = log.records  # records in the current journal, queued ones included
        self._written = log.disk_bytes  # bytes the files took at the last finished operation
        self._queued = 0  # bytes of records queued and not yet written
        self._dirty = False  # records queued since the last sync was queued
        self._last_sync = time.monotonic()

    @property
    def disk_bytes(self) -> int:
        """Bytes the journal and checkpoint files take, queued records included."""
        return self._written + self._queued

    def append(self, recs, failed=None, mark: int = 0, before=None) -> None:
        """Queue records (a list, or bytes of records end to end; all or none are written);
        failed(OSError) if they were not; mark: the MARK among them (control.py), which the
        next checkpoint keeps; before: run first on the I/O thread (a tenants record that the
        records name: tenants.py); if it raises, the records are not written."""
        if not recs:
            return
        n = len(recs) // fmt.REC_BYTES if isinstance(recs, bytes) else len(recs)  # (bytes: records end to end)
        nbytes, log = n * fmt.REC_BYTES, self.log
        self.records += n
        self._queued += nbytes
        self._dirty = True

        def done(size, e):
            self._queued -= nbytes
            if e is None:
                self._written = size
                return
            self.records -= n
            if not isinstance(e, OSError):
                raise e
            if failed is not None:
                failed(e)

        def write():
            if before is not None:
                before()
            log.append(recs)
            if mark:  # (written: the next checkpoint keeps it)
                log.mark = max(log.mark, mark)
            return log.disk_bytes

        self.fs.submit(write, done)

    def run(self, n: int, fn, done=None) -> None:
        """Queue fn(log), which appends n records it makes on the I/O thread (an order's, in
        chunks: applying.py); done(result, error) on the owner's thread (an error: nothing was
        appended)."""
        nbytes, log = n * fmt.REC_BYTES, self.log
        self.records += n
        self._queued += nbytes
        self._dirty = True

        def finish(r, e):
            self._queued -= nbytes
            if e is None:
                r, self._written = r
            else:
                self.records -= n
            if done is not None:
                done(r, e)
            elif e is not None and not isinstance(e, OSError):
                raise e

        self.fs.submit(lambda: (fn(log), log.disk_bytes), finish)

    def sync_if_due(self, now: float, failed) -> None:
        """Queue a fdatasync if records were queued more than sync_interval after the last one."""
        key = ("sync", id(self))
        if not self._dirty or now - self._last_sync < self.log.sync_interval or self.fs.busy(key):
            return
        self._dirty, self._last_sync = False, now
        self.fs.once(key, self.log.sync, lambda _, e: failed(e) if e is not None else None)

    def checkpoint(self, snapshot, failed) -> None:
        """Queue a checkpoint of snapshot (a Table, or [(key, slot, atime)]) (unless one is queued):
        the journal starts empty after it; failed(error) if it was not written."""
        log, before, key = self.log, self.records, ("checkpoint", id(self))
        if self.fs.busy(key):
            return
        self.records = 0

        def done(size, e):
            if e is None:
                self._written = size
                return
            self.records += before  # the old journal still holds them
            failed(e)

        def write():
            log.checkpoint(snapshot, self.fs.progress)
            return log.disk_bytes

        self.fs.once(key, write, done, deadline=max(CHECKPOINT_DEADLINE, self.fs.deadline))
