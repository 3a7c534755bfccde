# SPDX-License-Identifier: Apache-2.0
"""A store reopened with a smaller capacity keeps exactly the newest blocks.

Bug guarded against: a capacity lowered between runs was either ignored (the
directory stayed over its bound), or enforced by evicting the wrong blocks
(by slot number or file order instead of last use), or by dropping blocks only
in memory (a later open found them again), or by evicting more than needed.
Invariant: at open, the store evicts in LRU order (a hit refreshes a block; the
order survives a clean close) until data, journal and checkpoint fit the new
capacity, and not one block more; what it evicted is punched out of the data
file and stays evicted for every later open, whatever its capacity; every
survivor loads intact.
Fix: Store.__init__ shrinks to the capacity (Store._shrink_to_limit, oldest
first); evictions are journaled (DROP) and punched.
"""

from __future__ import annotations

import os

from aiokv.data import format as fmt
from tests.conftest import NS, PAYLOAD, key
from tools.storeio import StoreIO

SB = fmt.slot_bytes(PAYLOAD)
ROOM = 64 << 10  # journal and checkpoint


def _data_bytes(root: str) -> int:
    d = os.path.join(root, "ns", NS.hex())
    return sum(os.stat(os.path.join(d, n)).st_blocks * 512 for n in os.listdir(d) if n.endswith(".data"))


async def _loads_intact(st, ns, blocks, keys) -> bool:
    for j in range(len(keys)):
        blocks.clear(j)
    res = await st.load(ns, [(k, blocks.addr(j)) for j, k in enumerate(keys)])
    return res == [0] * len(keys) and all(blocks.holds(j, k) for j, k in enumerate(keys))


async def test_reopen_with_a_smaller_capacity_keeps_exactly_the_newest(tmp_path, blocks):
    root = str(tmp_path / "s")
    st = StoreIO(root, capacity=48 * SB + ROOM)
    ns = st.namespace(NS, PAYLOAD)
    saved = [key(i) for i in range(40)]
    for k in saved:  # one commit each: 40 distinct ages, oldest first
        blocks.fill(0, k)
        assert await st.save(ns, [(k, blocks.addr(0))]) == [0]
    hits = [key(3), key(30), key(7)]
    for k in hits:  # hits, in this order, make these the newest
        assert await _loads_intact(st, ns, blocks, [k])
    st.close()
    order = [k for k in saved if k not in hits] + hits  # oldest first

    small = 16 * SB + ROOM
    st = StoreIO(root, capacity=small)
    ns = st.namespace(NS, PAYLOAD)
    kept = set(ns.keys())
    n = len(kept)
    assert kept == set(order[-n:]), "the survivors are not the newest blocks"
    assert set(hits) <= kept
    # it fits, and not one block more was evicted than needed
    assert st.space.used() <= small < st.space.used() + ns.slot_cost, (st.space.used(), small)
    assert _data_bytes(root) <= small, "evicted blocks' space must be given back to the file system"
    assert st.lookup(ns, order[:-n]) == 0
    assert await _loads_intact(st, ns, blocks, sorted(kept))
    st.close()

    for cap in (small, 48 * SB + ROOM):  # what was evicted stays evicted, whatever the capacity
        st = StoreIO(root, capacity=cap)
        ns = st.namespace(NS, PAYLOAD)
        assert set(ns.keys()) == kept
        st.close()
