# SPDX-License-Identifier: Apache-2.0
"""A namespace loaded in the background, on a file system without hole punching,
hands out no slot twice.

Bug: once the loader's index was installed (store.py `_loaded`) the namespace was
ready at once, while the give-back of the slots the index does not name (replay.py
`give_back_io`: punch them) was still queued on the I/O thread; they were still
the allocator's holes meanwhile. The first reservation's grow planned those holes
(`SlotAllocator.plan_grow`); where the punch was refused (ramfs, tmpfs on old
kernels: EOPNOTSUPP) the give-back's outcome made them free, and the grow's outcome
made the same slots free again: two free-list entries a slot, so two saves handed
one slot. The second save's bytes overwrite the first block (its load then fails
verification, the header names another key: a recompute, never wrong KV), its commit
replaces the first key in the index (a block saved, then a miss), and the allocator
counts the slot in use twice (capacity lost until restart).

Invariant: after a background load, every slot below the high-water mark is
exactly one of in use, free or a hole, and every block saved loads back.

Fix: the slots being given back are taken out of the allocator until the give-back
ran (neither free nor holes, as a slot being punched is: space.py `_unback`): back
as holes where it punched them, free where it could not.
"""

from __future__ import annotations

import time

from aiokv.data import format as fmt
from tests.conftest import NS, PAYLOAD, key
from tests.test_journal_errors_keep_capacity_and_blocks import ramfs  # noqa: F401 (fixture)
from tools.storeio import StoreIO

SB = fmt.slot_bytes(PAYLOAD)


async def _save(st, ns, blocks, keys):
    for j, k in enumerate(keys):
        blocks.fill(j, k)
    return await st.save(ns, [(k, blocks.addr(j)) for j, k in enumerate(keys)])


async def test_no_slot_is_handed_to_two_saves_after_a_background_load_without_hole_punching(ramfs, blocks):  # noqa: F811
    root = ramfs / "s"
    st = StoreIO(root)
    ns = st.namespace(NS, PAYLOAD)
    assert await _save(st, ns, blocks, [key(i) for i in range(10)]) == [0] * 10
    st.drop(ns, [key(3), key(4), key(5)], corrupt=False)  # slots 3-5: free in this life, holes in the next
    st.close()

    st = StoreIO(root, capacity=24 * SB, io_thread=True)  # few slots: the free list is used up
    ns = st.namespace(NS, PAYLOAD)
    end = time.monotonic() + 10
    while not ns.ready and time.monotonic() < end:  # stop at the poll that installs the index
        st.refresh()
        time.sleep(0.01)
    assert ns.ready
    got: dict[bytes, int] = {}  # key -> the location its save was handed
    end = time.monotonic() + 10
    while len(got) < 20 and time.monotonic() < end:  # None while the space is being reserved: again
        k = key(100 + len(got))
        where = st.reserve(ns, k)
        if where is None:
            st.refresh()
            time.sleep(0.01)
        else:
            got[k] = where
    assert len(got) == 20
    locs = sorted(got.values())
    assert len(set(locs)) == len(locs), (
        f"two saves handed one slot: {sorted(s for s in set(locs) if locs.count(s) > 1)}"
    )
    st.abort(ns, list(got.items()), failed=False)
    a = ns.alloc
    free = list(a.free)
    assert len(set(free)) == len(free), f"a slot free twice: {sorted(s for s in set(free) if free.count(s) > 1)}"
    assert a.in_use == ns.table.count, "a slot in use without a block"
    assert a.in_use + len(free) + len(a.holes) == a.hwm, "a slot counted twice (or not at all) by the allocator"
    st.close()
