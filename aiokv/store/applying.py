# SPDX-License-Identifier: Apache-2.0
"""The owner's share of the operators' orders (aiokv clear, pin, unpin: control.py), a bounded
amount of it per scheduler step.

A `Job` is one table's share of some orders: our own blocks of a namespace (cleared, pinned or
unpinned, their FREE or FLAGS records and the punches handed to the I/O thread, then a MARK),
or our view of another engine's (a clear only: that engine frees its own). It walks the slots
that existed when the orders were taken, a window at a time (bulk.py: no Python object per
block), and leaves the blocks committed since (`Table.fresh`: they came after the orders). A
clear for every block of a dense table empties it at once and writes the old blocks out behind.

Per step (`new_step`, at each Store.refresh: once per vLLM step) the jobs look at most at SCAN
slots, forget at most BLOCKS blocks, pin or unpin at most FLAGS, start no window after STEP_S
seconds, and keep chunks of at most IN_FLIGHT blocks queued to the I/O thread, where each chunk's records
are made (12-16 bytes a block queued, 64 bytes a record only while it is written) and written
in one bounded write, then its slots punched, coalesced into runs. Journal commits and saves go
on between the chunks: the I/O thread runs them in order. The MARK follows the last chunk, and
is left out if any chunk's records could not be written (the order is applied again at the next
opening). Removed blocks reach a watcher (the KV events) as one entry per window: (False, their
tags as an array, None).

Threading contract: the owner's thread (the Store's); the chunks' file-system work runs on the
store's I/O thread (fsthread.py), at once without one, and its outcome is applied at poll.
"""

from __future__ import annotations

import collections
import logging
import os
import time

import numpy as np

from aiokv.data import format as fmt
from aiokv.store import bulk

SCAN = 1 << 20  # slots the jobs look at per step (aiokv._index.select: about 1 ms a million)
BLOCKS = 1 << 15  # blocks the jobs forget per step (a hash erase each: 50-200 ns)
FLAGS = 1 << 17  # blocks the jobs pin or unpin per step
STEP_S = 0.002  # seconds of a step after which no further window starts
SUB = 1 << 12  # blocks one window changes at most (the time is checked between windows)
IN_FLIGHT = 1 << 18  # blocks of chunks queued to the I/O thread at once (their completions are applied in steps too)
log = logging.getLogger("aiokv")


class Job:
    def __init__(self, ns, engine: int | None, steps: list):
        """engine: None for our own blocks, else the engine whose blocks we stop serving;
        steps: [(order, its Filter, or None if it is not for this namespace)]."""
        self.ns, self.engine, self.steps = ns, engine, steps
        self.table = self._table()
        self.fresh: set = set()
        self.table.fresh.append(self.fresh)
        self.end = self.table.slots  # the slots that existed when the orders were taken
        self.i = self.lo = self.changed = 0
        self.old = None  # an emptied table's old tags, written out from `lo`
        self.failed = False  # a chunk's records were not written (set on the I/O thread)

    def _table(self):
        return self.ns.table if self.engine is None else self.ns.tables.get(self.engine)

    def done(self) -> None:
        if self.fresh in self.table.fresh:
            self.table.fresh.remove(self.fresh)


