# SPDX-License-Identifier: Apache-2.0
"""vLLM's SchedulerOutput as plain data for the scheduler side: the Scheduled items of
a step, the recurrent-state checkpoints written in it, and whether it is decode-like.

Threading contract: the EngineCore scheduler thread only (the SchedulerRole's
build_connector_meta); a pure function of its arguments.
"""

from __future__ import annotations


def scheduled_items(scheduler_output, reqs: dict) -> tuple[list, dict | None, bool]:
    """vLLM's SchedulerOutput as plain data: (Scheduled items, the recurrent-state
    checkpoints written this step, whether every request computes one token). A running
    request with no new block whose computed tokens stay below its Req.due (`reqs`: the
    side's requests; due: where its next block fills) has nothing to track and is left out:
    a decode step costs a comparison per request, and nothing more, until a block fills."""
    from aiokv.scheduler.side import Scheduled

    spec = scheduler_output.scheduled_spec_decode_tokens or {}
    n_sched = scheduler_output.num_scheduled_tokens
    items = [
        Scheduled(
            r.req_id,
            r.num_computed_tokens,
            n_sched.get(r.req_id, 0) - len(spec.get(r.req_id, ())),
            r.block_ids,
            True,
        )
        for r in scheduler_output.scheduled_new_reqs
    ]
    c = scheduler_output.scheduled_cached_reqs
    resumed = c.resumed_req_ids or ()
    computed, new_ids = c.num_computed_tokens, c.new_block_ids
    for i, req_id in enumerate(c.req_ids):
        n = n_sched.get(req_id, 0)
        if spec:
            n -= len(spec.get(req_id, ()))
        new = new_ids[i]
        if new is None and req_id not in resumed:
            st = reqs.get(req_id)
            if st is not None and computed[i] + n < st.due:
                continue
        items.append(Scheduled(req_id, computed[i], n, new, req_id in resumed))
    state = getattr(scheduler_output, "kv_connector_block_state", None)
    boundary = state.boundary_state_offloads if state is not None else None
    if spec:
        decode_like = all(n <= 1 + len(spec.get(r, ())) for r, n in n_sched.items())
    else:
        decode_like = max(n_sched.values(), default=0) <= 1
    return items, boundary, decode_like
