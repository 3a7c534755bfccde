"""A circuit breaker in front of the shared tier.

After `threshold` failures in a row (errors or timeouts) the tier is skipped
for `cooldown` seconds: lookups answer "not there", uploads are dropped,
without a request. After the cooldown one request at a time is let through; a
success closes the breaker, a failure opens it for another cooldown. So a dead
or hung server costs each caller at most one request's timeout per cooldown,
not one per block.

Threading contract: any thread (the scheduler thread, the workers' loops and
the prober's loop share one instance per process); a lock guards its state.
"""
from __future__ import annotations

import threading
import time


class Breaker:
    def __init__(self, threshold: int = 3, cooldown: float = 10.0, clock=time.monotonic):
        self.threshold = threshold
        self.cooldown = cooldown
        self.clock = clock
        self._lock = threading.Lock()
        self._fails = 0
        self._open_until = 0.0
        self._trial = False  # a request is out after a cooldown; others wait for its outcome
        self.opened = 0      # times the breaker opened (counted)

    def allow(self) -> bool:
        """Whether a request may go to the server now."""
        with self._lock:
            if self._fails < self.threshold:
                return True
            if self.clock() < self._open_until or self._trial:
                return False
            self._trial = True
            return True

    def success(self) -> None:
        with self._lock:
            self._fails = 0
            self._trial = False

    def cancelled(self) -> None:
        """A request ended without an answer (its caller gave up): it was no trial."""
        with self._lock:
            self._trial = False

    def failure(self) -> None:
        with self._lock:
            self._fails += 1
            self._trial = False
            if self._fails >= self.threshold:
                if self.clock() >= self._open_until:
                    self.opened += 1
                self._open_until = self.clock() + self.cooldown

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self._fails >= self.threshold and self.clock() < self._open_until
