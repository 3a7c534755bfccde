# SPDX-License-Identifier: Apache-2.0
"""Bug: any OSError from the journal (EBADF, EIO, EROFS, an fdatasync failure)
was handled as a full disk: the capacity was lowered to what was in use, for
good, and a commit whose records had already been written was undone. A
journal whose header did not verify dropped its records, and the owner then
punched and truncated every slot the (shorter) index did not name: blocks that
still verified were destroyed. Capacity counted slots only, not the journal
and checkpoint, and counted a slot's space as given back when punching it
failed.
Invariant: only ENOSPC/EDQUOT lowers the capacity, and a lowered capacity
comes back once the file system has room again; a failed fdatasync does not
undo a written commit; a damaged journal header loses no verifiable block;
the bytes the store accounts for cover its data files, journal and checkpoint,
and stay at or under the capacity.
Fix: Store.commit tells ENOSPC from other errors; Store._grow re-reads the
file system's free space (at most once a second) when the capacity was
lowered; IndexLog.append keeps a written batch when fdatasync fails; an owner
rebuilds the index from the slot headers when the journal header is bad (as
for a bad checkpoint); Store._used adds journal and checkpoint bytes; a slot
whose punch fails stays counted (and reusable).
"""

from __future__ import annotations

import os
import subprocess

import pytest

from aiokv.data import format as fmt
from tests.conftest import NS, PAYLOAD, key
from tests.test_disk_full import small_fs  # noqa: F401 (fixture)
from tools.storeio import StoreIO

SB = fmt.slot_bytes(PAYLOAD)


async def _save(st, ns, blocks, keys):
    for j, k in enumerate(keys):
        blocks.fill(j, k)
    return await st.save(ns, [(k, blocks.addr(j)) for j, k in enumerate(keys)])


def _swap_journal_fd(st, ns, new_fd: int) -> int:
    """Point the journal's descriptor at another open file (a real fault, no mock);
    returns a duplicate of the original to put back."""
    log = st.logs[ns.nsid]
    saved = os.dup(log.fd)
    os.dup2(new_fd, log.fd)
    return saved


async def test_non_enospc_journal_error_keeps_the_capacity(tmp_path, blocks):
    cap = 64 * SB
    st = StoreIO(tmp_path / "s", capacity=cap)
    ns = st.namespace(NS, PAYLOAD)
    assert await _save(st, ns, blocks, [key(i) for i in range(4)]) == [0] * 4
    ro = os.open(tmp_path / "s" / "aiokv.json", os.O_RDONLY)
    saved = _swap_journal_fd(st, ns, ro)  # writes now fail with EBADF
    res = await _save(st, ns, blocks, [key(10)])
    assert res[0] < 0 and not ns.has(key(10))  # not durable, so not committed
    assert st.limit == cap, "a journal error that is not ENOSPC lowered the capacity"
    assert st.stats.enospc == 0
    os.dup2(saved, st.logs[ns.nsid].fd)
    assert await _save(st, ns, blocks, [key(11)]) == [0]
    st.close()
    os.close(ro)
    os.close(saved)


async def test_failed_fdatasync_does_not_undo_a_written_commit(tmp_path, blocks):
    st = StoreIO(tmp_path / "s", capacity=64 * SB, sync_interval=0)
    ns = st.namespace(NS, PAYLOAD)
    r, w = os.pipe()  # write(2) works, fdatasync(2) fails with EINVAL
    saved = _swap_journal_fd(st, ns, w)
    assert await _save(st, ns, blocks, [key(1)]) == [0]
    assert ns.has(key(1)) and st.limit == 64 * SB
    os.dup2(saved, st.logs[ns.nsid].fd)
    st.close()
    for fd in (r, w, saved):
        os.close(fd)


