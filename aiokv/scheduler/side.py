# SPDX-License-Identifier: Apache-2.0
"""The scheduler side: keys, the index of committed blocks, and per-request
load/save jobs. Runs in vLLM's EngineCore process; imports no vLLM.

SchedulerSide is the facade the connector calls; the work is done by:
    bookkeeping.py  what is known of each request alive; a step's first phase
    match.py    hits (every group serves them; the bucket tier may extend one)
    index_wait.py  requests wait ("not yet") while the index still loads at start
    plan.py     load jobs at allocation, save jobs per step, their reservations
    saving.py   a step's second phase: the store's upkeep, the breaker, admission, reservations
    commits.py  the ledger of jobs in flight: reports -> commits, give-backs
    state.py    the plain data (scheduled requests, groups, requests, counters)

Rules it keeps (docs/design.md):
- `match` has no side effects beyond memoising the request's keys; vLLM may call
  it many times.
- A load's keys are pinned (not evictable) until the workers report the request
  in finished_recving, whatever happened to the request meanwhile.
- A block is committed only after every rank reported it written (commits.py).
- Blocks are never held after a request finishes: the workers copy a step's
  blocks out before the step ends (see worker/device.py), so request_finished
  never delays a free.
- A store call that raises changed nothing (the store's contract), and never
  leaves the bookkeeping here half done: on_alloc builds every group's
  transfer and pins before it commits any; plan() updates every scheduled
  request's block tables before its first store call, then reserves request
  by request (all of a request's slots, or none); what must be given back
  (unpins, aborted reservations, drops) and could not be is tried again at
  the next step, so nothing stays pinned or pending.

Threading contract: one thread, the EngineCore scheduler thread.
"""

from __future__ import annotations

import logging

from aiokv.jobs import StepPlan, Transfer, WorkerReport
from aiokv.scheduler import match as matching
from aiokv.scheduler import plan as planning
from aiokv.scheduler.admission import Admission
from aiokv.scheduler.bookkeeping import Requests
from aiokv.scheduler.commits import Job, Ledger
from aiokv.scheduler.index_wait import IndexWait
from aiokv.scheduler.keys import extend_keys
from aiokv.scheduler.layout import FULL, GroupSpec
from aiokv.scheduler.saving import Saving
from aiokv.scheduler.state import Group, Req, Scheduled, SchedulerCounters
from aiokv.store.api import SpaceApi, StoreApi
from aiokv.util.breaker import Breaker

__all__ = ["Scheduled", "SchedulerCounters", "SchedulerSide"]

log = logging.getLogger("aiokv")


