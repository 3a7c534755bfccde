"""A circuit breaker for a slow or failing disk (scheduler side; imports no vLLM).

Without it, every request that hits on a hung disk waits `load_timeout` and then
recomputes, and every save on a failing one is written for nothing. The breaker
counts what the workers report: load timeouts and read/write I/O errors (not
blocks that fail verification: those are the data's fault, not the disk's).

- closed: hits and saves as usual. `failures` failures in a row (a load that
  succeeds resets the run; so does a quiet `cooldown`) open it.
- open: no hits, no saves, for `cooldown` seconds. Said once per opening, counted.
- half-open: after the cool-down, hits are offered again but only while no load
  is in flight (one probe at a time), and saves resume. The first report with a
  failure opens it again; the first with a successful load and no failure closes it.

- the file system does not answer (`file_system(stalled=True)`: an operation
  of the store's I/O thread is past its deadline, aiokv/store/fsthread.py):
  open, with no probe, until it answers; then half-open. One opening however
  long the stall, and none if the breaker was open already.

`failures=0` turns the counting of failures off (a hung file system still stops
hits and saves while it does not answer).

Threading contract: one thread, the EngineCore scheduler thread (SchedulerSide).
"""
from __future__ import annotations

import logging
import time

log = logging.getLogger("aiokv")

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"


class Breaker:
    def __init__(self, failures: int = 3, cooldown: float = 30.0, clock=time.monotonic):
        self.threshold = failures
        self.cooldown = cooldown
        self.clock = clock
        self.state = CLOSED
        self.run = 0            # failures in a row while closed
        self.last_failure = 0.0
        self.opened_at = 0.0
        self.opens = 0          # times it opened (a counter for the stats)
        self.fs_stalled = False  # the store's file system does not answer
        self._by_stall = False   # the current opening is the file system's, not failures'

    def _now_state(self) -> str:
        if self.state == OPEN and not self.fs_stalled and self.clock() - self.opened_at >= self.cooldown:
            self.state = HALF_OPEN
            log.info("aiokv: probing the cache disk again after %.0f s", self.cooldown)
        return self.state

    @property
    def is_open(self) -> bool:
        """Open or probing: the disk is not trusted yet."""
        return self._now_state() != CLOSED

    def allow_hit(self, loads_in_flight: int) -> bool:
        s = self._now_state()
        return s == CLOSED or (s == HALF_OPEN and loads_in_flight == 0)

    def allow_saves(self) -> bool:
        return self._now_state() != OPEN

    def record(self, counters: dict) -> None:
        """One workers' report: its counters (summed across ranks)."""
        if not self.threshold:
            return
        failures = (counters.get("load_timeouts", 0) + counters.get("read_errors", 0)
                    + counters.get("write_errors", 0))
        loaded = counters.get("loads_ok_blocks", 0)
        now = self.clock()
        state = self._now_state()
        if failures:
            if state == CLOSED and now - self.last_failure >= self.cooldown:
                self.run = 0  # failures far apart are not a sick disk
            self.last_failure = now
            self.run += failures
            if state == HALF_OPEN or (state == CLOSED and self.run >= self.threshold):
                self._open(now, failures)
        elif loaded:
            if state == HALF_OPEN:
                log.warning("aiokv: the cache disk answers again; hits and saves are back on")
                self.state = CLOSED
            self.run = 0

    def file_system(self, stalled: bool) -> None:
        """The store's file system stalled (an operation past its deadline) or answers (once per step)."""
        if stalled == self.fs_stalled:
            return
        self.fs_stalled = stalled
        if stalled:
            if self.state != OPEN:
                log.warning("aiokv: the cache directory's file system does not answer; no hits or saves until "
                            "it does")
                self.state = OPEN
                self.opens += 1
                self.opened_at = self.clock()
                self._by_stall = True
        elif self.state == OPEN and self._by_stall:
            log.warning("aiokv: the cache directory's file system answers again; probing it")
            self.state = HALF_OPEN
            self.run = 0

    def _open(self, now: float, failures: int) -> None:
        if self.state == CLOSED:
            log.warning("aiokv: the cache disk is failing (%d load timeouts or I/O errors in a row); no hits "
                        "or saves for %.0f s, then one probe", self.run, self.cooldown)
        self.state = OPEN
        self.opened_at = now
        self.opens += 1
        self.run = 0
        self._by_stall = False
