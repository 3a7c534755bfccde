# SPDX-License-Identifier: Apache-2.0
"""Reclaiming a dead engine's space punches only the slots its own journal frees.

Bug: when a running engine took over a dead engine's files to evict its oldest
blocks (Store._reclaim), it first punched every slot missing from its follower
view of that engine, not from that engine's journal. A view that lagged behind
the journal (blocks committed since the last look) made it punch committed
blocks: they stayed in the journal, so every engine then offered them as hits
that failed to load (misses, counted as corrupt, and dropped).
Invariant: the slots punched as unused are exactly those the dead engine's
journal does not name; every block its journal still names after the
reclaim loads back intact; the view of it is the journal's from then on.
Fix: Store._evict_dead replays the journal as owner and punches around its entries.
"""

from __future__ import annotations

from aiokv.data import format as fmt
from aiokv.store import reclaim as reclaim_mod
from tests.conftest import NS, PAYLOAD, key
from tools.storeio import StoreIO

SB = fmt.slot_bytes(PAYLOAD)


async def _save(st, ns, blocks, ids):
    for j, i in enumerate(ids):
        blocks.fill(j, key(i))
    return await st.save(ns, [(key(i), blocks.addr(j)) for j, i in enumerate(ids)])


async def _intact(st, ns, blocks, ids) -> list[int]:
    for j in range(len(ids)):
        blocks.clear(j)
    res = await st.load(ns, [(key(i), blocks.addr(j)) for j, i in enumerate(ids)])
    return [i for j, (i, r) in enumerate(zip(ids, res)) if r == 0 and blocks.holds(j, key(i))]


async def test_reclaim_keeps_blocks_the_view_had_not_seen(tmp_path, blocks, monkeypatch):
    monkeypatch.setattr(reclaim_mod, "RECLAIM_INTERVAL", 0)
    root = str(tmp_path / "s")
    cap = 16 * SB + 64 * 1024
    a = StoreIO(root, capacity=cap)
    na = a.namespace(NS, PAYLOAD)
    assert await _save(a, na, blocks, range(6)) == [0] * 6
    b = StoreIO(root, capacity=cap, engine=1)
    nb = b.namespace(NS, PAYLOAD)  # B has read A's journal once: blocks 0..5
    b.follow_interval = 3600  # and does not look again for a while
    assert await _save(a, na, blocks, range(6, 12)) == [0] * 6
    a.close(checkpoint=False)  # engine 0 dies (as after kill -9) with blocks 6..11 B has not seen
    for i in range(100, 112):  # B fills the directory: over the capacity, it reclaims engine 0's space
        assert await _save(b, nb, blocks, [i]) == [0]
        b.refresh()
    assert b.reclaim._reclaimed, "B took over engine 0 to evict its blocks"
    b.follow_interval = 0
    b.refresh()
    theirs = [i for i in range(12) if nb.has(key(i))]
    assert theirs and set(theirs) <= set(range(6, 12)), theirs  # the oldest went first
    assert await _intact(b, nb, blocks, theirs) == theirs  # each block its journal names is intact
    assert b.stats.corrupt_dropped == 0
    assert await _intact(b, nb, blocks, list(range(100, 112))) == list(range(100, 112))
    b.close()
    # the engine that adopts number 0 next finds the same blocks, intact
    c = StoreIO(root, engine=0)
    nc = c.namespace(NS, PAYLOAD)
    assert sorted(nc.keys(nc.engine)) == sorted(key(i) for i in theirs)
    assert await _intact(c, nc, blocks, theirs) == theirs
    c.close()
