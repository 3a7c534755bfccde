# SPDX-License-Identifier: Apache-2.0
"""Jobs in flight, and what the workers' reports do to them: commits and give-backs.

Every transfer the scheduler side plans is a job with an id of its own (Transfer.job:
from 1, never reused in the life of the ledger). The ledger keeps one record per job:
what it pinned (a load), what it reserved (a save; a load's blocks from the bucket
tier). The workers report per job, each result naming its rank (aiokv/jobs.py); the
ledger counts the ranks per block of a job (docs/design.md, "A step", 5-6):
- a block is committed once every rank reported it written;
- a block a rank failed is given back once every rank has reported it: until then
  another rank may still write its slot;
- a load's keys stay pinned until vLLM reports the request in finished_recving;
  a key that did not verify is dropped where it still lives in the slot read.
A result for a job the ledger no longer holds (or for a block of it already settled)
is ignored and counted (`reports_ignored`): ids are never reused, so a late report
never meets a newer reservation or pin.

Store errors: a report's bookkeeping is done whole first, the store calls after, each
on its own; a give-back the store refuses is made again at the next step (retry), so
nothing stays pinned or pending.

Threading contract: the EngineCore scheduler thread only (through SchedulerSide).
"""

from __future__ import annotations

import dataclasses
import logging

from aiokv.jobs import WorkerReport
from aiokv.scheduler.state import Group, SchedulerCounters

log = logging.getLogger("aiokv")


@dataclasses.dataclass
class Job:
    """The scheduler side's record of one job in flight."""

    req_id: str
    group: int
    pinned: list[bytes] = dataclasses.field(default_factory=list)  # a load's keys pinned in the store
    read: dict[bytes, int] = dataclasses.field(default_factory=dict)  # a load's key -> the slot it reads
    # key -> (slot reserved, ranks that reported it, ranks that failed it), until every rank has
    saving: dict[bytes, tuple[int, set[int], set[int]]] = dataclasses.field(default_factory=dict)
    from_bucket: bool = False  # `saving` holds a load's reservations for blocks of the bucket tier
    loading: bool = False  # a load whose request vLLM has not reported finished yet
    tenant: str = ""  # the request's tenant (its cache_salt): its blocks are committed as its
    pin: bool = False  # the request's blocks are committed pinned