async def test_lowered_capacity_comes_back_when_space_returns(small_fs, blocks):  # noqa: F811
    root = small_fs / "s"
    filler = small_fs / "filler"
    st = StoreIO(root, capacity="1GiB")
    st.space_check_interval = 0
    ns = st.namespace(NS, PAYLOAD)
    with open(filler, "wb") as f:  # another user of the disk takes most of it
        f.write(b"\0" * (14 << 20))
    n = 0
    while st.limit == 1 << 30:  # until a full disk lowers the capacity
        await _save(st, ns, blocks, [key(n * 8 + j) for j in range(8)])
        n += 1
        assert n < 40
    lowered = st.limit
    assert lowered < (24 << 20)
    os.unlink(filler)  # space comes back
    for m in range(n, n + 12):
        await _save(st, ns, blocks, [key(m * 8 + j) for j in range(8)])
    assert st.limit is None or st.limit > lowered + (8 << 20), "the capacity stayed lowered after space returned"
    assert ns.count() * SB > lowered, "saves never grew past the lowered capacity"
    st.close()


async def test_damaged_journal_header_loses_no_verifiable_block(tmp_path, blocks):
    root = tmp_path / "s"
    st = StoreIO(root)
    ns = st.namespace(NS, PAYLOAD)
    keys = [key(i) for i in range(12)]
    assert await _save(st, ns, blocks, keys) == [0] * 12
    # close without a checkpoint: every entry lives in the journal only
    st.logs[ns.nsid].close()
    st.logs.clear()
    st.close()
    d = root / "ns" / NS.hex()
    [jname] = [n for n in os.listdir(d) if n.startswith("journal.")]
    with open(d / jname, "r+b") as f:
        f.write(b"XXXXXXXX")  # the header's magic
    st = StoreIO(root)
    ns = st.namespace(NS, PAYLOAD)
    assert set(keys) <= set(ns.keys()), "blocks whose headers verify were lost with the journal header"
    for j in range(12):
        blocks.clear(j)
    assert await st.load(ns, [(k, blocks.addr(j)) for j, k in enumerate(keys)]) == [0] * 12
    assert all(blocks.holds(j, k) for j, k in enumerate(keys))
    st.close()


def _files_bytes(root) -> int:
    d = os.path.join(root, "ns", NS.hex())
    total = 0
    for name in os.listdir(d):
        s = os.stat(os.path.join(d, name))
        total += s.st_blocks * 512 if name.endswith(".data") else s.st_size
    return total


async def test_capacity_counts_journal_and_checkpoint(tmp_path, blocks):
    cap = 16 * SB  # exactly 16 slots: the index files must fit in it too
    st = StoreIO(tmp_path / "s", capacity=cap, checkpoint_every=40)
    ns = st.namespace(NS, PAYLOAD)
    for rnd in range(8):
        await _save(st, ns, blocks, [key(rnd * 16 + j) for j in range(16)])
        assert _files_bytes(st.root) <= cap, "data + journal + checkpoint exceed the capacity"
    assert 0 < ns.count() < 16
    st.close()


@pytest.fixture
def ramfs(tmp_path):
    """A file system that cannot punch holes (ramfs: fallocate is EOPNOTSUPP)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "ramfs", "-o", "mode=0700", "none", str(mnt)], check=True)
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=True)


def _data_bytes(root) -> int:
    d = os.path.join(root, "ns", NS.hex())
    return sum(os.stat(os.path.join(d, n)).st_blocks * 512 for n in os.listdir(d) if n.endswith(".data"))


async def test_failed_punch_stays_counted(ramfs, blocks):
    root = ramfs / "s"
    st = StoreIO(root, capacity=64 * SB)
    ns = st.namespace(NS, PAYLOAD)
    assert await _save(st, ns, blocks, [key(i) for i in range(24)]) == [0] * 24
    st.close()
    st = StoreIO(root, capacity=8 * SB)  # shrinking punches; ramfs refuses
    assert st.index.physical_bytes >= _data_bytes(st.root), "space counted as given back that the disk still holds"
    ns = st.namespace(NS, PAYLOAD)
    assert await _save(st, ns, blocks, [key(100)]) == [0]  # a slot that could not be punched is reused
    assert st.index.physical_bytes >= _data_bytes(st.root)
    st.close()