class SchedulerSide:
    def __init__(
        self,
        store: StoreApi,
        groups: "list[tuple[GroupSpec, SpaceApi]] | SpaceApi",
        block_size: int,
        breaker: Breaker | None = None,
        index_wait: float = 0.0,
    ):
        if isinstance(groups, SpaceApi):  # one full-attention group
            groups = [(GroupSpec(0, FULL, groups.payload_bytes, ()), groups)]
        self.breaker = breaker or Breaker()  # a sick disk: no hits or saves for a while (breaker.py)
        self.groups = [Group(spec, ns) for spec, ns in groups]
        self.ns = self.groups[0].ns
        self.bs = block_size
        self._full = [g for g in self.groups if g.spec.kind == FULL]
        self._partial = [g for g in self.groups if g.spec.kind != FULL]
        self.counters = SchedulerCounters()
        self.jobs = Ledger(store, self.groups, self.counters)  # jobs in flight: pins, reservations; the store
        self.index_wait = IndexWait([g.ns for g in self.groups], index_wait, self.counters)  # (the setting)
        self.known = Requests(self.groups, block_size)  # each request alive: keys, tables, marks
        self.saving = Saving(self.jobs, self.groups, self.counters, self.known)  # a step's saves
        self._new_loads: list[Transfer] = []
        self._cancel: list[str] = []
        self._reset_workers = False  # the next plan tells the workers to drop their memory tier
        self.disabled = False  # a worker could not start: no hits, no saves from now on
        self.saves = True  # False: this engine saves nothing (kv_role kv_consumer; set by the connector)
        self.save_generated = True  # False: only blocks of the prompt are saved (set by the connector)
        self.admission = Admission()  # which planned saves go to disk (admission.py; set by the connector)
        # the bucket tier's lookups (aiokv/bucket/lookup.py), set by the connector; None: no bucket tier
        self.bucket = None
        self.layerwise = False  # layerwise loads: a request's end is a cancel (bookkeeping.py: staged)
        self._logged: set[str] = set()  # the hooks whose failure was logged (error)

    @property
    def store(self) -> StoreApi:
        return self.jobs.store

    @store.setter
    def store(self, store: StoreApi) -> None:  # (tests and tools/store_faults.py wrap it)
        self.jobs.store = store

    # ---- matching and allocation ----
    def describe(self, req_id: str, tenant: str = "", pin: bool = False) -> None:
        """What a request is beyond its tokens: its tenant (its cache_salt, "" for none), and
        whether its blocks are pinned; before its first match. Never raises."""
        self.known.describe(req_id, tenant, pin)

    def match(self, req_id: str, tokens, root: bytes, num_computed: int) -> int | None:
        """External hit tokens beyond the num_computed local ones (block multiple); None: the
        index is still loading or the bucket tier has not answered yet (vLLM asks again next step)."""
        if req_id in self.known.no_hits or self.disabled or not self.breaker.allow_hit(len(self.jobs.loading)):
            return 0
        st = self.known.state(req_id, tokens, root)
        usable = (len(tokens) - 1) // self.bs
        extend_keys(st.keys, root, tokens, self.bs, usable)
        self.admission.looked_up(st, usable)
        local = num_computed // self.bs
        hit = matching.hit(self.store, self._full, self._partial, st.keys, usable, local, self.bs)
        if local < usable and self.index_wait.holds(req_id):
            return None
        if self.bucket is not None and not self._partial:
            got = matching.bucket_extend(self.bucket, self.groups, req_id, st.keys, max(hit, local), usable)
            if got is None:
                return None
            hit, span = got
            if span is None:
                self.known.from_bucket.pop(req_id, None)
            else:
                self.known.from_bucket[req_id] = span
        self.known.local_blocks[req_id] = local
        return (hit - local) * self.bs if hit > local else 0

    def bucket_hit_tokens(self, req_id: str, num_external: int) -> int:
        """Tokens of the hit just matched (num_external beyond the local ones) that the bucket
        tier serves; call before on_alloc (which consumes the match)."""
        return matching.span_tokens(
            self.known.from_bucket.get(req_id), self.known.local_blocks.get(req_id, 0), num_external, self.bs
        )

    def on_alloc(self, req_id: str, tokens, root: bytes, block_ids: tuple[list[int], ...], num_external: int) -> None:
        """One load job per group for the hit vLLM allocated, queued with its pins all
        together; if anything raises, nothing of it stays (pins and reservations are given
        back) and the exception goes to the caller (the connector then calls fail_load)."""
        st = self.known.state(req_id, tokens, root)
        # before a hit, the computed tokens are vLLM's own cache's; without one, all of them are (once
        # a load is done vLLM allocates again with no external tokens: the first call of the life counts)
        if st.own_cache < 0:
            st.own_cache = self.known.local_blocks.get(req_id, 0) if num_external > 0 else 1 << 62
        if num_external <= 0:
            return
        local = self.known.local_blocks.get(req_id, 0)
        n = num_external // self.bs
        from_bucket = self.known.from_bucket.pop(req_id, None)
        transfers, jobs, reserved = planning.alloc(
            self.store, self.jobs, self.groups, st, req_id, block_ids, local, n, from_bucket
        )
        # committed together: every group's load, its pins, its bucket-tier reservations
        self._new_loads += transfers
        self.jobs.add_loads(req_id, jobs)
        self.counters.bucket_hit_blocks += reserved
        self.counters.load_blocks += sum(len(t.keys) for t in transfers)
        self.counters.hit_requests += 1
        self.counters.hit_blocks += n
        self.counters.hit_tokens += n * self.bs

    def fail_load(self, req_id: str, block_ids: tuple[list[int], ...], num_external: int) -> None:
        """A load vLLM now waits for but that could not be prepared: whatever was queued
        for it is replaced by one load with no slots, so the worker reports the request
        finished, failed, exactly once. Never raises."""
        try:
            dropped = [t for t in self._new_loads if t.req_id == req_id]
            if dropped:
                self._new_loads = [t for t in self._new_loads if t.req_id != req_id]
                self.counters.load_blocks -= sum(len(t.keys) for t in dropped)
                for t in dropped:  # its bucket-tier reservations go back
                    self.jobs.forget(t.job)
            self.jobs.loads_done(req_id)
        except Exception:
            log.warning("aiokv: giving back what a failed load of %s held failed", req_id, exc_info=True)
        try:
            local = self.known.local_blocks.get(req_id, 0)
            n = num_external // self.bs
            blocks = [b for b in block_ids[0][local : local + n] if b != 0]
        except Exception:
            blocks = []
        blocks = blocks or [0]  # no block: the connector reports it whole (failed_recving)
        # nothing to read: every block fails
        t = Transfer(req_id, [], [], blocks, 0, job=self.jobs.new_id())
        self._new_loads.append(t)
        self.jobs.add_loads(req_id, {t.job: Job(req_id, 0)})  # in flight until reported: an abort sends a cancel
        self.counters.load_blocks += len(blocks)

    # ---- per step ----
    def plan(self, scheduled: list[Scheduled], boundary: dict | None = None) -> StepPlan:
        """This step's loads and cancellations (always delivered) and saves (best effort:
        a store error drops a request's saves of this step, never the step, never another
        request's). `boundary`: vLLM's recurrent-state checkpoints written this step,
        {req_id: [(group, block id, tokens)]}. Never raises: if the step's own work raises,
        step_failed (its saves dropped, its loads recomputed).

        Two phases: first the bookkeeping of every scheduled request (its block tables, the
        next block to save), with no store call; then the store: reservations request by
        request, each yielding its save jobs or giving back what it reserved."""
        plan = self._queued()
        if self.disabled:
            return plan
        try:
            wanted = {}
            if self.saves:  # (kv_consumer: nothing is saved, so nothing to track)
                own_cache = self.admission.sketch is not None
                wanted = self.known.track(scheduled, boundary, self.save_generated, own_cache)
            self.saving.reserve(plan, wanted, self.breaker, self.admission)
        except Exception:
            self.error("planning a step (its saves are dropped, its loads recomputed)")
            self.step_failed(plan)
        return plan

    def fail_step(self) -> StepPlan:
        """The connector's step work raised before plan() could run: this step's plan with
        its queued loads failed (reported to vLLM as failed: recomputed), its cancels and
        reset. Never raises (the caller counted the error)."""
        plan = self._queued()
        self.step_failed(plan)
        return plan

    def _queued(self) -> StepPlan:
        plan = StepPlan(loads=self._new_loads, cancel=self._cancel, reset=self._reset_workers)
        self._new_loads, self._cancel, self._reset_workers = [], [], False
        return plan

    def step_failed(self, plan: StepPlan) -> None:
        """The step's work raised: its saves are dropped (their reservations given back) and
        each of its loads is replaced by one with nothing to read under the same job id, so
        the workers report it finished, every block failed (vLLM recomputes it), exactly once;
        its pins stay until then, its bucket-tier reservations go back now. Never raises."""
        saves, plan.saves = plan.saves, []
        for t in saves:
            try:
                self.jobs.forget(t.job)
            except Exception:
                log.warning("aiokv: giving back the reservations of a dropped save failed", exc_info=True)
        failed = []
        for t in plan.loads:
            failed.append(Transfer(t.req_id, [], [], list(t.block_ids), t.group, job=t.job))
            self.known.no_hits.add(t.req_id)
            try:
                self.jobs.forget(t.job)  # (its pins: until vLLM reports the request finished)
            except Exception:
                log.warning("aiokv: giving back a failed load's bucket reservations failed", exc_info=True)
        plan.loads = failed

    def error(self, what: str) -> None:
        """aiokv's own work raised in one of vLLM's calls (`what`); call from the except
        block. Counted (hook_errors); the first of each `what` is logged with its traceback,
        the others only counted. Never raises."""
        self.counters.hook_errors += 1
        if what not in self._logged:
            self._logged.add(what)
            log.exception(
                "aiokv: %s failed; vLLM goes on without it; further failures of it are counted "
                "(vllm:aiokv_scheduler_errors), not logged",
                what,
            )

    def on_report(self, report: WorkerReport | None, finished_recving) -> None:
        """The workers' report: its bookkeeping whole first, then the store calls, each on
        its own (one that raises loses only its own blocks: a commit that fails gives its
        slots back)."""
        for req_id in finished_recving or ():
            if self.layerwise and req_id in self.known.reqs:
                self.known.staged.add(req_id)
        if report is not None:
            self.breaker.record(report.counters)
            self.counters.breaker_opens = self.breaker.opens
            if report.disabled and not self.disabled:
                self.disabled = True
                log.error("aiokv: a worker is disabled; aiokv stops offering hits and saving")
        failed, missing = self.jobs.on_report(report, finished_recving)
        self.known.no_hits.update(r for r in failed if r in self.known.reqs)
        if self.bucket is not None:
            for gi, key in missing:
                self.bucket.missing(gi, key)  # a bucket block that failed: not offered for a while

    def lost_report(self, report: WorkerReport | None, finished_recving) -> None:
        """on_report raised (the caller counted it): what the report held is given up, so
        nothing waits for it for ever. Its saves' slots go back (dropped saves), and the
        requests vLLM reported finished loading give back their pins. Never raises."""
        self.jobs.lost(report, finished_recving)

    def new_epoch(self) -> None:
        """The cache was reset (connector.reset_cache: the weights may have changed in
        place); the caller roots new requests' keys in a fresh epoch. Every request
        alive now computed some of its KV before the reset: it is never offered a hit
        or saved again, and its load in flight is cancelled (reported with its blocks
        failed: recomputed). The workers drop their memory tier at the next step."""
        self.retire(set(self.known.reqs) | set(self.jobs.loading))
        self.known.from_bucket.clear()
        self._reset_workers = True

    def retire(self, req_ids) -> None:
        """Requests whose KV can no longer be trusted to match their keys (a cache reset; their
        LoRA adapter's files changed while they ran): never offered a hit or saved again, their
        loads in flight cancelled (reported with their blocks failed: recomputed)."""
        loading = self.jobs.loading
        for r in req_ids:
            self.known.retire(r)
            if r in loading and r not in self._cancel:
                self._cancel.append(r)

    def finished(self, req_id: str) -> bool:
        """The request is gone from vLLM. Returns whether to delay freeing its blocks: never.
        Its cancel first: the one part vLLM's blocks depend on."""
        if req_id in self.jobs.loading:
            self._cancel.append(req_id)  # vLLM keeps its blocks until we report the load
            self.counters.loads_cancelled += 1
        elif req_id in self.known.staged:
            self._cancel.append(req_id)  # its blocks are vLLM's to reuse: never copy into them
        self.known.forget(req_id)
        self.index_wait.finished(req_id)
        if self.bucket is not None:
            self.bucket.forget(req_id)
        return False

    def close(self) -> None:
        """Commit saves whose reports can no longer arrive (the workers are gone)
        if their blocks verify on disk; give the other reservations back. Never raises."""
        self.jobs.close()
        try:
            self.store.close()
        except Exception:
            log.exception("aiokv: closing the store failed")
        if self.bucket is not None:
            self.bucket.close()

    @property
    def pending_saves(self) -> int:
        return self.jobs.pending

    @property
    def loads_in_flight(self) -> int:
        """Requests whose load the workers have not reported finished yet."""
        return len(self.jobs.loading)

    @property
    def give_backs_pending(self) -> int:
        """Give-backs the store refused, made again at the next step."""
        return len(self.jobs.later)

    @property
    def requests(self) -> dict[str, Req]:
        """What is known of each request alive (read-only for callers: the KV events' labels)."""
        return self.known.reqs

    @property
    def active_requests(self) -> int:
        return len(self.known.reqs)
