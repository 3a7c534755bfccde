# SPDX-License-Identifier: Apache-2.0
"""Under tensor parallelism a block is committed only once every rank has written it.

Bug guarded against: with TP each rank writes its own shard of a block to its
own file (`rank<r>.data`); a commit after the first rank's report (or one that
let a later success outvote an earlier failure) makes a hit of a block whose
other shard was never written: the next engine loads garbage on that rank.
Invariant (two real TransferWorkers, ranks 0 and 1, on real files; rank 1's
writes refused by the kernel: ENOSPC on a full tmpfs where its slots were
punched out): a block rank 1 failed to write is never committed, whether the
failure is reported in the same step as rank 0's success, a step later, or a
step earlier; its reservation is given back and counted as a failed save;
a block both ranks wrote is committed and both shards load back.
Fix: the scheduler side's ledger (scheduler/commits.py) commits a block of a
save job only when every rank of the namespace reported it saved (the job's
record collects the ranks per block), and a failure from any rank aborts the
reservation.
"""

from __future__ import annotations

import errno
import os
import time

import pytest
import torch

from aiokv import _native
from aiokv.data import format as fmt
from aiokv.jobs import SaveResult, Transfer, WorkerReport
from aiokv.scheduler.keys import request_root
from aiokv.scheduler.side import Scheduled, SchedulerSide
from aiokv.store import Store
from aiokv.store.store import ns_dir
from aiokv.worker.device import CpuDevice
from aiokv.worker.transfer import TransferWorker
from tests import mounts

NS = bytes(range(16))
NB = 16
BS = 16  # tokens per block


@pytest.fixture
def tmpfs(tmp_path):
    with mounts.tmpfs(tmp_path / "mnt", "8m") as mnt:
        yield mnt


def _fill_up(path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\xff" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)


def _report(w: TransferWorker, n: int) -> WorkerReport:
    end = time.monotonic() + 20
    rep = WorkerReport()
    while len(rep.written()) + len(rep.not_written()) < n:
        assert time.monotonic() < end, rep
        rep = rep.merge(w.poll()[2])
        time.sleep(0.005)
    return rep


def _only(rep: WorkerReport, keys) -> WorkerReport:
    return WorkerReport(
        saves=[
            SaveResult(s.job, s.rank, [k for k in s.written if k in keys], [k for k in s.failed if k in keys])
            for s in rep.saves
        ]
    )


def test_a_block_one_rank_failed_to_write_is_never_committed(tmpfs):
    root = str(tmpfs / "c")
    kvs = [{f"l{i}": torch.randn(NB, 2, 32, 8) for i in range(2)} for _ in range(2)]  # each rank's shard
    devs = [CpuDevice(kv, NB) for kv in kvs]
    store = Store(root, capacity=64 * fmt.slot_bytes(devs[0].payload_bytes))
    ns = store.namespace(NS, devs[0].payload_bytes, ranks=2)
    side = SchedulerSide(store, ns, BS)
    workers = [TransferWorker(d, ns_dir(root, NS), NS, r, staging_bytes=1, io="uring") for r, d in enumerate(devs)]
    try:
        tokens = list(range(4 * BS + 1))
        proot = request_root(NS, [])
        assert side.match("r", tokens, proot, 0) == 0
        side.on_alloc("r", tokens, proot, ([1, 2, 3, 4, 5],), 0)
        (t,) = side.plan([Scheduled("r", 0, len(tokens), ([1, 2, 3, 4, 5],), True)]).saves
        assert len(t.keys) == 4 and side.pending_saves == 4
        keys = t.keys
        # rank 1's file loses the space reserved for blocks 1..3, and the disk fills up:
        # its writes there need new pages, which the kernel refuses
        fd = os.open(os.path.join(ns_dir(root, NS), "rank1.data"), os.O_RDWR)
        for slot in t.locations[1:]:
            off = (slot & fmt.SLOT_MASK) * ns.slot_bytes
            _native.fallocate(fd, _native.FALLOC_FL_PUNCH_HOLE | _native.FALLOC_FL_KEEP_SIZE, off, ns.slot_bytes)
        os.close(fd)
        _fill_up(tmpfs / "filler")
        for w in workers:
            w.save([Transfer(t.req_id, list(t.keys), list(t.locations), list(t.block_ids), t.group, job=t.job)])
        rep0, rep1 = (_report(w, 4) for w in workers)
        os.unlink(tmpfs / "filler")  # (the journal needs room for the commit below)
        assert {k for _, _, k in rep0.written()} == set(keys) and not rep0.not_written(), rep0
        assert {k for _, _, k in rep1.written()} == {keys[0]}, rep1
        assert {k for _, _, k in rep1.not_written()} == set(keys[1:]), "the kernel refused rank 1's writes"
        assert rep1.counters.get("write_errors", 0) >= 1, rep1.counters

        # the reports reach the scheduler side as vLLM hands them over, merged across ranks:
        # key 1's failure in the same step as rank 0's success, key 2's a step later, key 3's earlier
        side.on_report(_only(rep0, keys[:3]).merge(_only(rep1, {keys[0], keys[1], keys[3]})), set())
        side.on_report(_only(rep0, {keys[3]}).merge(_only(rep1, {keys[2]})), set())
        assert side.pending_saves == 0, "every reservation is committed or given back"
        assert ns.has(keys[0]), "a block both ranks wrote is committed"
        for k in keys[1:]:
            assert not ns.has(k) and k not in ns.pending, "a block rank 1 never wrote was committed"
        assert side.counters.saves_committed == 1 and side.counters.save_failures == 3
        assert side.match("r2", tokens, proot, 0) == BS  # a hit of block 0 only

        # and block 0 loads back on both ranks, each its own shard
        for r, (w, kv) in enumerate(zip(workers, kvs)):
            w.load([Transfer(f"l{r}", [keys[0]], [ns.where(keys[0])], [9])])
            end = time.monotonic() + 20
            while True:
                done, errors, _ = w.poll()
                if f"l{r}" in done:
                    break
                assert time.monotonic() < end
                time.sleep(0.005)
            assert not errors and all(torch.equal(x[9], x[1]) for x in kv.values())
    finally:
        for w in workers:
            w.close()
        store.close()


def test_one_rank_short_of_its_report_keeps_the_block_uncommitted(tmp_path):
    """Rank 0's report alone, step after step, never commits: the block waits for rank 1."""
    store = Store(str(tmp_path / "c"))
    ns = store.namespace(NS, 4096, ranks=2)
    side = SchedulerSide(store, ns, BS)
    tokens = list(range(2 * BS + 1))
    proot = request_root(NS, [])
    side.match("r", tokens, proot, 0)
    side.on_alloc("r", tokens, proot, ([1, 2, 3],), 0)
    (t,) = side.plan([Scheduled("r", 0, len(tokens), ([1, 2, 3],), True)]).saves
    rank0 = WorkerReport(saves=[SaveResult(t.job, 0, list(t.keys))])
    for _ in range(3):  # a duplicate of rank 0's report is not rank 1's
        side.on_report(rank0, set())
        assert not any(ns.has(k) for k in t.keys) and side.pending_saves == 2
    side.on_report(WorkerReport(saves=[SaveResult(t.job, 1, list(t.keys))]), set())
    assert all(ns.has(k) for k in t.keys) and side.pending_saves == 0
    store.close()
