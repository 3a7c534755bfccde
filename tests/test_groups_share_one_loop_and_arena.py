# SPDX-License-Identifier: Apache-2.0
"""One event loop and one staging arena per worker process, for every KV-cache group
(worker/host.py). Before, a model with several groups ran one TransferWorker per
group, each with its own loop thread and arena: a hybrid model with many groups
ran many threads.

Invariants: the groups of one GroupedWorker built on one WorkerHost run on one
loop thread; groups whose slots differ in size share the arena (its slots the
largest group's size) and each saves and loads its own blocks bit-exact, from
the shared memory tier too, where the same key of two groups names two blocks;
the memory tier's level is reported once, not once per group; close ends the
thread and frees the arena once.
"""

from __future__ import annotations

import os
import threading
import time

import torch

from aiokv.data import format as fmt
from aiokv.jobs import Transfer
from aiokv.store.store import ns_dir
from aiokv.worker.device import CpuDevice
from aiokv.worker.groups import GroupedWorker
from aiokv.worker.host import WorkerHost
from aiokv.worker.transfer import TransferWorker
from tests.conftest import key

NB = 20
NSIDS = {0: bytes(range(16)), 1: bytes(range(1, 17))}


def _poll_all(gw: GroupedWorker, timeout: float = 10.0):
    finished, errors, counters, saved = set(), set(), {}, []
    end = time.monotonic() + timeout
    while True:
        busy = gw.in_flight
        f, e, _, rep = gw.poll()
        finished |= f
        errors |= e
        saved += rep.written()
        for k, v in rep.counters.items():
            counters[k] = counters.get(k, 0) + v
        if not busy or time.monotonic() > end:
            return finished, errors, counters, saved
        time.sleep(0.002)


def test_groups_of_different_slot_sizes_share_one_loop_and_arena(tmp_path):
    before = {t.name for t in threading.enumerate()}
    kv = {0: {"a": torch.randn(NB, 2, 64, 64)}, 1: {"b": torch.randn(NB, 2, 16, 8)}}  # slots of two sizes
    devs = {g: CpuDevice(kv[g], NB) for g in kv}
    slots = {g: fmt.slot_bytes(d.payload_bytes) for g, d in devs.items()}
    assert slots[0] > slots[1]
    host = WorkerHost(max(slots.values()), 8 * slots[0], 6 * slots[0], 0, 0)
    workers = {}
    for g, d in devs.items():
        os.makedirs(ns_dir(str(tmp_path), NSIDS[g]), exist_ok=True)
        workers[g] = TransferWorker(d, ns_dir(str(tmp_path), NSIDS[g]), NSIDS[g], 0, 0, host=host)
    gw = GroupedWorker(workers, {0, 1}, host)
    try:
        loops = {t.name for t in threading.enumerate()} - before
        assert loops == {"aiokv-worker0"}, f"one loop thread for every group, not {loops}"
        assert workers[0].loop is workers[1].loop and workers[0].staging is workers[1].staging
        # the same keys in both groups (a key names a block only within its group's namespace)
        gw.save([Transfer("s", [key(i) for i in range(3)], [0, 1, 2], [1, 2, 3], g) for g in (0, 1)])
        _, _, counters, saved = _poll_all(gw)
        assert len(saved) == 6 and counters["bytes_written"] == 3 * (slots[0] + slots[1])
        assert counters["memory_held_bytes"] == 6 * host.staging.slot_bytes, "the level is counted once"
        gw.load([Transfer("m", [key(i) for i in range(3)], [0, 1, 2], [6, 7, 8], g) for g in (0, 1)])
        finished, errors, counters, _ = _poll_all(gw)
        assert finished == {"m"} and not errors and counters["memory_hit_blocks"] == 6
        gw.drop_memory()  # the loads below read the disk
        gw.load([Transfer("r", [key(i) for i in range(3)], [0, 1, 2], [11, 12, 13], g) for g in (0, 1)])
        finished, errors, counters, _ = _poll_all(gw)
        assert finished == {"r"} and not errors and counters["loads_ok_blocks"] == 6
        assert counters["bytes_read"] == 3 * (slots[0] + slots[1])
        for g in kv:
            for t in kv[g].values():
                assert torch.equal(t[6:9], t[1:4]), f"group {g}'s blocks came back from memory bit-exact"
                assert torch.equal(t[11:14], t[1:4]), f"group {g}'s blocks came back from disk bit-exact"
        assert gw.staging_in_use == 0
    finally:
        gw.close()
    assert {t.name for t in threading.enumerate()} - before == set(), "the loop thread ended"
    assert host.staging.pool.arena._map.closed, "the arena was freed"
