# SPDX-License-Identifier: Apache-2.0
"""The store's file-system thread: while an engine serves, every file-system
call of its scheduler side (journal appends, syncs and checkpoints, following
the other engines' journals, free-space checks, growing and punching data
files, closing) runs here, never on vLLM's thread.

Why: on a hung mount (a FUSE daemon whose threads all wait on hung reads, a
hung NFS server, a device whose queue froze) every call on that mount blocks
in uninterruptible sleep: stat, open, write, fdatasync, fallocate. On vLLM's
scheduler thread one such call stops the whole engine. Here it stops only this
thread; the Store works from its in-memory index meanwhile, queues what must
be written, and `stalled` says that the operation now running is past its
deadline, which opens the breaker (no hits, no saves) until the file system
answers again.

Why one thread with a FIFO and not aiofiles: aiofiles runs each call on a
thread pool for an asyncio loop. The scheduler side has no loop (vLLM calls it
synchronously, once per step); a loop would be one more thread in between, and
a pool runs calls out of order, while the journal needs order (a DROP before
the COMMIT that reuses its slot, a checkpoint after the records it covers). One
thread and one queue keep that order by construction, and give one place where
a deadline is measured.

Operations are callables; `done(result, error)` runs on the owner's thread, in
`poll()` (or at once where the Store runs without a thread: `FsThread(None)`,
used by read-only openers, tools and unit tests, which keep today's synchronous
behaviour). What is still queued when `close` gives up is never written; the
Store says so (a commit that was not written is a miss after a restart).

A periodic operation (`every`: following the other engines' journals) runs on
the I/O thread on its own, whenever its interval has passed and nothing queued
is waiting, so the owner never waits for it: it only picks up, at poll(), what
the I/O thread last finished.

Threading contract: start/submit/once/every/poll/call/wait/close and the
properties are for the owner's thread (the Store's); operations run on the I/O
thread, one at a time (queued ones in submission order, the periodic one
between them, never beside one); both meet only in this object's
lock-protected queue and done list. `once`'s busy set is the owner's alone
(its entries are added at submit and removed by done callbacks, both on the
owner's thread).
"""

from __future__ import annotations

import collections
import logging
import threading
import time

log = logging.getLogger("aiokv")

DEADLINE = 2.0  # seconds an operation may take before the file system counts as hung


class FsTimeout(OSError):
    """The file system did not answer within a bound."""


class Op:
    __slots__ = ("fn", "done", "deadline", "started", "finished", "applied", "result", "error")

    def __init__(self, fn, done, deadline: float):
        self.fn, self.done, self.deadline = fn, done, deadline
        self.started = 0.0
        self.finished = False  # ran (set by the thread that ran it)
        self.applied = False  # its done callback ran (the owner's thread)
        self.result = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as e:  # reported to `done`, never lost
            self.error = e


