# SPDX-License-Identifier: Apache-2.0
"""`aiokv clear` removes blocks from a directory engines are serving from, crash-safely.

The bug: the only way to drop a customer's or a model's blocks was vLLM's whole-cache reset
(which only stops serving them, in one engine) or deleting files under running engines.
The invariant: after a clear every engine on the directory stops serving the blocks it names
(their own, and the others' at once), their space is given back, and a watcher hears each
removed block (the KV events' BlockRemoved); nothing else changes: other tenants, other
namespaces, newer blocks; a dry run changes no byte; the files of engines that are not running
are cleared by the command itself; a clear killed with kill -9 at any point leaves every block
either cleared or intact (never indexed with its space punched), and is finished by the next
run or the next engine to open those files; an index rebuilt from the slots is cleared again,
of the blocks written before the clear only.
The fix: aiokv/store/control.py (orders in DIR/control, applied by each engine with FREE and
MARK records in one journal write), aiokv/ops/orders.py (the command).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

from aiokv.cli import operate
from aiokv.data import format as fmt
from aiokv.store import Store, offline
from aiokv.store.table import tag_of
from tests.conftest import NS, PAYLOAD, key
from tests.stallfs import mounted
from tools.storeio import StoreIO

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NS2 = bytes(range(100, 116))


def cli(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "aiokv", *map(str, args)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=ROOT),
        **kw,
    )


async def _fill(st, ns, blocks, ids, tenant):
    for j, i in enumerate(ids):
        blocks.fill(j % 8, key(i))
        assert await st.save(ns, [(key(i), blocks.addr(j % 8))], tenant=tenant) == [0]


def _live(st: Store, ns, ids) -> list[bool]:
    st.lookup(ns, [], 0)
    return [ns.has(key(i)) for i in ids]


def _removed(changes) -> set[int]:
    """The tags a watcher heard removed (a clear's come as arrays of them, zeros skipped)."""
    out = set()
    for added, t, _ in changes:
        if not added:
            out |= {int(x) for x in (t.tolist() if hasattr(t, "tolist") else [t]) if x}
    return out


def _digest(root: str) -> str:
    h = hashlib.sha256()
    for d, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for f in sorted(files):
            p = os.path.join(d, f)
            h.update(p.encode())
            with open(p, "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


async def test_a_clear_reaches_every_running_engine_and_only_its_tenant(tmp_path, blocks):
    root = str(tmp_path / "c")
    e0, e1 = StoreIO(root, capacity="1GiB"), StoreIO(root, capacity="1GiB")
    for st in (e0, e1):
        st.follow_interval = 0
    ns0, ns1 = e0.namespace(NS, PAYLOAD), e1.namespace(NS, PAYLOAD)
    other0 = e0.namespace(NS2, PAYLOAD)
    await _fill(e0, ns0, blocks, range(0, 6), "alice")
    await _fill(e0, ns0, blocks, range(6, 10), "bob")
    await _fill(e1, ns1, blocks, range(10, 14), "alice")
    await _fill(e0, other0, blocks, range(20, 23), "alice")
    e0.refresh()
    e1.refresh()
    ns0.changes, ns1.changes = [], []  # what the KV events watch
    alloc_before = ns0.alloc.in_use

    doc = operate.run("clear", root, "alice", namespace=NS.hex()[:8], wait=0)
    assert doc["blocks"] == 10 and doc["order"] == 1 and doc["not_yet_applied_by"] == [0, 1]
    # engine 0 looks first: its own alice blocks and engine 1's stop being hits here at once
    e0.refresh()
    assert _live(e0, ns0, range(14)) == [False] * 6 + [True] * 4 + [False] * 4
    assert _removed(ns0.changes) == {tag_of(key(i)) for i in (*range(6), *range(10, 14))}
    assert ns0.alloc.in_use == alloc_before - 6 and len(ns0.alloc.holes) >= 6  # space given back (punched)
    # engine 1 applies it at its next look (a lookup, or the step's refresh)
    assert e1.stats.cleared == 0
    assert _live(e1, ns1, range(14)) == [False] * 6 + [True] * 4 + [False] * 4
    assert e1.stats.cleared == 10  # its own 4, and engine 0's 6 it stopped serving
    # the other namespace was not named: untouched
    assert _live(e0, other0, range(20, 23)) == [True] * 3
    # both engines say so in their journals: the command sees it
    assert offline.applied_mark(root, NS, 0) == offline.applied_mark(root, NS, 1) == 1
    e0.close()
    e1.close()
    st = Store(root, readonly=True)
    ns = st.index.namespaces[NS]
    assert sorted(ns.keys()) == sorted(key(i) for i in range(6, 10))
    st.close()


async def test_a_dry_run_changes_no_byte(tmp_path, blocks):
    root = str(tmp_path / "c")
    st = StoreIO(root, capacity="1GiB")
    ns = st.namespace(NS, PAYLOAD, fields={"model": "/models/tiny"})
    await _fill(st, ns, blocks, range(5), "alice")
    await _fill(st, ns, blocks, range(5, 8), "")
    st.close()
    before = _digest(root)
    p = cli("clear", root, "--model", "tiny", "--dry-run", "--format", "json")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    doc = json.loads(out)
    assert doc["dry_run"] and doc["blocks"] == 8 and doc["order"] is None
    assert {t["tenant"]: t["blocks"] for t in doc["namespaces"][0]["tenants"]} == {"alice": 5, "": 3}
    assert _digest(root) == before and not os.path.exists(os.path.join(root, fmt.CONTROL_NAME))
    p = cli("clear", root, "--model", "nothing-like-it", "--dry-run")
    _, err = p.communicate(timeout=60)
    assert p.returncode == 2 and err.count("\n") == 1 and "models here: /models/tiny" in err


async def test_stopped_engines_are_cleared_by_the_command_and_age_is_respected(tmp_path, blocks):
    root = str(tmp_path / "c")
    st = StoreIO(root, capacity="1GiB")
    ns = st.namespace(NS, PAYLOAD)
    await _fill(st, ns, blocks, range(4), "")
    time.sleep(1.2)
    await _fill(st, ns, blocks, range(4, 6), "")
    st.close()
    doc = operate.run("clear", root, None, older_than="1s", wait=0)
    assert doc["blocks"] == 4 and doc["applied_by_this_command"] == [0] and doc["not_yet_applied_by"] == []
    st = Store(root, capacity="1GiB")
    ns = st.namespace(NS, PAYLOAD)
    assert _live(st, ns, range(6)) == [False] * 4 + [True] * 2
    # its space was given back, and what is left verifies
    assert len(ns.alloc.holes) >= 4
    st.close()


async def test_a_rebuilt_index_is_cleared_again_of_older_blocks_only(tmp_path, blocks):
    root = str(tmp_path / "c")
    st = StoreIO(root, capacity="1GiB")
    ns = st.namespace(NS, PAYLOAD)
    await _fill(st, ns, blocks, range(3), "alice")
    st.close()
    operate.run("clear", root, "alice", wait=0)  # applied by the command (the engine is stopped)
    st = StoreIO(root, capacity="1GiB")
    ns = st.namespace(NS, PAYLOAD)
    await _fill(st, ns, blocks, range(3, 5), "alice")  # newer than the clear: they stay
    st.close()
    d = os.path.join(root, "ns", NS.hex())
    with open(os.path.join(d, "checkpoint"), "r+b") as f:
        f.write(b"garbage!")  # the index (and its MARK) lost: rebuilt from the slot headers
    st = Store(root, capacity="1GiB")
    ns = st.namespace(NS, PAYLOAD)
    assert _live(st, ns, range(5)) == [False] * 3 + [True] * 2
    st.close()


def _template(root: str, namespaces: int, per: int) -> None:
    """A stopped engine's directory: `namespaces` namespaces of small blocks, half alice's."""
    import asyncio

    from tests.conftest import Blocks

    async def fill():
        st = StoreIO(root)  # (no capacity: each namespace's files grow 64 MiB at a time)
        b = Blocks(4096, 8)
        for n in range(namespaces):
            ns = st.namespace(bytes([n]) * 16, 4096)
            for i in range(per):
                b.fill(0, key(i, n))
                assert await st.save(ns, [(key(i, n), b.addr(0))], tenant="alice" if i % 2 else "bob") == [0]
        st.close()

    asyncio.run(fill())
    Store(root).close()  # opened again: the space no block uses is given back (small copies)


def _state(root: str, namespaces: int, per: int) -> list[int]:
    """Per namespace, alice's blocks its files still index; asserts the rest: every bob block
    is indexed, every indexed block verifies on disk (never punched under its index entry), and
    a reader of the directory (inspect, another engine) serves none of alice's once the order
    is written."""
    from aiokv.data.slotfile import read_slot
    from aiokv.store.journal import IndexLog

    out = []
    for n in range(namespaces):
        nsid = bytes([n]) * 16
        d = os.path.join(root, "ns", nsid.hex())
        dfd = os.open(d, os.O_RDONLY)
        fd = os.open(os.path.join(d, fmt.data_file(0)), os.O_RDONLY)
        try:
            entries = IndexLog(d, dfd, readonly=True).load()  # what the files say, no order applied
            assert all(key(i, n) in entries for i in range(0, per, 2)), n  # bob's, all of them
            out.append(sum(key(i, n) in entries for i in range(1, per, 2)))
            for k, (slot, _) in entries.items():
                read_slot(fd, slot, nsid, 0, 4096, k)
        finally:
            os.close(fd)
            os.close(dfd)
    st = Store(root, readonly=True)
    if st.control.orders:  # (the order written whole: a kill may land between the file and its record)
        for n in range(namespaces):
            ns = st.index.namespaces[bytes([n]) * 16]
            assert [ns.has(key(i, n)) for i in range(per)] == [i % 2 == 0 for i in range(per)], n
    st.close()
    return out


def _journal_bytes(d: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.startswith("journal."))


def test_a_clear_killed_with_kill_9_leaves_each_block_cleared_or_whole(tmp_path):
    """The command is killed (SIGKILL) once it has written the order, then once it has cleared
    its first namespace (of 24); each time the directory is whole, and the next run finishes the
    clear. The directory is on a FUSE mount (tests/stallfs.py) whose journal writes of one
    namespace the test holds: the command cannot get past that point before the kill lands,
    however fast the machine (it raced the command before: six tries, hoping one kill landed in
    the middle), and the held write never lands (it fails once the command is dead)."""
    namespaces, per = 24, 40
    template = str(tmp_path / "template")
    _template(template, namespaces, per)
    control = str(tmp_path / "control")
    with mounted(str(tmp_path / "src"), str(tmp_path / "mnt"), control):
        for trial, (held_ns, want) in enumerate([(0, "none"), (1, "part")]):
            shutil.copytree(template, str(tmp_path / "src" / f"t{trial}"))
            root = str(tmp_path / "mnt" / f"t{trial}")
            dirs = [os.path.join(root, "ns", (bytes([n]) * 16).hex()) for n in range(namespaces)]
            sizes = [_journal_bytes(d) for d in dirs]
            where = "ns/" + (bytes([held_ns]) * 16).hex()
            with open(control, "w") as f:
                f.write(f"j\n{where}")  # (namespaces are opened in order: the command stops at this one)
            p = cli("clear", root, "--tenant", "alice", "--wait", "0")
            deadline = time.monotonic() + 60
            while not os.path.exists(os.path.join(root, fmt.CONTROL_NAME)) or (
                held_ns == 1 and _journal_bytes(dirs[0]) == sizes[0]
            ):
                assert p.poll() is None and time.monotonic() < deadline, p.communicate()
                time.sleep(0.01)
            os.kill(p.pid, signal.SIGKILL)
            # a process in a write the FUSE daemon holds dies only once it answers: the held write
            # fails (EIO), so the killed command's last write never lands
            with open(control, "w") as f:
                f.write(f"x\n{where}")
            p.wait(60)
            os.unlink(control)
            left = _state(root, namespaces, per)
            got = "none" if all(n == per // 2 for n in left) else "all" if not any(left) else "part"
            assert got == want and (want == "none" or left[0] == 0 and left[1:] == [per // 2] * 23), left
            # an engine opening those files finishes it (here: the next run of the command)
            q = cli("clear", root, "--tenant", "alice", "--wait", "0")
            _, err = q.communicate(timeout=120)
            assert q.returncode == 0, err
            assert _state(root, namespaces, per) == [0] * namespaces, trial


def test_orders_are_numbered_and_a_torn_one_is_cut_off(tmp_path):
    from aiokv.store.control import append_order, read_orders

    root = tmp_path / "c"
    Store(str(root)).close()
    fd = os.open(root, os.O_RDONLY)
    try:
        a = append_order(fd, "clear", None, {fmt.tenant_tag("x")})
        with open(root / fmt.CONTROL_NAME, "ab") as f:
            f.write(fmt.pack_order(2, 1, b'{"op": "clear"}')[:-3])  # a writer killed mid-append
        got, _, last = read_orders(fd)
        assert [o.number for o in got] == [1] and last == 1 and got[0] == a
        b = append_order(fd, "pin", [NS], {fmt.tenant_tag("y")})
        got, _, _ = read_orders(fd)
        assert [o.number for o in got] == [1, 2] and got[1] == b and got[1].nsids == frozenset([NS])
    finally:
        os.close(fd)


async def test_a_load_reading_a_cleared_block_completes_or_fails_verification(tmp_path, blocks):
    """A load planned before the clear reads its slots after them: before the punch (the
    block as it was), after it (a hole), after the slot went to another block: each read
    either returns the block's own bytes or fails verification (-EBADMSG), never another
    block's bytes; the load's pins are let go without harm."""
    import errno

    st = StoreIO(str(tmp_path / "c"), capacity="1GiB")
    st.follow_interval = 0
    ns = st.namespace(NS, PAYLOAD)
    await _fill(st, ns, blocks, range(4), "acme")
    keys = [key(i) for i in range(4)]
    io = st.blockio(ns)

    async def read(slots, ks):
        for j in range(len(ks)):
            blocks.clear(8 + j)
        got = await io.read([(s, k, blocks.addr(8 + j)) for j, (s, k) in enumerate(zip(slots, ks))])
        for j, (r, k) in enumerate(zip(got, ks)):
            assert r in (0, -errno.EBADMSG), r
            assert r != 0 or blocks.holds(8 + j, k), "a load returned bytes that are not its block's"
        return got

    held = st.pin(ns, keys)  # a load has planned them: its slots
    assert await read(held[:2], keys[:2]) == [0, 0]  # read before the order: whole
    operate.run("clear", st.root, "acme", wait=0)
    st.refresh()  # the order applied: forgotten, punched
    assert not any(ns.has(k) for k in keys)
    assert await read(held[2:3], keys[2:3]) == [-errno.EBADMSG]  # a hole: fails verification
    # the slots go to other blocks; the late read of the last one meets another key
    others = range(100, 100 + 2 * len(ns.alloc.free) + 64)  # past the free slots: the holes are grown again
    await _fill(st, ns, blocks, others, "other")
    reused = [s for s in held if s in {ns.where(key(i)) for i in others}]
    assert reused, "no slot was reused (the test would prove nothing)"
    assert await read([reused[0]], [keys[held.index(reused[0])]]) == [-errno.EBADMSG]
    st.unpin(ns, keys)  # the load reports: its pins go, nothing else does
    assert all(ns.has(key(i)) for i in others)
    st.close()
