"""Persistence and close (a part of Store, store.py): journal syncs due, checkpoints,
and closing every file, with the I/O thread bounded by CLOSE_WAIT without an
answer from the file system and CLOSE_MAX in all.

Threading contract: called on the owner's thread; the writes are queued to the
store's I/O thread (journalq.py, fsthread.py) where it has one, else run at once.
`_close_files` runs on the I/O thread (or inline) as the last operation.
"""
from __future__ import annotations

import logging
import os
import time

from aiokv.store.index import Namespace

CLOSE_WAIT = 5.0  # seconds close (and the last verifications) wait for the file system to answer (io_thread)
CLOSE_MAX = 30.0  # seconds close waits in all for a file system that answers, slowly (io_thread)
_log = logging.getLogger("aiokv")  # (`log` names a journal here)


class Persist:
    """Mixin of Store: the attributes it uses are set in Store.__init__."""

    def _snapshot(self, ns: Namespace):
        return [(k, s, ns.atime.get(k, 0)) for k, s in ns.own.items()]

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

    def _close_deadline(self) -> float:
        """With the I/O thread: when close stops waiting for the file system in all (set at the first call)."""
        if self._close_by is None:
            self._close_by = time.monotonic() + CLOSE_MAX
        return self._close_by

    def close(self, checkpoint: bool = True) -> None:
        """Checkpoint and close everything. With the I/O thread: what was queued is
        written first; returns once the file system has not answered for CLOSE_WAIT,
        or CLOSE_MAX after the first close-time call (verify_slot or this), whatever
        the file system does; records not written by then are lost, and said so (their
        blocks are misses after a restart: the journal never named them)."""
        fs = self.fs
        if not fs.inline and fs._closed:
            return  # closed already
        snaps = None
        if checkpoint and not self.readonly and self.lock is not None and self.lock.fd is not None:
            snaps = [(log, self._snapshot(self.index.namespaces[nsid])) for nsid, log in self.logs.items()]
        if fs.inline:
            self._close_files(snaps)
            return
        fs.poll()
        queued = fs.pending
        op = fs.submit(lambda: self._close_files(snaps), lambda r, e: None)
        if not fs.drain(op, CLOSE_WAIT, self._close_deadline()):
            _log.warning("aiokv: the cache directory's file system did not answer at shutdown (%.0f s without an "
                        "answer, or %.0f s in all); %d queued operation(s) may not be written (blocks committed "
                        "since are misses after a restart) and its files are left to the process exit",
                        CLOSE_WAIT, CLOSE_MAX, queued)
            fs.close(0)
            return
        fs.close(1.0)
        if op.error is not None:
            _log.warning("aiokv: closing the store failed (%s)", op.error)

    def _close_files(self, snaps) -> None:
        for log, snap in snaps or ():
            try:
                log.checkpoint(snap)
            except OSError as e:  # EIO, EROFS, ENOSPC: the journal still holds every record
                _log.warning("aiokv: %s", f"checkpoint at close failed ({os.strerror(e.errno or 0)}); "
                             "the journal keeps its records")
        for log in self.logs.values():
            log.close()
        self._release_reclaimed()
        for fl in self.followers.values():
            fl.close()
        self.followers.clear()
        own = [fd for nsid, fd in self._own_fds.items() if fd != self._dir_fds.get(nsid)]
        for fd in [*self._rank_fds.values(), *own, *self._peer_fds.values(), *self._dir_fds.values(), self._ns_fd,
                   self._root_fd]:
            if fd is not None:
                os.close(fd)
        self._rank_fds.clear()
        self._own_fds.clear()
        self._peer_fds.clear()
        self._dir_fds.clear()
        self._ns_fd = self._root_fd = None
        if self.lock is not None:
            self.lock.release()