class FsThread:
    def __init__(self, name: str | None, deadline: float = DEADLINE):
        """name: the thread's name, or None to run every operation at once on the
        caller's thread (until `start`)."""
        self.deadline = deadline
        self._q: collections.deque[Op] = collections.deque()
        self._done: list[Op] = []
        self._cond = threading.Condition()
        self._current: Op | None = None
        self._closed = False
        self.stalls = 0  # times an operation went past its deadline
        self._stalled = False
        self._busy: set = set()  # what `once` has queued and not yet seen done
        self._every = None  # (interval, fn, done) of the periodic operation
        self._every_due = 0.0
        self._wait_left = 0.0  # what wait_in_step may still wait in this step
        self.answers = 0  # operations finished, and long ones' progress (the I/O thread counts them, under the lock)
        self.thread = None
        if name is not None:
            self.start(name, deadline)

    def start(self, name: str, deadline: float | None = None) -> None:
        """From now on operations run on a thread of their own (the store, once opened)."""
        if deadline is not None:
            self.deadline = deadline
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()

    @property
    def inline(self) -> bool:
        return self.thread is None

    # ---- the I/O thread ----
    def _next(self) -> Op:
        """The next operation to run: a queued one, else the periodic one once due."""
        with self._cond:
            while True:
                left = None
                if self._every is not None and not self._closed:
                    left = self._every_due - time.monotonic()
                    if left <= 0:  # before what is queued: a busy queue does not starve it
                        interval, fn, done = self._every
                        op = Op(fn, done, self.deadline)
                        self._every_due = time.monotonic() + interval()
                        break
                if self._q:
                    op = self._q.popleft()
                    break
                self._cond.wait(left)
            op.started = time.monotonic()
            self._current = op if op.fn is not None else None
            return op

    def _main(self) -> None:
        while True:
            op = self._next()
            if op.fn is None:  # close
                with self._cond:
                    self._cond.notify_all()
                return
            op.run()
            with self._cond:
                self._current = None
                if op.result is not None or op.error is not None or op.fn is not self._every_fn():
                    self._done.append(op)  # (a periodic look that found nothing new hands nothing over)
                op.finished = True  # with its done callback queued: poll() applies it
                self.answers += 1
                self._cond.notify_all()

    def progress(self) -> None:
        """A long operation still running got an answer from the file system (a checkpoint's
        chunk written): `drain` counts it as answering, as it counts an operation finished.
        The I/O thread's (from inside the operation), or a no-op without one."""
        if self.thread is not None:
            with self._cond:
                self.answers += 1
                self._cond.notify_all()

    # ---- the owner's thread ----
    def _every_fn(self):
        return self._every[1] if self._every is not None else None

    def every(self, interval, fn, done) -> None:
        """Run fn on the I/O thread every interval() seconds (the first time at once);
        done(result, error) on the owner's thread at poll(). Inline: nothing runs
        (the owner calls fn itself)."""
        with self._cond:
            self._every = (interval, fn, done)
            self._every_due = 0.0
            self._cond.notify()

    def allow(self, seconds: float) -> None:
        """From an operation on the I/O thread: it may take `seconds` more before the file
        system counts as hung (a whole replay of another engine's index of tens of millions
        of blocks reads and sorts for a second or more, not a stall)."""
        op = self._current
        if op is not None and self.thread is threading.current_thread():
            op.deadline = max(op.deadline, time.monotonic() - op.started + seconds)

    def once(self, what, fn, done=None, deadline: float | None = None) -> Op | None:
        """submit(fn, done) unless the operation `what` is queued already (None then)."""
        if what in self._busy:
            return None
        self._busy.add(what)

        def finish(r, e):
            self._busy.discard(what)
            if done is not None:
                done(r, e)
            elif e is not None and not isinstance(e, OSError):
                raise e

        try:
            return self.submit(fn, finish, deadline)
        except BaseException:
            self._busy.discard(what)
            raise

    def new_step(self, budget: float) -> None:
        """A scheduler step begins: wait_in_step may wait `budget` seconds in all until the next."""
        self._wait_left = budget

    def wait_in_step(self, op: Op) -> bool:
        """Wait for op within what is left of this step's budget, never while the file
        system is stalled; True if it finished (its done callback has run)."""
        if op.finished:
            self.poll()
            return True
        if self._wait_left <= 0 or self.stalled:
            return False
        t = time.monotonic()
        ok = self.wait(op, self._wait_left)
        self._wait_left -= time.monotonic() - t
        return ok

    def busy(self, what) -> bool:
        """Whether `once` has the operation `what` queued or running."""
        return what in self._busy

    def submit(self, fn, done=None, deadline: float | None = None) -> Op:
        """Queue fn; done(result, error) runs on the owner's thread once it ran. From an
        operation on the I/O thread itself (the store opening a namespace there), or
        inline, fn and done run at once."""
        op = Op(fn, done, self.deadline if deadline is None else deadline)
        if self.thread is None or threading.current_thread() is self.thread:  # inline, or from an operation
            op.run()
            op.finished = True
            self._finish(op)
            return op
        with self._cond:
            if self._closed:
                raise FsTimeout("aiokv: the store is closed")
            self._q.append(op)
            self._cond.notify()
        return op

    def _finish(self, op: Op) -> None:
        op.applied = True
        if op.done is not None:
            op.done(op.result, op.error)
        elif op.error is not None and not isinstance(op.error, OSError):
            log.error("aiokv: a store operation failed", exc_info=op.error)

    def post(self, done, result=None, error: BaseException | None = None) -> None:
        """done(result, error) at the owner's next poll: what another thread of the store
        (the index loader, store.py) hands the owner."""
        op = Op(None, done, 0.0)
        op.result, op.error, op.finished = result, error, True
        with self._cond:
            self._done.append(op)

    def poll(self) -> None:
        """Run the done callbacks of finished operations (cheap when there are none)."""
        if not self._done:
            return
        with self._cond:
            done, self._done = self._done, []
        for op in done:
            try:
                self._finish(op)
            except Exception:
                log.exception("aiokv: applying a store operation's result failed")

    @property
    def pending(self) -> int:
        """Operations queued or running."""
        return len(self._q) + (self._current is not None)

    @property
    def stalled(self) -> bool:
        """The operation now running has been running past its deadline."""
        op = self._current
        now = op is not None and time.monotonic() - op.started > op.deadline
        if now and not self._stalled:
            self.stalls += 1
        self._stalled = now
        return now

    def wait(self, op: Op, timeout: float) -> bool:
        """Wait at most timeout for op to finish (its done callback then runs); False if it did not."""
        if self.thread is not None and not op.finished:
            end = time.monotonic() + timeout
            with self._cond:
                while not op.finished:
                    left = end - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(left)
        self.poll()
        return True

    def drain(self, op: Op, quiet: float, until: float) -> bool:
        """Wait for op while the file system answers: give up once no operation has
        finished or progressed (`progress`) for `quiet` seconds (it does not answer), or at time.monotonic()
        `until` (slow, but answering); True if op finished (its done callback has run).
        For close: whatever was queued before op is written first if it can be."""
        if self.thread is not None and not op.finished:
            with self._cond:
                seen, last = self.answers, time.monotonic()
                while not op.finished:
                    now = time.monotonic()
                    if self.answers != seen:
                        seen, last = self.answers, now
                    left = min(until, last + quiet) - now
                    if left <= 0:
                        break
                    self._cond.wait(left)
        self.poll()
        return op.finished

    def call(self, fn, timeout: float, deadline: float | None = None):
        """fn's result, run on the I/O thread, waited for at most timeout; raises
        FsTimeout if it did not answer (it still runs, later, or never)."""
        op = self.submit(fn, deadline=deadline)
        if not self.wait(op, timeout):
            raise FsTimeout(f"the file system did not answer within {timeout:.1f} s")
        if op.error is not None:
            raise op.error
        return op.result

    def close(self, timeout: float) -> bool:
        """Run what is queued, then stop; waits at most timeout. False: operations
        were left (the thread is a daemon: the process exit ends it)."""
        if self.thread is None:
            return True
        with self._cond:
            self._closed = True
            self._q.append(Op(None, None, 0))
            self._cond.notify()
        self.thread.join(timeout)
        self.poll()
        return not self.thread.is_alive()


