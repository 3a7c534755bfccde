# SPDX-License-Identifier: Apache-2.0
"""A load cancelled by a cache reset leaves vLLM nothing of what it loaded (issue 37, item 3).

Bug: a reset (`reset_prefix_cache(reset_connector=True)`, the weights changed in place)
cancels the loads in flight, but a cancelled load reported as failed only the blocks it
had not copied yet, and vLLM's per-block path keeps every block before the first failed
one: the prefix already copied, computed under the old weights, was used under the new
ones. A load that had ended on the worker's loop but whose report vLLM had not been
handed yet was reported whole and used whole.
Invariant: a cancelled load is reported with every block failed, whatever it copied;
so is a load whose cancel reaches the worker before vLLM was handed its report (a
layer-by-layer load staged but not copied too: its staged blocks are dropped). On real
vLLM (CPU), a load held in flight (slow reads) across `reset_prefix_cache(reset_connector=True)`
after `reload_weights` serves the tokens of an engine started on the new weights; vLLM's
own reset reports False while the request holds its blocks, and succeeds once asked again
with `reset_running_requests=True` after the cancelled load was reported (docs/operations.md).
Fix: worker/loads.py (a cancelled load's blocks all fail), worker/results.py (`cancelled`:
a report not handed on yet is made whole-failed), worker/transfer.py (cancel calls it).
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from aiokv.data import format as fmt
from aiokv.data.faults import ACK, FIRED
from aiokv.jobs import Transfer
from aiokv.store.store import ns_dir
from aiokv.worker.device import CpuDevice
from aiokv.worker.transfer import TransferWorker
from tests.conftest import NS, key
from tests.e2e import happened, prompts, run
from tests.workers import until

NB = 24


def _worker(root: str, staging: int, layerwise: bool = False) -> tuple[TransferWorker, torch.Tensor]:
    kv = torch.randn(NB, 2, 16, 8)
    os.makedirs(ns_dir(root, NS), exist_ok=True)
    dev = CpuDevice({"l0": kv}, NB)
    w = TransferWorker(
        dev, ns_dir(root, NS), NS, 0, staging_bytes=staging * fmt.slot_bytes(dev.payload_bytes), layerwise=layerwise
    )
    return w, kv


def _save(w: TransferWorker, n: int) -> None:
    """Blocks 10.. saved under key(0..n-1) in slots 0..n-1 (three at a time: a small staging pool)."""
    for i in range(0, n, 3):
        part = range(i, min(n, i + 3))
        w.save([Transfer("s", [key(j) for j in part], list(part), [10 + j for j in part])])
        w.drain(10)
        _, _, rep = w.poll()
        assert len(rep.written()) == len(part), rep


def _report(w: TransferWorker, req: str, timeout: float = 10) -> tuple[set, dict]:
    """(block ids reported failed, counters) once `req` is reported finished."""
    end, errors, counts = time.monotonic() + timeout, set(), {}
    while time.monotonic() < end:
        done, errs, rep = w.poll()
        errors |= errs
        for k, v in rep.counters.items():
            counts[k] = counts.get(k, 0) + v
        if req in done:
            assert all(set(r.failed) == errors for r in rep.loads if r.req_id == req), rep.loads
            return errors, counts
        time.sleep(0.005)
    raise AssertionError(f"load {req} never reported")


def test_a_load_cancelled_after_copying_part_reports_every_block_failed(tmp_path, monkeypatch):
    # 4 staging buffers: the 6 blocks load in two chunks; the second chunk's reads are late
    monkeypatch.setenv("AIOKV_FAULTS", json.dumps([{"op": "read", "kind": "late", "delay": 1.0, "skip": 4}]))
    monkeypatch.setenv("AIOKV_FAULTS_ACK", ACK)
    FIRED.clear()
    w, kv = _worker(str(tmp_path), 4)
    try:
        _save(w, 6)
        kv[1:7] = 0
        w.load([Transfer("r", [key(i) for i in range(6)], list(range(6)), list(range(1, 7)))])
        assert until(lambda: FIRED.get("read:late", 0) > 0, 10), "the second chunk's reads never started"
        assert torch.equal(kv[1:5], kv[10:14]), "the first chunk was not copied before the second's reads"
        w.cancel(["r"])  # the reset: the request lives on and recomputes
        failed, counts = _report(w, "r")
        assert failed == set(range(1, 7)), f"blocks reported failed: {sorted(failed)} (vLLM keeps those before)"
        assert counts.get("loads_ok_blocks", 0) == 0 and counts["load_cancelled_blocks"] == 6, counts
    finally:
        w.close()


@pytest.mark.parametrize("seen", ["queued", "drained"])
@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_a_load_ended_but_not_yet_reported_when_cancelled_reports_every_block_failed(tmp_path, seen, layerwise):
    """queued: its report still in the loop's queue; drained: read off it, not yet handed to vLLM."""
    w, kv = _worker(str(tmp_path), 16, layerwise)
    try:
        _save(w, 3)
        kv[1:4] = 0
        w.results.job_done.clear()  # (set by the save)
        w.load([Transfer("r", [key(i) for i in range(3)], [0, 1, 2], [1, 2, 3])])
        assert until(lambda: w.results.job_done.is_set(), 10)  # it ended on the loop
        if seen == "drained":
            assert w.in_flight == 0  # (drains the queue)
        w.cancel(["r"])
        if w.layers is not None:
            w.layers.begin()
            w.layers.end_step()
        failed, counts = _report(w, "r")
        assert failed == {1, 2, 3}, f"blocks reported failed: {sorted(failed)}"
        if w.layers is not None:  # staged, not copied: dropped
            assert torch.count_nonzero(kv[1:4]) == 0 and w.layers.counts["dropped_blocks"] == 3
        assert counts.get("loads_ok_blocks", 0) == 0 and counts["load_cancelled_blocks"] == 3, counts
        # a later load of the same id is not cut by that cancel
        w.load([Transfer("r", [key(0)], [0], [5])])
        assert _report(w, "r")[0] == set()
    finally:
        w.close()


