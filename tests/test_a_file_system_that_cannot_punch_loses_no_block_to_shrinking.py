# SPDX-License-Identifier: Apache-2.0
"""A directory over its capacity on a file system that cannot punch holes stops evicting
blocks to give back space it cannot give back.

Bug: over the capacity (a lower capacity at start; slots a background load could not
punch), every refresh (each scheduler step) gave space back: free slots queued for
punching, and, with none free (every one reserved by saves in flight), our least recently
used blocks evicted and their slots queued too. On a file system that refuses the punch
(ramfs; EOPNOTSUPP) each punch failed, the slots came back free and still counted, the
directory stayed over its capacity, and the next step did it all again: blocks evicted
step after step for no byte given back (hits lost), and slots counted in use with no block
between each try and its failure.

Invariant: once a punch was refused as unsupported, refreshes evict no block and leave no
slot in use without a block; the blocks stay hits and their slots are reused by saves.

Fix: space.py remembers that the file system refused a punch (`punch_refused`, said once)
and no longer shrinks by punching nor evicts a block whose space was to be punched.

And the first round: with a lower capacity at start, the install of a background load
shrank at once; with the I/O thread the blocks were evicted before the first punch had run
(5 of 12 lost, for nothing). Fix: the loader thread learns it first, with a punch past the
end of a data file (Space.probe_punch).
"""

from __future__ import annotations

import time

from aiokv.data import format as fmt
from tests.conftest import NS, PAYLOAD, key, refresh_until
from tests.test_journal_errors_keep_capacity_and_blocks import ramfs  # noqa: F401 (fixture)
from tools.storeio import StoreIO

SB = fmt.slot_bytes(PAYLOAD)


async def _save(st, ns, blocks, keys):
    for j, k in enumerate(keys):
        blocks.fill(j, k)
    return await st.save(ns, [(k, blocks.addr(j)) for j, k in enumerate(keys)])


def _drain(st, ns, seconds: float = 1.0) -> None:
    """Refresh (as the scheduler does each step) until what the I/O thread ran is applied."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        st.refresh()
        time.sleep(0.01)


async def test_refreshes_over_the_capacity_evict_nothing_where_punching_is_refused(ramfs, blocks, caplog):  # noqa: F811
    root = ramfs / "s"
    st = StoreIO(root)
    ns = st.namespace(NS, PAYLOAD)
    assert await _save(st, ns, blocks, [key(i) for i in range(12)]) == [0] * 12
    st.close()

    st = StoreIO(root, capacity=8 * SB, io_thread=True)  # lower than what the directory holds
    ns = st.namespace(NS, PAYLOAD)
    refresh_until(st, lambda: ns.ready, "the index did not load")
    _drain(st, ns)  # the first give-back tried (the refusal learnt)
    assert "cannot punch holes" in caplog.text
    # every free slot reserved by a save in flight: a shrink could only evict blocks now
    held = []
    while ns.alloc.free:
        k = key(1000 + len(held))
        where = st.reserve(ns, k)
        assert where is not None
        held.append((k, where))
    count, evictions = ns.table.count, st.stats.evictions
    _drain(st, ns, 2.0)
    assert st.stats.evictions == evictions, "blocks evicted for space the file system cannot give back"
    assert ns.table.count == count
    a = ns.alloc
    assert a.in_use == ns.table.count + len(held), "a slot in use without a block or a save"
    st.abort(ns, held, failed=False)
    # the blocks kept are hits and load whole; a new block reuses a slot
    kept = [k for k in (key(i) for i in range(12)) if ns.where(k) is not None]
    assert len(kept) == count
    assert await st.load(ns, [(k, blocks.addr(j)) for j, k in enumerate(kept)]) == [0] * count
    assert await _save(st, ns, blocks, [key(500)]) == [0]
    st.close()


async def test_a_lower_capacity_at_start_evicts_nothing_where_punching_is_refused(ramfs, blocks, caplog):  # noqa: F811
    root = ramfs / "s"
    st = StoreIO(root)
    ns = st.namespace(NS, PAYLOAD)
    keys = [key(i) for i in range(12)]
    assert await _save(st, ns, blocks, keys) == [0] * 12
    st.close()

    st = StoreIO(root, capacity=8 * SB, io_thread=True)  # lower than what the directory holds
    ns = st.namespace(NS, PAYLOAD)
    refresh_until(st, lambda: ns.ready, "the index did not load")
    _drain(st, ns)
    assert "cannot punch holes" in caplog.text
    assert st.stats.evictions == 0 and ns.table.count == 12, "blocks evicted for space the file system cannot give back"
    assert ns.alloc.in_use == 12
    assert await st.load(ns, [(k, blocks.addr(j)) for j, k in enumerate(keys)]) == [0] * 12
    st.close()