class Jobs:
    def __init__(self, fs, persist, space, stats, pin_room, may_pin):
        """pin_room(ns): blocks of ns that may still be pinned (None: no bound); may_pin(ns, n,
        tenant): the store's refusal (said and counted)."""
        self.fs, self.persist, self.space, self.stats = fs, persist, space, stats
        self.pin_room, self.may_pin = pin_room, may_pin
        self.queue: collections.deque[Job] = collections.deque()
        self.in_flight = 0
        self._said = False
        self.new_step()

    def new_step(self) -> None:
        """A scheduler step begins: its budget (spent by every `step` until the next)."""
        self.scan, self.blocks, self.flags, self.time_left = SCAN, BLOCKS, FLAGS, STEP_S

    def add(self, job: Job) -> None:
        self.queue.append(job)

    @property
    def busy(self) -> bool:
        """Orders still being applied (or their chunks written)."""
        return bool(self.queue) or self.in_flight > 0

    def step(self) -> None:
        """Go on with the jobs within what is left of this step's budget."""
        start = time.monotonic()
        try:
            while self.queue:
                if not self._advance(self.queue[0], start):
                    return
                self.queue.popleft().done()
        finally:
            self.time_left -= time.monotonic() - start

    def _advance(self, job: Job, start: float) -> bool:
        """True once the job is done."""
        while job.i < len(job.steps):
            if job._table() is not job.table:
                return True  # another engine's files replayed whole (and filtered then): its view is new
            order, f = job.steps[job.i]
            if f is not None and not self._order(job, order, f, start):
                return False
            if job.changed and f is not None and f.op == "clear":
                job.table.forget_order()
                if job.engine is None:
                    log.info(
                        "aiokv: control order %d cleared %d block(s) of namespace %s",
                        order.number,
                        job.changed,
                        job.ns.hex[:12],
                    )
            job.i, job.lo, job.changed, job.old = job.i + 1, 0, 0, None
        if job.engine is None:
            self._mark(job, job.steps[-1][0].number)
        return True

    def _order(self, job: Job, order, f, start: float) -> bool:
        """One order applied to the job's table, from job.lo; True once done."""
        t = job.table
        if job.lo == 0 and job.old is None and not job.fresh and bulk.covers(t, f) and t.count * 2 >= t.slots:
            n = t.count
            job.old, rest = bulk.empty(t)  # every block at once (dense: the old tags are 8 bytes a block)
            self.fs.submit(rest.clear)  # (the other old columns freed on the I/O thread: tens of MB)
            job.end, job.changed = len(job.old), n
            self.stats.cleared += n
            self._gone(job.ns, job.old)
            if job.engine is not None:
                return True  # (another engine's: it writes its own records)
        while job.lo < job.end:
            if self.scan <= 0 or time.monotonic() - start > self.time_left:
                return False
            if job.engine is None and self.in_flight >= IN_FLIGHT:
                return False  # (the I/O thread is behind: what is queued stays bounded)
            if job.old is not None:
                hi = min(job.end, job.lo + bulk.CHUNK)
                w = job.old[job.lo : hi]
                slots = np.flatnonzero(w).astype(np.int64) + job.lo
                self.scan -= hi - job.lo
                job.lo = hi
                if len(slots):
                    self._write(job, slots, job.old[slots])
                continue
            if not self._window(job, order, f):
                return False
        return True

    def _window(self, job: Job, order, f) -> bool:
        """One window of slots of the job's table; False once this step's budget is spent."""
        t, ns = job.table, job.ns
        left = self.blocks if f.op == "clear" else self.flags
        room = self.pin_room(ns) if f.op == "pin" else None
        if left <= 0:
            return False
        slots, nxt = bulk.select(t, f, job.lo, min(job.end, job.lo + self.scan), min(SUB, left))
        self.scan -= nxt - job.lo
        job.lo = nxt
        if job.fresh and len(slots):
            slots = slots[~np.isin(slots, np.fromiter(job.fresh, np.int64, len(job.fresh)))]
        if room is not None and len(slots) > room:
            self.may_pin(ns, len(slots) - room, int(t.tenant[slots[room]]))  # (refused: said, counted)
            slots, job.lo = slots[:room], job.end  # the rest stays unpinned
        if not len(slots):
            return True
        job.changed += len(slots)
        if f.op == "clear":
            self.blocks -= len(slots)
            tags = bulk.clear_slots(t, slots)
            self.stats.cleared += len(slots)
            self._gone(ns, tags)
            if job.engine is None:
                self._write(job, slots, tags)
        else:
            self.flags -= len(slots)
            tags = t.tag[slots]
            self._write(job, slots, tags, bulk.flag_slots(t, slots, f.op == "pin"))
        return True

    @staticmethod
    def _gone(ns, tags) -> None:
        if ns.changes is not None:
            ns.changes.append((False, tags, None))  # (zeros in it: no block; the KV events skip them)

    # ---- the I/O thread's half ----
    def _write(self, job: Job, slots: np.ndarray, tags: np.ndarray, flags=None) -> None:
        """A chunk of our own blocks' records queued: FREE (then their slots punched) or FLAGS."""
        ns, space = job.ns, self.space
        cost = ns.slot_cost * len(slots) if flags is None else 0
        space._punching += cost  # (not counted as used meanwhile, as Space._unback does)
        self.in_flight += len(slots)

        def io(jlog):
            try:
                jlog.append(bulk.free_records(slots, tags) if flags is None else bulk.flags_records(slots, tags, flags))
            except OSError:
                job.failed = True
                raise
            return self.space.punch_runs(ns, slots) if cost else True

        def done(ok, e):
            self.in_flight -= len(slots)
            space._punching -= cost
            if cost:  # given back (punched), or kept backed and reused where that failed
                (ns.alloc.punch_many if e is None and ok else ns.alloc.release_many)(slots)
            if e is not None and not self._said:
                self._said = True
                log.warning(
                    "aiokv: writing a control order's records failed (%s); the order is applied again at the "
                    "next start",
                    os.strerror(e.errno or 0) if isinstance(e, OSError) else e,
                )

        self.persist.journals[ns.nsid].run(len(slots), io, done)

    def _mark(self, job: Job, number: int) -> None:
        """The MARK after the job's chunks: left out if any of them was not written."""
        rec = fmt.pack_mark(number, time.time_ns())
        job.ns.mark = max(job.ns.mark, number)

        def io(jlog):
            if not job.failed:
                jlog.append(rec, mark=number)

        self.persist.journals[job.ns.nsid].run(1, io)
