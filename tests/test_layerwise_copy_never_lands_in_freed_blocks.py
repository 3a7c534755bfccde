# SPDX-License-Identifier: Apache-2.0
"""Bug: with layer-by-layer loads, verified blocks wait in staging after the
load is reported finished and are copied into the KV cache during the next
step's forward. If a request ends in between, vLLM frees its blocks and may hand
them to another request: a late copy would overwrite that request's KV. A copy
of a block after the first one that failed would race vLLM's recompute of it.
Invariant: nothing reaches the KV cache before `begin` (the step's start); every
layer of every staged block is in place when its `wait_layer` returns and when
`end_step` returns; a cancelled request's staged blocks are never copied,
whether the cancel comes before or after the load was staged; blocks from the
first failed one on are never staged; staging buffers all come back; a load
bigger than half the pool takes the whole-request path (copied before it is
reported).
Fix: aiokv/worker/layerwise.py (stage, cancel-before-copy, per-layer events).
Real io_uring/thread backends, real files, a real CPU KV tensor; only the CUDA
branch's stream and event calls are stood in for (no GPU here), to pin its ordering.
"""

from __future__ import annotations

import json
import os
import time

import torch

from aiokv.data import format as fmt
from aiokv.data.faults import ACK
from aiokv.data.slotfile import data_path
from aiokv.jobs import Transfer
from aiokv.store.store import ns_dir
from aiokv.worker.device import CpuDevice
from aiokv.worker.transfer import TransferWorker
from tests.conftest import NS, key

NB = 24
SLOTS = 16


def _worker(root: str, backend_kind: str, memory_bufs: int = 0) -> tuple[TransferWorker, dict]:
    kv = {f"l{i}": torch.randn(NB, 2, 32, 8) for i in range(2)}
    os.makedirs(ns_dir(root, NS), exist_ok=True)
    dev = CpuDevice(kv, NB)
    sb = fmt.slot_bytes(dev.payload_bytes)
    w = TransferWorker(
        dev,
        ns_dir(root, NS),
        NS,
        0,
        staging_bytes=SLOTS * sb,
        io=backend_kind,
        memory_bytes=memory_bufs * sb,
        layerwise=True,
    )
    return w, kv


def _save(w: TransferWorker, n: int) -> None:
    """Blocks 1..n saved under key(0..n-1) in slots 0..n-1."""
    w.save([Transfer("s", [key(i) for i in range(n)], list(range(n)), [i + 1 for i in range(n)])])
    w.drain(10)
    _, _, rep = w.poll()
    assert len(rep.written()) == n and not rep.not_written(), rep


def _finished(w: TransferWorker, req: str, timeout: float = 10) -> set:
    end = time.monotonic() + timeout
    errors: set = set()
    while time.monotonic() < end:
        done, errs, _ = w.poll()
        errors |= errs
        if req in done:
            return errors
        time.sleep(0.005)
    raise AssertionError(f"load {req} never finished")


