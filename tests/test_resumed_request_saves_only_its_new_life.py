# SPDX-License-Identifier: Apache-2.0
"""A preempted request that resumes starts a new life: its saves come from its new block table,
from the block its new life starts at (engine-free: vLLM's own SchedulerOutput records through
the scheduler-role connector and the scheduler side, over a real Store; no engine).

The bugs this pins (issue 37 item 11, each seen passing the suite when seeded on purpose):
- the resumed flag ignored (connector/scheduler_role.py): the resumed request's new table was
  appended to its first life's, and its blocks were saved from block ids that belonged to its
  first life (by then another request's, or nobody's): other tokens' KV under its keys;
- its first life's next_save kept (scheduler/plan.py track, replace=True): blocks its new life
  recomputed from before that point were never saved again, so a block whose first save failed
  stayed missing.
Invariant: a resumed request's new life saves exactly the blocks that became full in it, from
its new table: from the first block at or after its new num_computed_tokens, and nothing its
first life's table held.
"""

from __future__ import annotations

from types import SimpleNamespace

from aiokv.connector.scheduler_role import SchedulerRole
from aiokv.jobs import SaveResult, WorkerReport
from aiokv.scheduler.keys import extend_keys, request_root
from aiokv.scheduler.side import SchedulerSide
from aiokv.store import Store

BS = 4
NSID = bytes([5]) * 16


def _role(tmp_path) -> SchedulerRole:
    """The scheduler-role connector over a real store, as open() leaves it (one full-attention group)."""
    store = Store(str(tmp_path / "c"), capacity="64MiB")
    ns = store.namespace(NSID, 4096)
    names = SimpleNamespace(fields={}, groups=[], group_nsids=[NSID], nsid=NSID, block_size=BS)
    role = SchedulerRole(SimpleNamespace(fs_timeout=2.0), names, 1, False, True, "kv_both")  # (cfg: for the LoRA looks)
    role.sched = SchedulerSide(store, ns, BS)
    return role


def _step(role, new=(), cached=(), resumed=()):
    """One step's SchedulerOutput (vLLM's own records): new = [(req, block_ids, computed, scheduled)],
    cached = [(req, new block ids or None, computed, scheduled)]; returns {req: [(key, block)]} saved."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    so = SchedulerOutput.make_empty()
    for r, ids, computed, n in new:
        so.scheduled_new_reqs.append(NewRequestData(r, None, [], None, None, (list(ids),), computed, None))
        so.num_scheduled_tokens[r] = n
    c = CachedRequestData.make_empty()
    for r, ids, computed, n in cached:
        c.req_ids.append(r)
        c.new_block_ids.append(None if ids is None else (list(ids),))
        c.num_computed_tokens.append(computed)
        c.num_output_tokens.append(1)
        so.num_scheduled_tokens[r] = n
    c.resumed_req_ids = set(resumed)
    so.scheduled_cached_reqs = c
    so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
    saves = role.build_connector_meta(so).plan.saves
    return saves, {t.req_id: list(zip(t.keys, t.block_ids)) for t in saves}


def _report(role, saves, failed: bool = False) -> None:
    res = [SaveResult(t.job, 0, [] if failed else list(t.keys), list(t.keys) if failed else []) for t in saves]
    role.sched.on_report(WorkerReport(saves=res), set())


def test_a_resumed_request_saves_its_new_life_from_its_new_table(tmp_path):
    role = _role(tmp_path)
    side = role.sched
    root = request_root(NSID, [])
    tokens = list(range(3, 13))  # 10 prompt tokens: blocks 0 and 1 full
    keys = lambda n: extend_keys([], root, tokens, BS, n)  # noqa: E731
    assert side.match("R", tokens, root, 0) == 0
    side.on_alloc("R", tokens, root, ([1, 2, 3],), 0)

    # first life: the prefill saves blocks 0 and 1 (ids 1, 2); they commit
    saves, got = _step(role, new=[("R", [1, 2, 3], 0, 10)])
    assert got == {"R": list(zip(keys(2), [1, 2]))}
    _report(role, saves)
    tokens.append(50)  # decode: token 11 (block 2 not full yet)
    assert _step(role, cached=[("R", None, 10, 1)])[1] == {}
    tokens.append(51)  # token 12: block 2 (id 3) is full; its save fails
    saves, got = _step(role, cached=[("R", None, 11, 1)])
    assert got == {"R": [(keys(3)[2], 3)]}
    _report(role, saves, failed=True)
    tokens.append(52)  # token 13 goes into a new block (id 4)
    assert _step(role, cached=[("R", [4], 12, 1)])[1] == {}

    # preempted: its blocks go back to vLLM, whose prefix cache keeps blocks 0 and 1 (ids 1, 2);
    # it asks aiokv again before it resumes
    assert _step(role)[1] == {}
    assert side.match("R", tokens, root, 8) == 0  # aiokv holds blocks 0, 1 only: vLLM's own hit
    side.on_alloc("R", tokens, root, ([1, 2, 9, 10],), 0)
    # resumed at 8 computed tokens with a whole new table: its new life recomputes blocks 2 and 3;
    # block 2 became full in it and is not stored (its first save failed): saved from id 9
    saves, got = _step(role, cached=[("R", [1, 2, 9, 10], 8, 5)], resumed=["R"])
    assert got == {"R": [(keys(3)[2], 9)]}, "the new life's block 2 is saved from the new table"
    _report(role, saves)
    for computed in (13, 14):
        tokens.append(60 + computed)
        assert _step(role, cached=[("R", None, computed, 1)])[1] == {}
    tokens.append(99)  # token 16: block 3 is full, in the new table's id 10 (the first life had it in 4)
    saves, got = _step(role, cached=[("R", None, 15, 1)])
    assert got == {"R": [(keys(4)[3], 10)]}
    _report(role, saves)
    assert side.pending_saves == 0
    assert side.store.lookup(side.ns, keys(4)) == 4
    side.close()
