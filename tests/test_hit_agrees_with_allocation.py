# SPDX-License-Identifier: Apache-2.0
"""The scheduler side with several KV-cache groups, on a real store (no vLLM).

The bugs this guards against: a hit promised for more blocks than the load then
covers (a recurrent-state hit cut back to an earlier checkpoint, a window that
needs blocks that are not stored), and vLLM's null block (id 0, blocks that
slid out of a window or states not kept) being saved or loaded into.
Invariants: `match` offers the longest hit every group can serve (all blocks
of full attention, the window's blocks for sliding-window groups, the state at
the hit's end for recurrent groups), falling back to an earlier end when a
checkpoint is missing; `on_alloc` turns exactly that hit into loads of the
blocks vLLM allocated (nulls skipped, the state group loads one block), each
key pinned until the load is reported; saves never carry block id 0.
"""

from __future__ import annotations

from aiokv.scheduler.keys import extend_keys, request_root
from aiokv.scheduler.layout import FULL, STATE, WINDOW, GroupSpec
from aiokv.scheduler.side import Scheduled, SchedulerSide
from aiokv.store import Store

BS = 32
NS = [bytes([i]) * 16 for i in range(3)]


def _side(tmp_path, kinds):
    store = Store(str(tmp_path / "c"), capacity="1GiB")
    groups = [
        (GroupSpec(i, k, 4096, (f"l{i}",), window=64 if k == WINDOW else 0), store.namespace(NS[i], 4096))
        for i, k in enumerate(kinds)
    ]
    return SchedulerSide(store, groups, BS)


def _commit(side, gi, keys):
    ns = side.groups[gi].ns
    items = [(k, side.store.reserve(ns, k)) for k in keys]
    side.store.commit(ns, items)


def _keys(root, tokens, n):
    return extend_keys([], root, tokens, BS, n)


def test_hit_falls_back_to_the_last_checkpoint_every_group_has(tmp_path):
    side = _side(tmp_path, [FULL, STATE])
    root = request_root(NS[0], [])
    tokens = list(range(10 * BS + 5))
    keys = _keys(root, tokens, 10)
    _commit(side, 0, keys)  # attention: all 10 blocks
    _commit(side, 1, [keys[3], keys[6]])  # states after 4 and 7 blocks only
    assert side.match("r", tokens, root, 0) == 7 * BS
    # a local hit past the last checkpoint: nothing external to offer
    assert side.match("r", tokens, root, 8 * BS) == 0
    # the promise and the allocation agree: 7 attention blocks, one state (the 7th block's)
    side.match("r", tokens, root, 0)
    ids = (list(range(1, 11)), [0] * 6 + [42, 43, 0, 0])
    side.on_alloc("r", tokens, root, ids, 7 * BS)
    plan = side.plan([])
    by_group = {t.group: t for t in plan.loads}
    assert by_group[0].block_ids == list(range(1, 8)) and by_group[0].keys == keys[:7]
    assert by_group[1].block_ids == [42] and by_group[1].keys == [keys[6]] and by_group[1].locations[0] >= 0
    assert len(side.store.index.pins) == 8
    side.on_report(None, {"r"})
    assert not side.store.index.pins


def test_window_groups_need_only_the_window_and_never_touch_null_blocks(tmp_path):
    side = _side(tmp_path, [WINDOW, FULL])
    root = request_root(NS[0], [])
    tokens = list(range(8 * BS + 1))
    keys = _keys(root, tokens, 8)
    _commit(side, 1, keys)
    _commit(side, 0, keys[5:8])  # a 64-token window ending after 8 blocks needs blocks 6 and 7
    assert side.match("r", tokens, root, 0) == 8 * BS
    side.store.drop(side.groups[0].ns, [keys[6]])
    # block 6 is missing: the hit falls back to an end whose window is stored (after 6 blocks: blocks 4, 5)
    assert side.match("r", tokens, root, 0) == 0  # block 4 was never stored either
    _commit(side, 0, [keys[4]])
    assert side.match("r", tokens, root, 0) == 6 * BS
    ids = ([0, 0, 0, 0, 11, 12, 0, 0], list(range(21, 29)))
    side.on_alloc("r", tokens, root, ids, 6 * BS)
    loads = {t.group: t for t in side.plan([]).loads}
    assert loads[0].block_ids == [11, 12] and loads[0].keys == [keys[4], keys[5]]
    assert loads[1].block_ids == list(range(21, 27))


def test_saves_skip_null_blocks_and_take_states_only_from_vllm_checkpoints(tmp_path):
    side = _side(tmp_path, [WINDOW, STATE, FULL])
    root = request_root(NS[0], [])
    tokens = list(range(4 * BS + 3))
    assert side.match("r", tokens, root, 0) == 0
    side.on_alloc("r", tokens, root, ([], [], []), 0)
    tables = ([0, 0, 5, 6, 7], [0, 0, 0, 9, 10], [1, 2, 3, 4, 8])
    boundary = {"r": [(1, 9, 4 * BS), (1, 0, 3 * BS), (0, 6, 4 * BS), (1, 10, 4 * BS + 3)]}
    plan = side.plan([Scheduled("r", 0, len(tokens), tables, True)], boundary)
    saves = {t.group: t for t in plan.saves}
    keys = _keys(root, tokens, 4)
    assert saves[0].block_ids == [5, 6] and saves[0].keys == keys[2:4]  # nulls before the window skipped
    assert saves[2].block_ids == [1, 2, 3, 4] and saves[2].keys == keys
    # only the checkpoint at a block end, into a real block, of a state group
    assert saves[1].block_ids == [9] and saves[1].keys == [keys[3]]
    assert all(b != 0 for t in plan.saves for b in t.block_ids)
    # every group's save commits once its (only) rank reports it
    from aiokv.jobs import SaveResult, WorkerReport

    side.on_report(WorkerReport(saves=[SaveResult(t.job, 0, list(t.keys)) for t in plan.saves]), set())
    assert side.pending_saves == 0
    assert side.match("r2", tokens, root, 0) == 4 * BS
