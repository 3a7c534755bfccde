"""The scheduler side: keys, the index of committed blocks, and per-request
load/save intents. Runs in vLLM's EngineCore process; imports no vLLM.

Rules it keeps (docs/design.md):
- A hit is the run of committed keys at the start of the request's full blocks,
  capped so at least one token is left to compute. `match` has no side effects
  beyond memoising the request's keys; vLLM may call it many times.
- A load is one explicit Transfer (keys, slots, block ids) built once at
  allocation; its keys are pinned (not evictable) until the workers report the
  request in finished_recving, whatever happened to the request meanwhile.
- A block is saved only when all its tokens were computed in the current life
  of the request (blocks from before a preemption, a local prefix hit or a load
  are never re-saved from a rebuilt table), and committed only after every rank
  reported it written.
- Blocks are never held after a request finishes: the workers copy a step's
  blocks out before the step ends (see worker/device.py), so request_finished
  never delays a free.

Threading contract: one thread, the EngineCore scheduler thread.
"""
from __future__ import annotations

import dataclasses
import logging

from aiokv.breaker import Breaker
from aiokv.jobs import StepPlan, Transfer, WorkerReport
from aiokv.keys import extend_keys
from aiokv.store import Store
from aiokv.store.index import Namespace

log = logging.getLogger("aiokv")


@dataclasses.dataclass
class Scheduled:
    """One request in this step's SchedulerOutput, as plain data."""

    req_id: str
    num_computed: int         # tokens computed before this step
    num_scheduled: int        # tokens computed in this step (spec tokens excluded)
    block_ids: list[int] | None  # new requests/resumed: the whole table; running: appended ids
    replace: bool             # True: block_ids is the whole table (new or resumed request)


@dataclasses.dataclass
class _Req:
    tokens: object            # the live token list of the request (prompt + output)
    root: bytes
    keys: list[bytes] = dataclasses.field(default_factory=list)
    block_ids: list[int] = dataclasses.field(default_factory=list)
    next_save: int = 0        # first block index not yet considered for saving in this life


@dataclasses.dataclass
class SchedulerCounters:
    hit_requests: int = 0
    hit_blocks: int = 0
    hit_tokens: int = 0
    saves_planned: int = 0
    saves_committed: int = 0
    save_failures: int = 0
    load_bad_blocks: int = 0
    loads_cancelled: int = 0
    breaker_opens: int = 0
    saves_skipped_breaker: int = 0


