# SPDX-License-Identifier: Apache-2.0
"""Requests' key roots: each request's root (its namespace and extras, the reset epoch),
kept for its life, and the requests whose LoRA adapter has no fingerprint yet.

- `of(request)`: the request's root, or None while its adapter is not fingerprinted
  (adapters.py: before the first look at its files, or while changed files are hashed
  again) and for a retired request.
- A request allocated with no root (`wait`) is a miss that saves nothing yet; at each
  step (`rooted`, before the step is planned) it is given its root once the fingerprint
  is known: its state is made then (SchedulerSide.on_alloc, no hit), so it saves nothing
  before. Where every KV-cache group is full attention, the blocks it computed before in
  this life (still its own in vLLM's cache: full attention frees none while a request
  runs; not those vLLM's own prefix cache gave it, which aiokv never saves unasked) are
  saved at that step too, else only those it computes from then on (a sliding window may
  have freed earlier ones).
- When a look sees an adapter's files change (`poll`), the requests keyed by its old
  fingerprint are retired: they never hit or save again (SchedulerSide.retire; their KV
  may be the old adapter's or the new one's: vLLM's to say, not the files').
- `reset` (reset_cache): a fresh random epoch; requests alive then, waiting ones too,
  never save again.

Threading contract: the EngineCore scheduler thread only (the connector's hooks).
"""

from __future__ import annotations

import os

from aiokv.connector.namespace import request_extras
from aiokv.scheduler.keys import request_root
from aiokv.scheduler.layout import FULL
from aiokv.scheduler.state import Scheduled


class Roots:
    def __init__(self, nsid: bytes, adapters):
        self.nsid, self.adapters = nsid, adapters
        # set by reset: bound into every root, random, so never the epoch of another life or
        # reset (None: the weight files' own blocks)
        self.epoch: str | None = None
        self._of: dict[str, tuple[int, bytes, object]] = {}  # request -> (mm inputs seen, root, its adapter)
        self.waiting: dict[str, list] = {}  # request -> [vLLM's Request, its block ids per group]
        self.retired: set[str] = set()  # requests never given a root again

    def of(self, request) -> bytes | None:
        # a streaming-input session keeps its id but may gain multimodal inputs: a new root then
        n = len(request.mm_features or ())
        got = self._of.get(request.request_id)
        if got is None or got[0] != n:
            if request.request_id in self.retired:
                return None
            extras = request_extras(request, self.adapters)
            if extras is None:
                return None
            if self.epoch is not None:
                extras.append(["epoch", self.epoch])
            lora = request.lora_request
            got = self._of[request.request_id] = (n, request_root(self.nsid, extras), lora)
        return got[1]

    def wait(self, request, block_ids) -> bool:
        """An allocation with no root: it waits for its adapter's fingerprint (True), unless retired."""
        if request.request_id in self.retired:
            return False
        self.waiting[request.request_id] = [request, [list(ids) for ids in block_ids], None]
        return True

    def allocated(self, req_id: str) -> None:
        """An allocation with a root: it waits no more."""
        self.waiting.pop(req_id, None)

    def poll(self, side) -> None:
        """The adapters' finished looks; the requests keyed by an adapter's old files are retired."""
        changed = self.adapters.poll()
        if not changed:
            return
        gone = [
            r
            for r, (_, _, lora) in self._of.items()
            if lora is not None and getattr(lora, "lora_path", None) in changed
        ]
        for r in gone:
            del self._of[r]
        self.retired.update(gone)
        side.retire(gone)

    def rooted(self, items: list[Scheduled], side) -> list[Scheduled]:
        """This step's items, a waiting request's block ids kept up to date; one whose root is now
        known gets its state (no hit) and its item becomes a new life that saves from here (with
        only full-attention groups, also the blocks it computed before)."""
        if not self.waiting:
            return items
        every_full = all(g.spec.kind == FULL for g in side.groups)
        out = []
        for s in items:
            w = self.waiting.get(s.req_id)
            if w is None:
                out.append(s)
                continue
            if s.replace:  # new or resumed: the whole tables, and what vLLM's own cache gave this life
                w[1], w[2] = [list(ids) for ids in s.block_ids or ()], s.num_computed
            elif s.block_ids:
                for ids, new in zip(w[1], s.block_ids):
                    ids.extend(new)
            root = self.of(w[0])
            if root is None:
                out.append(s)
                continue
            del self.waiting[s.req_id]
            tables = tuple(list(ids) for ids in w[1])
            side.on_alloc(s.req_id, w[0].all_token_ids, root, tables, 0)
            st = side.requests.get(s.req_id)  # (made now: its tokens already hold some output)
            if st is not None:
                st.prompt = min(st.prompt, w[0].num_prompt_tokens)
            if every_full:  # what this life computed so far counts as this step's: saved now
                first = s.num_computed if w[2] is None else w[2]  # (never vLLM's own cached blocks)
                out.append(Scheduled(s.req_id, first, s.num_computed + s.num_scheduled - first, tables, True))
            else:
                out.append(Scheduled(s.req_id, s.num_computed, s.num_scheduled, tables, True))
        return out

    def reset(self) -> None:
        """A new epoch: no request alive now is given a root again."""
        self.epoch = os.urandom(16).hex()
        self._of.clear()
        self.retired.update(self.waiting)
        self.waiting.clear()

    def finished(self, req_id: str) -> None:
        self._of.pop(req_id, None)
        self.waiting.pop(req_id, None)
        self.retired.discard(req_id)
