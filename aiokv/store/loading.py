# SPDX-License-Identifier: Apache-2.0
"""Loading in the background: each namespace's index read on a loader thread, installed by the owner.

Opening with io_thread (the engine's scheduler side): the directory, our lock and the namespaces
are opened at once; each namespace's index is read on a loader thread of its own (`Loader.run`),
and until the owner installs it (at a poll of the I/O thread: `loaded`) the namespace is not
`ready`: its lookups are misses and its saves are dropped (the store's `skipped_loading`). So
opening does not grow with the cache. Our data files, directories and lock are given back by the
last of close and the loader to be done with them (`release`, counting `users` under a lock):
never while the loader may still read or write our files.

Threading contract: `start`, `loaded`, `failed`, `loading` and `wait` are the owner's (the Store's
thread); `run` is the loader thread's: it reads, and writes only the files of the namespaces it
loads (journal.py, replay.py), and hands what it read to the owner through fs.post; `release` is
called by either, under `_users_lock`. No file-system call of it moves onto the owner's thread
but the punch of the slots given back, which goes to the I/O thread (fs.submit).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from array import array

from aiokv.store.table import give_back_scratch

log = logging.getLogger("aiokv")


class Loader:
    def __init__(self, index, fs, replay, control, tenants, space, close_dirs):
        """close_dirs(): gives back our data files, directories and lock (called once, by the
        last of close and the loader)."""
        self.index, self.fs, self.replay, self.control = index, fs, replay, control
        self.tenants, self.space, self._close_dirs = tenants, space, close_dirs
        self.thread: threading.Thread | None = None
        self.closing = False
        self._users = 1  # what needs our data files, directories and lock: close, and the loader while it runs
        self._users_lock = threading.Lock()

    def start(self, shells: list, engine: int | None) -> None:
        """Read these namespaces' indexes on a loader thread (each not ready until installed)."""
        self.thread = threading.Thread(target=self.run, args=(shells,), name=f"aiokv-load{engine}", daemon=True)
        self._users += 1
        self.thread.start()

    def run(self, shells: list) -> None:
        """The loader thread: each namespace's own files read into a Table, handed to the
        owner (fs.post). Reads, and writes only those files (journal.py, replay.py): nothing
        else touches them until the owner installs what was read. Our data files, directories
        and lock stay open until it ends (`release`)."""
        try:
            for ns in shells:
                if self.closing:
                    return
                t = time.monotonic()
                try:
                    table, jlog = self.replay.read_own(ns)
                    self.space.probe_punch(ns)  # (before a lower capacity evicts for space it cannot give back)
                except BaseException as e:
                    self.fs.post(lambda r, err, ns=ns, e=e: self.failed(ns, e))
                    continue
                if self.closing:  # (nobody installs it now)
                    with contextlib.suppress(OSError):
                        jlog.close()
                    return
                self.fs.post(lambda r, err, ns=ns, table=table, jlog=jlog, t=t: self.loaded(ns, table, jlog, t))
        finally:
            self.release()

    def loaded(self, ns, table, jlog, started: float) -> None:
        """A namespace's index has loaded (the owner's thread, at poll): hits and saves begin."""
        if self.closing:
            jlog.close()
            return
        self.replay.install(ns, table, jlog)
        give_back_scratch()
        self.control.catch_up(ns)  # the orders its index has not applied (before its hits begin)
        ns.ready = True
        # the slots being given back are neither holes nor free until the punch ran (as in
        # Space._unback): a grow planned meanwhile must not take them, or, where the punch is
        # refused, they would become free twice (once here, once by the grow): one slot, two saves
        holes, hwm = ns.alloc.holes, ns.alloc.hwm  # (an array of 8 bytes a slot, descending: ours now)
        # The space for this life's first saves is reserved now, not by the first of them, which would
        # skip them while it runs; and by the first I/O queued, not behind the punch of the rest (a
        # clear's millions of slots): the lowest unnamed slots (the last life's free ones are backed
        # already) are kept for it; it cuts the last life's tail first, so the give-back does not.
        keep = len(holes) - min(len(holes), self.space.grow_slots(ns, ahead=True))
        ns.alloc.holes = holes[keep:]
        del holes[keep:]
        cut = not self.space.growing_in(ns) and self.space.grow(ns, ahead=True, cut=True) is not False
        if not cut:  # (no room for a grow: all is given back)
            holes.extend(ns.alloc.holes)
            ns.alloc.holes = array("q")

        def unbacked(ok, e):
            if ok:
                ns.alloc.holes = array("q", holes) + ns.alloc.holes  # at the front: the grow planned the end
            else:
                ns.alloc.free.extend(holes)  # they may still hold space: counted, and reused first

        self.fs.submit(lambda: self.replay.give_back_io(ns, holes, hwm, truncate=not cut), unbacked)
        log.info(
            "aiokv: the index of namespace %s is loaded (%d blocks, %.2f s); its hits begin",
            ns.hex[:12],
            table.count,
            time.monotonic() - started,
        )
        if self.space.limit is not None and self.space.used() > self.space.limit:
            try:
                self.space.shrink_to_limit()
            except OSError:
                pass  # tried again at the next refresh

    def failed(self, ns, e: BaseException) -> None:
        self.tenants.failed_loads.add(ns.nsid)
        ns.load_failed = True  # (requests waiting for it stop waiting: scheduler/index_wait.py)
        log.error(
            "aiokv: loading the index of namespace %s failed (%s); it serves no hits and takes no saves",
            ns.hex[:12],
            getattr(e, "strerror", None) or e,
        )

    def loading(self) -> int:
        """Namespaces whose index is still loading (no hits, no saves from them meanwhile)."""
        return sum(not ns.ready and not ns.load_failed for ns in self.index.namespaces.values())

    def wait(self, close_wait: float, deadline: float, root: str) -> None:
        """At close, after the journals: a load in progress is waited for, at most close_wait (the
        store's wait for an answer, persist.py) and never past `deadline` (time.monotonic); one
        still reading then keeps our files (said)."""
        loader = self.thread
        if loader is not None and loader is not threading.current_thread() and loader.is_alive():
            loader.join(max(0.0, min(close_wait, deadline - time.monotonic())))
            if loader.is_alive():
                log.warning(
                    "aiokv: the index of %s is still being read at shutdown (a file system that does not "
                    "answer?); the engine's lock is given back once that read ends, or at the process exit",
                    root,
                )

    def release(self) -> None:
        """Close and the loader each give up our data files and directories when done with them:
        the last of the two closes them and gives our engine's lock back (dirs.close, last)."""
        with self._users_lock:
            self._users -= 1
            if self._users:
                return
        self._close_dirs()