class Ledger:
    def __init__(self, store, groups: list[Group], counters: SchedulerCounters):
        self.store, self.groups, self.counters = store, groups, counters
        self.jobs: dict[int, Job] = {}
        self.loading: dict[str, list[int]] = {}  # request -> its load jobs, until reported finished
        self.later: list[tuple] = []  # give-backs the store refused, made again at the next step
        self._last = 0

    def new_id(self) -> int:
        self._last += 1
        return self._last

    def add_save(
        self, job: int, req_id: str, gi: int, items: list[tuple[bytes, int]], tenant: str = "", pin: bool = False
    ) -> None:
        self.jobs[job] = Job(req_id, gi, saving={k: (slot, set(), set()) for k, slot in items}, tenant=tenant, pin=pin)

    def add_loads(self, req_id: str, jobs: dict[int, Job]) -> None:
        """A request's load: one job per group, in flight until the request is reported finished."""
        for job in jobs.values():
            job.loading = True
        self.jobs.update(jobs)
        self.loading[req_id] = list(jobs)

    @property
    def pending(self) -> int:
        """Reserved blocks not yet reported by every rank."""
        return sum(len(j.saving) for j in self.jobs.values())

    def _settle(self, job: int) -> None:
        rec = self.jobs.get(job)
        if rec is not None and not rec.saving and not rec.loading:
            del self.jobs[job]

    def forget(self, job: int) -> None:
        """A load job that never reached the workers: its bucket-tier reservations go back
        (its pins with the request's loads, loads_done)."""
        rec = self.jobs.get(job)
        if rec is not None and rec.saving:
            items, rec.saving = [(k, s) for k, (s, _, _) in rec.saving.items()], {}
            self.give_back(("abort", rec.group, items, False))
        self._settle(job)

    def loads_done(self, req_id: str) -> None:
        """The request's loads are over (reported finished, or replaced): their pins go back."""
        for job in self.loading.pop(req_id, None) or []:
            rec = self.jobs.get(job)
            if rec is None:
                continue
            rec.loading = False
            self.give_back(("unpin", rec.group, rec.pinned))
            self._settle(job)

    # ---- reports ----
    def on_report(self, report: WorkerReport | None, finished) -> tuple[set[str], list[tuple[int, bytes]]]:
        """The workers' results, then the requests vLLM reported finished loading. Returns
        (requests whose load failed, (group, key) that did not verify and are not in the
        store under the slot read: bucket-tier blocks)."""
        done: dict[tuple[int, str, bool], list] = {}  # (group, tenant, pin) -> blocks every rank wrote
        failed: dict[int, list] = {}
        bucket_lost: dict[int, list] = {}
        bad: dict[int, list] = {}
        failed_loads: set[str] = set()
        missing: list[tuple[int, bytes]] = []
        for r in report.saves if report is not None else ():
            rec = self.jobs.get(r.job)
            if rec is None:
                self.counters.reports_ignored += 1
                continue
            for key, ok in [(k, True) for k in r.written] + [(k, False) for k in r.failed]:
                entry = rec.saving.get(key)
                if entry is None:
                    self.counters.reports_ignored += 1
                    continue
                slot, ranks, failing = entry
                ranks.add(r.rank)
                if not ok:
                    failing.add(r.rank)
                if len(ranks) < self.groups[rec.group].ns.ranks:
                    continue  # committed, or given back, once every rank has reported
                del rec.saving[key]
                # a bucket block that did not arrive: a miss, not a failed save
                if failing:
                    (bucket_lost if rec.from_bucket else failed).setdefault(rec.group, []).append((key, slot))
                else:
                    done.setdefault((rec.group, rec.tenant, rec.pin), []).append((key, slot))
            self._settle(r.job)
        seen: set[tuple[int, bytes, int]] = set()
        for r in report.loads if report is not None else ():
            rec = self.jobs.get(r.job)
            if rec is None:
                self.counters.reports_ignored += 1
                continue
            if r.failed:
                failed_loads.add(rec.req_id)
            ns = self.groups[rec.group].ns
            for key in r.bad:
                slot = rec.read.get(key)
                if slot is None or (rec.group, key, slot) in seen:
                    continue
                seen.add((rec.group, key, slot))
                if self.store.holds(ns, key, slot):  # (several drives: on the drive read)
                    bad.setdefault(rec.group, []).append((key, slot))
                else:
                    missing.append((rec.group, key))
        for req_id in finished or ():
            self.loads_done(req_id)
        # the store
        for (gi, tenant, pin), items in done.items():
            before = self.store.stats.commits
            try:
                self.store.commit(self.groups[gi].ns, items, tenant, pin, request=pin)
            except Exception:
                log.exception("aiokv: committing %d block(s) failed; they are not stored", len(items))
                self.give_back(("abort", gi, items, True))
            self.counters.saves_committed += self.store.stats.commits - before
        for gi, items in failed.items():
            self.give_back(("abort", gi, items, True))
            self.counters.save_failures += len(items)
        for gi, items in bucket_lost.items():
            self.give_back(("abort", gi, items, False))
        for gi, items in bad.items():
            self.give_back(("drop", gi, items))
        return failed_loads, missing

    # ---- give-backs ----
    def give_back(self, op: tuple) -> None:
        """Give the store back a pin, a reservation or a bad key: ("unpin", group, keys),
        ("abort", group, [(key, slot)], failed), ("drop", group, [(key, slot)]). If the store
        raises, the same call is made again at the next step (retry), until it goes through."""
        try:
            kind, gi, arg = op[:3]
            ns = self.groups[gi].ns
            if kind == "unpin":
                self.store.unpin(ns, arg)
            elif kind == "abort":
                self.store.abort(ns, arg, failed=op[3])
            else:  # only where the key still sits in the slot that failed (not a newer copy, nor another drive's)
                self.counters.load_bad_blocks += self.store.drop_at(ns, arg)
        except Exception:
            log.warning(
                "aiokv: giving the store back %s of %d block(s) failed; trying again at the next step",
                op[0],
                len(op[2]),
                exc_info=True,
            )
            self.later.append(op)

    def abort_reserved(self, reserved: list[tuple[int, bytes, int]]) -> None:
        by_group: dict[int, list] = {}
        for gi, key, slot in reserved:
            by_group.setdefault(gi, []).append((key, slot))
        for gi, items in by_group.items():
            self.give_back(("abort", gi, items, False))

    def retry(self) -> None:
        later, self.later = self.later, []
        for op in later:
            self.give_back(op)

    def give_up(self, report: WorkerReport | None) -> None:
        """A report that could not be processed: the blocks it reported (written or not) are
        not committed; their slots go back (a dropped save)."""
        for r in report.saves if report is not None else ():
            rec = self.jobs.get(r.job)
            if rec is None:
                continue
            items = [(k, rec.saving.pop(k)[0]) for k in r.written + r.failed if k in rec.saving]
            if items:
                self.give_back(("abort", rec.group, items, False))
            self._settle(r.job)

    def lost(self, report: WorkerReport | None, finished) -> None:
        """A report on_report could not process, given up whole (SchedulerSide.lost_report): its
        saves' slots go back, and the requests in `finished` give back their pins. Never raises."""
        try:
            self.give_up(report)
        except Exception:
            log.warning("aiokv: giving back the slots of an unprocessed report failed", exc_info=True)
        for req_id in finished or ():
            try:
                self.loads_done(req_id)
            except Exception:
                log.warning("aiokv: unpinning the load of request %s failed", req_id, exc_info=True)

    def close(self) -> None:
        """Commit saves whose reports can no longer arrive (the workers are gone) if
        their blocks verify on disk; give the other reservations back. Never raises."""
        done: dict[tuple[int, int, bool], list] = {}
        lost: dict[int, list] = {}
        for rec in self.jobs.values():
            ns = self.groups[rec.group].ns
            for key, (slot, _, failing) in rec.saving.items():
                try:
                    ok = not failing and self.store.verify_slot(ns, key, slot)
                except Exception:
                    ok = False
                if ok:
                    done.setdefault((rec.group, rec.tenant, rec.pin), []).append((key, slot))
                else:
                    lost.setdefault(rec.group, []).append((key, slot))
            rec.saving.clear()
        for job in list(self.jobs):
            self._settle(job)
        for (gi, tenant, pin), items in done.items():
            try:
                self.store.commit(self.groups[gi].ns, items, tenant, pin, request=pin)
                self.counters.saves_committed += len(items)
            except Exception:
                log.exception("aiokv: committing saves at shutdown failed")
                lost.setdefault(gi, []).extend(items)
        self.retry()
        for gi, items in lost.items():
            self.give_back(("abort", gi, items, False))
