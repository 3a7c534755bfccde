# SPDX-License-Identifier: Apache-2.0
"""What the scheduler side knows of each request alive: its keys and block tables
(state.Req), its tenant, its last match (local blocks, the bucket tier's span), and
the marks that bar it from hits (a failed load) or saves (alive at a cache reset);
and the first phase of a step's plan: every scheduled request's bookkeeping, with
no store call (plan.track). SchedulerSide holds one and forwards to it.

Threading contract: the EngineCore scheduler thread only (SchedulerSide's caller).
"""

from __future__ import annotations

import logging

from aiokv.scheduler import plan as planning
from aiokv.scheduler.state import Group, Req, Scheduled

log = logging.getLogger("aiokv")


class Requests:
    """The requests alive, by id, and their marks. No store call, no I/O.
    Threading contract: the EngineCore scheduler thread only."""

    def __init__(self, groups: list[Group], block_size: int):
        self.groups = groups
        self.bs = block_size
        self.reqs: dict[str, Req] = {}
        self.described: dict[str, tuple[str, bool]] = {}  # req -> (tenant, pin): describe()
        self.local_blocks: dict[str, int] = {}  # from the last match, used by on_alloc
        self.from_bucket: dict[str, tuple[int, int]] = {}  # req -> blocks [start, end) from the bucket tier
        # requests whose load failed: vLLM recomputes them, and must not be offered
        # the same hit again (a slow disk would make it wait and fail forever)
        self.no_hits: set[str] = set()
        # requests alive at a cache reset (new_epoch): some of their KV is the old weights'; never saved
        self.stale: set[str] = set()
        # layerwise loads (worker/layerwise.py): a load reported finished may still sit in
        # staging, copied in at the workers' next step; until the request ends, its end
        # is sent as a cancel so that its blocks, once vLLM frees them, are never written
        self.staged: set[str] = set()

    def describe(self, req_id: str, tenant: str = "", pin: bool = False) -> None:
        """A request's tenant and pin, before its first match (SchedulerSide.describe). Never raises."""
        try:
            self.described[req_id] = (str(tenant or ""), bool(pin))  # (registered at its first commit)
        except Exception:
            log.exception('aiokv: naming request %s\'s tenant failed; its blocks count as the tenant ""', req_id)

    def state(self, req_id: str, tokens, root: bytes) -> Req:
        """The request's Req, made anew at its first call or under a new key root."""
        st = self.reqs.get(req_id)
        if st is None or st.root != root:
            n = len(self.groups)
            tenant, pin = self.described.get(req_id, ("", False))
            st = self.reqs[req_id] = Req(
                tokens,
                root,
                block_ids=[[] for _ in range(n)],
                next_save=[0] * n,
                prompt=len(tokens),
                tenant=tenant,
                pin=pin,
            )
        st.tokens = tokens
        return st

    def track(
        self, scheduled: list[Scheduled], boundary: dict | None, generated: bool, own_cache: bool
    ) -> dict[str, list[tuple[int, list[bytes], list[int]]]]:
        """A step's first phase: every scheduled request's block tables and the blocks it
        wants saved, {req_id: [(group, keys, block ids)]}; `boundary`: vLLM's recurrent-state
        checkpoints of the step. A request whose tracking raised is left out."""
        wanted: dict[str, list[tuple[int, list[bytes], list[int]]]] = {}
        for s in scheduled:
            self._track(s, wanted, generated, own_cache)
        for req_id, items in (boundary or {}).items():
            self._track_states(req_id, items, wanted, generated)
        return wanted

    def _track(self, s: Scheduled, wanted: dict, generated: bool, own_cache: bool) -> None:
        st = self.reqs.get(s.req_id)
        if st is None or s.req_id in self.stale:  # alive at a cache reset: never saved again
            return
        try:
            planning.track(st, s, self.groups, self.bs, wanted, generated, own_cache=own_cache)
        except Exception:
            # its tables can no longer be trusted: never saved from them (a resumed life starts anew)
            log.exception("aiokv: tracking request %s failed; its blocks are not saved", s.req_id)
            self.reqs.pop(s.req_id, None)
            wanted.pop(s.req_id, None)

    def _track_states(self, req_id: str, items, wanted: dict, generated: bool) -> None:
        st = self.reqs.get(req_id)
        if st is None or req_id in self.stale:
            return
        try:
            planning.track_states(st, req_id, items, self.groups, self.bs, wanted, generated)
        except Exception:
            log.exception("aiokv: reading the state checkpoints of request %s failed; they are not saved", req_id)

    def retire(self, req_id: str) -> None:
        """Never offered a hit or saved again (SchedulerSide.retire)."""
        self.stale.add(req_id)
        self.no_hits.add(req_id)
        self.from_bucket.pop(req_id, None)

    def forget(self, req_id: str) -> None:
        """The request is gone from vLLM: nothing of it stays."""
        self.staged.discard(req_id)
        self.reqs.pop(req_id, None)
        self.described.pop(req_id, None)
        self.local_blocks.pop(req_id, None)
        self.no_hits.discard(req_id)
        self.stale.discard(req_id)
        self.from_bucket.pop(req_id, None)
