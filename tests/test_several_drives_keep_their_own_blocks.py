# SPDX-License-Identifier: Apache-2.0
"""Bug: `path` was one directory, so a server's several NVMe drives could serve as
one cache only through RAID0/LVM, and one failing drive (EIO, a hung mount) then
cost every block: the one breaker stopped all hits and saves.

Invariant: with a list of paths each block is placed on one drive by its key
(rendezvous hashing over the drives' path strings), so a restart with the same
list, in any order, finds every block again; each drive has its own files,
journal, capacity share and breaker: a failing or hung drive's blocks become
misses and its saves are dropped (counted) while the other drives hit and save;
a drive missing at start is one log line and a cache smaller by its share; all
missing is an OSError (aiokv off, as for one bad path). Several engines on the
same list share blocks as on one directory; `aiokv inspect` takes the list.

Fix: aiokv/store/drives.py (Drives: one Store per drive, locations carry the
drive above the engine's bits), aiokv/data/drives.py (DriveIO: one BlockIO per
drive, per-drive verdicts and the drives a timed-out call waited on), per-drive
breakers fed by WorkerReport.drives, config.parse_paths, `aiokv inspect DIR...`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import threading

import pytest

from aiokv.config import AioKVConfig, ConfigError
from aiokv.data import format as fmt
from aiokv.data.drives import WAITING
from aiokv.data.faults import ACK
from aiokv.store.drives import place
from tests.conftest import NS, PAYLOAD, key
from tools.storeio import DrivesIO

N = 48


def _paths(tmp_path, n=3):
    out = []
    for i in range(n):
        os.makedirs(tmp_path / f"mnt{i}", exist_ok=True)
        out.append(str(tmp_path / f"mnt{i}" / "aiokv"))
    return out


async def _save(st, ns, blocks, keys):
    for i, k in enumerate(keys):
        blocks.fill(i, k)
    return await st.save(ns, [(k, blocks.addr(i)) for i, k in enumerate(keys)])


async def _load(st, ns, blocks, keys):
    for i in range(len(keys)):
        blocks.clear(i)
    res = await st.load(ns, [(k, blocks.addr(i)) for i, k in enumerate(keys)])
    return [r == 0 and blocks.holds(i, k) for i, (k, r) in enumerate(zip(keys, res))]


def _drive(st, ns, k) -> int:
    return fmt.drive_of(ns.entries.get(k))[0]


@pytest.mark.asyncio
async def test_blocks_are_placed_by_key_and_found_again_after_a_restart_in_any_order(tmp_path, blocks):
    paths = _paths(tmp_path)
    keys = [key(i) for i in range(N)]
    st = DrivesIO(paths, capacity="1GiB")
    ns = st.namespace(NS, PAYLOAD)
    assert await _save(st, ns, blocks, keys) == [0] * N
    on = [_drive(st, ns, k) for k in keys]
    assert on == [place(k, st.seeds, [0, 1, 2]) for k in keys]
    assert all(on.count(d) >= N // 6 for d in range(3)), f"spread over every drive: {on}"
    for d, p in enumerate(paths):  # each drive has its own files and journal
        assert os.path.exists(os.path.join(p, "ns", NS.hex(), "rank0.data")), p
        assert len(st.stores[d].index.namespaces[NS].own) == on.count(d)
    st.close()
    st = DrivesIO(paths[::-1], capacity="1GiB")  # the same list in another order
    ns = st.namespace(NS, PAYLOAD)
    assert st.lookup(ns, keys) == N
    assert [paths[::-1][_drive(st, ns, k)] for k in keys] == [paths[d] for d in on], "each block on its drive"
    assert await _load(st, ns, blocks, keys) == [True] * N
    st.close()


@pytest.mark.asyncio
async def test_a_drive_missing_at_start_is_one_line_and_a_smaller_cache(tmp_path, blocks, caplog):
    paths = _paths(tmp_path)
    keys = [key(i) for i in range(N)]
    st = DrivesIO(paths, capacity="3GiB")
    ns = st.namespace(NS, PAYLOAD)
    await _save(st, ns, blocks, keys)
    on = [_drive(st, ns, k) for k in keys]
    st.close()
    shutil.rmtree(tmp_path / "mnt1")  # drive 1 not mounted: its mount point's directory is gone
    with caplog.at_level(logging.ERROR, logger="aiokv"):
        st = DrivesIO(paths, capacity="3GiB")
    lines = [r.message for r in caplog.records if "left out" in r.message]
    assert len(lines) == 1 and paths[1] in lines[0], lines
    assert st.live == [0, 2] and st.limit == 2 << 30, "its share of the capacity is not spread"
    ns = st.namespace(NS, PAYLOAD)
    assert [k in ns.entries for k in keys] == [d != 1 for d in on], "only its own blocks are misses"
    assert await _load(st, ns, blocks, [k for k, d in zip(keys, on) if d != 1]) == [True] * (N - on.count(1))
    moved = [k for k, d in zip(keys, on) if d == 1]
    assert await _save(st, ns, blocks, moved) == [0] * len(moved), "its keys are saved on the others"
    assert all(_drive(st, ns, k) in (0, 2) for k in moved)
    st.close()
    shutil.rmtree(tmp_path / "mnt0")
    shutil.rmtree(tmp_path / "mnt2")
    with pytest.raises(OSError):
        DrivesIO(paths)


@pytest.mark.asyncio
async def test_a_failing_drive_costs_only_its_own_blocks(tmp_path, blocks, monkeypatch, caplog):
    paths = _paths(tmp_path)
    keys = [key(i) for i in range(N)]
    st = DrivesIO(paths, capacity="1GiB", failures=3)
    ns = st.namespace(NS, PAYLOAD)
    await _save(st, ns, blocks, keys)
    on = [_drive(st, ns, k) for k in keys]
    st.close()
    # every read of drive 1's files fails with EIO from now on (the fault injector, by file path)
    monkeypatch.setenv("AIOKV_FAULTS", json.dumps([{"op": "read", "kind": "eio", "file": "/mnt1/"}]))
    monkeypatch.setenv("AIOKV_FAULTS_ACK", ACK)
    st = DrivesIO(paths, capacity="1GiB", failures=3)
    ns = st.namespace(NS, PAYLOAD)
    sick = [k for k, d in zip(keys, on) if d == 1]
    well = [k for k, d in zip(keys, on) if d != 1]
    with caplog.at_level(logging.WARNING, logger="aiokv"):
        got = await _load(st, ns, blocks, sick[:3] + well[:3])
    assert got == [False] * 3 + [True] * 3
    assert st.breakers[1].is_open and not st.breakers[0].is_open and not st.breakers[2].is_open
    assert any("is failing" in r.message and paths[1] in r.message for r in caplog.records)
    assert st.stats.drive_breaker_opens == 1
    # its blocks are no hits now, the others' are
    assert st.lookup(ns, sick[3:4]) == 0 and st.pin(ns, sick[3:4]) == [None]
    assert st.lookup(ns, well) == len(well)
    assert await _load(st, ns, blocks, well) == [True] * len(well)
    # saves placed on it are dropped and counted; the others' go on
    fresh = [key(i, salt=7) for i in range(N)]
    res = await _save(st, ns, blocks, fresh)
    placed = [place(k, st.seeds, st.live) for k in fresh]
    assert [r == 0 for r in res] == [d != 1 for d in placed]
    assert st.stats.skipped_drive_down == placed.count(1)
    st.close()


@pytest.mark.asyncio
async def test_a_timed_out_read_names_only_the_drive_it_waited_on(tmp_path, blocks, monkeypatch):
    paths = _paths(tmp_path)
    keys = [key(i) for i in range(N)]
    st = DrivesIO(paths, capacity="1GiB")
    ns = st.namespace(NS, PAYLOAD)
    await _save(st, ns, blocks, keys)
    st.close()
    monkeypatch.setenv("AIOKV_FAULTS", json.dumps([{"op": "read", "kind": "late", "delay": 2.0, "file": "/mnt2/"}]))
    monkeypatch.setenv("AIOKV_FAULTS_ACK", ACK)
    st = DrivesIO(paths, capacity="1GiB")
    ns = st.namespace(NS, PAYLOAD)
    where = st.pin(ns, keys)
    waiting: set = set()
    WAITING.set(waiting)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(
            st.blockio(ns).read([(w, k, blocks.addr(i)) for i, (k, w) in enumerate(zip(keys, where))]), 0.5
        )
    assert waiting == {2}
    st.unpin(ns, keys)
    st.close()


@pytest.mark.asyncio
async def test_a_hung_drive_file_system_stops_only_its_own_hits_and_saves(tmp_path, blocks):
    paths = _paths(tmp_path)
    keys = [key(i) for i in range(N)]
    st = DrivesIO(paths, capacity="1GiB")
    ns = st.namespace(NS, PAYLOAD)
    await _save(st, ns, blocks, keys)
    on = [_drive(st, ns, k) for k in keys]
    st.close()
    st = DrivesIO(paths, capacity="1GiB", io_thread=True, fs_timeout=0.1)
    ns = st.namespace(NS, PAYLOAD)
    hang = threading.Event()
    st.stores[0].fs.submit(lambda: hang.wait(30))  # drive 0's I/O thread is stuck in its file system
    await asyncio.sleep(0.3)
    st.refresh()
    assert st.breakers[0].is_open and not st.stalled, "one drive stalled is not the cache stalled"
    assert st.lookup(ns, [k for k, d in zip(keys, on) if d == 0][:1]) == 0
    assert st.lookup(ns, [k for k, d in zip(keys, on) if d != 0]) == N - on.count(0)
    fresh = [key(i, salt=9) for i in range(16)]
    got = [st.reserve(ns, k) for k in fresh]
    assert [w is not None for w in got] == [place(k, st.seeds, st.live) != 0 for k in fresh]
    st.abort(ns, [(k, w) for k, w in zip(fresh, got) if w is not None], failed=False)
    hang.set()
    st.close()


@pytest.mark.asyncio
async def test_several_engines_on_one_list_share_blocks(tmp_path, blocks):
    paths = _paths(tmp_path)
    keys = [key(i) for i in range(N)]
    a = DrivesIO(paths, capacity="1GiB")
    b = DrivesIO(paths, capacity="1GiB")
    na, nb = a.namespace(NS, PAYLOAD), b.namespace(NS, PAYLOAD)
    assert {s.engine for s in a.stores.values()} != {s.engine for s in b.stores.values()}
    await _save(a, na, blocks, keys)
    for s in b.stores.values():
        s.following.follow_all()
    assert b.lookup(nb, keys) == N
    assert await _load(b, nb, blocks, keys) == [True] * N
    a.close()
    b.close()


def test_path_takes_a_list_and_says_what_is_wrong_in_one_line(tmp_path, monkeypatch):
    one = AioKVConfig.from_extra({"path": str(tmp_path / "a")})
    assert one.paths == [one.path] == [str(tmp_path / "a")]
    two = AioKVConfig.from_extra({"path": [str(tmp_path / "a"), "~/b"]})
    assert two.paths == [str(tmp_path / "a"), os.path.expanduser("~/b")] and two.path == two.paths[0]
    monkeypatch.setenv("AIOKV_PATH", f"{tmp_path}/x:{tmp_path}/y")
    assert AioKVConfig.from_extra({}).paths == [f"{tmp_path}/x", f"{tmp_path}/y"]
    monkeypatch.setenv("AIOKV_PATH", f"{tmp_path}/x")
    assert AioKVConfig.from_extra({}).paths == [f"{tmp_path}/x"]
    for bad, says in (
        ([], "empty list"),
        ([str(tmp_path), str(tmp_path) + "/"], "twice"),
        ([3], "string"),
        ([""], "string"),
        (7, "list of them"),
    ):
        with pytest.raises(ConfigError, match=says) as e:
            AioKVConfig.from_extra({"path": bad})
        assert "\n" not in str(e.value)


def test_inspect_takes_the_list(tmp_path, blocks, capsys):
    from aiokv.cli.main import main

    paths = _paths(tmp_path, 2)
    keys = [key(i) for i in range(N)]

    async def fill():
        st = DrivesIO(paths, capacity="1GiB")
        ns = st.namespace(NS, PAYLOAD)
        await _save(st, ns, blocks, keys)
        st.close()
        return [_drive(st, ns, k) for k in keys]

    on = asyncio.run(fill())
    capsys.readouterr()
    assert main(["inspect", *paths, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [d["path"] for d in doc["drives"]] == paths
    assert [d["total"]["blocks"] for d in doc["drives"]] == [on.count(0), on.count(1)]
    assert main(["inspect", *paths, "--verify", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert out.count("== drive") == 2
    assert main(["inspect", paths[0], str(tmp_path / "nothing")]) == 2, "one unreadable: the worst status"
    assert "nothing" in capsys.readouterr().err
