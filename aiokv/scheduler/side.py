"""The scheduler side: keys, the index of committed blocks, and per-request
load/save intents. Runs in vLLM's EngineCore process; imports no vLLM.

Rules it keeps (docs/design.md):
- A hit is the longest run of full blocks, capped so at least one token is left
  to compute, for which every KV-cache group has what vLLM will load: every
  block for full attention, the blocks inside the window that ends at the hit
  for sliding-window groups, the state checkpoint at the hit's end for
  recurrent-state groups (aiokv/scheduler/layout.py). `match` has no side effects beyond
  memoising the request's keys; vLLM may call it many times.
- A load is one explicit Transfer (keys, slots, block ids) per group built once
  at allocation from the block ids vLLM allocated (null blocks are skipped); its keys are pinned (not evictable) until the workers report the
  request in finished_recving, whatever happened to the request meanwhile.
- A block is saved only when all its tokens were computed in the current life
  of the request (blocks from before a preemption, a local prefix hit or a load
  are never re-saved from a rebuilt table), and committed only after every rank
  reported it written.
- Blocks are never held after a request finishes: the workers copy a step's
  blocks out before the step ends (see worker/device.py), so request_finished
  never delays a free.
- A store call that raises changed nothing (the store's contract), and never
  leaves the bookkeeping here half done: on_alloc builds every group's
  transfer and pins before it commits any; plan() updates every scheduled
  request's block tables before its first store call, then reserves request
  by request (all of a request's slots, or none); what must be given back
  (unpins, aborted reservations, drops) and could not be is tried again at
  the next step (_give_back), so nothing stays pinned or pending.

Threading contract: one thread, the EngineCore scheduler thread.
"""
from __future__ import annotations

import dataclasses
import logging

from aiokv.util.breaker import Breaker
from aiokv.jobs import StepPlan, Transfer, WorkerReport
from aiokv.scheduler.keys import extend_keys
from aiokv.scheduler.layout import FULL, STATE, GroupSpec
from aiokv.store import Store
from aiokv.store.index import Namespace

log = logging.getLogger("aiokv")


@dataclasses.dataclass
class Scheduled:
    """One request in this step's SchedulerOutput, as plain data."""

    req_id: str
    num_computed: int         # tokens computed before this step
    num_scheduled: int        # tokens computed in this step (spec tokens excluded)
    block_ids: tuple[list[int], ...] | None  # per group; new/resumed: whole tables; running: appended ids
    replace: bool             # True: block_ids are the whole tables (new or resumed request)


@dataclasses.dataclass
class _Group:
    spec: GroupSpec
    ns: Namespace


@dataclasses.dataclass
class _Req:
    tokens: object            # the live token list of the request (prompt + output)
    root: bytes
    keys: list[bytes] = dataclasses.field(default_factory=list)
    block_ids: list[list[int]] = dataclasses.field(default_factory=list)  # per group
    next_save: list[int] = dataclasses.field(default_factory=list)  # per group: first block not yet considered


@dataclasses.dataclass
class SchedulerCounters:
    hit_requests: int = 0
    hit_blocks: int = 0
    hit_tokens: int = 0
    load_blocks: int = 0      # blocks in the loads of every KV-cache group (hit_blocks when there is one)
    saves_planned: int = 0
    saves_committed: int = 0
    save_failures: int = 0
    load_bad_blocks: int = 0
    loads_cancelled: int = 0
    breaker_opens: int = 0
    saves_skipped_breaker: int = 0
    remote_hit_blocks: int = 0