def _eventually(cond, timeout: float = 10.0) -> None:
    """Poll `cond` until it holds (a generous deadline for a busy machine), instead of a sleep."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition never held"
        time.sleep(0.002)


def _same(kv, dst: int, src: int) -> bool:
    return all(torch.equal(t[dst], t[src]) for t in kv.values())


def _mark(kv, blocks) -> dict:
    """Fill blocks with a sentinel; returns their contents to compare later."""
    for t in kv.values():
        for b in blocks:
            t[b].fill_(7.5)
    return {b: [t[b].clone() for t in kv.values()] for b in blocks}


def _untouched(kv, marks) -> bool:
    return all(torch.equal(t[b], m) for b, ms in marks.items() for t, m in zip(kv.values(), ms))


def test_staged_blocks_land_layer_by_layer_at_the_next_step(tmp_path, backend_kind):
    w, kv = _worker(str(tmp_path), backend_kind)
    try:
        _save(w, 4)
        marks = _mark(kv, [11, 12, 13, 14])
        w.load([Transfer("r", [key(i) for i in range(4)], [0, 1, 2, 3], [11, 12, 13, 14])])
        assert _finished(w, "r") == set()
        lw = w.layers
        # reported, yet held in staging with no copy started: only the next step's begin() hands
        # staged blocks to the copy thread (no sleep needed to show an absence)
        assert lw.held == 4 and lw.counts.get("copied_blocks", 0) == 0 and lw._thread is None
        assert _untouched(kv, marks), "a staged load must not reach the KV cache before the next step"
        assert w.pool.in_use == 4
        lw.begin()
        lw.wait_layer("l0")
        assert all(torch.equal(kv["l0"][11 + i], kv["l0"][1 + i]) for i in range(4))
        lw.wait_layer("l1")
        lw.end_step()
        assert all(_same(kv, 11 + i, 1 + i) for i in range(4))
        _eventually(lambda: w.pool.in_use == 0)  # the copy thread gives the slots back after the last layer
        assert lw.counts["staged_blocks"] == 4 and lw.counts["copied_blocks"] == 4
    finally:
        w.close()


def test_copied_blocks_join_the_memory_tier(tmp_path, backend_kind):
    """As after a whole-request load: a second hit on them is served from host memory."""
    w, _ = _worker(str(tmp_path), backend_kind)
    _save(w, 3)
    w.close()
    w, kv = _worker(str(tmp_path), backend_kind, memory_bufs=8)  # a restart: nothing in memory
    try:
        w.load([Transfer("a", [key(i) for i in range(3)], [0, 1, 2], [11, 12, 13])])
        _finished(w, "a")
        w.layers.begin()
        w.layers.end_step()
        _eventually(lambda: w.cache.kept == 3 and w.staging_in_use == 0)
        w.load([Transfer("b", [key(i) for i in range(3)], [0, 1, 2], [14, 15, 16])])
        _finished(w, "b")
        assert w.layers.counts["staged_blocks"] == 3, "served from memory: copied before it is reported"
        assert all(_same(kv, 14 + i, 11 + i) for i in range(3))
    finally:
        w.close()


def test_cancel_after_staging_never_copies(tmp_path, backend_kind):
    w, kv = _worker(str(tmp_path), backend_kind)
    try:
        _save(w, 3)
        marks = _mark(kv, [15, 16, 17])
        w.load([Transfer("gone", [key(i) for i in range(3)], [0, 1, 2], [15, 16, 17])])
        _finished(w, "gone")
        w.cancel(["gone"])  # the request ended; vLLM may give blocks 15-17 to another request
        w.layers.begin()
        w.layers.end_step()
        _eventually(lambda: w.pool.in_use == 0)
        assert _untouched(kv, marks) and w.layers.counts["dropped_blocks"] == 3
    finally:
        w.close()


def test_cancel_before_staging_never_copies(tmp_path, backend_kind):
    w, kv = _worker(str(tmp_path), backend_kind)
    try:
        _save(w, 3)
        marks = _mark(kv, [18, 19, 20])
        w.load([Transfer("early", [key(i) for i in range(3)], [0, 1, 2], [18, 19, 20])])
        w.cancel(["early"])  # before or while the load runs: whichever, it is never staged
        _finished(w, "early")
        w.layers.begin()
        w.layers.end_step()
        _eventually(lambda: w.pool.in_use == 0)
        assert _untouched(kv, marks)
    finally:
        w.close()


def test_an_id_used_again_after_its_cancel_still_loads(tmp_path, backend_kind):
    w, kv = _worker(str(tmp_path), backend_kind)
    try:
        _save(w, 2)
        w.cancel(["x"])  # an earlier request "x" ended
        w.load([Transfer("x", [key(0), key(1)], [0, 1], [21, 22])])
        assert _finished(w, "x") == set()
        w.layers.begin()
        w.layers.end_step()
        assert _same(kv, 21, 1) and _same(kv, 22, 2)
    finally:
        w.close()


def test_blocks_from_the_first_bad_one_on_are_not_staged(tmp_path, backend_kind):
    w, kv = _worker(str(tmp_path), backend_kind)
    try:
        _save(w, 4)
        sb = fmt.slot_bytes(w.device.payload_bytes)
        path = data_path(ns_dir(str(tmp_path), NS), 0)
        with open(path, "r+b") as f:  # one byte of the second layer's section of slot 2
            off = 2 * sb + fmt.HEADER_BYTES + w.device.layers[0].nbytes + 5
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 1]))
        marks = _mark(kv, [13, 14])
        w.load([Transfer("r", [key(i) for i in range(4)], [0, 1, 2, 3], [11, 12, 13, 14])])
        assert _finished(w, "r") == {13, 14}, "the bad block and every one after it are recomputed"
        w.layers.begin()
        w.layers.end_step()
        assert _same(kv, 11, 1) and _same(kv, 12, 2)
        assert _untouched(kv, marks)
        _eventually(lambda: w.pool.in_use == 0)
    finally:
        w.close()


def test_nothing_after_a_block_that_cannot_be_loaded_is_staged(tmp_path, backend_kind):
    """A key gone since the lookup (slot -1) fails its block; vLLM recomputes from
    there, so the blocks after it, read fine, must not be copied either."""
    w, kv = _worker(str(tmp_path), backend_kind)
    try:
        _save(w, 3)
        marks = _mark(kv, [12, 13])
        w.load([Transfer("r", [key(0), key(1), key(2)], [0, -1, 2], [11, 12, 13])])
        assert _finished(w, "r") == {12, 13}
        w.layers.begin()
        w.layers.end_step()
        assert _same(kv, 11, 1) and _untouched(kv, marks)
        _eventually(lambda: w.pool.in_use == 0)
    finally:
        w.close()


def test_a_load_over_half_the_pool_is_copied_before_it_is_reported(tmp_path, backend_kind):
    w, kv = _worker(str(tmp_path), backend_kind)
    try:
        n = SLOTS // 2 + 1
        _save(w, n)
        w.load([Transfer("big", [key(i) for i in range(n)], list(range(n)), [12 + i for i in range(n)])])
        assert _finished(w, "big") == set()
        assert all(_same(kv, 12 + i, 1 + i) for i in range(n))
        assert w.layers.counts["staged_blocks"] == 0 and w.pool.in_use == 0
    finally:
        w.close()


class _Event:
    """Stands in for torch.cuda.Event (no GPU here): done once the test says so."""

    def __init__(self, layer: int):
        self.layer, self.done = layer, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


class _Stream:
    def __init__(self):
        self.waited: list[int] = []

    def wait_event(self, ev: _Event) -> None:
        self.waited.append(ev.layer)


def test_cuda_ordering_side_stream_events(tmp_path, backend_kind, monkeypatch):
    """The CUDA branch's ordering, with the device's stream calls replaced (the one
    mock: no GPU here; the copies themselves run as on the CPU): layers queued
    LOOKAHEAD ahead of the forward, the compute stream waits on exactly the layer's
    event, on the last one at the end of the step (and at once for a step that may
    replay a full CUDA graph), and slots come back only once the last event is done."""
    import torch

    from aiokv.worker import layerwise

    compute = _Stream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    kv = {f"l{i}": torch.randn(NB, 2, 32, 8) for i in range(4)}
    os.makedirs(ns_dir(str(tmp_path), NS), exist_ok=True)

    class FakeCuda(CpuDevice):
        asynchronous = True
        device = "cuda:0"
        queued: list[_Event] = []

        def begin_layers(self, block_ids):
            return list(block_ids)

        def copy_in_layer_async(self, index, idx, slots):
            self.copy_in_layer(index, idx, slots)
            ev = _Event(index)
            self.queued.append(ev)
            return ev

        def wait_out(self, bufs=None):
            pass

    dev = FakeCuda(kv, NB)
    w = TransferWorker(
        dev,
        ns_dir(str(tmp_path), NS),
        NS,
        0,
        staging_bytes=SLOTS * fmt.slot_bytes(dev.payload_bytes),
        io=backend_kind,
        layerwise=True,
    )
    try:
        _save(w, 3)
        w.load([Transfer("r", [key(i) for i in range(3)], [0, 1, 2], [11, 12, 13])])
        _finished(w, "r")
        lw = w.layers
        lw.begin()
        assert [e.layer for e in dev.queued] == list(range(layerwise.LOOKAHEAD)) and compute.waited == []
        lw.wait_layer("l1")
        assert compute.waited == [1] and len(dev.queued) == min(1 + layerwise.LOOKAHEAD + 1, 4)
        lw.end_step()
        assert compute.waited == [1, 3] and [e.layer for e in dev.queued] == [0, 1, 2, 3]
        assert all(_same(kv, 11 + i, 1 + i) for i in range(3))
        assert w.pool.in_use == 3, "the slots are the DMA's until its last event is done"
        lw.begin()
        assert w.pool.in_use == 3
        dev.queued[-1].done = True
        lw.begin()
        assert w.pool.in_use == 0
        # a step that may replay a full CUDA graph: everything ordered before the forward
        dev.queued.clear()
        compute.waited.clear()
        w.load([Transfer("d", [key(0)], [0], [14])])
        _finished(w, "d")
        lw.begin(whole=True)
        assert [e.layer for e in dev.queued] == [0, 1, 2, 3] and compute.waited == [3]
        lw.end_step()
        lw.close()
        assert w.pool.in_use == 0
    finally:
        w.close()


def test_a_cancel_during_the_read_is_a_cancelled_load_not_a_failed_one(tmp_path, backend_kind, monkeypatch):
    """The request ends while its read is in flight and the cancel reaches the staging step
    first (the loop task has no await left to interrupt): its blocks are dropped and the load
    counts as cancelled, not failed (reported with its blocks, which vLLM holds until then).
    Before the fix it counted every block as failed (the e2e abort test's 7 load_failed_blocks)."""
    w0, _ = _worker(str(tmp_path), backend_kind)
    _save(w0, 4)
    w0.close()
    # the read completes 1 s late: the cancel below comes while it is in flight, however slowly
    # this thread runs (it only waits for the read to have started)
    monkeypatch.setenv("AIOKV_FAULTS", json.dumps([{"op": "read", "kind": "late", "delay": 1.0}]))
    monkeypatch.setenv("AIOKV_FAULTS_ACK", ACK)
    w, kv = _worker(str(tmp_path), backend_kind)
    try:
        marks = _mark(kv, [11, 12, 13, 14])
        w.load([Transfer("r", [key(i) for i in range(4)], [0, 1, 2, 3], [11, 12, 13, 14])])
        (rule,) = w.backend.rules
        _eventually(lambda: rule.fired > 0)  # the read has been issued: its late answer is pending
        assert w.in_flight == 1, "the read is in flight"
        # the cancel reaches the staging step, not the task (it has no await left): the loop
        # forgets the task before it takes the cancel (commands run in the order handed in)
        w.loop.call_soon_threadsafe(w.loads._tasks.pop, "r", None)
        w.cancel(["r"])
        end = time.monotonic() + 10
        done, errors, counts = set(), set(), {}
        while "r" not in done and time.monotonic() < end:
            d, e, rep = w.poll()
            done |= d
            errors |= e
            for k, v in rep.counters.items():
                counts[k] = counts.get(k, 0) + v
            time.sleep(0.005)
        assert done == {"r"} and errors == {11, 12, 13, 14}, errors  # nothing was copied in
        assert counts.get("load_failed_blocks", 0) == 0 and counts["load_cancelled_blocks"] == 4, counts
        w.layers.begin()
        w.layers.end_step()
        assert _untouched(kv, marks) and w.pool.in_use == 0
    finally:
        w.close()