class SchedulerSide:
    def __init__(self, store: Store, ns: Namespace, block_size: int, breaker: Breaker | None = None):
        self.store = store
        self.breaker = breaker or Breaker()  # a sick disk: no hits or saves for a while (breaker.py)
        self.ns = ns
        self.bs = block_size
        self.ranks = ns.ranks
        self.counters = SchedulerCounters()
        self._reqs: dict[str, _Req] = {}
        self._local_blocks: dict[str, int] = {}        # from the last match, used by on_alloc
        self._new_loads: list[Transfer] = []
        self._loading: dict[str, list[bytes]] = {}     # req -> pinned keys, until finished_recving
        self._cancel: list[str] = []
        self._saving: dict[bytes, tuple[int, set[int]]] = {}  # key -> (slot, ranks written)
        # requests whose load failed: vLLM recomputes them, and must not be offered
        # the same hit again (a slow disk would make it wait and fail forever)
        self._no_hits: set[str] = set()
        self.disabled = False  # a worker could not start: no hits, no saves from now on

    # ---- matching and allocation ----
    def _state(self, req_id: str, tokens, root: bytes) -> _Req:
        st = self._reqs.get(req_id)
        if st is None or st.root != root:
            st = self._reqs[req_id] = _Req(tokens, root)
        st.tokens = tokens
        return st

    def match(self, req_id: str, tokens, root: bytes, num_computed: int) -> int:
        """External hit tokens beyond the num_computed local ones (block multiple)."""
        if req_id in self._no_hits or self.disabled or not self.breaker.allow_hit(len(self._loading)):
            return 0
        st = self._state(req_id, tokens, root)
        usable = (len(tokens) - 1) // self.bs
        extend_keys(st.keys, root, tokens, self.bs, usable)
        hit = self.store.lookup(self.ns, st.keys, usable)  # keys may run past usable (decode)
        local = num_computed // self.bs
        self._local_blocks[req_id] = local
        return (hit - local) * self.bs if hit > local else 0

    def on_alloc(self, req_id: str, tokens, root: bytes, block_ids: list[int], num_external: int) -> None:
        st = self._state(req_id, tokens, root)
        if num_external <= 0:
            return
        local = self._local_blocks.get(req_id, 0)
        n = num_external // self.bs
        keys = st.keys[local:local + n]
        slots = self.store.pin(self.ns, keys)
        # a key gone since match cannot be loaded: slot -1 makes the worker report it failed
        self._new_loads.append(Transfer(req_id, keys, [-1 if s is None else s for s in slots],
                                        list(block_ids[local:local + n])))
        self._loading[req_id] = [k for k, s in zip(keys, slots) if s is not None]
        self.counters.hit_requests += 1
        self.counters.hit_blocks += n
        self.counters.hit_tokens += n * self.bs

    def fail_load(self, req_id: str, block_ids: list[int], num_external: int) -> None:
        """A load vLLM now waits for but that could not be prepared: emit it with no
        slots, so the worker reports it finished with every block failed."""
        local = self._local_blocks.get(req_id, 0)
        n = num_external // self.bs
        self._loading.pop(req_id, None)
        self._new_loads.append(Transfer(req_id, [b"\0" * 32] * n, [-1] * n, list(block_ids[local:local + n])))

    # ---- per step ----
    def plan(self, scheduled: list[Scheduled]) -> StepPlan:
        """This step's loads and cancellations (always delivered) and saves (best effort:
        a store error drops saves, never the step)."""
        plan = StepPlan(loads=self._new_loads, cancel=self._cancel)
        self._new_loads, self._cancel = [], []
        if self.disabled:
            return plan
        try:
            self.store.flush_if_due()
            self._plan_saves(scheduled, plan)
        except Exception:
            log.exception("aiokv: planning saves failed; this step's saves are dropped")
        return plan

    def _plan_saves(self, scheduled: list[Scheduled], plan: StepPlan) -> None:
        bs = self.bs
        saving = self.breaker.allow_saves()
        for s in scheduled:
            st = self._reqs.get(s.req_id)
            if st is None:
                continue
            if s.replace:
                # a new life: only blocks computed from here on may be saved
                st.block_ids = list(s.block_ids or [])
                st.next_save = -(-s.num_computed // bs)
            elif s.block_ids:
                st.block_ids.extend(s.block_ids)
            full = min((s.num_computed + s.num_scheduled) // bs, len(st.block_ids), len(st.tokens) // bs)
            if full <= st.next_save:
                continue
            extend_keys(st.keys, st.root, st.tokens, bs, full)
            keys, slots, blocks = [], [], []
            for i in range(st.next_save, full):
                slot = self.store.reserve(self.ns, st.keys[i]) if saving else None
                self.counters.saves_skipped_breaker += not saving
                if slot is not None:
                    keys.append(st.keys[i])
                    slots.append(slot)
                    blocks.append(st.block_ids[i])
                    self._saving[st.keys[i]] = (slot, set())
            st.next_save = full
            if keys:
                plan.saves.append(Transfer(s.req_id, keys, slots, blocks))
                self.counters.saves_planned += len(keys)

    def on_report(self, report: WorkerReport | None, finished_recving) -> None:
        if report is not None:
            self.breaker.record(report.counters)
            self.counters.breaker_opens = self.breaker.opens
            done = []
            for rank, key, slot in report.saved:
                entry = self._saving.get(key)
                if entry is None or entry[0] != slot:
                    continue
                entry[1].add(rank)
                if len(entry[1]) == self.ranks:
                    del self._saving[key]
                    done.append((key, slot))
            if done:
                before = self.store.stats.commits
                self.store.commit(self.ns, done)
                self.counters.saves_committed += self.store.stats.commits - before
            failed = []
            for rank, key, slot in report.save_failed:
                entry = self._saving.get(key)
                if entry is not None and entry[0] == slot:  # not a stale report of an older try
                    del self._saving[key]
                    failed.append((key, slot))
            self.store.abort(self.ns, failed)
            self.counters.save_failures += len(failed)
            self._no_hits.update(r for r in report.load_failed if r in self._reqs)
            if report.disabled and not self.disabled:
                self.disabled = True
                log.error("aiokv: a worker is disabled; aiokv stops offering hits and saving")
            if report.load_bad:
                # only where the key still sits in the slot that failed (not a newer copy)
                bad = [k for k, s in dict.fromkeys(report.load_bad) if self.ns.entries.get(k) == s]
                self.store.drop(self.ns, bad)
                self.counters.load_bad_blocks += len(bad)
        for req_id in finished_recving or ():
            keys = self._loading.pop(req_id, None)
            if keys is not None:
                self.store.unpin(self.ns, keys)

    def finished(self, req_id: str) -> bool:
        """The request is gone from vLLM. Returns whether to delay freeing its blocks: never."""
        self._reqs.pop(req_id, None)
        self._local_blocks.pop(req_id, None)
        self._no_hits.discard(req_id)
        if req_id in self._loading:
            self._cancel.append(req_id)  # vLLM keeps its blocks until we report the load
            self.counters.loads_cancelled += 1
        return False

    def close(self) -> None:
        """Commit saves whose reports can no longer arrive (the workers are gone)
        if their blocks verify on disk; give the other reservations back."""
        done, lost = [], []
        for key, (slot, _) in self._saving.items():
            (done if self.store.verify_slot(self.ns, key, slot) else lost).append((key, slot))
        self._saving.clear()
        self.store.commit(self.ns, done)
        self.store.abort(self.ns, lost, failed=False)
        self.counters.saves_committed += len(done)
        self.store.close()

    @property
    def pending_saves(self) -> int:
        return len(self._saving)

    @property
    def active_requests(self) -> int:
        return len(self._reqs)
