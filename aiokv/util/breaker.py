# SPDX-License-Identifier: Apache-2.0
"""The circuit breaker: the disk and the bucket each hold one (imports nothing of aiokv).

Without it, every request that hits on a hung disk waits `load_timeout` and then
recomputes, every save on a failing one is written for nothing, and a dead or
hung bucket costs each caller one request's timeout per block.

- closed: everything as usual. `failures` failures in a row open it (a
  success resets the run; for the disk, so does a quiet `cooldown`).
- open: no hits, no saves, no requests for `cooldown` seconds (`in_cooldown`).
  Counted (`opens`); the disk says so once per opening.
- half-open: after the cool-down, one trial at a time (`allow`: one request;
  `allow_hit`: a hit only while no load is in flight), and the disk's saves
  resume. The first failure opens it again; the first success closes it.
- the file system does not answer (`file_system(stalled=True)`: an operation
  of the store's I/O thread is past its deadline, aiokv/store/fsthread.py):
  open, with no probe, until it answers; then half-open. One opening however
  long the stall, and none if the breaker was open already.

Two ways of judging, one flag:
- the disk (`per_request=False`): verdicts come from the workers' reports
  (`record`: load timeouts and read/write I/O errors are failures, not blocks
  that fail verification: those are the data's fault, not the disk's; a
  successful load is a success); reports that arrive while it is open come from
  work begun before it opened and change nothing.
- the bucket (`per_request=True`): every request is a verdict on the server
  (`success`, `failure`, `cancelled` for a request its caller gave up on), also
  one begun before it opened: a success closes it, a failure keeps it open for
  another cooldown. Only a success forgets a run of failures. It logs nothing
  (its callers count what it costs).

`failures=0` turns the counting of failures off (a hung file system still stops
hits and saves while it does not answer).

Threading contract: any thread; a lock guards the state. The disk's is used by
the EngineCore scheduler thread (SchedulerSide); the bucket's is shared by the
scheduler thread, the workers' loops and the prober's loop of one process.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("aiokv")

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"


class Breaker:
    def __init__(
        self,
        failures: int = 3,
        cooldown: float = 30.0,
        clock=time.monotonic,
        per_request: bool = False,
        where: str = "",
    ):
        self.threshold = failures
        self.where = f" ({where})" if where else ""  # the drive it judges, in its lines (aiokv/store/drives.py)
        self.cooldown = cooldown
        self.clock = clock
        self.per_request = per_request
        self._lock = threading.RLock()
        self.state = CLOSED
        self.run = 0  # failures in a row while closed
        self.last_failure = 0.0
        self.opened_at = 0.0
        self.opens = 0  # times it opened (a counter for the stats)
        self.fs_stalled = False  # the store's file system does not answer
        self._by_stall = False  # the current opening is the file system's, not failures'
        self._trial = False  # half-open: a request is out; others wait for its outcome

    def _now_state(self) -> str:
        if self.state == OPEN and not self.fs_stalled and self.clock() - self.opened_at >= self.cooldown:
            self.state = HALF_OPEN
            if not self.per_request:
                log.info("aiokv: probing the cache disk%s again after %.0f s", self.where, self.cooldown)
        return self.state

    @property
    def is_open(self) -> bool:
        """Open or probing: not trusted yet."""
        with self._lock:
            return self._now_state() != CLOSED

    @property
    def in_cooldown(self) -> bool:
        """Open, its cooldown not over: no request, not even a trial."""
        with self._lock:
            return self._now_state() == OPEN

    def allow(self) -> bool:
        """Whether a request may go now: closed, or half-open with no trial out (it becomes the trial)."""
        with self._lock:
            s = self._now_state()
            if s == CLOSED:
                return True
            if s == OPEN or self._trial:
                return False
            self._trial = True
            return True

    def allow_hit(self, loads_in_flight: int) -> bool:
        with self._lock:
            s = self._now_state()
            return s == CLOSED or (s == HALF_OPEN and loads_in_flight == 0)

    def allow_saves(self) -> bool:
        with self._lock:
            return self._now_state() != OPEN

    def record(self, counters: dict) -> None:
        """One workers' report: its counters (summed across ranks)."""
        with self._lock:
            if not self.threshold:
                return
            failures = (
                counters.get("load_timeouts", 0) + counters.get("read_errors", 0) + counters.get("write_errors", 0)
            )
            now, state = self.clock(), self._now_state()
            if failures:
                self._failed(failures, now, state)
            elif counters.get("loads_ok_blocks", 0):
                self._answered(state)

    def success(self) -> None:
        """An answer: closes a half-open breaker (per request: an open one too)."""
        with self._lock:
            self._trial = False
            if self.threshold:
                self._answered(self._now_state())

    def cancelled(self) -> None:
        """A request ended without an answer (its caller gave up): it was no trial."""
        with self._lock:
            self._trial = False

    def failure(self, n: int = 1) -> None:
        with self._lock:
            self._trial = False
            if self.threshold:
                now = self.clock()
                self._failed(n, now, self._now_state())

    def _answered(self, state: str) -> None:
        if state == HALF_OPEN or (state == OPEN and self.per_request and not self.fs_stalled):
            if not self.per_request:
                log.warning("aiokv: the cache disk%s answers again; hits and saves are back on", self.where)
            self.state = CLOSED
        self.run = 0

    def _failed(self, n: int, now: float, state: str) -> None:
        if state == CLOSED and not self.per_request and now - self.last_failure >= self.cooldown:
            self.run = 0  # failures far apart are not a sick disk
        self.last_failure = now
        self.run += n
        if state == HALF_OPEN or (state == CLOSED and self.run >= self.threshold):
            self._open(now)
        elif state == OPEN and self.per_request and not self.fs_stalled:
            self.opened_at = now  # another cooldown from now

    def file_system(self, stalled: bool) -> None:
        """The store's file system stalled (an operation past its deadline) or answers (once per step)."""
        with self._lock:
            if stalled == self.fs_stalled:
                return
            self.fs_stalled = stalled
            if stalled:
                if self.state != OPEN:
                    log.warning(
                        "aiokv: the cache directory's file system%s does not answer; no hits or saves until it does",
                        self.where,
                    )
                    self.state = OPEN
                    self.opens += 1
                    self.opened_at = self.clock()
                    self._by_stall = True
            elif self.state == OPEN and self._by_stall:
                log.warning("aiokv: the cache directory's file system%s answers again; probing it", self.where)
                self.state = HALF_OPEN
                self.run = 0

    def _open(self, now: float) -> None:
        if self.state == CLOSED and not self.per_request:
            log.warning(
                "aiokv: the cache disk%s is failing (%d load timeouts or I/O errors in a row); no hits "
                "or saves for %.0f s, then one probe",
                self.where,
                self.run,
                self.cooldown,
            )
        self.state = OPEN
        self.opened_at = now
        self.opens += 1
        self.run = 0
        self._by_stall = False
