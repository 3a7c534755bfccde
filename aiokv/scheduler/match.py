# SPDX-License-Identifier: Apache-2.0
"""Hits: how many blocks of a request every KV-cache group can serve.

A hit is the longest run of full blocks, capped so at least one token is left to
compute, for which every group has what vLLM will load: every block for full
attention, the blocks inside the window that ends at the hit for sliding-window
groups, the state checkpoint at the hit's end for recurrent-state groups
(aiokv/scheduler/layout.py); the bucket tier may extend a full-attention hit
(docs/sharing.md). Lookups only: no side effects on the store.

Threading contract: the EngineCore scheduler thread only (through SchedulerSide).
"""

from __future__ import annotations

from aiokv.scheduler.state import Group


def hit(store, full: list[Group], partial: list[Group], keys: list[bytes], usable: int, local: int, bs: int) -> int:
    """The longest hit (in blocks, at most `usable`) every group can serve, or 0."""
    hi = usable
    for g in full:  # keys may run past usable (decode)
        hi = store.lookup(g.ns, keys, hi)
    if not partial:
        return hi
    # only blocks the store serves now (several drives: none from a drive whose breaker is open),
    # asked once per group for the blocks past `local`
    views = [(g, store.served(g.ns, keys[local:hi])) for g in partial]
    for h in range(hi, local, -1):  # the hit falls back to an earlier window end / checkpoint
        if all(serves(g, held, h, local, bs) for g, held in views):
            return h
    return 0


def serves(g: Group, held: list[bool], h: int, local: int, bs: int) -> bool:
    """Whether `held` (whether each block from `local` on is served now: store.served) has every
    block group g loads for a hit of h."""
    first = max(g.spec.first_needed_block(h, bs), local)
    return all(held[first - local : h - local])


def bucket_extend(
    bucket, groups: list[Group], req_id: str, keys: list[bytes], start: int, usable: int
) -> tuple[int, tuple[int, int] | None] | None:
    """The hit extended past `start` by what the bucket tier holds, with the span of
    blocks it serves (None: none); None: the bucket tier has not answered yet."""
    more = bucket.extend(req_id, keys, start, usable)
    if more is None:
        return None
    for i in range(start, start + more):  # a block on its way in for another request: stop before it
        if any(g.ns.reserved(keys[i]) for g in groups):
            more = i - start
            break
    return start + more, ((start, start + more) if more else None)


def span_tokens(span: tuple[int, int] | None, local: int, num_external: int, bs: int) -> int:
    """Tokens of a hit of num_external tokens beyond `local` blocks that `span` covers."""
    if span is None or num_external <= 0:
        return 0
    lo, hi = max(span[0], local), min(span[1], local + num_external // bs)
    return max(0, hi - lo) * bs
