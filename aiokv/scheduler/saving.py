# SPDX-License-Identifier: Apache-2.0
"""The second phase of a step's plan: the store's upkeep at each step (give-backs
tried again, the journal's flush, other engines' blocks refreshed), the breaker's
word on saves, admission (admit: reused), and each request's reservations, request
by request, into the step's save jobs (plan.reserve). SchedulerSide holds one.

Threading contract: the EngineCore scheduler thread only (SchedulerSide's caller).
"""

from __future__ import annotations

import logging

from aiokv.jobs import StepPlan
from aiokv.scheduler import plan as planning
from aiokv.scheduler.admission import Admission
from aiokv.scheduler.bookkeeping import Requests
from aiokv.scheduler.commits import Ledger
from aiokv.scheduler.state import Group, SchedulerCounters
from aiokv.util.breaker import Breaker

log = logging.getLogger("aiokv")


class Saving:
    """A step's saves, from the blocks its requests want saved (Requests.track). Reads the
    store through the ledger (which a test may wrap). Threading contract: the EngineCore
    scheduler thread only."""

    def __init__(self, ledger: Ledger, groups: list[Group], counters: SchedulerCounters, known: Requests):
        self.jobs = ledger
        self.groups = groups
        self.counters = counters
        self.known = known
        self.allowed = True  # the breaker's word for this step's saves

    def reserve(self, plan: StepPlan, wanted: dict, breaker: Breaker, admission: Admission) -> None:
        """The store's upkeep, then `wanted` ({req_id: [(group, keys, block ids)]}) into
        plan.saves: a store error drops that request's saves of this step, no other's."""
        store = self.jobs.store
        self.jobs.retry()
        for call in (store.flush_if_due, store.refresh):  # refresh: other engines' blocks become hits
            try:
                call()
            except Exception:
                log.exception("aiokv: the store's %s failed; trying again at the next step", call.__name__)
        breaker.file_system(store.stalled)  # a hung file system: no hits, no saves
        self.counters.breaker_opens = breaker.opens
        self.allowed = breaker.allow_saves()
        for req_id, parts in wanted.items():
            if not self.allowed:  # the breaker is open: the disk is failing
                self.counters.saves_skipped_breaker += sum(len(keys) for _, keys, _ in parts)
                continue
            if admission.sketch is not None:
                parts = self._admit(admission, req_id, parts)
            st = self.known.reqs[req_id]
            plan.saves += planning.reserve(
                self.jobs.store, self.jobs, self.groups, self.counters, req_id, parts, st.tenant, st.pin
            )

    def _admit(self, admission: Admission, req_id: str, parts: list) -> list:
        """The planned saves admission lets through (admit: reused); the others are counted."""
        st, out = self.known.reqs[req_id], []
        for gi, keys, blocks in parts:
            ok = admission.admitted(st, keys)
            self.counters.saves_not_admitted += ok.count(False)
            if any(ok):
                out.append((gi, [k for k, y in zip(keys, ok) if y], [b for b, y in zip(blocks, ok) if y]))
        return out
