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
Later bugs (issue 37, each test's docstring): a failing drive's blocks still
counted for sliding-window and state groups' hits (the whole request was then
recomputed); a corrupt copy on a later drive was never dropped; one drive's
error that is no OSError left the other drives' I/O running after the call.

Fix: aiokv/store/drives.py (Drives: one Store per drive, locations carry the
drive above the engine's bits), aiokv/data/drives.py (DriveIO: one BlockIO per
drive, per-drive verdicts and the drives a timed-out call waited on), per-drive
breakers fed by WorkerReport.drives, config.parse_paths, `aiokv inspect DIR...`;
then Drives.serving (match's view), Drives.holds/drop_at (the ledger), DriveIO
settling every part on any exception.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import threading
import time

import pytest

from aiokv.config import AioKVConfig, ConfigError
from aiokv.data import format as fmt
from aiokv.data.faults import ACK
from aiokv.store.drives import place
from tests.conftest import NS, PAYLOAD, key, refresh_until
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
    return fmt.drive_of(ns.where(k))[0]


@pytest.mark.asyncio
async def test_blocks_are_placed_by_key_and_found_again_after_a_restart_in_any_order(tmp_path, blocks):
    paths = _paths(tmp_path)
    keys = [key(i) for i in range(N)]
    st = DrivesIO(paths, capacity="1GiB")
    ns = st.namespace(NS, PAYLOAD)
    assert await _save(st, ns, blocks, keys) == [0] * N
    on = [_drive(st, ns, k) for k in keys]
    assert on == [place(k, st.seeds, [0, 1, 2]) for k in keys]
    # spread over every drive. The seeds come from the paths, which pytest's tmp_path changes
    # each run: at least N // 6 of these N blocks on each drive failed about once in 110 runs
    # (one drive had 7 of 48), so the evenness is checked on 4,800 keys (each drive's share
    # 0.33 +- 0.007) and these N only for a block on every drive
    assert all(on.count(d) for d in range(3)), f"a block on every drive: {on}"
    many = [place(key(i, salt=1), st.seeds, [0, 1, 2]) for i in range(4800)]
    assert all(many.count(d) >= 4800 // 6 for d in range(3)), [many.count(d) for d in range(3)]
    for d, p in enumerate(paths):  # each drive has its own files and journal
        assert os.path.exists(os.path.join(p, "ns", NS.hex(), "rank0.data")), p
        assert st.stores[d].index.namespaces[NS].table.count == on.count(d)
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
    assert [ns.has(k) for k in keys] == [d != 1 for d in on], "only its own blocks are misses"
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
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(
            st.blockio(ns).read([(w, k, blocks.addr(i)) for i, (k, w) in enumerate(zip(keys, where))], waiting=waiting),
            0.5,
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
    # every drive's index in place, its space reserved
    refresh_until(
        st, lambda: ns.ready and not any(s.space.growing for s in st.stores.values()), "the drives did not load"
    )
    hang = threading.Event()
    st.stores[0].fs.submit(lambda: hang.wait(30))  # drive 0's I/O thread is stuck in its file system
    end = time.monotonic() + 20
    while not st.stores[0].stalled:  # past fs_timeout (not a sleep hoping the thread got there)
        assert time.monotonic() < end, "drive 0 never counted as stalled"
        await asyncio.sleep(0.01)
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


# ---- the scheduler side over several drives (no vLLM) ----
BS = 32


def _side(paths, kinds):
    """A SchedulerSide over DrivesIO, one namespace per group (window: 64 tokens)."""
    from aiokv.scheduler.layout import WINDOW, GroupSpec
    from aiokv.scheduler.side import SchedulerSide

    st = DrivesIO(paths, capacity="1GiB", failures=3)
    groups = [
        (GroupSpec(i, k, 4096, (f"l{i}",), window=64 if k == WINDOW else 0), st.namespace(bytes([i]) * 16, 4096))
        for i, k in enumerate(kinds)
    ]
    return st, SchedulerSide(st, groups, BS)


def _on(st, ns, d: int, keys) -> None:
    """keys committed on drive d, wherever placement would put them (a block saved on another
    drive while its own was missing stays a hit there; a restart with the drive back holds both)."""
    s, n = st.stores[d], ns.on[d]
    s.commit(n, [(k, s.reserve(n, k)) for k in keys])


def _down(st, d: int) -> None:
    st.record({d: [3, 0]})  # three I/O errors in a row: its breaker opens
    assert st.breakers[d].is_open


@pytest.mark.parametrize("model", ["window", "full+state"])
def test_a_failing_drive_costs_no_hit_of_another_drive_for_any_group_kind(tmp_path, model):
    """Bug: match checked window and state groups against every drive's blocks, open breakers
    included; pin then found nothing for the block on the failing drive, and the whole request
    was recomputed, losing the hits the other drive could serve. Invariant: the hit falls back
    to the longest one whose every needed block is on a drive that serves hits now, and every
    block of its load has a location."""
    from aiokv.scheduler.keys import extend_keys, request_root
    from aiokv.scheduler.layout import FULL, STATE, WINDOW

    kinds = [WINDOW] if model == "window" else [FULL, STATE]
    st, side = _side(_paths(tmp_path, 2), kinds)
    root = request_root(b"r" * 16, [])
    tokens = list(range(8 * BS + 1))
    keys = extend_keys([], root, tokens, BS, 8)
    gs = [g.ns for g in side.groups]
    if model == "window":  # a 64-token window ending after 8 blocks needs blocks 6 and 7
        _on(st, gs[0], 1, keys[:7])
        _on(st, gs[0], 0, keys[7:])
    else:  # every attention block on drive 1; the state at 8 blocks on drive 0, at 7 on drive 1
        _on(st, gs[0], 1, keys)
        _on(st, gs[1], 1, [keys[6]])
        _on(st, gs[1], 0, [keys[7]])
    assert side.match("r", tokens, root, 0) == 8 * BS
    _down(st, 0)
    # the hit that drive 1 alone serves: 7 blocks (window: blocks 5 and 6; state: the one at 7)
    assert side.match("r", tokens, root, 0) == 7 * BS
    tables = tuple(list(range(10 * gi + 1, 10 * gi + 9)) for gi in range(len(kinds)))
    side.on_alloc("r", tokens, root, tables, 7 * BS)
    loads = side.plan([]).loads
    assert loads and all(w >= 0 and fmt.drive_of(w)[0] == 1 for t in loads for w in t.locations), loads
    side.on_report(None, {"r"})
    st.close()


def test_a_corrupt_copy_on_a_later_drive_is_dropped_there(tmp_path):
    """Bug: a block that did not verify was dropped only where the first drive's copy of its
    key sat (the ledger compared the slot read with the union's location, the first drive's):
    a bad copy on another drive was never dropped, and every later hit read it and failed
    again until the first drive came back. Invariant: the copy that failed is dropped on its
    own drive, the other drive's copy is kept, the failure is counted, and the next lookup
    stops before the block."""
    from aiokv.jobs import LoadResult, WorkerReport
    from aiokv.scheduler.keys import extend_keys, request_root
    from aiokv.scheduler.layout import FULL

    st, side = _side(_paths(tmp_path, 2), [FULL])
    ns = side.groups[0].ns
    root = request_root(b"r" * 16, [])
    tokens = list(range(4 * BS + 1))
    keys = extend_keys([], root, tokens, BS, 4)
    _on(st, ns, 1, keys)
    _on(st, ns, 0, keys[2:3])  # block 2 on both drives (drive 0 was missing when drive 1 saved it)
    _down(st, 0)
    assert side.match("r", tokens, root, 0) == 4 * BS
    side.on_alloc("r", tokens, root, ([1, 2, 3, 4],), 4 * BS)
    (load,) = side.plan([]).loads
    assert fmt.drive_of(load.locations[2])[0] == 1, "drive 0 is down: drive 1's copy is read"
    # the workers found drive 1's copy of block 2 corrupt
    side.on_report(WorkerReport(loads=[LoadResult(load.job, 0, "r", failed=[3, 4], bad=[keys[2]])]), {"r"})
    assert not ns.on[1].has(keys[2]), "the corrupt copy is still offered"
    assert ns.on[0].has(keys[2]), "the other drive's copy was dropped instead"
    assert side.counters.load_bad_blocks == 1
    assert side.match("r2", tokens, root, 0) == 2 * BS, "the next hit stops before the bad block"
    st.close()


@pytest.mark.asyncio
async def test_one_drive_raising_leaves_no_other_drive_io_running(tmp_path, blocks, monkeypatch):
    """Bug: a call over several drives awaited their parts with gather, which on an error that
    is no OSError (a bug, an exception below BlockIO) raised at once and left the other drives'
    parts running, their reads still landing in staging buffers the caller then gave back.
    Invariant: when a call over several drives ends, however it ends, none of its parts is
    still running. Fix: DriveIO settles every part on any exception, as BlockIO._pipelined does."""
    paths = _paths(tmp_path, 2)
    keys = [key(i) for i in range(N)]
    st = DrivesIO(paths, capacity="1GiB")
    ns = st.namespace(NS, PAYLOAD)
    await _save(st, ns, blocks, keys)
    on = [_drive(st, ns, k) for k in keys]
    assert set(on) == {0, 1}
    st.close()
    rules = [
        {"op": "read", "kind": "raise", "file": "/mnt0/"},  # drive 0: an exception that is no OSError
        {"op": "read", "kind": "late", "delay": 1.0, "file": "/mnt1/"},  # drive 1: its reads still out
    ]
    monkeypatch.setenv("AIOKV_FAULTS", json.dumps(rules))
    monkeypatch.setenv("AIOKV_FAULTS_ACK", ACK)
    st = DrivesIO(paths, capacity="1GiB")
    ns = st.namespace(NS, PAYLOAD)
    where = st.pin(ns, keys)
    io = st.blockio(ns)
    before = asyncio.all_tasks()
    with pytest.raises(RuntimeError, match="injected"):
        await io.read([(w, k, blocks.addr(i)) for i, (k, w) in enumerate(zip(keys, where))])
    left = [t for t in asyncio.all_tasks() - before if not t.done()]
    assert not left, f"{len(left)} drive part(s) still running once the call ended"
    st.unpin(ns, keys)
    st.close()
