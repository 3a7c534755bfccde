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

Threading contract: submit/poll/call/close and the properties are for the
owner's thread (the Store's); operations run on the I/O thread, one at a time,
in submission order; both meet only in this object's lock-protected queue and
done list.
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
    __slots__ = ("fn", "done", "deadline", "started", "finished", "result", "error")

    def __init__(self, fn, done, deadline: float):
        self.fn, self.done, self.deadline = fn, done, deadline
        self.started = 0.0
        self.finished = False
        self.result = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as e:  # reported to `done`, never lost
            self.error = e


class FsThread:
    def __init__(self, name: str | None, deadline: float = DEADLINE):
        """name: the thread's name, or None to run every operation at once on the caller's thread."""
        self.deadline = deadline
        self._q: collections.deque[Op] = collections.deque()
        self._done: list[Op] = []
        self._cond = threading.Condition()
        self._current: Op | None = None
        self._closed = False
        self.stalls = 0  # times an operation went past its deadline
        self._stalled = False
        self.thread = None
        if name is not None:
            self.thread = threading.Thread(target=self._main, name=name, daemon=True)
            self.thread.start()

    @property
    def inline(self) -> bool:
        return self.thread is None

    # ---- the I/O thread ----
    def _main(self) -> None:
        while True:
            with self._cond:
                while not self._q:
                    self._cond.wait()
                op = self._q.popleft()
                if op.fn is None:  # close
                    self._current = None
                    self._cond.notify_all()
                    return
                op.started = time.monotonic()
                self._current = op
            op.run()
            with self._cond:
                self._current = None
                self._done.append(op)
                op.finished = True  # with its done callback queued: poll() applies it
                self._cond.notify_all()

    # ---- the owner's thread ----
    def submit(self, fn, done=None, deadline: float | None = None) -> Op:
        """Queue fn; done(result, error) runs on the owner's thread once it ran."""
        op = Op(fn, done, self.deadline if deadline is None else deadline)
        if self.thread is None:
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
        if op.done is not None:
            op.done(op.result, op.error)
        elif op.error is not None and not isinstance(op.error, OSError):
            log.error("aiokv: a store operation failed", exc_info=op.error)

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

    def call(self, fn, timeout: float):
        """fn's result, run on the I/O thread, waited for at most timeout; raises
        FsTimeout if it did not answer (it still runs, later, or never)."""
        op = self.submit(fn)
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
