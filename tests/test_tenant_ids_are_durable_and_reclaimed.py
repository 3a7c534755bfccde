# SPDX-License-Identifier: Apache-2.0
"""A tenant id names one tenant's blocks for good: through failed, short and torn writes of the
tenants file, restarts, other engines following, and ids reclaimed once no block carries them.

The bugs (issue 40 item 6): aiokv/store/tenants.py marked an id written before its record was
written, never wrote it again after a failure, ignored a short os.write, appended after a torn
tail (unreadable from then on), and after a restart took the next id from the file alone: the
journal named ids the file did not, the next new tenant got them, so alice's blocks became
carol's and `aiokv clear --tenant carol` removed alice's. Ids were registered for every
request's cache_salt, saving or not, and never reclaimed: past 65,534 salts in a directory's
life every new tenant shared one overflow id (a clear of one cleared them all).
The invariant: every block the index holds is attributed to the tenant its slot header names,
or to none, never to another (checked against the headers, after each restart); a clear of one
tenant removes no other tenant's block; ids are registered only for committed blocks and
reused once no block of any engine carries them; past the limit a new tenant's blocks are not
stored (counted), so a clear of a named tenant never reaches another's.
The fix: the tenants record is written on the I/O thread inside the journal write of the first
commit naming its id (written whole, a short or failed write cut off again, the commit undone
and tried again at the next one), the torn tail cut at open, ids registered at commit and
reclaimed (the file replaced without the freed ids), version 2 of the tenants file.
"""

from __future__ import annotations

import errno
import os
import time

import pytest

from aiokv.data import format as fmt
from aiokv.store import Store
from aiokv.store import tenants as tenants_mod
from aiokv.store.control import append_order
from tests import mounts
from tests.conftest import NS, PAYLOAD, key
from tools.storeio import StoreIO

SB = fmt.slot_bytes(PAYLOAD)
PAGE = 4096


@pytest.fixture
def tmpfs(tmp_path):
    """A 16 MiB tmpfs (a real ENOSPC, and real short writes, once it is full)."""
    with mounts.tmpfs(tmp_path / "mnt", "16m") as mnt:
        yield mnt