class SchedulerSide:
    def __init__(self, store: Store, groups: "list[tuple[GroupSpec, Namespace]] | Namespace", block_size: int,
                 breaker: Breaker | None = None):
        if isinstance(groups, Namespace):  # one full-attention group
            groups = [(GroupSpec(0, FULL, groups.payload_bytes, ()), groups)]
        self.store = store
        self.breaker = breaker or Breaker()  # a sick disk: no hits or saves for a while (breaker.py)
        self.groups = [_Group(spec, ns) for spec, ns in groups]
        self.ns = self.groups[0].ns
        self.bs = block_size
        self._full = [g for g in self.groups if g.spec.kind == FULL]
        self._partial = [g for g in self.groups if g.spec.kind != FULL]
        self.counters = SchedulerCounters()
        self._reqs: dict[str, _Req] = {}
        self._local_blocks: dict[str, int] = {}        # from the last match, used by on_alloc
        self._new_loads: list[Transfer] = []
        self._loading: dict[str, list[tuple[int, list[bytes]]]] = {}  # req -> pinned (group, keys)
        self._cancel: list[str] = []
        # (group, key) -> (slot, ranks reported, ranks that failed); a reservation a rank failed is
        # given back only once every rank has reported (another rank may still be writing the
        # slot, and its report must not meet a newer reservation there)
        self._saving: dict[tuple[int, bytes], tuple[int, set[int], set[int]]] = {}
        # requests whose load failed: vLLM recomputes them, and must not be offered
        # the same hit again (a slow disk would make it wait and fail forever)
        self._no_hits: set[str] = set()
        # requests alive at a cache reset (new_epoch): some of their KV is the old weights'; never saved
        self._stale: set[str] = set()
        self._reset_workers = False  # the next plan tells the workers to drop their memory tier
        self.disabled = False  # a worker could not start: no hits, no saves from now on
        self._saves_allowed = True  # the breaker's word for this step's saves
        self.saves = True  # False: this engine saves nothing (kv_role kv_consumer; set by the connector)
        # the shared tier's lookups (aiokv/bucket/lookup.py), set by the connector; None: no shared tier
        self.shared = None
        self._remote: dict[str, tuple[int, int]] = {}  # req -> blocks [start, end) from the shared tier
        self._from_shared: set[tuple[int, bytes]] = set()  # (group, key) reserved for a load from it
        # layerwise loads (worker/layerwise.py): a load reported finished may still sit in
        # staging, copied in at the workers' next step; until the request ends, its end
        # is sent as a cancel so that its blocks, once vLLM frees them, are never written
        self.layerwise = False
        self._staged: set[str] = set()
        self._give_back_later: list[tuple] = []  # store calls that raised, tried again at the next step

    # ---- matching and allocation ----
    def _state(self, req_id: str, tokens, root: bytes) -> _Req:
        st = self._reqs.get(req_id)
        if st is None or st.root != root:
            n = len(self.groups)
            st = self._reqs[req_id] = _Req(tokens, root, block_ids=[[] for _ in range(n)], next_save=[0] * n)
        st.tokens = tokens
        return st

    def match(self, req_id: str, tokens, root: bytes, num_computed: int) -> int | None:
        """External hit tokens beyond the num_computed local ones (block multiple);
        None: the shared tier has not answered yet (vLLM asks again next step)."""
        if req_id in self._no_hits or self.disabled or not self.breaker.allow_hit(len(self._loading)):
            return 0
        st = self._state(req_id, tokens, root)
        usable = (len(tokens) - 1) // self.bs
        extend_keys(st.keys, root, tokens, self.bs, usable)
        local = num_computed // self.bs
        hit = self._hit(st.keys, usable, local)
        if self.shared is not None and not self._partial:
            hit = self._shared_hit(req_id, st.keys, max(hit, local), usable)
            if hit is None:
                return None
        self._local_blocks[req_id] = local
        return (hit - local) * self.bs if hit > local else 0

    def shared_hit_tokens(self, req_id: str, num_external: int) -> int:
        """Tokens of the hit just matched (num_external beyond the local ones) that the shared
        tier serves; call before on_alloc (which consumes the match)."""
        span = self._remote.get(req_id) if num_external > 0 else None
        if span is None:
            return 0
        local = self._local_blocks.get(req_id, 0)
        lo, hi = max(span[0], local), min(span[1], local + num_external // self.bs)
        return max(0, hi - lo) * self.bs

    def _shared_hit(self, req_id: str, keys: list[bytes], start: int, usable: int) -> int | None:
        """The hit extended past `start` by what the shared tier holds; None: not known yet."""
        more = self.shared.extend(req_id, keys, start, usable)
        if more is None:
            return None
        for i in range(start, start + more):  # a block on its way in for another request: stop before it
            if any(keys[i] in g.ns.pending for g in self.groups):
                more = i - start
                break
        if more:
            self._remote[req_id] = (start, start + more)
        else:
            self._remote.pop(req_id, None)
        return start + more

    def _hit(self, keys: list[bytes], usable: int, local: int) -> int:
        """The longest hit (in blocks, at most `usable`) every group can serve, or 0."""
        hi = usable
        for g in self._full:  # keys may run past usable (decode)
            hi = self.store.lookup(g.ns, keys, hi)
        if not self._partial:
            return hi
        for h in range(hi, local, -1):  # the hit falls back to an earlier window end / checkpoint
            if all(self._serves(g, keys, h, local) for g in self._partial):
                return h
        return 0

    def _serves(self, g: _Group, keys: list[bytes], h: int, local: int) -> bool:
        entries = g.ns.entries
        first = max(g.spec.first_needed_block(h, self.bs), local)
        return all(keys[i] in entries for i in range(first, h))

    def on_alloc(self, req_id: str, tokens, root: bytes, block_ids: tuple[list[int], ...], num_external: int) -> None:
        """One Transfer per group for the hit vLLM allocated, queued with its pins all
        together; if anything raises, nothing of it stays (pins and reservations are given
        back) and the exception goes to the caller (the connector then calls fail_load)."""
        st = self._state(req_id, tokens, root)
        if num_external <= 0:
            return
        local = self._local_blocks.get(req_id, 0)
        n = num_external // self.bs
        remote = self._remote.pop(req_id, None)
        transfers, pinned, reserved = [], [], []
        try:
            for gi, g in enumerate(self.groups):
                ids = block_ids[gi]
                if g.spec.kind == STATE:  # only the state at the hit's end is read by vLLM
                    idx = [local + n - 1]
                else:  # null blocks (before a window) are neither needed nor written
                    idx = [i for i in range(local, min(local + n, len(ids))) if ids[i] != 0]
                keys = [st.keys[i] for i in idx]
                blocks = [ids[i] if i < len(ids) else 0 for i in idx]
                slots = self.store.pin(g.ns, keys)
                pinned.append((gi, [k for k, s in zip(keys, slots) if s is not None]))
                from_shared = self._reserve_remote(gi, idx, keys, slots, remote, reserved) if remote else []
                # a key gone since match, or no block to load into, cannot be loaded:
                # slot -1 makes the worker report it failed (vLLM recomputes)
                transfers.append(Transfer(req_id, keys, [-1 if s is None or b == 0 else s
                                                         for s, b in zip(slots, blocks)], blocks, gi, from_shared))
        except BaseException:
            for gi, keys in pinned:
                self._give_back(("unpin", gi, keys))
            self._abort_reserved(reserved)
            raise
        # committed together: every group's load, its pins, its shared-tier reservations
        self._new_loads += transfers
        self._loading[req_id] = pinned
        for gi, key, slot in reserved:
            self._saving[(gi, key)] = (slot, set(), set())
            self._from_shared.add((gi, key))
        self.counters.remote_hit_blocks += len(reserved)
        self.counters.load_blocks += sum(len(t.keys) for t in transfers)
        self.counters.hit_requests += 1
        self.counters.hit_blocks += n
        self.counters.hit_tokens += n * self.bs

    def _reserve_remote(self, gi: int, idx: list[int], keys: list[bytes], slots: list, remote,
                        reserved: list) -> list[bool]:
        """Blocks of `remote` (range) not stored locally get a reserved slot (in `slots`,
        and (group, key, slot) in `reserved`): the worker loads them from the shared tier
        and writes them through to it."""
        out = [False] * len(keys)
        ns = self.groups[gi].ns
        for j, i in enumerate(idx):
            if slots[j] is None and remote[0] <= i < remote[1]:
                slot = self.store.reserve(ns, keys[j])
                if slot is not None:
                    slots[j] = slot
                    out[j] = True
                    reserved.append((gi, keys[j], slot))
        return out

    def _abort_reserved(self, reserved: list[tuple[int, bytes, int]]) -> None:
        by_group: dict[int, list] = {}
        for gi, key, slot in reserved:
            by_group.setdefault(gi, []).append((key, slot))
        for gi, items in by_group.items():
            self._give_back(("abort", gi, items, False))

    def fail_load(self, req_id: str, block_ids: tuple[list[int], ...], num_external: int) -> None:
        """A load vLLM now waits for but that could not be prepared: whatever was queued
        for it is replaced by one load with no slots, so the worker reports the request
        finished, failed, exactly once. Never raises."""
        dropped = [t for t in self._new_loads if t.req_id == req_id]
        if dropped:
            self._new_loads = [t for t in self._new_loads if t.req_id != req_id]
            self.counters.load_blocks -= sum(len(t.keys) for t in dropped)
            for t in dropped:  # shared-tier reservations made for it
                mine = [(t.group, k, s) for k, s, r in zip(t.keys, t.slots, t.remote) if r
                        and self._saving.get((t.group, k), (None,))[0] == s]
                for gi, k, _ in mine:
                    del self._saving[(gi, k)]
                    self._from_shared.discard((gi, k))
                self._abort_reserved(mine)
        self._unpin_loading(req_id)
        try:
            local = self._local_blocks.get(req_id, 0)
            n = num_external // self.bs
            blocks = [b for b in block_ids[0][local:local + n] if b != 0]
        except Exception:
            blocks = []
        blocks = blocks or [0]  # no block: the connector reports it whole (failed_recving)
        self._new_loads.append(Transfer(req_id, [b"\0" * 32] * len(blocks), [-1] * len(blocks), blocks, 0))
        self._loading[req_id] = []  # in flight until reported: an abort meanwhile sends a cancel
        self.counters.load_blocks += len(blocks)

    def _unpin_loading(self, req_id: str) -> None:
        for gi, keys in self._loading.pop(req_id, None) or []:
            self._give_back(("unpin", gi, keys))

    def _give_back(self, op: tuple) -> None:
        """Give the store back a pin, a reservation or a bad key: ("unpin", group, keys),
        ("abort", group, [(key, slot)], failed), ("drop", group, [(key, slot)]). If the store
        raises, the same call is made again at the next step (plan), until it goes through."""
        try:
            kind, gi, arg = op[:3]
            ns = self.groups[gi].ns
            if kind == "unpin":
                self.store.unpin(ns, arg)
            elif kind == "abort":
                self.store.abort(ns, arg, failed=op[3])
            else:  # only where the key still sits in the slot that failed (not a newer copy)
                keys = [k for k, slot in arg if ns.entries.get(k) == slot]
                if keys:
                    self.store.drop(ns, keys)
                    self.counters.load_bad_blocks += len(keys)
        except Exception:
            log.warning("aiokv: giving the store back %s of %d block(s) failed; trying again at the next step",
                        op[0], len(op[2]), exc_info=True)
            self._give_back_later.append(op)

    # ---- per step ----
    def plan(self, scheduled: list[Scheduled], boundary: dict | None = None) -> StepPlan:
        """This step's loads and cancellations (always delivered) and saves (best effort:
        a store error drops a request's saves of this step, never the step, never another
        request's). `boundary`: vLLM's recurrent-state checkpoints written this step,
        {req_id: [(group, block id, tokens)]}.

        Two phases: first the bookkeeping of every scheduled request (its block tables, the
        next block to save), with no store call; then the store: reservations request by
        request, each yielding its transfers or giving back what it reserved."""
        plan = StepPlan(loads=self._new_loads, cancel=self._cancel, reset=self._reset_workers)
        self._new_loads, self._cancel, self._reset_workers = [], [], False
        if self.disabled:
            return plan
        wanted: dict[str, list[tuple[int, list[bytes], list[int]]]] = {}
        if self.saves:  # (kv_consumer: nothing is saved, so nothing to track)
            for s in scheduled:
                self._track(s, wanted)
            for req_id, items in (boundary or {}).items():
                self._track_states(req_id, items, wanted)
        later, self._give_back_later = self._give_back_later, []
        for op in later:
            self._give_back(op)
        for call in (self.store.flush_if_due, self.store.refresh):  # refresh: other engines' blocks become hits
            try:
                call()
            except Exception:
                log.exception("aiokv: the store's %s failed; trying again at the next step", call.__name__)
        self.breaker.file_system(self.store.stalled)  # a hung file system: no hits, no saves
        self.counters.breaker_opens = self.breaker.opens
        self._saves_allowed = self.breaker.allow_saves()
        for req_id, parts in wanted.items():
            plan.saves += self._reserve(req_id, parts)
        return plan

    def _track(self, s: Scheduled, wanted: dict) -> None:
        """Bookkeeping of one scheduled request (no store call): its block tables, and
        the blocks of full/window groups whose tokens all became computed in this life."""
        st = self._reqs.get(s.req_id)
        if st is None or s.req_id in self._stale:  # alive at a cache reset: never saved again
            return
        bs = self.bs
        try:
            if s.replace:
                # a new life: only blocks computed from here on may be saved
                st.block_ids = [list(ids) for ids in s.block_ids or ()] or [[] for _ in self.groups]
                st.next_save = [-(-s.num_computed // bs)] * len(self.groups)
            elif s.block_ids:
                for ids, new in zip(st.block_ids, s.block_ids):
                    ids.extend(new)
            full = min((s.num_computed + s.num_scheduled) // bs, len(st.tokens) // bs)
            for gi, g in enumerate(self.groups):
                if g.spec.kind == STATE:
                    continue  # states are saved from vLLM's checkpoints (_track_states)
                ids = st.block_ids[gi]
                upto = min(full, len(ids))
                if upto <= st.next_save[gi]:
                    continue
                extend_keys(st.keys, st.root, st.tokens, bs, upto)
                # a null block slid out of the window before this life computed it
                idx = [i for i in range(st.next_save[gi], upto) if ids[i] != 0]
                st.next_save[gi] = upto
                if idx:
                    wanted.setdefault(s.req_id, []).append((gi, [st.keys[i] for i in idx], [ids[i] for i in idx]))
        except Exception:
            # its tables can no longer be trusted: never saved from them (a resumed life starts anew)
            log.exception("aiokv: tracking request %s failed; its blocks are not saved", s.req_id)
            self._reqs.pop(s.req_id, None)
            wanted.pop(s.req_id, None)

    def _track_states(self, req_id: str, items, wanted: dict) -> None:
        st = self._reqs.get(req_id)
        if st is None or req_id in self._stale:
            return
        bs = self.bs
        try:
            for gi, block, tokens in items:
                if not (0 <= gi < len(self.groups)) or self.groups[gi].spec.kind != STATE or block == 0 \
                        or tokens <= 0 or tokens % bs or tokens > len(st.tokens):
                    continue
                i = tokens // bs - 1
                extend_keys(st.keys, st.root, st.tokens, bs, i + 1)
                wanted.setdefault(req_id, []).append((gi, [st.keys[i]], [block]))
        except Exception:
            log.exception("aiokv: reading the state checkpoints of request %s failed; they are not saved", req_id)

    def _reserve(self, req_id: str, parts: list[tuple[int, list[bytes], list[int]]]) -> list[Transfer]:
        """Slots for one request's blocks of this step: all of its saves, or none."""
        if not self._saves_allowed:  # the breaker is open: the disk is failing
            self.counters.saves_skipped_breaker += sum(len(keys) for _, keys, _ in parts)
            return []
        got: list[tuple[int, bytes, int, int]] = []  # (group, key, slot, block)
        try:
            for gi, keys, blocks in parts:
                ns = self.groups[gi].ns
                for key, block in zip(keys, blocks):
                    slot = self.store.reserve(ns, key)
                    if slot is not None:
                        got.append((gi, key, slot, block))
        except Exception:
            log.exception("aiokv: reserving slots failed; request %s's saves of this step are dropped", req_id)
            self._abort_reserved([(gi, k, slot) for gi, k, slot, _ in got])
            return []
        out: dict[int, Transfer] = {}
        for gi, key, slot, block in got:
            t = out.setdefault(gi, Transfer(req_id, [], [], [], gi))
            t.keys.append(key)
            t.slots.append(slot)
            t.block_ids.append(block)
            self._saving[(gi, key)] = (slot, set(), set())
        self.counters.saves_planned += len(got)
        return list(out.values())

    def on_report(self, report: WorkerReport | None, finished_recving) -> None:
        """The workers' report: its bookkeeping whole first, then the store calls, each on
        its own (one that raises loses only its own blocks: a commit that fails gives its
        slots back)."""
        for req_id in finished_recving or ():
            self._unpin_loading(req_id)
            if self.layerwise and req_id in self._reqs:
                self._staged.add(req_id)
        if report is None:
            return
        self.breaker.record(report.counters)
        self.counters.breaker_opens = self.breaker.opens
        done: dict[int, list] = {}
        failed: dict[int, list] = {}
        shared_lost: dict[int, list] = {}
        outcomes = [(r, k, s, g, True) for r, k, s, g in report.saved]
        outcomes += [(r, k, s, g, False) for r, k, s, g in report.save_failed]
        for rank, key, slot, gi, ok in outcomes:
            entry = self._saving.get((gi, key))
            if entry is None or entry[0] != slot:
                continue  # not a report of this reservation (a stale report of an older try)
            entry[1].add(rank)
            if not ok:
                entry[2].add(rank)
            if len(entry[1]) < self.groups[gi].ns.ranks:
                continue  # committed, or given back, once every rank has reported
            del self._saving[(gi, key)]
            shared = (gi, key) in self._from_shared
            self._from_shared.discard((gi, key))
            if entry[2]:
                # a shared block that did not arrive: a miss, not a failed save
                (shared_lost if shared else failed).setdefault(gi, []).append((key, slot))
            else:
                done.setdefault(gi, []).append((key, slot))
        self._no_hits.update(r for r in report.load_failed if r in self._reqs)
        if report.disabled and not self.disabled:
            self.disabled = True
            log.error("aiokv: a worker is disabled; aiokv stops offering hits and saving")
        bad: dict[int, list] = {}
        for key, slot, gi in dict.fromkeys(report.load_bad):
            if not 0 <= gi < len(self.groups):
                continue
            if self.groups[gi].ns.entries.get(key) == slot:
                bad.setdefault(gi, []).append((key, slot))
            elif self.shared is not None:
                self.shared.missing(gi, key)  # a shared block that failed: not offered for a while
        # the store
        for gi, items in done.items():
            before = self.store.stats.commits
            try:
                self.store.commit(self.groups[gi].ns, items)
            except Exception:
                log.exception("aiokv: committing %d block(s) failed; they are not stored", len(items))
                self._give_back(("abort", gi, items, True))
            self.counters.saves_committed += self.store.stats.commits - before
        for gi, items in failed.items():
            self._give_back(("abort", gi, items, True))
            self.counters.save_failures += len(items)
        for gi, items in shared_lost.items():
            self._give_back(("abort", gi, items, False))
        for gi, items in bad.items():
            self._give_back(("drop", gi, items))

    def new_epoch(self) -> None:
        """The cache was reset (connector.reset_cache: the weights may have changed in
        place); the caller roots new requests' keys in a fresh epoch. Every request
        alive now computed some of its KV before the reset: it is never offered a hit
        or saved again, and its load in flight is cancelled (reported with its blocks
        failed: recomputed). The workers drop their memory tier at the next step."""
        alive = set(self._reqs) | set(self._loading)
        self._stale |= alive
        self._no_hits |= alive
        self._cancel += [r for r in self._loading if r not in self._cancel]
        self._remote.clear()
        self._reset_workers = True

    def finished(self, req_id: str) -> bool:
        """The request is gone from vLLM. Returns whether to delay freeing its blocks: never."""
        self._reqs.pop(req_id, None)
        self._local_blocks.pop(req_id, None)
        self._no_hits.discard(req_id)
        self._stale.discard(req_id)
        self._remote.pop(req_id, None)
        if self.shared is not None:
            self.shared.forget(req_id)
        if req_id in self._loading:
            self._cancel.append(req_id)  # vLLM keeps its blocks until we report the load
            self.counters.loads_cancelled += 1
        elif req_id in self._staged:
            self._cancel.append(req_id)  # its blocks are vLLM's to reuse: never copy into them
        self._staged.discard(req_id)
        return False

    def close(self) -> None:
        """Commit saves whose reports can no longer arrive (the workers are gone)
        if their blocks verify on disk; give the other reservations back. Never raises."""
        done: dict[int, list] = {}
        lost: dict[int, list] = {}
        for (gi, key), (slot, _, failing) in self._saving.items():
            ns = self.groups[gi].ns
            try:
                ok = not failing and self.store.verify_slot(ns, key, slot)
            except Exception:
                ok = False
            (done if ok else lost).setdefault(gi, []).append((key, slot))
        self._saving.clear()
        self._from_shared.clear()
        for gi, items in done.items():
            try:
                self.store.commit(self.groups[gi].ns, items)
                self.counters.saves_committed += len(items)
            except Exception:
                log.exception("aiokv: committing saves at shutdown failed")
                lost.setdefault(gi, []).extend(items)
        later, self._give_back_later = self._give_back_later, []
        for op in later:
            self._give_back(op)
        for gi, items in lost.items():
            self._give_back(("abort", gi, items, False))
        try:
            self.store.close()
        except Exception:
            log.exception("aiokv: closing the store failed")
        if self.shared is not None:
            self.shared.close()

    @property
    def pending_saves(self) -> int:
        return len(self._saving)

    @property
    def active_requests(self) -> int:
        return len(self._reqs)