def bounded(fn, timeout: float, what: str, late=None):
    """fn() on a thread of its own, waited for at most timeout seconds (a start on a
    mount that does not answer); raises FsTimeout naming `what` if it did not
    return. late(result) is called if fn returns after all (to close what it opened)."""
    box: dict = {}
    lock = threading.Lock()

    def target():
        try:
            r = fn()
        except BaseException as e:
            with lock:
                box["error"] = e
            return
        with lock:
            box["result"] = r
            gave_up = box.get("gave_up")
        if gave_up and late is not None:
            late(r)

    t = threading.Thread(target=target, name="aiokv-start", daemon=True)
    t.start()
    t.join(timeout)
    with lock:
        if "result" not in box and "error" not in box:
            box["gave_up"] = True
            raise FsTimeout(f"aiokv: {what} did not answer within {timeout:.0f} s (a hung file system?)")
    if "error" in box:
        raise box["error"]
    return box["result"]


def at_once(calls, timeout: float) -> bool:
    """Each (what, fn) of calls run on a thread of its own, all at once, waited for at most
    timeout seconds in all (closing several drives: each is bounded on its own); an error is
    logged naming `what`. False if some did not return in time (they go on, daemon threads)."""

    def run(what, fn):
        try:
            fn()
        except Exception:
            log.exception("aiokv: %s failed", what)

    threads = [threading.Thread(target=run, args=c, name="aiokv-close", daemon=True) for c in calls]
    for t in threads:
        t.start()
    end = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    return not any(t.is_alive() for t in threads)
