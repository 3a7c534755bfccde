# SPDX-License-Identifier: Apache-2.0
"""Bug: ENOSPC crashes the writer or leaves a half-accounted store.
Invariant: a full disk skips saves and evicts; usage stays under the capacity
bound; what is stored still loads; the store keeps serving.
Fix: disk space is reserved with fallocate when slots are created, so ENOSPC
arrives at reservation (a skipped save + eviction), never in the middle of a write;
a fallocate that fails part-way is punched back (it leaves nothing allocated).
"""

from __future__ import annotations

import os

import pytest

from aiokv.data import format as fmt
from tests import mounts
from tests.conftest import NS, PAYLOAD, key
from tools.storeio import StoreIO


@pytest.fixture
def small_fs(tmp_path):
    """A 24 MiB ext4 file system on a loop device."""
    with mounts.loop_ext4(tmp_path / "mnt", "24M") as mnt:
        yield mnt


async def test_enospc_skips_and_evicts(small_fs, blocks, backend_kind):
    root = str(small_fs / "s")
    st = StoreIO(root, capacity="1GiB")  # far above the 24 MiB the disk has
    ns = st.namespace(NS, PAYLOAD)
    stored = []
    for rnd in range(12):  # ~ 12 * 32 * 68 KiB = 26 MiB > the file system
        batch = [key(rnd * 32 + j) for j in range(32)]
        for j, k in enumerate(batch):
            blocks.fill(j, k)
        res = await st.save(ns, [(k, blocks.addr(j)) for j, k in enumerate(batch)])
        stored += [k for k, r in zip(batch, res) if r == 0]
    assert st.stats.enospc >= 1
    assert st.stats.evictions > 0, "a full disk must make room by evicting"
    # a failed fallocate gives back what it did allocate: the data file holds only slots in use or
    # free (and the file system's own extent blocks, a few KiB)
    du = os.stat(os.path.join(st.root, "ns", NS.hex(), "rank0.data")).st_blocks * 512
    assert du <= ns.alloc.backed * ns.slot_bytes + (64 << 10), (du, ns.alloc.backed * ns.slot_bytes)
    # the newest batch got in after eviction
    assert st.lookup(ns, [key(11 * 32)]) == 1
    present = [k for k in stored if ns.has(k)]
    for i in range(0, len(present), 64):
        chunk = present[i : i + 64]
        for j in range(len(chunk)):
            blocks.clear(j)
        assert await st.load(ns, [(k, blocks.addr(j)) for j, k in enumerate(chunk)]) == [0] * len(chunk)
        assert all(blocks.holds(j, k) for j, k in enumerate(chunk))
    st.close()
    st = StoreIO(root)  # a later open still hits what stayed
    ns = st.namespace(NS, PAYLOAD)
    assert set(present) <= set(ns.keys())
    st.close()


async def test_capacity_bound_is_kept(tmp_path, blocks):
    cap = 40 * fmt.slot_bytes(PAYLOAD) + (64 << 10)  # 40 slots and room for the journal
    st = StoreIO(tmp_path / "s", capacity=cap)
    ns = st.namespace(NS, PAYLOAD)
    for rnd in range(5):
        batch = [key(rnd * 32 + j) for j in range(32)]
        for j, k in enumerate(batch):
            blocks.fill(j, k)
        assert await st.save(ns, [(k, blocks.addr(j)) for j, k in enumerate(batch)]) == [0] * 32
        assert st.index.physical_bytes <= cap
        du = os.stat(os.path.join(st.root, "ns", NS.hex(), "rank0.data")).st_blocks * 512
        assert du <= cap
    assert ns.count() == 40 and st.stats.evictions == 5 * 32 - 40
    # LRU: the newest 40 survive, and a hit refreshes a key
    assert st.lookup(ns, [key(159)]) == 1 and st.lookup(ns, [key(119)]) == 0
    st.pin(ns, [key(120)])
    st.unpin(ns, [key(120)])
    blocks.fill(0, key(500))
    await st.save(ns, [(key(500), blocks.addr(0))])
    assert ns.has(key(120)) and not ns.has(key(121))
    st.close()
    st = StoreIO(tmp_path / "s", capacity=cap // 2)  # a smaller bound at reopen evicts down to it
    assert st.index.physical_bytes <= cap // 2
    st.close()
