# SPDX-License-Identifier: Apache-2.0
"""A clear, pin or unpin of any size is bulk work in bounded steps, and removes what was computed
before it (issue 40, items 2 and 7).

The bugs: an engine applied an order block by block in Python on vLLM's scheduler thread, all of
it in one step (10.4 µs and ~830 bytes held per block: minutes of stalled scheduling at 30M
blocks); its FREE records and MARK went to the journal in one write(2), which Linux cuts short
near 2 GiB (above ~33.5M blocks: the MARK was lost), and the KV events got one BlockRemoved per
block. A save reserved before the order and committed after it was kept and served. An engine
holding a dead engine's files for reclaim never applied an order to them (the command could not
take their lock, and the holder did not).

The invariant: each step does a bounded share of an order (blocks forgotten, flags changed,
slots looked at), saves and commits go on meanwhile and the blocks committed after the order
stay; every journal write is bounded; a watcher hears a clear's removals in batches; a kill -9
at any point leaves each block cleared or whole (never indexed with its space punched) and the
next opening finishes the order; a save reserved before an order it is for is never committed;
a dead engine's files held for reclaim are cleared by their holder, MARK included.

The fix: aiokv/store/applying.py (the owner's jobs, a budget per step; records made and written
in chunks on the I/O thread, slots punched in runs), aiokv/store/bulk.py and native/bulk.c
(select and erase in C; records in bulk; an opening applies what its MARK is behind before it
serves), journal.py (writes of at most WRITE_MAX), control.py (`admit`), reclaim.py (orders
reach the dead engines' files it holds), events.py (removals in batches).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np

from aiokv.cli import operate
from aiokv.data import format as fmt
from aiokv.store import Store, applying, bulk, journal, logrecords, offline
from aiokv.store import reclaim as reclaim_mod
from aiokv.store.control import append_order
from aiokv.store.journal import IndexLog
from tests.conftest import NS, PAYLOAD, key
from tools.storeio import StoreIO

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SB = fmt.slot_bytes(PAYLOAD)


def _keys(lo: int, hi: int, salt: int = 0) -> list[bytes]:
    return [(i ^ salt).to_bytes(8, "little") * 4 for i in range(lo, hi)]


def _commit(st: Store, ns, lo: int, hi: int, tenant: int, batch: int = 4096) -> None:
    """Blocks lo..hi-1 of a tenant committed through the owner's API (their slots given disk
    space by fiat: the index and journal are real, the data files sparse)."""
    ns.alloc.grow(range(ns.alloc.hwm, ns.alloc.hwm + (hi - lo)))
    for i in range(lo, hi, batch):
        items = []
        for k in _keys(i, min(i + batch, hi)):
            where = ns.alloc.take()
            ns.pending[k] = where
            items.append((k, where))
        st.commit(ns, items, tenant)


def _order(root: str, op: str, tenants=None) -> None:
    fd = os.open(root, os.O_RDONLY)
    try:
        append_order(fd, op, None, tenants)
    finally:
        os.close(fd)


def _busy(st: Store) -> bool:
    """Whether the store is still applying an order (its jobs, or their chunks in flight)."""
    return st.control.jobs.busy


def _journal_recs(root: str, engine: int = 0):
    d = os.path.join(root, "ns", NS.hex(), fmt.engine_dir(engine)).rstrip("/")
    names = [n for n in os.listdir(d) if n.startswith("journal.")]
    with open(os.path.join(d, names[0]), "rb") as f:
        return logrecords.parse_records(f.read()[fmt.FILE_HDR_BYTES :])[0]


def test_a_clear_of_a_million_blocks_takes_a_bounded_share_of_each_step_while_commits_go_on(tmp_path, monkeypatch):
    """1M blocks (2^20), alice's every other run of 4096; per step at most BLOCKS forgotten; blocks committed
    during the clear (alice's too) stay; at the end every old alice block is gone, bob's are
    whole, alice's slots are holes (punched) and the MARK is in the journal."""
    monkeypatch.setattr(applying, "BLOCKS", 40_000, raising=False)
    root = str(tmp_path / "c")
    st = Store(root, checkpoint_every=10**9, io_thread=True)
    try:
        st.follow_interval = 0.01
        ns = st.namespace(NS, PAYLOAD)
        alice, bob = "alice", "bob"  # (commits take the tenant's name: its id given at the first)
        n = 1 << 20
        for lo in range(0, n, 8192):  # interleaved: alice's blocks are every other run of 4096
            _commit(st, ns, lo, min(lo + 4096, n), alice)
            _commit(st, ns, lo + 4096, min(lo + 8192, n), bob)
        st.refresh()
        old_alice = ns.table.blocks_of(st.tenant(alice))
        assert old_alice == n // 2
        _order(root, "clear", {fmt.tenant_tag("alice")})
        per_step, new, steps, taken = [], 0, 0, None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            before = ns.table.blocks_of(st.tenant(alice))
            st.refresh()
            gone = before - ns.table.blocks_of(st.tenant(alice))
            per_step.append(gone)
            if taken is None and st.control.last == 1:
                taken = new  # the order is taken: from here on commits came after it
            # saves go on: new blocks of both tenants each step
            _commit(st, ns, n + new, n + new + 100, alice)
            _commit(st, ns, 2 * n + new, 2 * n + new + 100, bob)
            new += 100
            steps += 1
            if ns.mark >= 1 and not _busy(st):
                break
            time.sleep(0.002)
        assert ns.mark == 1, "the clear did not finish"
        # each step forgot at most the budget, and the clear took several steps
        assert max(per_step) <= 40_000 + 100, max(per_step)
        assert sum(1 for g in per_step if g > 0) >= old_alice // 40_000
        st.lookup(ns, [], 0)
        own = ns.table.find  # (our own blocks: a slot, -1 for none)
        assert not any(own(k) >= 0 for k in _keys(0, 4096)), "an old alice block survived"
        assert all(own(k) >= 0 for k in _keys(4096, 8192))
        assert all(own(k) >= 0 for k in _keys(n + taken, n + new)), "a block committed during the clear was cleared"
        assert (
            ns.table.blocks_of(st.tenant(alice)) == new - taken and ns.table.blocks_of(st.tenant(bob)) == n // 2 + new
        )
        st.fs.wait(st.fs.submit(lambda: None), 30)
        assert ns.alloc.hole_count >= old_alice  # their space given back
        assert st.stats.cleared == old_alice + taken  # (those committed before it was taken: cleared too)
        recs = _journal_recs(root)
        assert int((recs["kind"] == fmt.REC_FREE).sum()) == old_alice + taken and logrecords.marks(recs) == 1
    finally:
        st.close()
    st = Store(root)  # what the files say after a restart
    ns = st.index.namespaces[NS]
    assert ns.table.blocks_of(st.tenant("alice")) == new - taken and ns.table.count == n // 2 + 2 * new - taken
    st.close()


def test_pins_and_unpins_take_a_bounded_share_of_each_step(tmp_path, monkeypatch):
    monkeypatch.setattr(applying, "FLAGS", 30_000, raising=False)
    root = str(tmp_path / "c")
    st = Store(root, checkpoint_every=10**9)
    try:
        st.pin_capacity = 1 << 50
        st.follow_interval = 0
        ns = st.namespace(NS, PAYLOAD)
        acme = "acme"
        _commit(st, ns, 0, 200_000, acme)
        for op, want in (("pin", 200_000), ("unpin", 0)):
            _order(root, op, {fmt.tenant_tag("acme")})
            steps = []
            for _ in range(2000):
                before = ns.table.pinned
                st.refresh()
                steps.append(abs(ns.table.pinned - before))
                if ns.table.pinned == want and not _busy(st):
                    break
            assert ns.table.pinned == want
            assert max(steps) <= 30_000 and len([s for s in steps if s]) >= 200_000 // 30_000, steps
    finally:
        st.close()
    st = Store(root)
    assert st.index.namespaces[NS].table.pinned == 0
    st.close()


def test_every_journal_write_of_a_clear_is_bounded(tmp_path, monkeypatch):
    """The FREE records of a clear go to the journal in writes of at most a chunk (here 4096
    records, 256 KiB), never in one write the size of the clear; and any append larger than
    WRITE_MAX goes in several writes, all of it landing."""
    monkeypatch.setattr(bulk, "CHUNK", 4096, raising=False)
    monkeypatch.setattr(applying, "SUB", 4096, raising=False)
    root = str(tmp_path / "c")
    st = Store(root, checkpoint_every=10**9)
    st.follow_interval = 0
    ns = st.namespace(NS, PAYLOAD)
    _commit(st, ns, 0, 100_000, "alice")
    sizes = []
    real = os.write

    def spy(fd, data):
        sizes.append(len(data))
        return real(fd, data)

    monkeypatch.setattr(journal.os, "write", spy)
    _order(root, "clear")
    for _ in range(2000):
        st.refresh()
        if ns.mark == 1 and not _busy(st):
            break
    monkeypatch.setattr(journal.os, "write", real)
    st.close(checkpoint=False)  # (the journal as the clear left it)
    assert sizes and max(sizes) <= 4096 * fmt.REC_BYTES, max(sizes)
    recs = _journal_recs(root)
    assert int((recs["kind"] == fmt.REC_FREE).sum()) == 100_000 and logrecords.marks(recs) == 1
    # an append past WRITE_MAX
    monkeypatch.setattr(journal, "WRITE_MAX", 4096, raising=False)
    d = tmp_path / "j"
    d.mkdir()
    dfd = os.open(d, os.O_RDONLY)
    try:
        jl = IndexLog(str(d), dfd)
        jl.load_table(1 << 20)
        sizes.clear()
        monkeypatch.setattr(journal.os, "write", spy)
        jl.append(b"".join(fmt.pack_free(i, i + 1) for i in range(1000)))
        monkeypatch.setattr(journal.os, "write", real)
        jl.close()
        assert max(sizes) <= 4096 and sum(sizes) == 1000 * fmt.REC_BYTES
        back = IndexLog(str(d), dfd, readonly=True)
        back.load_table(1 << 20)
        assert back.records == 1000
    finally:
        os.close(dfd)


async def test_a_save_reserved_before_a_clear_and_committed_after_it_is_not_kept(tmp_path, blocks):
    root = str(tmp_path / "c")
    st = StoreIO(root, capacity="1GiB")
    st.follow_interval = 0
    ns = st.namespace(NS, PAYLOAD)
    alice, bob = "alice", "bob"
    early = st.reserve(ns, key(1), alice)  # computed before the order
    other = st.reserve(ns, key(2), bob)  # another tenant's: the clear is not for it
    operate.run("clear", root, "alice", wait=0)
    st.refresh()  # the order taken
    late = st.reserve(ns, key(3), alice)  # computed after it
    free_before = len(ns.alloc.free)
    st.commit(ns, [(key(1), early)], alice)
    st.commit(ns, [(key(2), other)], bob)
    st.commit(ns, [(key(3), late)], alice)
    assert not ns.has(key(1)), "a save computed before the clear was kept"
    assert ns.has(key(2)) and ns.has(key(3))
    assert len(ns.alloc.free) == free_before + 1  # its slot given back
    st.close()
    st = Store(root)
    assert set(st.index.namespaces[NS].keys(0)) == {key(2), key(3)}
    st.close()


async def test_a_clear_reaches_a_dead_engines_files_another_engine_holds(tmp_path, blocks, monkeypatch):
    """Engine 0 dies holding alice's and bob's blocks; engine 1, over the capacity, takes its
    files to evict from them (their lock). A clear of alice: the command cannot open those files
    (locked), so engine 1 applies it to them: no alice block left in them, the MARK written."""
    monkeypatch.setattr(reclaim_mod, "RECLAIM_INTERVAL", 0)
    root = str(tmp_path / "s")
    cap = 24 * SB + 64 * 1024
    a = StoreIO(root, capacity=cap)
    na = a.namespace(NS, PAYLOAD)
    for i in range(16):
        blocks.fill(0, key(i))
        assert await a.save(na, [(key(i), blocks.addr(0))], tenant="alice" if i % 2 else "bob") == [0]
    a.close(checkpoint=False)  # dead (as after kill -9): its lock is free
    b = StoreIO(root, capacity=cap, engine=1)
    b.follow_interval = 0
    nb = b.namespace(NS, PAYLOAD)
    for i in range(100, 112):  # the directory fills: b takes engine 0's files to evict its oldest
        blocks.fill(0, key(i))
        assert await b.save(nb, [(key(i), blocks.addr(0))], tenant="carol") == [0]
        b.refresh()
    assert 0 in b.reclaim._reclaiming
    doc = operate.run("clear", root, "alice", wait=0)
    assert 0 not in doc["applied_by_this_command"]  # (held by engine 1)
    b.refresh()
    b.refresh()
    left = IndexLog(
        os.path.join(root, "ns", NS.hex()), os.open(os.path.join(root, "ns", NS.hex()), os.O_RDONLY), readonly=True
    ).load()
    assert left and not any(key(i) in left for i in range(1, 16, 2)), "alice's blocks stayed in the dead engine's files"
    assert offline.applied_mark(root, NS, 0) == 1
    assert not any(nb.has(key(i)) for i in range(1, 16, 2))
    b.close()
    st = Store(root)  # the engine adopting number 0 next serves none of them
    assert not any(st.index.namespaces[NS].has(key(i)) for i in range(1, 16, 2))
    st.close()


_KILLED = r"""
import sys, time
sys.path.insert(0, sys.argv[2])
from aiokv.store import Store
try:
    from aiokv.store import applying, bulk
    applying.BLOCKS, applying.SUB, bulk.CHUNK = 128, 128, 128  # (a clear of many steps: the kill lands in it)
except ImportError:
    pass  # (the code before issue 40: one write)
st = Store(sys.argv[1], io_thread=True, checkpoint_every=10**9)
st.follow_interval = 0.005
ns = st.namespace(bytes(range(16)), 4096)
while not ns.ready:
    st.refresh()
    time.sleep(0.001)
print("ready", flush=True)
while True:
    st.refresh()
    time.sleep(0.02)
"""


def _journal_bytes(d: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.startswith("journal."))


async def test_an_engine_killed_mid_clear_leaves_each_block_cleared_or_whole(tmp_path):
    """An engine applies a clear of alice's 1,000 blocks (of 2,000) 128 at a time and is killed
    (SIGKILL) as soon as its journal has grown by a chunk; the files then index every bob block,
    alice's either indexed or not, and every indexed block verifies (never punched under its
    entry); the next opening applies the rest before it serves, MARK included."""
    import shutil

    from aiokv.data.slotfile import read_slot
    from tests.conftest import Blocks

    n, payload = 2000, 4096
    template = str(tmp_path / "t")
    t = StoreIO(template)
    ns = t.namespace(NS, payload)
    b = Blocks(payload, 8)
    try:
        for i in range(0, n, 2):
            for q in range(2):
                b.fill(q, key(i + q))
            tenant = "alice" if (i // 2) % 2 else "bob"
            assert await t.save(ns, [(key(i + q), b.addr(q)) for q in range(2)], tenant=tenant) == [0, 0]
    finally:
        b.pool.close()
    t.close()
    alice = {key(i) for i in range(n) if (i // 2) % 2}
    seen = set()
    for trial in range(6):
        if "part" in seen:
            break
        root = str(tmp_path / f"r{trial}")
        shutil.copytree(template, root)
        d = os.path.join(root, "ns", NS.hex())
        size = _journal_bytes(d)
        p = subprocess.Popen(
            [sys.executable, "-c", _KILLED, root, ROOT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
            _order(root, "clear", {fmt.tenant_tag("alice")})
            deadline = time.monotonic() + 60
            while p.poll() is None and time.monotonic() < deadline and _journal_bytes(d) < size + 128 * fmt.REC_BYTES:
                time.sleep(0.0002)
        finally:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
        dfd = os.open(d, os.O_RDONLY)
        fd = os.open(os.path.join(d, fmt.data_file(0)), os.O_RDONLY)
        try:
            entries = IndexLog(d, dfd, readonly=True).load()
            assert all(key(i) in entries for i in range(n) if key(i) not in alice)  # bob's, every one
            for k, (slot, _) in entries.items():
                read_slot(fd, slot, NS, 0, payload, k)  # (raises if punched or torn)
        finally:
            os.close(fd)
            os.close(dfd)
        left = len(alice & set(entries))
        seen.add("none" if left == len(alice) else "all" if not left else "part")
        st = Store(root)  # the next opening finishes it before it serves
        own = set(st.index.namespaces[NS].keys(0))
        st.close()
        assert not own & alice and len(own) == n - len(alice), trial
        assert offline.applied_mark(root, NS, 0) == 1
    assert "part" in seen, seen


def test_bulk_erase_leaves_a_table_as_clearing_one_by_one_would():
    """aiokv._index.erase (a clear's) against Table.clear of each slot, on tables with long
    probe runs (a quarter to all of the blocks, in any order): the same blocks found at the
    same slots, the same counts."""
    from aiokv.store.table import Table

    rng = np.random.default_rng(7)
    for n, frac in ((5000, 0.25), (5000, 1.0), (40_000, 0.6)):
        slots = rng.permutation(2 * n)[:n].astype(np.uint64)
        tags = rng.integers(1, 2**63, n, dtype=np.uint64)
        tags[: n // 10] = (tags[: n // 10] & ~np.uint64(0xFFFF)) | np.uint64(5)  # (shared homes: long runs)
        ten, fl = rng.integers(0, 5, n).astype(np.uint16), rng.integers(0, 2, n).astype(np.uint8)
        a, b = (Table.of(slots, tags, np.arange(n, dtype=np.uint64), ten, fl) for _ in range(2))
        gone = rng.permutation(slots.astype(np.int64))[: int(n * frac)]
        for s in gone.tolist():
            a.clear(s)
        by_slot = dict(zip(slots.tolist(), tags.tolist()))
        assert bulk.clear_slots(b, gone).tolist() == [by_slot[s] for s in gone.tolist()]
        assert a.count == b.count and a.pinned == b.pinned and (a.tenant_blocks == b.tenant_blocks).all()
        found_a, found_b = np.empty(n, np.int64), np.empty(n, np.int64)
        a.probe.find_many(tags, found_a)
        b.probe.find_many(tags, found_b)
        assert (found_a == found_b).all() and (a.tag == b.tag).all() and (a.flags == b.flags).all()


def test_records_made_in_bulk_are_the_ones_format_packs():
    slots = np.array([0, 7, 2**32 - 1, 12345], np.int64)
    tags = np.array([1, 2**64 - 1, 0x0123456789ABCDEF, 42], np.uint64)
    flags = np.array([1, 0, 1, 0], np.uint8)
    assert bytes(bulk.free_records(slots, tags)) == b"".join(
        fmt.pack_free(s, t) for s, t in zip(slots.tolist(), tags.tolist())
    )
    assert bytes(bulk.flags_records(slots, tags, flags)) == b"".join(
        fmt.pack_flags(s, t, f) for s, t, f in zip(slots.tolist(), tags.tolist(), flags.tolist())
    )
