# SPDX-License-Identifier: Apache-2.0
"""The way back from a worker's pipelines to vLLM's worker thread, and that
thread's own view of the jobs it handed in.

Producers on any thread (the loop thread's pipelines, vLLM's thread itself when
a job fails before it reaches the loop, the uploader's counters) `put` messages
on one SimpleQueue: no lock, never a wait. vLLM's thread drains it (`drain`, from
poll, in_flight, wait_for_jobs) into what it alone touches: the report and the
counters to hand on, the loads finished since the last poll, and the jobs handed
in and not seen finished (`loads` by request, `saves` by job id), so that a dead
loop still has every outstanding load and save reported failed.

Threading contract: `put`, `count`, `report`, `started` and `next_job` from any
thread; everything else (`drain`, `take`, `outstanding`, the tables) on vLLM's
worker thread only.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import queue
import threading

from aiokv.jobs import Transfer, WorkerReport, add_drives

# message kinds
_COUNT, _REPORT, _LOAD_DONE, _SAVE_DONE, _SAVE_STARTED = range(5)
NOTHING: frozenset = frozenset()  # what a poll with nothing to report hands back (shared: never changed)


class Results:
    def __init__(self):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count(1)  # save job ids (next() is atomic: any thread takes one)
        self.job_done = threading.Event()  # set when a load or save finishes; see TransferWorker.wait_for_jobs
        # vLLM's thread only
        self.loads: dict[str, Transfer] = {}  # req -> load handed in, not seen finished
        self.saves: dict[int, Transfer] = {}  # save job id -> save handed in or started, not seen finished
        self._done_loads: list[tuple[str, list[int], Transfer | None]] = []  # (req, failed block ids, its load)
        self._cut: set[str] = set()  # requests whose load in flight was cancelled: reported whole-failed
        self._report = WorkerReport()
        self._counts = collections.Counter()

    # ---- any thread ----
    def next_job(self) -> int:
        return next(self._ids)

    def count(self, **kw) -> None:
        self._q.put((_COUNT, kw))

    def report(self, part: WorkerReport) -> None:
        """Entries for the scheduler that end no job."""
        self._q.put((_REPORT, part))

    def started(self, job: int, t: Transfer) -> None:
        """A save job the loop started by itself (a write-through of blocks from the bucket)."""
        self._q.put((_SAVE_STARTED, job, t))

    def load_done(self, req_id: str, failed: list[int], part: WorkerReport) -> None:
        """A load ended (`failed`: its block ids not loaded); `part` is its report and counters."""
        self._q.put((_LOAD_DONE, req_id, failed, part))
        self.job_done.set()

    def save_done(self, job: int | None, part: WorkerReport) -> None:
        """A save ended (job None: one that never became a job); `part` is its report and counters."""
        self._q.put((_SAVE_DONE, job, part))
        self.job_done.set()

    # ---- vLLM's thread ----
    def drain(self) -> None:
        while True:
            try:
                msg = self._q.get_nowait()
            except queue.Empty:
                return
            kind = msg[0]
            if kind == _COUNT:
                self._counts.update(msg[1])
            elif kind == _REPORT:
                self._add(msg[1])
            elif kind == _LOAD_DONE:
                _, req_id, failed, part = msg
                t = self.loads.pop(req_id, None)
                if req_id in self._cut:
                    self._cut.discard(req_id)
                    if t is not None:
                        failed = _fail_whole(t, failed, part.loads, part.counters)
                self._done_loads.append((req_id, failed, t))
                self._add(part)
            elif kind == _SAVE_DONE:
                _, job, part = msg
                self.saves.pop(job, None)
                self._add(part)
            else:  # _SAVE_STARTED
                self.saves[msg[1]] = msg[2]

    def _add(self, part: WorkerReport) -> None:
        """`part` into the report being gathered, in place (lists extended, counters added)."""
        for f in dataclasses.fields(part):
            v = getattr(part, f.name)
            if f.name == "counters":
                self._counts.update(v)
            elif f.name == "drives":
                add_drives(self._report.drives, v)
            elif isinstance(v, list):
                getattr(self._report, f.name).extend(v)
            elif v:
                setattr(self._report, f.name, v)

    def cancelled(self, req_ids) -> None:
        """A cancel of these requests' loads is handed in. A load that ends, or has ended,
        without vLLM having been handed its report is reported with every block failed,
        whatever it copied: a cache reset cancels the loads of requests that live on, and
        vLLM must then use nothing they loaded (it keeps a load's blocks up to its first
        failed one). A load already handed on is past recall (docs/operations.md)."""
        for r in req_ids:
            if r in self.loads:  # its report is still to come (queued, or the load runs)
                self._cut.add(r)
                continue
            for i, (req, failed, t) in enumerate(self._done_loads):
                if req == r and t is not None:
                    self._done_loads[i] = (req, _fail_whole(t, failed, self._report.loads, self._counts), t)

    @property
    def quiet(self) -> bool:
        """Nothing arrived since the last take and nothing waits to be taken (a look at O(1))."""
        return self._q.empty() and not self._done_loads and not self._counts and self._report.empty()

    @property
    def in_flight(self) -> int:
        self.drain()
        return len(self.loads) + len(self.saves)

    @property
    def loads_done(self) -> bool:
        """Some load finished since the last take."""
        return bool(self._done_loads)

    def outstanding(self) -> tuple[list[Transfer], list[tuple[int, Transfer]]]:
        """Every load and save not seen finished, forgotten here (a dead loop: they fail)."""
        self.drain()
        loads, self.loads = list(self.loads.values()), {}
        self._cut.clear()  # (every one of them is reported failed)
        saves, self.saves = list(self.saves.items()), {}
        return loads, saves

    def take(self) -> tuple[list[tuple[str, list[int]]], WorkerReport, collections.Counter]:
        """What finished since the last take: (loads, report, counters)."""
        self.drain()
        done, self._done_loads = [(r, f) for r, f, _ in self._done_loads], []
        report, self._report = self._report, WorkerReport()
        counts, self._counts = self._counts, collections.Counter()
        return done, report, counts


def _fail_whole(t: Transfer, failed: list[int], results: list, counts) -> list[int]:
    """Every block of load `t` failed (a cancel came before vLLM saw it finish): its
    LoadResult among `results` says so too, and its loaded blocks count as cancelled."""
    every = sorted(t.block_ids)
    for r in results:
        if r.job == t.job and r.req_id == t.req_id:
            r.failed = list(every)
    moved = len(every) - len(failed)
    if moved > 0:
        counts["loads_ok_blocks"] = counts.get("loads_ok_blocks", 0) - moved
        counts["load_cancelled_blocks"] = counts.get("load_cancelled_blocks", 0) + moved
    return every
