# SPDX-License-Identifier: Apache-2.0
"""Bug guarded against: every hit read the disk, even for a block saved or read
a second ago; a memory tier could also serve a block that never reached the
disk, outgrow its budget, or hand a job a slot another job still reads.

Invariants: a block kept in host memory is served without any disk read (the
data file may be gone); only blocks written (saves) or read and verified
(loads) are kept; the tier holds at most `memory_bytes` of slots, least
recently used out first; kept buffers are not counted as staging in use, and
saves and loads still get slots when the tier is full (they evict it);
`memory_held_bytes` reports the level as it changes.

Fix: aiokv/worker/memory.py (HostCache over the staging arena) wired into
TransferWorker._save (keep after the write) and _load_body (take before the
read, keep after the copy in).
"""

from __future__ import annotations

import os

import torch

from aiokv.data.slotfile import data_path
from aiokv.jobs import Transfer
from aiokv.store.store import ns_dir
from aiokv.worker.transfer import TransferWorker
from tests.conftest import NS, key
from tests.workers import cpu_worker, run_jobs

NB = 40


def _worker(root: str, kept: int, **kw) -> tuple[TransferWorker, dict]:
    kv = {f"l{i}": torch.randn(NB, 2, 32, 8) for i in range(2)}
    return cpu_worker(root, kv, 4, kept, **kw), kv


_run = run_jobs


def _save(w, ids):
    """Save blocks ids (block id i + 1 under key(i), slot i)."""
    _, _, rep = _run(w, w.save, [Transfer(f"s{i}", [key(i)], [i], [i + 1]) for i in ids])
    assert not rep.not_written() and len(rep.written()) == len(ids), rep
    return rep


def _load(w, ids, first_block: int):
    ts = Transfer("r", [key(i) for i in ids], list(ids), list(range(first_block, first_block + len(ids))))
    done, errors, rep = _run(w, w.load, [ts])
    assert done == {"r"}
    return errors, rep.counters


def test_recent_blocks_load_from_memory_without_the_disk(tmp_path):
    w, kv = _worker(str(tmp_path), kept=8)
    try:
        rep = _save(w, range(6))
        assert rep.counters["memory_held_bytes"] == 6 * w.slot_bytes
        assert w.staging_in_use == 0, "kept buffers are not staging in use"
        os.unlink(data_path(ns_dir(str(tmp_path), NS), 0))  # no disk behind them any more
        errors, c = _load(w, range(6), 20)
        assert not errors
        assert c["memory_hit_blocks"] == 6 and c["loads_ok_blocks"] == 6 and not c.get("bytes_read"), c
        for i in range(6):
            for t in kv.values():
                assert torch.equal(t[20 + i], t[i + 1])
    finally:
        w.close()


def test_only_written_or_verified_blocks_are_kept_and_the_budget_holds(tmp_path):
    w, kv = _worker(str(tmp_path), kept=4)
    try:
        _save(w, range(5))  # (in two parts: 8 slots in all)
        _save(w, range(5, 10))  # 10 written, 4 kept: the 4 whose writes ended last
        assert w.cache.kept == 4
        # the two most recently kept (the two oldest go when the load below keeps blocks 0 and 1)
        newest = [next(i for i in range(10) if (w.memory_ns, key(i)) == k) for k in list(w.cache._kept)[-2:]]
        errors, c = _load(w, [0, 1], 20)  # not kept: read from disk, verified, then kept
        assert not errors and c["bytes_read"] == 2 * w.slot_bytes and not c.get("memory_hit_blocks"), c
        errors, c = _load(w, [0, 1, *newest], 22)  # all four kept now (0, 1 by the load, the others by saves)
        assert not errors and c["memory_hit_blocks"] == 4 and not c.get("bytes_read"), c
        assert w.cache.kept == 4, "never more than the budget"
        for i, b in zip([0, 1, *newest], range(22, 26)):
            assert torch.equal(kv["l0"][b], kv["l0"][i + 1])
        # a block whose read does not verify is not kept (nor served from memory later)
        bad = Transfer("b", [key(99)], [5], [27])  # slot 5 holds key(5): verification fails
        done, errors, rep = _run(w, w.load, [bad])
        assert errors == {27} and w.staging.take_kept([key(99)], w.memory_ns) == [None]
        assert w.staging_in_use == 0
    finally:
        w.close()


def test_jobs_evict_the_tier_when_staging_runs_short(tmp_path):
    w, _ = _worker(str(tmp_path), kept=8)
    try:
        _save(w, range(8))
        assert w.cache.kept == 8 and w.cache.available == w.pool.count
        # a save of 10 blocks needs more slots than are free: it evicts kept blocks, never drops
        _, _, rep = _run(
            w, w.save, [Transfer("big", [key(100 + i) for i in range(10)], list(range(100, 110)), list(range(1, 11)))]
        )
        assert len(rep.written()) == 10 and not rep.not_written()
        assert not rep.counters.get("save_skipped_staging_full")
        assert w.cache.kept == 8 and w.staging_in_use == 0
    finally:
        w.close()


def test_memory_off_keeps_nothing(tmp_path):
    w, _ = _worker(str(tmp_path), kept=0)
    try:
        rep = _save(w, range(3))
        assert not rep.counters.get("memory_held_bytes") and w.cache.kept == 0
        errors, c = _load(w, range(3), 20)
        assert not errors and c["bytes_read"] == 3 * w.slot_bytes and not c.get("memory_hit_blocks")
        assert w.pool.in_use == 0
    finally:
        w.close()


def test_memory_setting_parses_and_bad_values_name_the_fix():
    import re

    import pytest

    from aiokv.config import AioKVConfig, ConfigError

    assert AioKVConfig.from_extra({"path": "/tmp/x"}).memory == 1 << 30
    assert AioKVConfig.from_extra({"path": "/tmp/x", "memory": "16GiB"}).memory == 16 << 30
    assert AioKVConfig.from_extra({"path": "/tmp/x", "memory": 0}).memory == 0
    for bad, says in (("lots", "not a size"), (-1, "0 (off) or a size")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            AioKVConfig.from_extra({"path": "/tmp/x", "memory": bad})


def test_a_cache_reset_drops_the_tier(tmp_path):
    """After a cache reset (connector.reset_cache: the weights may have changed) the
    workers keep nothing from before: a load reads the disk again, and the slots are free."""
    w, kv = _worker(str(tmp_path), kept=8)
    try:
        _save(w, range(4))
        assert w.cache.kept == 4
        w.drop_memory()
        assert w.cache.kept == 0 and w.pool.in_use == 0
        errors, c = _load(w, range(4), 20)
        assert not errors and not c.get("memory_hit_blocks") and c["bytes_read"] > 0, c
    finally:
        w.close()