def _fill_up(path) -> None:
    """Another user takes the rest of the file system (until ENOSPC)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            try:
                os.write(fd, b"\xff" * PAGE)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                return
    finally:
        os.close(fd)


async def _save(st, ns, blocks, ids, tenant: str) -> list[int]:
    for j, i in enumerate(ids):
        blocks.fill(j, key(i))
    return await st.save(ns, [(key(i), blocks.addr(j)) for j, i in enumerate(ids)], tenant=tenant)


def _headers(root: str, ns) -> dict[bytes, bytes]:
    """key -> the tenant tag its slot header carries, for every block of ours the index holds."""
    out = {}
    with open(os.path.join(root, "ns", NS.hex(), fmt.data_file(0)), "rb") as f:
        for k in ns.keys(ns.engine):
            s = ns.block(k)[0]
            f.seek(s * SB)
            out[k] = fmt.header_tenant(f.read(fmt.HEADER_BYTES))
    return out


def _attributed(st, ns) -> dict[bytes, bytes | None]:
    """key -> the tenant tag the index attributes each of our blocks to (None: to no tenant)."""
    t = ns.table
    return {k: st.tenants.tag_of(int(t.tenant[t.find(k)])) for k in ns.keys(ns.engine)}


def _check_attribution(st, ns, root) -> dict[bytes, bytes]:
    """Every block is attributed to the tenant its header names, or to none: never another."""
    heads, got = _headers(root, ns), _attributed(st, ns)
    wrong = {
        k.hex()[:8]: (heads[k].hex()[:8], (got[k] or b"-").hex()[:8]) for k in heads if got[k] not in (heads[k], None)
    }
    assert not wrong, f"blocks attributed to another tenant than their header's (header, index): {wrong}"
    return heads


def _clear(st, root, *tenants) -> None:
    """`aiokv clear --tenant T` for each T, applied by the store at its next refresh."""
    fd = os.open(root, os.O_RDONLY)
    try:
        append_order(fd, "clear", None, {fmt.tenant_tag(t) for t in tenants})
    finally:
        os.close(fd)
    st.follow_interval = 0
    st.refresh()


def _clear_leaves_the_others(st, ns, root, tenant: str) -> None:
    heads = _check_attribution(st, ns, root)
    others = {k for k, tag in heads.items() if tag != fmt.tenant_tag(tenant)}
    _clear(st, root, tenant)
    gone = others - set(ns.keys(ns.engine))
    assert not gone, f"a clear of {tenant} removed {len(gone)} block(s) of other tenants"
    assert not [k for k, tag in heads.items() if tag == fmt.tenant_tag(tenant) and ns.block(k) is not None]


@pytest.mark.parametrize("io_thread", [False, True])
async def test_a_failed_tenants_write_then_a_restart_keeps_alices_blocks_alices(tmpfs, blocks, io_thread):
    root = str(tmpfs / "s")
    st = StoreIO(root, capacity=140 * SB, checkpoint_every=10**6, io_thread=io_thread)  # (one growth: every slot)
    ns = st.namespace(NS, PAYLOAD)
    assert await _save(st, ns, blocks, [0], "") == [0]
    _fill_up(tmpfs / "filler")
    # alice's record cannot be written (the disk is full): her blocks are not committed
    got = await _save(st, ns, blocks, [1, 2], "alice")
    if io_thread:  # (in the index at once; taken back when the I/O thread reports the write failed)
        st.fs.drain(st.fs.submit(lambda: None), 5.0, time.monotonic() + 5.0)
        st.refresh()
        got = [0 if ns.block(key(i)) is not None else -errno.EIO for i in (1, 2)]
    assert got == [-errno.EIO] * 2
    os.unlink(tmpfs / "filler")
    await _save(st, ns, blocks, [3], "alice")  # room again: her record is written now
    st.close()
    st = StoreIO(root, capacity=140 * SB, checkpoint_every=10**6)
    ns = st.namespace(NS, PAYLOAD)
    assert await _save(st, ns, blocks, [4], "carol") == [0]
    assert ns.block(key(3)) is not None, "alice's save once the disk had room again"
    _clear_leaves_the_others(st, ns, root, "carol")
    st.close()


async def test_a_short_tenants_write_is_cut_off_and_written_again(tmpfs, blocks):
    root = str(tmpfs / "s")
    st = StoreIO(root, capacity=140 * SB, checkpoint_every=10**6)
    ns = st.namespace(NS, PAYLOAD)
    # first tenants whose records end the file 10 bytes before a page ends: bob's record then
    # takes 10 bytes of that page and the rest of a page the full disk does not have (short)
    per = len(fmt.pack_tenant(fmt.tenant_tag("x"), 1, False, "x")) - 1  # a record less its name
    left, n = PAGE - 10 - fmt.FILE_HDR_BYTES, 18  # (names of at most 200 bytes: format.MAX_TENANT_NAME)
    for i in range(n):
        size = left // n + (i < left % n) - per
        assert await _save(st, ns, blocks, [100 + i], f"{i:02d}".ljust(size, "a")) == [0]
    assert os.path.getsize(os.path.join(root, fmt.tenants_name(0))) == PAGE - 10
    _fill_up(tmpfs / "filler")
    assert await _save(st, ns, blocks, [1], "bob") == [-errno.EIO], "committed without its tenant's record"
    assert os.path.getsize(os.path.join(root, fmt.tenants_name(0))) == PAGE - 10, "a torn record was left"
    os.unlink(tmpfs / "filler")
    assert await _save(st, ns, blocks, [2], "bob") == [0]
    st.close()
    st = StoreIO(root, capacity=140 * SB, checkpoint_every=10**6)
    ns = st.namespace(NS, PAYLOAD)
    assert await _save(st, ns, blocks, [3], "carol") == [0]
    assert st.tenants.name_of(int(ns.table.tenant[ns.table.find(key(2))])) == "bob"
    _clear_leaves_the_others(st, ns, root, "carol")
    st.close()


async def test_a_torn_tail_of_the_tenants_file_is_cut_before_the_next_record(tmp_path, blocks):
    root = str(tmp_path / "s")
    st = StoreIO(root, capacity="64MiB")
    ns = st.namespace(NS, PAYLOAD)
    assert await _save(st, ns, blocks, [0], "alice") == [0]
    st.close()
    with open(os.path.join(root, fmt.tenants_name(0)), "ab") as f:  # a writer killed mid-append
        f.write(fmt.pack_tenant(fmt.tenant_tag("zed"), 2, False, "zed")[:20])
    st = StoreIO(root, capacity="64MiB")
    ns = st.namespace(NS, PAYLOAD)
    assert await _save(st, ns, blocks, [1], "bob") == [0]
    st.close()
    st = StoreIO(root, capacity="64MiB")
    ns = st.namespace(NS, PAYLOAD)
    assert await _save(st, ns, blocks, [2], "carol") == [0]
    assert [st.tenants.name_of(int(ns.table.tenant[ns.table.find(key(i))])) for i in range(3)] == [
        "alice",
        "bob",
        "carol",
    ]
    _clear_leaves_the_others(st, ns, root, "carol")
    st.close()


def test_requests_that_never_save_register_no_tenant(tmp_path):
    from aiokv.scheduler.side import SchedulerSide

    st = Store(str(tmp_path / "c"), capacity="64MiB")
    side = SchedulerSide(st, st.namespace(NS, PAYLOAD), 16)
    for i in range(100):
        side.describe(f"r{i}", f"salt-{i}")
    assert st.tenants.ids() == [0], "ids were taken by requests that stored nothing"
    assert not os.path.exists(tmp_path / "c" / fmt.tenants_name(0))
    st.close()


async def test_ids_no_block_carries_are_reclaimed_in_a_life_and_across_restarts(tmp_path, blocks, monkeypatch):
    monkeypatch.setattr(fmt, "MAX_TENANT_ID", 3)  # (65,534 in production: the same code path)
    monkeypatch.setattr(tenants_mod, "RECLAIM_EVERY", 0, raising=False)  # (a look a second at most in production)
    root = str(tmp_path / "s")
    st = StoreIO(root, capacity="64MiB")
    ns = st.namespace(NS, PAYLOAD)
    for i in (1, 2, 3):
        assert await _save(st, ns, blocks, [i], f"t{i}") == [0]
    _clear(st, root, "t1", "t2")  # no block carries their ids any more
    inodes = []
    for i in (4, 5):
        assert await _save(st, ns, blocks, [i], f"t{i}") == [0], f"t{i} got no id"
        inodes.append(os.stat(os.path.join(root, fmt.tenants_name(0))).st_ino)
    assert inodes[0] == inodes[1], "the file is replaced once (t1's and t2's records out), then appended to"
    names = {i: st.tenants.name_of(int(ns.table.tenant[ns.table.find(key(i))])) for i in (3, 4, 5)}
    assert names == {3: "t3", 4: "t4", 5: "t5"}
    _check_attribution(st, ns, root)
    st.close()
    st = StoreIO(root, capacity="64MiB")
    ns = st.namespace(NS, PAYLOAD)
    _check_attribution(st, ns, root)
    assert len(st.tenants.ids()) == 4  # "" and t3, t4, t5
    _clear(st, root, "t4")
    st.close()
    st = StoreIO(root, capacity="64MiB")  # t4's id is reclaimed at the next life's first new tenant
    ns = st.namespace(NS, PAYLOAD)
    assert await _save(st, ns, blocks, [6], "t6") == [0]
    assert st.tenants.name_of(int(ns.table.tenant[ns.table.find(key(6))])) == "t6"
    _clear_leaves_the_others(st, ns, root, "t5")
    st.close()
    st = StoreIO(root, capacity="64MiB")
    ns = st.namespace(NS, PAYLOAD)
    assert sorted(st.tenants.name_of(int(ns.table.tenant[ns.table.find(k)])) for k in ns.keys(ns.engine)) == [
        "t3",
        "t6",
    ]
    assert os.path.getsize(os.path.join(root, fmt.tenants_name(0))) < 4096  # the freed ids' records went
    st.close()


async def test_past_the_limit_a_new_tenant_is_not_stored_and_no_clear_reaches_another(tmp_path, blocks, monkeypatch):
    monkeypatch.setattr(fmt, "MAX_TENANT_ID", 2)
    monkeypatch.setattr(tenants_mod, "RECLAIM_EVERY", 0, raising=False)
    root = str(tmp_path / "s")
    st = StoreIO(root, capacity="64MiB")
    ns = st.namespace(NS, PAYLOAD)
    assert await _save(st, ns, blocks, [1], "t1") == [0]
    assert await _save(st, ns, blocks, [2], "t2") == [0]
    assert await _save(st, ns, blocks, [0], "") == [0]  # (the tenant "" needs no id)
    for i in (3, 4):  # every id holds blocks: a new tenant's blocks are not stored
        await _save(st, ns, blocks, [i], f"t{i}")
    _clear_leaves_the_others(st, ns, root, "t3")
    assert ns.block(key(3)) is None and ns.block(key(4)) is None
    assert st.stats.skipped_tenants == 2
    _clear_leaves_the_others(st, ns, root, "t1")
    assert await _save(st, ns, blocks, [5], "t5") == [0], "t1's id is free again"
    st.close()


async def test_another_engine_follows_a_reclaimed_id_to_its_new_tenant(tmp_path, blocks, monkeypatch):
    monkeypatch.setattr(fmt, "MAX_TENANT_ID", 2)
    monkeypatch.setattr(tenants_mod, "RECLAIM_EVERY", 0, raising=False)
    root = str(tmp_path / "s")
    e0, e1 = StoreIO(root, capacity="1GiB"), StoreIO(root, capacity="1GiB")
    e0.follow_interval = e1.follow_interval = 0
    ns0, ns1 = e0.namespace(NS, PAYLOAD), e1.namespace(NS, PAYLOAD)
    assert await _save(e0, ns0, blocks, [1], "t1") == [0]
    assert await _save(e0, ns0, blocks, [2], "t2") == [0]
    e1.refresh()
    _clear(e0, root, "t1")
    assert await _save(e0, ns0, blocks, [3], "t3") == [0]  # t1's id, reclaimed
    e1.refresh()
    peer = ns1.tables[0]
    seen = {i: e1.tenants.name_of(int(peer.tenant[peer.find(key(i))])) for i in (2, 3)}
    assert seen == {2: "t2", 3: "t3"} and peer.find(key(1)) < 0
    e1.close()
    e0.close()


async def test_blocks_whose_ids_the_file_lost_count_for_no_tenant(tmp_path, blocks, caplog):
    """A tenants file lost or damaged (or written by an aiokv with the bug above): the blocks
    whose ids it no longer names count for no tenant, and those ids go to no new tenant."""
    root = str(tmp_path / "s")
    st = StoreIO(root, capacity="64MiB")
    ns = st.namespace(NS, PAYLOAD)
    assert await _save(st, ns, blocks, [1, 2], "alice") == [0, 0]
    st.close(checkpoint=False)
    os.unlink(os.path.join(root, fmt.tenants_name(0)))
    for life in range(2):
        st = StoreIO(root, capacity="64MiB")
        ns = st.namespace(NS, PAYLOAD)
        assert await _save(st, ns, blocks, [3 + life], f"carol{life}") == [0]
        got = _attributed(st, ns)
        assert got[key(1)] is None and got[key(2)] is None, "alice's blocks given to another tenant"
        assert st.tenants.label(int(ns.table.tenant[ns.table.find(key(1))])) == "(no tenant)"
        _clear_leaves_the_others(st, ns, root, f"carol{life}")
        st.close()
    assert "name tenant ids that tenants.0 does not" in caplog.text


async def test_an_id_is_given_anew_only_once_a_failed_journal_write_is_checkpointed(tmp_path, blocks, monkeypatch):
    """A clear of t1 whose FREE record could not be written (the journal write failed): t1's
    block is gone here, but a replay brings it back under t1's id. That id goes to t3 only after
    a checkpoint has written the index as it is, so no restart gives t1's block to t3."""
    monkeypatch.setattr(fmt, "MAX_TENANT_ID", 2)
    monkeypatch.setattr(tenants_mod, "RECLAIM_EVERY", 0, raising=False)
    root = str(tmp_path / "s")
    st = StoreIO(root, capacity="64MiB")
    ns = st.namespace(NS, PAYLOAD)
    assert await _save(st, ns, blocks, [1], "t1") == [0]
    assert await _save(st, ns, blocks, [2], "t2") == [0]
    log = st.logs[ns.nsid]
    saved, ro = os.dup(log.fd), os.open(os.path.join(root, "aiokv.json"), os.O_RDONLY)
    os.dup2(ro, log.fd)  # journal writes fail (EBADF): a real fault, no mock
    _clear(st, root, "t1")
    os.dup2(saved, log.fd)
    assert ns.block(key(1)) is None
    await _save(st, ns, blocks, [3], "t3")  # t1's id is free, but not before a checkpoint
    assert await _save(st, ns, blocks, [4], "t3") == [0]
    st.close(checkpoint=False)  # (a kill: the journal and checkpoint as they are)
    st = StoreIO(root, capacity="64MiB")
    ns = st.namespace(NS, PAYLOAD)
    assert _attributed(st, ns).get(key(1)) in (None, fmt.tenant_tag("t1")), "t1's block is t3's"
    assert _attributed(st, ns)[key(4)] == fmt.tenant_tag("t3")
    st.close()