@pytest.mark.vllm
def test_a_load_held_across_a_reset_serves_only_the_new_weights(tmp_path, tiny_model):
    """Real vLLM (CPU), one engine life; the memory tier holds 4 blocks. Phase 0 stores P0 (6
    blocks) under the weight files; phase 1 loads its first 4 blocks (a prompt of those 4 and
    one token): the memory tier now holds them. Phase 2: other weights loaded in place
    (reload_weights), vLLM's own prefix cache emptied, P0 asked again: aiokv copies blocks 1-4
    in from memory and reads 5-6 from disk, held back (late by 2 s); then
    `reset_prefix_cache(reset_connector=True)`: False, as vLLM's own reset fails while P0 holds
    its blocks, but aiokv's epoch rotates and the load is cut. P0's tokens are those of an
    engine started on the new weights. Asked again once nothing holds blocks (the start of
    phase 3), the reset succeeds.

    Then issue 37, item 9: phase 3 stores Q under the new epoch; phase 4 asks for Q0 again and
    aborts it while its load is in flight: `reset_prefix_cache(reset_running_requests=True,
    reset_connector=True)` raises RuntimeError in vLLM before it reaches the connector (the
    aborted request's blocks stay held until its load is reported), so aiokv's epoch does not
    rotate; `reset_connector=True` alone reaches it (False: vLLM's part failed); once the
    cancelled load was reported, the first call succeeds. Phase 5: Q0 is a miss (the epoch
    rotated) with the new weights' tokens."""
    from aiokv.demo.tiny_model import build

    other = build(str(tmp_path / "other"), layers=2, hidden=128, heads=2, kv_heads=2, intermediate=256, seed=1)
    p = prompts(1, 200, seed=71)  # 6 full blocks of 32 (one token is left to compute)
    q = prompts(2, 200, seed=72)
    every = {"reset_running_requests": True, "reset_connector": True}
    phases = [
        {"prompts": p},
        {"prompts": [p[0][: 4 * 32 + 1]], "settle": True, "reset_prefix_cache": {}},
        {"prompts": p, "reload_weights": other, "reset_prefix_cache": {}},
        {"prompts": q, "reset_prefix_cache": every},  # asked again once nothing holds blocks: True
        {"prompts": q[:1], "settle": True, "reset_prefix_cache": {}},
        {"prompts": q[:1]},
    ]
    base = run(dict(model=tiny_model, phases=phases))
    phases[2]["resets"] = [{"when": "fired:read:late", "kwargs": {"reset_connector": True}}]
    phases[4]["abort_after"] = {0: 1}
    phases[4]["resets"] = [
        {"when": "loading", "kwargs": every},
        {"when": "loading", "kwargs": {"reset_connector": True}},
        {"when": "not_loading", "kwargs": every},
    ]
    # the memory tier keeps the last 4 blocks: after phase 0, P0's 3-6; phase 1 reads 1-2 (on time)
    # and keeps 1-4. Every later read is late.
    late = [{"op": "read", "kind": "late", "delay": 2.0, "skip": 2}]
    memory = 4 * fmt.slot_bytes(2 * 2 * 32 * 2 * 64 * 4)  # 4 slots of the tiny model's blocks (fp32)
    life = run(
        dict(model=tiny_model, cache=str(tmp_path / "c"), extra={"memory": memory}, phases=phases),
        env={"AIOKV_FAULTS": json.dumps(late), "AIOKV_FAULTS_ACK": ACK},
    )
    assert life["reset"] == [True, True, True, True], life["reset"]  # (at the start of phases 1 to 4)
    assert life["phase_resets"] == [
        [2, False, True],
        [4, "RuntimeError", False],
        [4, False, True],
        [4, True, True],
    ], life["phase_resets"]
    assert life["aborted_while"] == {"WAITING_FOR_REMOTE_KVS": 1}, life["aborted_while"]
    assert life["cached"][5] == [0], life["cached"]
    # (loads_cancelled counts the abort only: the scheduler side's count of loads of aborted requests)
    happened(
        life,
        base,
        hit_blocks=4 + 6 + 6,
        memory_hit_blocks=">=6",
        loads_cancelled=1,
        load_cancelled_blocks=12,
        loads_ok_blocks=4,
    )
