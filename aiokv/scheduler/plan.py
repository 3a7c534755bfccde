# SPDX-License-Identifier: Apache-2.0
"""Plans: the load jobs of a hit vLLM allocated, and each step's save jobs.

- A load is one Transfer per group, built at allocation from the block ids vLLM
  allocated (null blocks are skipped; a state group loads only the state at the
  hit's end); its keys are pinned, and blocks the bucket tier serves get a
  reserved slot the workers write through to. Every group's transfer, pin and
  reservation is built before any is kept: if anything raises, all of them are
  given back and the exception goes to the caller.
- A block is saved only when all its tokens were computed in the current life of
  the request (a resumed request starts a new life at its new num_computed,
  rounded up to a block), or, with admit: reused, when vLLM's own prefix cache gave
  it to this life; recurrent states only from vLLM's boundary checkpoints.
  Tracking (block tables, next_save) makes no store call; reserving does, request
  by request: all of a request's slots of the step, or none.
Every transfer gets its job id here, and its record in the ledger (commits.py).

Threading contract: the EngineCore scheduler thread only (through SchedulerSide).
"""

from __future__ import annotations

import logging

from aiokv.jobs import Transfer
from aiokv.scheduler.commits import Job, Ledger
from aiokv.scheduler.keys import extend_keys
from aiokv.scheduler.layout import STATE
from aiokv.scheduler.state import Group, Req, Scheduled, SchedulerCounters

log = logging.getLogger("aiokv")


def alloc(
    store,
    ledger: Ledger,
    groups: list[Group],
    st: Req,
    req_id: str,
    block_ids: tuple[list[int], ...],
    local: int,
    n: int,
    from_bucket,
) -> tuple[list[Transfer], dict[int, Job], int]:
    """The load of blocks [local, local + n): (one transfer per group, their job records,
    blocks reserved for the bucket tier). Raises with nothing of it left behind."""
    transfers, jobs, pinned, reserved = [], {}, [], []
    try:
        for gi, g in enumerate(groups):
            ids = block_ids[gi]
            if g.spec.kind == STATE:  # only the state at the hit's end is read by vLLM
                idx = [local + n - 1]
            else:  # null blocks (before a window) are neither needed nor written
                idx = [i for i in range(local, min(local + n, len(ids))) if ids[i] != 0]
            keys = [st.keys[i] for i in idx]
            blocks = [ids[i] if i < len(ids) else 0 for i in idx]
            slots = store.pin(g.ns, keys)
            if st.pin:  # a pinned request's hit: its blocks stay (within request_pins: store/pins.py)
                store.pin_blocks(g.ns, [k for k, s in zip(keys, slots) if s is not None], request=True)
            pinned.append((gi, [k for k, s in zip(keys, slots) if s is not None]))
            first = len(reserved)
            bucket_flags = (
                reserve_from_bucket(store, g, gi, idx, keys, slots, from_bucket, reserved, st.tenant)
                if from_bucket
                else []
            )
            mine = reserved[first:]
            # a key gone since match, or no block to load into, cannot be loaded:
            # slot -1 makes the worker report it failed (vLLM recomputes)
            t = Transfer(
                req_id,
                keys,
                [-1 if s is None or b == 0 else s for s, b in zip(slots, blocks)],
                blocks,
                gi,
                bucket_flags,
                job=ledger.new_id(),
                tenant=store.tag(st.tenant) if st.tenant else b"",  # (its write-through's)
            )
            transfers.append(t)
            jobs[t.job] = Job(
                req_id,
                gi,
                pinned=pinned[-1][1],
                read=dict(zip(t.keys, t.locations)),
                saving={k: (s, set(), set()) for _, k, s in mine},
                from_bucket=True,
                tenant=st.tenant,
                pin=st.pin,
            )
    except BaseException:
        for gi, keys in pinned:
            ledger.give_back(("unpin", gi, keys))
        ledger.abort_reserved(reserved)
        raise
    return transfers, jobs, len(reserved)


def reserve_from_bucket(
    store, g: Group, gi: int, idx: list[int], keys: list[bytes], slots: list, span, reserved: list, tenant: str = ""
) -> list[bool]:
    """Blocks of `span` (a range) not stored locally get a reserved slot (in `slots`,
    and (group, key, slot) in `reserved`): the worker loads them from the bucket tier
    and writes them through to it."""
    out = [False] * len(keys)
    for j, i in enumerate(idx):
        if slots[j] is None and span[0] <= i < span[1]:
            slot = store.reserve(g.ns, keys[j], tenant)
            if slot is not None:
                slots[j] = slot
                out[j] = True
                reserved.append((gi, keys[j], slot))
    return out


