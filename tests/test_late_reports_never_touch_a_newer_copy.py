# SPDX-License-Identifier: Apache-2.0
"""A report that arrives late never touches a newer reservation or a newer copy of its key.

Bug: the scheduler side acted on a worker's report by key: a save failure
reported late (another rank's report of the same save, steps after the first
rank's) aborted whatever reservation the key had by then, a newer request's; a
load's bad-block report dropped whatever copy the key had by then, a copy
written and committed since.
Invariant: a save report counts only for the reservation it was made for (its
job, whose ranks have not all reported yet); a bad-block report drops a key only
where it still lives in the slot its job read, and that slot never holds a newer
copy while a load of the old one is in flight; a report of a job no longer held
is ignored (and counted); the newer reservation commits, the newer copy stays a hit.
Fix: every transfer carries a job id (Transfer.job, never reused); the workers
report per job and rank, and the scheduler side's ledger (scheduler/commits.py)
keeps one record per job; a reservation one rank failed is given back only once
every rank has reported it; a key dropped while other loads hold it pinned keeps
its slot until they unpin it (Index.release_dropped), so neither slot can be
handed out again while a report about it is still on its way (the free list hands
a slot given back straight out again).
"""

from __future__ import annotations

from aiokv.jobs import LoadResult, SaveResult, WorkerReport
from aiokv.scheduler.keys import request_root
from aiokv.scheduler.side import Scheduled, SchedulerSide
from aiokv.store import Store

NS = bytes(range(16))
BS = 16


def _side(tmp_path, ranks: int = 1) -> SchedulerSide:
    store = Store(str(tmp_path / "c"))
    return SchedulerSide(store, store.namespace(NS, 4096, ranks=ranks), BS)


def _plan(side: SchedulerSide, req: str, tokens: list[int], ids: list[int]):
    root = request_root(NS, [])
    side.match(req, tokens, root, 0)
    side.on_alloc(req, tokens, root, (ids,), 0)
    saves = side.plan([Scheduled(req, 0, len(tokens), (ids,), True)]).saves
    return saves[0] if saves else None


def _written(t, *ranks: int) -> WorkerReport:
    return WorkerReport(saves=[SaveResult(t.job, r, list(t.keys)) for r in ranks])


def _failed(t, rank: int) -> WorkerReport:
    return WorkerReport(saves=[SaveResult(t.job, rank, [], list(t.keys))])


def _bad(t, keys) -> WorkerReport:
    return WorkerReport(loads=[LoadResult(t.job, 0, t.req_id, list(t.block_ids), list(keys))])


def test_a_late_failure_of_another_rank_keeps_the_newer_reservation(tmp_path):
    side = _side(tmp_path, ranks=2)
    ns = side.groups[0].ns
    tokens = list(range(BS + 1))  # one block: a slot given back is the next one handed out
    first = _plan(side, "r1", tokens, [1, 2])
    side.on_report(_failed(first, 0), set())  # rank 0: failed
    side.finished("r1")
    # a new request with the same prefix plans the same key again, while rank 1's report of
    # the first try is still on its way (rank 1 may still be writing that slot)
    second = _plan(side, "r2", tokens, [4, 5])
    side.on_report(_failed(first, 1), set())  # rank 1's late failure
    if second is not None:  # (planned again at once: its reports must count for it alone)
        side.on_report(_written(second, 0, 1), set())
        assert ns.has(first.keys[0]), "the late failure report dropped the newer reservation"
    assert side.pending_saves == 0 and not ns.pending
    # once every rank has reported the first try, the key is saved again like any other
    third = second or _plan(side, "r3", tokens, [6, 7])
    if second is None:
        side.on_report(_written(third, 0, 1), set())
    assert ns.has(first.keys[0]) and side.pending_saves == 0
    side.store.close()


def test_a_late_success_of_another_rank_does_not_count_for_the_newer_reservation(tmp_path):
    side = _side(tmp_path, ranks=2)
    ns = side.groups[0].ns
    tokens = list(range(BS + 1))
    first = _plan(side, "r1", tokens, [1, 2])
    side.on_report(_failed(first, 0), set())
    side.finished("r1")
    second = _plan(side, "r2", tokens, [4, 5])
    side.on_report(_written(first, 1), set())  # rank 1 wrote the first try
    if second is not None:
        side.on_report(_written(second, 0), set())  # rank 0 wrote the second
        assert not ns.has(first.keys[0]), "committed before rank 1 wrote the newer try"
        side.on_report(_written(second, 1), set())
    else:
        assert not ns.has(first.keys[0]), "the failed first try was committed"
        second = _plan(side, "r3", tokens, [6, 7])
        side.on_report(_written(second, 0, 1), set())
    assert ns.has(first.keys[0]) and side.pending_saves == 0
    side.store.close()


def test_a_late_bad_block_report_keeps_the_newer_copy(tmp_path):
    side = _side(tmp_path)
    store, ns = side.store, side.groups[0].ns
    tokens = list(range(BS + 1))
    t = _plan(side, "w", tokens, [1, 2])
    side.on_report(_written(t, 0), set())
    (k,) = t.keys
    # two requests with that prefix load the block at once (both pinned); it is bad on disk
    root = request_root(NS, [])
    for r, ids in (("r0", [3, 4]), ("r1", [5, 6])):
        assert side.match(r, tokens, root, 0) == BS
        side.on_alloc(r, tokens, root, (ids,), BS)
    loads = {t.req_id: t for t in side.plan([]).loads}
    assert len(loads) == 2
    side.on_report(_bad(loads["r0"], [k]), {"r0"})  # r0's report
    assert not ns.has(k)
    # a third request computes the block and saves it again, before r1's report arrives
    t2 = _plan(side, "r2", tokens, [7, 8])
    side.on_report(_written(t2, 0), set())
    assert ns.has(k)
    side.on_report(_bad(loads["r1"], [k]), {"r1"})  # r1's, late
    assert ns.has(k), "the late bad-block report dropped the newer copy"
    assert not store.index.pins and side.counters.reports_ignored == 0
    store.close()


def test_a_bad_block_report_drops_the_copy_it_read(tmp_path):
    side = _side(tmp_path)
    ns = side.groups[0].ns
    tokens = list(range(2 * BS + 1))
    t = _plan(side, "w", tokens, [1, 2, 3])
    side.on_report(_written(t, 0), set())
    root = request_root(NS, [])
    assert side.match("r", tokens, root, 0) == 2 * BS
    side.on_alloc("r", tokens, root, ([4, 5, 6],), 2 * BS)
    (load,) = side.plan([]).loads
    side.on_report(_bad(load, [t.keys[1]]), {"r"})
    assert ns.has(t.keys[0]) and not ns.has(t.keys[1])
    side.on_report(_bad(load, [t.keys[0]]), set())  # a report of a job no longer held
    assert ns.has(t.keys[0]) and side.counters.reports_ignored == 1
    assert not side.store.index.pins
    side.store.close()
