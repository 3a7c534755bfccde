# SPDX-License-Identifier: Apache-2.0
"""A look at the other engines that fails part-way loses no order and no record.

The bug: following.py read the control file and each other engine's files in one look, moving
each reader's position as it read, and handed the look over whole or not at all. An EIO on one
engine's journal (or any other error later in the look, or in applying it: a bug, `control.take`
raising) dropped what had been read already, and the positions had moved past it: an order was
never applied here (its clear kept this engine's blocks for good), and another engine's new
blocks were never seen.
The invariant: a position moves only with what was handed over and applied; one engine's bad
files never stop following the others (nor the orders); once they read again, nothing they said
is missing.
The fix: following.py follows each engine apart: a poll that fails reads again from where it
was (follower.py's Follower puts its position back, or replays the files whole if it was
replacing its view); a failure after a poll, or in applying one engine's records, replays that
engine's files whole at a later look (waiting longer while it keeps failing); the control file's
position moves only with a read that succeeded; the owner takes the orders and applies each
engine's records apart.
"""

from __future__ import annotations

import asyncio
import errno
import os
import time

import pytest

from aiokv.cli import operate
from aiokv.store import control as control_mod
from tests.conftest import NS, PAYLOAD, key
from tests.stallfs import mounted
from tests.workers import until
from tools.storeio import StoreIO


async def _fill(st, ns, blocks, ids, tenant):
    for j, i in enumerate(ids):
        blocks.fill(j % 8, key(i))
        deadline = time.monotonic() + 20
        while True:
            skipped = st.stats.skipped_fs_busy + st.stats.skipped_loading
            got = await st.save(ns, [(key(i), blocks.addr(j % 8))], tenant=tenant)
            # with the I/O thread, a save that finds its data file still growing past the step's
            # budget (a loaded machine) is dropped and counted, never waited for: save it again
            if got != [-errno.ENOSPC] or st.stats.skipped_fs_busy + st.stats.skipped_loading == skipped:
                break
            assert time.monotonic() < deadline, "the data file never grew"
            await asyncio.sleep(0.01)
        assert got == [0]


def _hits(st, ns, ids) -> list[bool]:
    st.refresh()
    st.lookup(ns, [], 0)
    return [ns.has(key(i)) for i in ids]


async def _three_engines(root, blocks, io_thread):
    """Engines 0 and 1 with blocks 0-5 (0-3 alice's); engine 2, the one that follows (with or
    without the store's I/O thread), with its own alice blocks 10 and 11, seeing 0-5."""
    e0, e1 = StoreIO(root, capacity="1GiB"), StoreIO(root, capacity="1GiB")
    n0, n1 = e0.namespace(NS, PAYLOAD), e1.namespace(NS, PAYLOAD)
    await _fill(e0, n0, blocks, range(4), "alice")
    await _fill(e1, n1, blocks, range(4, 6), "bob")
    obs = StoreIO(root, capacity="1GiB", io_thread=io_thread)
    obs.follow_interval = 0
    nobs = obs.namespace(NS, PAYLOAD)
    assert until(lambda: (obs.refresh(), obs.loading)[1] == 0, 20)
    await _fill(obs, nobs, blocks, [10, 11], "alice")
    assert until(lambda: _hits(obs, nobs, range(6)) == [True] * 6, 10)
    return (e0, n0), (e1, n1), (obs, nobs)


@pytest.mark.parametrize("io_thread", [False, True], ids=["inline", "io_thread"])
async def test_an_eio_on_one_engines_journal_after_the_control_file_was_read_loses_nothing(tmp_path, blocks, io_thread):
    control = str(tmp_path / "stall")
    with mounted(str(tmp_path / "src"), str(tmp_path / "mnt"), control):
        root = str(tmp_path / "mnt" / "c")
        (e0, n0), (e1, n1), (obs, nobs) = await _three_engines(root, blocks, io_thread)
        try:
            # an order, a new block of engine 0 and one of engine 1; then engine 1's journal
            # stops reading (EIO from the kernel), so each look reads the control file and
            # engine 0's journal and then fails on engine 1's
            assert operate.run("clear", root, "alice", wait=0)["order"] == 1
            await _fill(e0, n0, blocks, [20], "bob")
            await _fill(e1, n1, blocks, [21], "bob")
            with open(control + ".eio", "w") as f:
                f.write("/e1/journal")
            # the order is applied here and engine 0's new block seen, whatever engine 1's files do
            assert until(lambda: _hits(obs, nobs, [10, 11, 20]) == [False, False, True], 10), (
                f"with engine 1's journal failing: own alice blocks 10, 11 and engine 0's new block 20 "
                f"are {_hits(obs, nobs, [10, 11, 20])} (want cleared, cleared, seen); orders taken: "
                f"{[o.number for o in obs.control.orders]}"
            )
            assert _hits(obs, nobs, [4, 5, 21]) == [True, True, False]  # engine 1 as last read
            os.unlink(control + ".eio")
            # its files read again: its new block is seen, nothing else changed
            assert until(lambda: _hits(obs, nobs, [21]) == [True], 20), "engine 1's new block never seen"
            assert _hits(obs, nobs, [*range(6), 10, 11, 20, 21]) == [False] * 4 + [True] * 2 + [False] * 2 + [True] * 2
        finally:
            for st in (obs, e0, e1):
                st.close()