NEVER = 1 << 62  # Req.due of a request with nothing more to track but new blocks (states only, prompt saved)


def track(
    st: Req, s: Scheduled, groups: list[Group], bs: int, wanted: dict, generated: bool = True, own_cache: bool = False
) -> None:
    """Bookkeeping of one scheduled request (no store call): its block tables, and
    the blocks of full/window groups whose tokens all became computed in this life
    (into wanted[req_id]: (group, keys, block ids)). Raises if the tables cannot be trusted.
    own_cache (admit: reused): a new life also offers the blocks vLLM's own prefix cache gave it
    (st.own_cache, never the blocks loaded from aiokv after them): the request that computed them
    met their keys first and was not admitted, so without this a block every request shares (a
    system prompt) would never be written."""
    if s.replace:
        # a new life: only blocks computed from here on may be saved
        st.block_ids = [list(ids) for ids in s.block_ids or ()] or [[] for _ in groups]
        st.next_save = [-(-s.num_computed // bs)] * len(groups)
        cached, st.own_cache = min(st.own_cache, s.num_computed // bs), -1
        if own_cache and cached > 0:
            if not generated:
                cached = min(cached, st.prompt // bs)
            extend_keys(st.keys, st.root, st.tokens, bs, cached)
            for gi, g in enumerate(groups):
                ids = st.block_ids[gi]
                idx = [i for i in range(min(cached, len(ids))) if ids[i] != 0] if g.spec.kind != STATE else []
                if idx:
                    wanted.setdefault(s.req_id, []).append((gi, [st.keys[i] for i in idx], [ids[i] for i in idx]))
    elif s.block_ids:
        for ids, new in zip(st.block_ids, s.block_ids):
            ids.extend(new)
    full = min((s.num_computed + s.num_scheduled) // bs, len(st.tokens) // bs)
    if not generated:  # save_generated off: the prompt's blocks only
        full = min(full, st.prompt // bs)
    for gi, g in enumerate(groups):
        if g.spec.kind == STATE:
            continue  # states are saved from vLLM's checkpoints (track_states)
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
    # below st.due, with no new block, a next call changes nothing (the connector skips it)
    nexts = [n for n, g in zip(st.next_save, groups) if g.spec.kind != STATE]
    st.due = (min(nexts) + 1) * bs if nexts and (generated or min(nexts) < st.prompt // bs) else NEVER


def track_states(
    st: Req, req_id: str, items, groups: list[Group], bs: int, wanted: dict, generated: bool = True
) -> None:
    """vLLM's recurrent-state checkpoints of this step, [(group, block id, tokens)], into wanted."""
    for gi, block, tokens in items:
        if (
            not (0 <= gi < len(groups))
            or groups[gi].spec.kind != STATE
            or block == 0
            or tokens <= 0
            or tokens % bs
            or tokens > len(st.tokens)
            or not generated
            and tokens > st.prompt
        ):
            continue
        i = tokens // bs - 1
        extend_keys(st.keys, st.root, st.tokens, bs, i + 1)
        wanted.setdefault(req_id, []).append((gi, [st.keys[i]], [block]))


def reserve(
    store,
    ledger: Ledger,
    groups: list[Group],
    counters: SchedulerCounters,
    req_id: str,
    parts: list[tuple[int, list[bytes], list[int]]],
    tenant: str = "",
    pin: bool = False,
) -> list[Transfer]:
    """Slots for one request's blocks of this step (of its `tenant`, pinned if `pin`): all of
    its save jobs, or none."""
    got: list[tuple[int, bytes, int, int]] = []  # (group, key, slot, block)
    try:
        for gi, keys, blocks in parts:
            ns = groups[gi].ns
            if pin:  # those stored already (by an earlier request, another engine) are pinned now
                store.pin_blocks(ns, keys, request=True)
            for key, block in zip(keys, blocks):
                slot = store.reserve(ns, key, tenant)
                if slot is not None:
                    got.append((gi, key, slot, block))
    except Exception:
        log.exception("aiokv: reserving slots failed; request %s's saves of this step are dropped", req_id)
        ledger.abort_reserved([(gi, k, slot) for gi, k, slot, _ in got])
        return []
    out: dict[int, Transfer] = {}
    tag = store.tag(tenant) if tenant else b""
    for gi, key, slot, block in got:
        t = out.get(gi)
        if t is None:
            t = out[gi] = Transfer(req_id, [], [], [], gi, job=ledger.new_id(), tenant=tag)
        t.keys.append(key)
        t.locations.append(slot)
        t.block_ids.append(block)
    for t in out.values():
        ledger.add_save(t.job, req_id, t.group, list(zip(t.keys, t.locations)), tenant, pin)
    counters.saves_planned += len(got)
    return list(out.values())
