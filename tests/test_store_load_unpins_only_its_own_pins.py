# SPDX-License-Identifier: Apache-2.0
"""Bug: Store.load pinned the keys it found committed but unpinned every key it
was given: a key that was not committed when the load started, and that was
committed and pinned by someone else while the load's read was in flight, lost
that other pin, so its slot could be evicted and rewritten under the other
reader.
Invariant: a load releases exactly the pins it took.
Fix: Store.load unpins only the keys it pinned (the load now lives in tools/storeio.py,
StoreIO.load, as tests' and benchmarks' data path beside the Store).
"""

from __future__ import annotations

import asyncio

from tests.conftest import NS, PAYLOAD, key
from tools.storeio import StoreIO


async def test_load_leaves_other_pins_alone(tmp_path, blocks, backend_kind):
    st = StoreIO(tmp_path / "s")
    ns = st.namespace(NS, PAYLOAD)
    blocks.fill(0, key(0))
    assert await st.save(ns, [(key(0), blocks.addr(0))]) == [0]
    # key(1) is not committed yet: the load pins key(0) only
    task = asyncio.ensure_future(st.load(ns, [(key(0), blocks.addr(1)), (key(1), blocks.addr(2))]))
    await asyncio.sleep(0)  # the load has pinned and its read is in flight
    slot = st.reserve(ns, key(1))
    st.commit(ns, [(key(1), slot)])
    st.pin(ns, [key(1)])  # another reader (the scheduler's load) pins it
    assert await task == [0, -2]
    assert st.index.pins[(NS, key(1))] == 1, "the load released a pin it never took"
    assert st.index.pins[(NS, key(0))] == 0
    st.close()