async def test_an_error_in_applying_one_engines_records_or_the_orders_loses_nothing(tmp_path, blocks, monkeypatch):
    """A bug (not an OSError) while the owner applies a look, once in `control.take` and once
    in engine 1's records: the look's other records are applied, and the orders and engine 1's
    records are handed over again."""
    control = str(tmp_path / "stall")
    with mounted(str(tmp_path / "src"), str(tmp_path / "mnt"), control):
        root = str(tmp_path / "mnt" / "c")
        (e0, n0), (e1, n1), (obs, nobs) = await _three_engines(root, blocks, io_thread=True)
        try:
            real_take = control_mod.Control.take
            fail = {"take": 1}

            def take(self, orders):
                if orders and fail["take"]:
                    fail["take"] -= 1
                    raise RuntimeError("injected: taking the orders failed")
                return real_take(self, orders)

            monkeypatch.setattr(control_mod.Control, "take", take)
            broken = {"peer_apply": 1}
            real_peer_apply = type(nobs).peer_apply

            def peer_apply(self, engine, *a, **kw):
                if engine == 1 and broken["peer_apply"]:
                    broken["peer_apply"] -= 1
                    raise ValueError("injected: applying engine 1's records failed")
                return real_peer_apply(self, engine, *a, **kw)

            monkeypatch.setattr(type(nobs), "peer_apply", peer_apply)
            assert operate.run("clear", root, "alice", wait=0)["order"] == 1
            await _fill(e0, n0, blocks, [20], "bob")
            await _fill(e1, n1, blocks, [21], "bob")
            assert until(lambda: _hits(obs, nobs, [10, 11, 20, 21]) == [False, False, True, True], 10), (
                f"after a failed take and a failed apply: blocks 10, 11, 20, 21 are "
                f"{_hits(obs, nobs, [10, 11, 20, 21])} (want cleared, cleared, seen, seen)"
            )
            assert not fail["take"] and not broken["peer_apply"]  # (both faults happened)
        finally:
            for st in (obs, e0, e1):
                st.close()


async def test_an_eio_while_another_engine_rolls_its_checkpoint_loses_nothing(tmp_path, blocks):
    """Engine 1 writes a checkpoint (a roll: the rest of its old journal, then its new one) and
    its new journal does not read: the look fails after it moved to the new files; the records
    it read from the old journal are not lost (its files are replayed whole once they read)."""
    control = str(tmp_path / "stall")
    with mounted(str(tmp_path / "src"), str(tmp_path / "mnt"), control):
        root = str(tmp_path / "mnt" / "c")
        (e0, n0), (e1, n1), (obs, nobs) = await _three_engines(root, blocks, io_thread=False)
        try:
            await _fill(e1, n1, blocks, [30], "bob")  # in its old journal
            e1.checkpoint()
            await _fill(e1, n1, blocks, [31], "bob")  # in its new one
            with open(control + ".eio", "w") as f:
                f.write(f"/e1/journal.{e1.persist.logs[NS].gen}")
            assert _hits(obs, nobs, [30, 31]) == [False, False]  # (the look failed)
            os.unlink(control + ".eio")
            assert until(lambda: _hits(obs, nobs, [30, 31]) == [True, True], 20), (
                f"after the failed roll, engine 1's blocks 30 (old journal) and 31 (new one) are "
                f"{_hits(obs, nobs, [30, 31])}"
            )
            assert _hits(obs, nobs, range(6)) == [True] * 6
        finally:
            for st in (obs, e0, e1):
                st.close()
