# SPDX-License-Identifier: Apache-2.0
"""Several engines on one cache directory at the same time (store level).

Bug: a second engine on a directory was refused ("in use by another engine"),
so engines on one host (DP ranks, several `vllm serve`) could not share blocks.
Invariant: any number of engines open one directory at once; a block committed
by one is a hit for the others within about a second while both run, and
loads back byte for byte from the committer's files; capacity and LRU are the
directory's, not an engine's; an engine killed with kill -9 mid-save leaves
the others running, its committed blocks served and its half-written ones
never; a restarted engine adopts a dead engine's files; a format-1 directory
opens (migrated); `aiokv inspect` shows every engine.
Fix: each engine owns an engine number (an flock per number) and only its own
files; it follows the others' journals (Store.refresh, from lookups and once per
step) and hands out locations (engine << 32 | slot) that BlockIO resolves to the
right engine's file; every read verifies the slot header and CRCs.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import types

import pytest

from aiokv.cli import inspect as insp
from aiokv.data import format as fmt
from aiokv.store import Store, StoreLocked
from aiokv.store import index as index_mod
from aiokv.store import loadpins as loadpins_mod
from aiokv.store import meta as meta_mod
from aiokv.store import reclaim as reclaim_mod
from aiokv.store import saves as saves_mod
from aiokv.store import store as store_mod
from aiokv.store.lock import engines
from tests.conftest import NS, PAYLOAD, key
from tools.storeio import StoreIO

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SB = fmt.slot_bytes(PAYLOAD)


def _following(st: Store) -> Store:
    st.follow_interval = 0  # look at the other engines at every lookup/refresh
    return st


async def _save(st, ns, blocks, ids):
    for j, i in enumerate(ids):
        blocks.fill(j, key(i))
    return await st.save(ns, [(key(i), blocks.addr(j)) for j, i in enumerate(ids)])


async def _loads_intact(st, ns, blocks, ids) -> bool:
    for j in range(len(ids)):
        blocks.clear(j)
    res = await st.load(ns, [(key(i), blocks.addr(j)) for j, i in enumerate(ids)])
    return res == [0] * len(ids) and all(blocks.holds(j, key(i)) for j, i in enumerate(ids))


async def test_two_engines_share_hits_both_ways(tmp_path, blocks, backend_kind):
    root = str(tmp_path / "s")
    a = _following(StoreIO(root))
    b = _following(StoreIO(root))
    assert (a.engine, b.engine) == (0, 1)
    na, nb = a.namespace(NS, PAYLOAD), b.namespace(NS, PAYLOAD)
    assert await _save(a, na, blocks, range(16)) == [0] * 16
    assert b.lookup(nb, [key(i) for i in range(16)]) == 16  # A's blocks are B's hits
    assert await _loads_intact(b, nb, blocks, range(16))  # read from A's file
    assert all(fmt.split(nb.where(key(i)))[0] == 0 for i in range(16))
    # B does not store again what A holds; what B adds is A's hit in turn
    assert await _save(b, nb, blocks, range(12, 24)) == [-17] * 4 + [0] * 8  # -EEXIST for 12..15
    assert a.lookup(na, [key(i) for i in range(24)]) == 24
    assert await _loads_intact(a, na, blocks, range(24))
    a.close()
    b.close()
    # a restarted engine takes number 0 again (its own files) and still sees B's
    c = StoreIO(root)
    nc = c.namespace(NS, PAYLOAD)
    assert c.engine == 0 and c.lookup(nc, [key(i) for i in range(24)]) == 24
    assert await _loads_intact(c, nc, blocks, range(24))
    c.close()


async def test_a_block_dropped_by_its_engine_is_a_miss_for_the_other(tmp_path, blocks):
    root = str(tmp_path / "s")
    a, b = _following(StoreIO(root)), _following(StoreIO(root))
    na, nb = a.namespace(NS, PAYLOAD), b.namespace(NS, PAYLOAD)
    await _save(a, na, blocks, range(4))
    assert b.lookup(nb, [key(i) for i in range(4)]) == 4
    a.drop(na, [key(0)], corrupt=False)
    assert b.lookup(nb, [key(0)]) == 0 and b.lookup(nb, [key(1)]) == 1
    # a slot rewritten under B's feet (B has not looked yet) is a miss, never wrong bytes
    b.follow_interval = 3600
    a.drop(na, [key(1)], corrupt=False)
    assert await _save(a, na, blocks, [50]) == [0]  # reuses key(1)'s slot
    assert na.block(key(50))[0] == fmt.split(nb.where(key(1)))[1]
    blocks.clear(0)
    assert await b.load(nb, [(key(1), blocks.addr(0))]) == [-74]  # -EBADMSG: header names another key
    assert not nb.has(key(1)) and b.stats.corrupt_dropped == 1
    a.close()
    b.close()


async def test_capacity_and_lru_are_the_directorys(tmp_path, blocks):
    root = str(tmp_path / "s")
    cap = 24 * SB + 64 * 1024  # 24 slots, and room for the journals
    a, b = _following(StoreIO(root, capacity=cap)), _following(StoreIO(root, capacity=cap))
    na, nb = a.namespace(NS, PAYLOAD), b.namespace(NS, PAYLOAD)
    assert await _save(a, na, blocks, range(16)) == [0] * 16  # A's blocks are the oldest
    for i in range(100, 116, 2):  # B writes 16 newer blocks while both step
        b.refresh()
        assert await _save(b, nb, blocks, [i, i + 1]) == [0, 0]
        a.refresh()
    b.refresh()
    a.refresh()
    # every block of B is kept; A gave back its oldest ones
    assert b.lookup(nb, [key(i) for i in range(100, 116)]) == 16
    assert 0 < na.table.count <= 8 and set(na.keys(na.engine)) == {key(i) for i in range(16 - na.table.count, 16)}
    disk = sum(
        os.stat(os.path.join(dp, f)).st_blocks * 512 for dp, _, fs in os.walk(root) for f in fs if f.endswith(".data")
    )
    assert disk <= cap + cap // 16, (disk, cap)
    # the directory's total, seen by both, is within the capacity once A shed
    assert a.space.used() <= cap and b.space.used() <= cap + cap // 16
    a.close()
    b.close()


async def test_engine_killed_mid_save_leaves_the_other_unaffected(tmp_path, blocks, backend_kind):
    root = str(tmp_path / "s")
    b = StoreIO(root, capacity="256MiB")  # engine 0: this process, following at its default pace
    nb = b.namespace(NS, PAYLOAD)
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.Popen(
        [sys.executable, "-m", "tests._crash_writer", root], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    )  # engine 1: saves bursts forever
    committed, delays = [], []
    mine = 0
    try:
        deadline = time.monotonic() + 60
        while len(committed) < 300 and time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            k = bytes.fromhex(line.strip())
            committed.append(k)
            if len(committed) % 32 == 1:  # how long until this engine sees it, while both run
                t0 = time.monotonic()
                while b.lookup(nb, [k]) == 0 and time.monotonic() - t0 < 5:
                    time.sleep(0.01)
                delays.append(time.monotonic() - t0)
                # and this engine keeps saving meanwhile
                assert await _save(b, nb, blocks, range(100000 + mine, 100000 + mine + 4)) == [0] * 4
                mine += 4
        os.kill(p.pid, signal.SIGKILL)  # mid-burst: its next batch is being written
        p.wait()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert len(committed) >= 300, "the writer did not get going"
    # A hit for the other engine within about a second (it follows every FOLLOW_INTERVAL, 0.1 s):
    # the bound is the promise, doubled for a busy 2-core machine; an engine that stopped following
    # never sees the block (the poll above gives up after 5 s)
    assert max(delays) < 2.0, delays
    b.refresh()
    # everything the dead engine committed is served, byte for byte; nothing else is
    assert b.lookup(nb, committed) == len(committed)
    dead = set(nb.keys(1))
    assert set(committed) <= dead
    ids_of = {key(i): i for i in range(len(dead) + 64)}
    assert dead <= set(ids_of)  # only keys the writer saved, no garbage
    for chunk in range(0, len(committed), 32):
        ids = [ids_of[k] for k in committed[chunk : chunk + 32]]
        assert await _loads_intact(b, nb, blocks, ids)
    # this engine goes on as before
    assert await _save(b, nb, blocks, range(200000, 200008)) == [0] * 8
    assert await _loads_intact(b, nb, blocks, range(200000, 200008))
    # a new engine adopts the dead one's number and files (replaying its journal as owner)
    c = StoreIO(root)
    nc = c.namespace(NS, PAYLOAD)
    assert c.engine == 1 and set(committed) <= set(nc.keys(nc.engine))
    c.close()
    b.close()


async def test_many_engines_and_explicit_numbers(tmp_path):
    root = str(tmp_path / "s")
    stores = [StoreIO(root) for _ in range(4)]
    assert [s.engine for s in stores] == [0, 1, 2, 3]
    assert engines(root) == {e: os.getpid() for e in range(4)}
    with pytest.raises(StoreLocked) as e:
        StoreIO(root, engine=2)
    assert "engine 2" in str(e.value) and f"pid {os.getpid()}" in str(e.value) and "\n" not in str(e.value)
    stores[1].close()
    assert engines(root)[1] is None
    again = StoreIO(root)  # the lowest free number
    assert again.engine == 1
    for s in stores[:1] + stores[2:] + [again]:
        s.close()


async def test_format_1_directory_is_migrated_and_unknown_formats_refused(tmp_path, blocks):
    root = str(tmp_path / "s")
    st = StoreIO(root)
    ns = st.namespace(NS, PAYLOAD)
    await _save(st, ns, blocks, range(8))
    st.close()
    # a format-1 directory has exactly engine 0's layout: only aiokv.json differs
    with open(os.path.join(root, "aiokv.json"), "w") as f:
        json.dump({"format": 1, "magic": "aiokv"}, f)
    ro = StoreIO(root, readonly=True)  # read-only openers read it as it is
    assert ro.index.namespaces[NS].count() == 8
    ro.close()
    st = StoreIO(root)
    ns = st.namespace(NS, PAYLOAD)
    assert st.lookup(ns, [key(i) for i in range(8)]) == 8 and await _loads_intact(st, ns, blocks, range(8))
    st.close()
    with open(os.path.join(root, "aiokv.json")) as f:
        assert json.load(f)["format"] == fmt.FORMAT_VERSION
    with open(os.path.join(root, "aiokv.json"), "w") as f:
        json.dump({"format": 3, "magic": "aiokv"}, f)
    with pytest.raises(ValueError) as e:
        StoreIO(root)
    assert "has format 3" in str(e.value) and "new directory" in str(e.value) and "\n" not in str(e.value)


def _summary(root: str) -> dict:
    ro = insp.open_readonly(root)
    try:
        return insp.summary(ro)
    finally:
        ro.close()


async def test_inspect_shows_every_engine(tmp_path, blocks):
    root = str(tmp_path / "s")
    a, b = _following(StoreIO(root)), _following(StoreIO(root))
    na, nb = a.namespace(NS, PAYLOAD), b.namespace(NS, PAYLOAD)
    await _save(a, na, blocks, range(5))
    await _save(b, nb, blocks, range(10, 13))
    d = _summary(root)
    assert [(e["engine"], e["pid"], e["running"], e["blocks"]) for e in d["engines"]] == [
        (0, os.getpid(), True, 5),
        (1, os.getpid(), True, 3),
    ]
    (n,) = d["namespaces"]
    assert n["blocks"] == 8 and n["engines"] == {"0": 5, "1": 3}
    ro = insp.open_readonly(root)
    assert {k["engine"] for k in insp.keys(ro)["namespaces"][0]["keys"]} == {0, 1}
    ro.close()
    b.close()
    d = _summary(root)
    assert [(e["engine"], e["running"], e["blocks"]) for e in d["engines"]] == [(0, True, 5), (1, False, 3)]
    text = insp.render_summary(d)
    assert f"engine 0:  running, pid {os.getpid()}; 5 block(s)" in text and "engine 1:  not running; 3 block(s)" in text
    v = await asyncio.to_thread(insp.verify, root)  # it runs its own event loop
    assert v["ok"] and v["checked_blocks"] == 8
    a.close()


def test_a_symlink_posing_as_an_engine_is_not_followed(tmp_path):
    root = str(tmp_path / "s")
    a = _following(StoreIO(root))
    ns = a.namespace(NS, PAYLOAD)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, os.path.join(root, "ns", NS.hex(), "e7"))
    a.refresh()
    assert 7 not in ns.peers() and (NS, 7) not in a.followers
    a.close()


async def test_following_survives_half_written_records_and_checkpoints(tmp_path, blocks):
    root = str(tmp_path / "s")
    a, b = StoreIO(root), _following(StoreIO(root))
    na, nb = a.namespace(NS, PAYLOAD), b.namespace(NS, PAYLOAD)
    await _save(a, na, blocks, range(4))
    assert b.lookup(nb, [key(i) for i in range(6)]) == 4
    # a batch caught half-way through its write(2): nothing of it is applied yet
    log = a.logs[NS]
    slot = 90
    rec = fmt.pack_record(fmt.REC_COMMIT, key(4), slot, 1)
    os.write(log.fd, rec[:40])
    assert b.lookup(nb, [key(i) for i in range(6)]) == 4
    os.write(log.fd, rec[40:])
    assert b.lookup(nb, [key(i) for i in range(6)]) == 5 and nb.where(key(4)) == fmt.loc(0, slot)
    log.size += fmt.REC_BYTES
    # A checkpoints (a new generation, the old journal deleted): B replays and keeps following
    a.drop(na, [key(0)], corrupt=False)
    a.checkpoint()
    await _save(a, na, blocks, [7])
    # (key 4 was written behind A's back: A's checkpoint, its truth, does not hold it)
    assert b.lookup(nb, [key(0)]) == 0 and b.lookup(nb, [key(4)]) == 0
    assert b.lookup(nb, [key(i) for i in (1, 2, 3, 7)]) == 4
    fl = b.followers[(NS, 0)]
    assert fl.gen == log.gen
    # (B's view had drifted by key 4: that was a full replay.) In step, a checkpoint is not
    # replayed: B reads the rest of the old journal and follows the new one.
    replay = fl.log
    a.checkpoint()
    await _save(a, na, blocks, [9])
    assert b.lookup(nb, [key(i) for i in (1, 2, 3, 7, 9)]) == 5
    assert fl.log is replay and fl.gen == log.gen and nb.count(0) == na.table.count == 5
    a.close()
    b.close()


def _fake_wall_clock(monkeypatch) -> list[int]:
    """The stores' wall clock (time.time_ns: commit and hit times) made the test's: [now in ns],
    moved by the test, so "at most once a second" is shown without sleeping or racing a real clock."""
    now = [time.time_ns()]
    fake = types.SimpleNamespace(**{n: getattr(time, n) for n in dir(time) if not n.startswith("_")})
    fake.time_ns = lambda: now[0]
    for mod in (store_mod, saves_mod, loadpins_mod):  # (commits in saves.py, a load's pins in loadpins.py)
        monkeypatch.setattr(mod, "time", fake)
    monkeypatch.setattr(index_mod, "time", fake)
    return now


async def test_hits_from_another_engine_keep_a_block_young(tmp_path, blocks, monkeypatch):
    now = _fake_wall_clock(monkeypatch)
    every = loadpins_mod.TOUCH_EVERY_NS
    root = str(tmp_path / "s")
    cap = 16 * SB + 64 * 1024
    a, b = _following(StoreIO(root, capacity=cap)), _following(StoreIO(root, capacity=cap))
    na, nb = a.namespace(NS, PAYLOAD), b.namespace(NS, PAYLOAD)
    assert await _save(a, na, blocks, range(8)) == [0] * 8  # A's blocks, oldest first
    b.refresh()
    now[0] += every  # the blocks are a TOUCH interval old
    assert await _loads_intact(b, nb, blocks, range(4))  # B hits A's keys 0..3: a TOUCH in B's journal
    assert b.logs[NS].records == 4
    now[0] += every - 1  # again within the interval since those hits: no second record
    assert await _loads_intact(b, nb, blocks, range(4))
    assert b.followers[(NS, 0)] and b.logs[NS].records == 4
    now[0] += 1  # an interval after the last record: recorded again
    assert await _loads_intact(b, nb, blocks, range(2))
    assert b.logs[NS].records == 6
    a.refresh()  # A sees the hits: 0..3 are now younger than 4..7
    assert [k for _, k in a.index.lru][:4] == [key(i) for i in range(4, 8)]
    for i in range(100, 112):  # B fills the directory with newer blocks, a block a step
        now[0] += 1_000_000
        b.refresh()
        assert await _save(b, nb, blocks, [i]) == [0]
        a.refresh()
    # A shed the blocks nobody used; the ones B hits stay
    assert set(range(4)) <= {i for i in range(8) if na.block(key(i)) is not None} and na.table.count < 8
    assert not any(na.block(key(i)) is not None for i in range(4, 4 + 8 - na.table.count))
    # a reopened A keeps that order (touches reach its checkpoint)
    a.close()
    a = StoreIO(root, capacity=cap)
    na = a.namespace(NS, PAYLOAD)
    assert {k for _, k in list(a.index.lru)[-4:]} == {key(i) for i in range(4)}
    a.close()
    b.close()


async def test_a_dead_engines_oldest_blocks_are_reclaimed_by_a_live_one(tmp_path, blocks, monkeypatch):
    monkeypatch.setattr(reclaim_mod, "RECLAIM_INTERVAL", 0)
    root = str(tmp_path / "s")
    cap = 16 * SB + 64 * 1024
    a = StoreIO(root, capacity=cap)
    na = a.namespace(NS, PAYLOAD)
    assert await _save(a, na, blocks, range(12)) == [0] * 12
    a.close(checkpoint=False)  # engine 0 is gone (as after kill -9): its lock is free
    b = _following(StoreIO(root, capacity=cap, engine=1))
    nb = b.namespace(NS, PAYLOAD)
    assert b.lookup(nb, [key(i) for i in range(12)]) == 12  # the dead engine's blocks are hits
    for i in range(100, 112):  # the directory fills with B's newer blocks, a block a step
        assert await _save(b, nb, blocks, [i]) == [0]
        b.refresh()
    # B evicted the dead engine's oldest blocks, as its owner would, and kept all of its own
    assert b.lookup(nb, [key(i) for i in range(100, 112)]) == 12
    left = [i for i in range(12) if nb.has(key(i))]
    assert left == list(range(12 - len(left), 12)) and 0 < len(left) < 12
    assert b.space.used() <= cap
    c = StoreIO(root)  # engine 0's number is held by B while it evicts there
    assert c.engine == 2 and set(c.namespace(NS, PAYLOAD).keys(0)) == {key(i) for i in left}
    c.close()
    b.close()
    # what B dropped stays dropped for the engine that adopts number 0 next
    d = StoreIO(root)
    assert d.engine == 0 and set(d.index.namespaces[NS].keys(0)) == {key(i) for i in left}
    d.close()


def test_an_engine_stuck_creating_files_does_not_hang_the_others(tmp_path, monkeypatch):
    import fcntl

    monkeypatch.setattr(meta_mod, "SETUP_WAIT", 0.3)
    root = str(tmp_path / "s")
    StoreIO(root).close()
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as an engine hung in the middle of creating a namespace
    try:
        t = time.monotonic()
        with pytest.raises(ValueError) as e:
            StoreIO(root)
        assert time.monotonic() - t < 5
        assert "another engine has been creating files there" in str(e.value) and "\n" not in str(e.value)
        ro = StoreIO(root, readonly=True)  # read-only openers do not wait at all
        ro.close()
    finally:
        os.close(fd)
    StoreIO(root).close()


async def test_an_engine_that_opens_later_sees_the_hits_of_a_lower_numbered_engine(tmp_path, blocks, monkeypatch):
    """Bug: a look applied a replay's TOUCH records as it came to their engine. An engine opening
    a directory replays every engine in number order, so the hits engine 0 recorded on engine
    1's blocks were applied before engine 1's blocks were there, and lost: the newcomer saw those
    blocks as old as their commits (its LRU view of the directory wrong until engine 0's files
    were replayed again). Invariant: a look applies the hits it found once every engine's table
    is in. Fix: following.py applies a look's TOUCH records after all its engines (touch_tags)."""
    now = _fake_wall_clock(monkeypatch)
    root = str(tmp_path / "s")
    b, a = _following(StoreIO(root)), _following(StoreIO(root))  # b: engine 0 (it hits), a: engine 1 (it holds)
    assert (b.engine, a.engine) == (0, 1)
    nb, na = b.namespace(NS, PAYLOAD), a.namespace(NS, PAYLOAD)
    assert await _save(a, na, blocks, range(6)) == [0] * 6
    b.refresh()
    now[0] += loadpins_mod.TOUCH_EVERY_NS  # a TOUCH interval later, b hits 0..2 of a's blocks
    assert await _loads_intact(b, nb, blocks, range(3))
    a.refresh()  # a sees the hits on its own blocks
    held = {i: na.block(key(i))[1] for i in range(6)}
    assert all(held[i] == now[0] for i in range(3)) and all(held[i] < now[0] for i in range(3, 6))
    c = StoreIO(root)  # engine 2: its first look replays engines 0 and 1
    try:
        nc = c.namespace(NS, PAYLOAD)
        c.refresh()
        assert c.engine == 2
        seen = {i: nc.block(key(i), engine=1)[1] for i in range(6)}
        assert all(seen[i] == now[0] for i in range(3)), ("it sees b's hits on a's blocks", seen, now[0])
        assert all(seen[i] < now[0] for i in range(3, 6)), "and the blocks nobody hit as old as they are"
    finally:
        for st in (c, a, b):
            st.close()
