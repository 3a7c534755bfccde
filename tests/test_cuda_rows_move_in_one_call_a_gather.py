# SPDX-License-Identifier: Apache-2.0
"""A CUDA worker moves a gather's rows between the GPU and the pinned arena in one call.

The bug: CudaDevice copied each block's row with a Python `copy_` of its own, between the
device's gather buffer and the pinned staging arena: a save's rows on vLLM's thread (copy_out),
a load's on the loop thread (copy_in), a layer-by-layer load's on vLLM's thread again, one
interpreter round trip and one driver call a block. A 32k-token prefill of 16-token blocks is
2,000 such calls in one step, per KV-cache group.

The risk of batching them: one address wrong (a row's offset, the header's place in a slot, a
layer's columns) writes another block's bytes, or a header, where a payload belongs; a batch
copy that misbehaves on some build of vLLM or CUDA taken at its word.

Invariants: with a batch copy, what reaches the disk and what a load leaves in the KV tensors
is what the row-by-row copies gave: slots that format.check_slot accepts, loads bit-exact into
the blocks asked and no other, a flipped payload byte flagged for exactly its block; every row
moves through the batch copy, one call per gather (no row copied one by one); layer-by-layer
loads the same; a batch copy that copies wrong, or raises, when attach tries it on a scattered
pattern is not used (rows one by one, as before), said in one line.

The fix: CudaDevice(batch_copy=vLLM's swap_blocks_batch, which the connector finds:
connector/worker_role.vllm_batch_copy), checked at attach (worker/cuda.batch_copy_checked);
_rows_out and _rows_in compute a gather's addresses with tensor ops. Here the batch copy is a
stand-in that does what vLLM's does (its argument checks, then a memmove per entry) on CPU
tensors' real addresses, so every address the device computes is exercised.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import threading
import time

import pytest
import torch

from aiokv.data import format as fmt
from aiokv.data.buffers import BufferPool
from aiokv.jobs import Transfer
from aiokv.store.store import ns_dir
from aiokv.worker import cuda
from aiokv.worker.cuda import CudaDevice
from aiokv.worker.transfer import TransferWorker
from tests.conftest import NS, key
from tests.fakecuda import FakeEvent, FakeStream
from tests.workers import Polled, data_file, flip_payload_bytes, run_jobs, until

NB = 40


class BatchCopy:
    """vLLM's swap_blocks_batch(src_ptrs, dst_ptrs, sizes) on host memory: its argument checks,
    then each copy; the calls and the rows they moved counted. `wrong`: a misbehaving build."""

    def __init__(self, wrong: str | None = None):
        self.calls, self.rows, self.wrong = 0, 0, wrong

    def __call__(self, src, dst, sizes, is_src_access_order_any=False):
        for t in (src, dst, sizes):
            assert t.device.type == "cpu" and t.dtype == torch.int64 and t.dim() == 1 and len(t) == len(src)
        if self.wrong == "raises":
            raise RuntimeError("cuMemcpyBatchAsync failed")
        self.calls += 1
        self.rows += len(src)
        entries = list(zip(src.tolist(), dst.tolist(), sizes.tolist()))
        if self.wrong == "first only":
            entries = entries[:1]
        for s, d, n in entries:
            ctypes.memmove(d, s, n)


def _kv():
    g = torch.Generator().manual_seed(5)  # layers of different widths: 2304, 1152 and 4608 bytes a block
    shapes = [(NB, 2, 32, 9), (NB, 2, 16, 9), (NB, 4, 32, 9)]
    return {f"l{i}": torch.randn(*s, generator=g) for i, s in enumerate(shapes)}


def _worker(root: str, kv: dict, batch, kept: int = 0) -> TransferWorker:
    os.makedirs(ns_dir(root, NS), exist_ok=True)
    dev = CudaDevice(kv, NB, batch_copy=batch)
    slot = fmt.slot_bytes(dev.payload_bytes)
    return TransferWorker(dev, ns_dir(root, NS), NS, 0, staging_bytes=16 * slot, memory_bytes=kept * slot)


def _round_trip(root: str, batch, ids, bad: dict[int, int]):
    """Save blocks 1.. of ids, flip `bad` payload bytes on disk, load them into blocks 21..:
    (the disk's bytes, the KV tensors after the load, the blocks the load failed)."""
    kv = _kv()
    w = _worker(root, kv, batch)
    try:
        _, _, rep = run_jobs(w, w.save, [Transfer("s", [key(i) for i in ids], list(ids), [i + 1 for i in ids])])
        assert len(rep.written()) == len(ids) and not rep.not_written()
    finally:
        w.close()
    path, disk = data_file(root)
    flip_payload_bytes(path, w.slot_bytes, bad, 0x10)
    w = _worker(root, kv, batch, kept=16)
    try:
        done, errors, _ = run_jobs(w, w.load, [Transfer("r", [key(i) for i in ids], list(ids), [21 + i for i in ids])])
        assert done == {"r"} and w.staging_in_use == 0
        return disk, {n: t.clone() for n, t in kv.items()}, errors, w
    finally:
        w.close()


def test_a_gathers_rows_move_in_one_call_and_land_where_row_by_row_copies_put_them(fake_cuda, tmp_path, monkeypatch):
    monkeypatch.setattr(cuda, "GATHER_BYTES", 4 * 8064)  # a gather of 4 blocks: 10 blocks are 3 calls each way
    ids, bad = range(10), {3: 0, 7: 8064 - 1}
    batch = BatchCopy()
    disk, kv, errors, w = _round_trip(str(tmp_path / "batch"), batch, ids, bad)
    assert w.device._batch is batch and w.device.crc_in_copy, "attach took the batch copy (and the device CRC)"
    # attach's check (out and back, once per worker), then 3 gathers saved and 3 loaded
    assert (batch.calls, batch.rows) == (2 * 2 + 3 + 3, 2 * 2 * 3 + 10 + 10), (batch.calls, batch.rows)
    ref_disk, ref_kv, ref_errors, ref = _round_trip(str(tmp_path / "rows"), None, ids, bad)
    assert ref.device._batch is None
    sb, plen, h = w.slot_bytes, w.device.payload_bytes, fmt.HEADER_BYTES
    assert len(disk) == len(ref_disk)
    for i in ids:  # valid slots, whose payloads are the row-by-row copies' (headers differ by their save's time)
        fmt.check_slot(disk[i * sb : (i + 1) * sb], NS, 0, plen, key(i), w.device.layout_tag, None)
        assert disk[i * sb + h : (i + 1) * sb] == ref_disk[i * sb + h : (i + 1) * sb], i
    assert errors == ref_errors == {21 + s for s in bad}, "exactly the flipped blocks failed"
    fresh = _kv()
    for name, t in kv.items():
        assert torch.equal(t, ref_kv[name])
        for b in range(NB):  # loaded blocks hold the saved ones; every other block is untouched
            want = fresh[name][b - 20] if 21 <= b < 31 and b - 21 not in bad else fresh[name][b]
            if 21 <= b < 31 and b - 21 in bad:
                continue  # a failed block's bytes are the caller's to discard (it recomputes)
            assert torch.equal(t[b], want), (name, b)


def test_layer_by_layer_loads_move_a_layers_rows_in_one_call(fake_cuda):
    kv, batch = _kv(), BatchCopy()
    dev = CudaDevice(kv, NB, batch_copy=batch)
    pool = BufferPool(fmt.slot_bytes(dev.payload_bytes), 8)
    try:
        dev.attach(pool)
        assert dev._batch is batch
        g = torch.Generator().manual_seed(9)
        rows = pool.arena.tensor().view(pool.count, pool.slot_bytes)
        rows[:] = torch.randint(0, 256, rows.shape, dtype=torch.uint8, generator=g)
        before, bufs, ids = {n: t.clone() for n, t in kv.items()}, [6, 2, 5], [30, 11, 17]
        calls = batch.calls
        idx = dev.begin_layers(ids)
        for index in range(len(dev.layers)):
            dev.copy_in_layer_async(index, idx, bufs)
        assert batch.calls - calls == len(dev.layers), "one call a layer"
        for (name, t), (_, a, b) in zip(kv.items(), dev._cols()):
            for blk in range(NB):
                if blk in ids:
                    want = rows[bufs[ids.index(blk)], a:b]
                    assert torch.equal(t[blk].contiguous().view(torch.uint8).view(-1), want), (name, blk)
                else:
                    assert torch.equal(t[blk], before[name][blk]), (name, blk)
    finally:
        dev.close()
        pool.close()


@pytest.mark.parametrize("wrong", ["first only", "raises"])
def test_a_batch_copy_that_fails_its_check_at_attach_is_not_used(fake_cuda, tmp_path, wrong, caplog):
    batch = BatchCopy(wrong)
    with caplog.at_level(logging.WARNING, logger="aiokv"):
        disk, kv, errors, w = _round_trip(str(tmp_path), batch, range(6), {})
    checks = {"first only": 2 * 2, "raises": 0}[wrong]  # two workers' attach, out and back (a raise: not counted)
    assert w.device._batch is None and batch.calls == checks, ("not used after its check", batch.calls)
    said = [r for r in caplog.records if "batch copy" in r.getMessage()]
    assert said and all("rows are copied one by one" in r.getMessage() for r in said)
    assert not errors
    fresh = _kv()
    for name, t in kv.items():
        assert all(torch.equal(t[21 + i], fresh[name][i + 1]) for i in range(6)), "rows one by one, bit-exact"


def test_the_connector_hands_down_vllms_batch_copy_only_where_this_build_registered_it(monkeypatch):
    from vllm import _custom_ops as ops

    from aiokv.connector.worker_role import vllm_batch_copy

    assert not hasattr(torch.ops._C_cache_ops, "swap_blocks_batch"), "this CPU build has no batch copy"
    assert vllm_batch_copy() is None
    monkeypatch.setattr(torch.ops._C_cache_ops, "swap_blocks_batch", BatchCopy(), raising=False)
    assert vllm_batch_copy() is ops.swap_blocks_batch


def _saved(tmp_path, kv: dict, ids) -> TransferWorker:
    """A worker (batch copies) that has saved blocks 1.. as keys of ids."""
    w = _worker(str(tmp_path), kv, BatchCopy())
    _, _, rep = run_jobs(w, w.save, [Transfer("s", [key(i) for i in ids], list(ids), [i + 1 for i in ids])])
    assert len(rep.written()) == len(ids)
    return w


def _device_waits_until(released: threading.Event, timeout: float, monkeypatch) -> threading.Event:
    """From now on a wait on the device (an event's or a stream's synchronize) returns only once
    `released` is set (it raises after `timeout`); returns the Event set when a wait began."""
    waiting = threading.Event()

    def synchronize(self):
        waiting.set()
        if not released.wait(timeout):
            raise RuntimeError("the device's wait was never released (nothing ran on the worker's loop)")

    monkeypatch.setattr(FakeEvent, "synchronize", synchronize)
    monkeypatch.setattr(FakeStream, "synchronize", synchronize)
    return waiting


def test_a_loads_copies_land_while_the_worker_loop_runs_other_work(fake_cuda, tmp_path, monkeypatch):
    """Bug: CudaDevice.copy_in waited on the GPU (the stream's synchronize, and a .cpu() per
    gather for the CRC checks) on the worker's loop thread: while a load's DMA landed no other
    job's I/O completion was reaped and nothing else on the loop ran. Invariant: the loop runs
    other work while a load's copies are still landing, and the load completes bit-exact once
    they have. Fix: copy_in_queued queues the copies and one event; Reads.copy_in waits for the
    event on a thread of the loop's executor (util/loops.waited). Here a wait on the device (an
    event's or a stream's synchronize) does not return until a task on the worker's loop has run,
    after the wait began: on a loop held by the wait that task never runs, and the wait gives up
    after 10 s (the load then fails)."""
    ids, kv = range(6), _kv()
    w = _saved(tmp_path, kv, ids)
    try:
        ran = threading.Event()
        waiting = _device_waits_until(ran, 10, monkeypatch)

        async def other_work():  # on the worker's loop: runs once the copy's wait has begun
            while not waiting.is_set():
                await asyncio.sleep(0.001)
            ran.set()

        asyncio.run_coroutine_threadsafe(other_work(), w.host.lt.loop)
        done, errors, rep = run_jobs(
            w, w.load, [Transfer("r", [key(i) for i in ids], list(ids), [21 + i for i in ids])], timeout=30
        )
        assert ran.is_set() and done == {"r"} and not errors, (done, errors)
        assert rep.counters["loads_ok_blocks"] == 6
        assert all(torch.equal(t[21 + i], t[i + 1]) for t in kv.values() for i in ids)
    finally:
        w.close()


def test_a_load_cancelled_while_its_copies_land_gives_nothing_back_before_they_have(fake_cuda, tmp_path, monkeypatch):
    """The wait for a load's copies moved off the loop can be cancelled (an aborted request). The
    copies still write its KV blocks and read its staging buffers: neither may go back (to vLLM,
    to the pool) before they have landed. Invariant: a load cancelled during the wait is reported
    (every block failed) and its buffers freed only once the device's wait returned."""
    ids, kv = range(6), _kv()
    w = _saved(tmp_path, kv, ids)
    try:
        landed = threading.Event()
        waiting = _device_waits_until(landed, 30, monkeypatch)
        w.load([Transfer("r", [key(i) for i in ids], list(ids), [21 + i for i in ids])])
        assert waiting.wait(10), "the load's copies were queued"
        w.cancel(["r"])
        time.sleep(0.3)  # (on a correct worker nothing below changes however long this is)
        polled = Polled(w)
        held, early = w.staging_in_use, polled.finished("r")
        landed.set()
        assert until(lambda: polled.finished("r"), 10)
        assert held == 6 and not early, "nothing went back while the copies were landing"
        assert polled.errors == {21 + i for i in ids} and until(lambda: w.staging_in_use == 0, 10)
    finally:
        w.close()
