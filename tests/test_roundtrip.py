# SPDX-License-Identifier: Apache-2.0
"""Round trips through the store on both I/O backends.

Invariant: what `load` returns for a key is exactly what `save` stored under it,
with many saves and loads in flight at once; a key is visible only once saved.
"""

from __future__ import annotations

import asyncio
import errno

from tests.conftest import NS, PAYLOAD, key
from tools.storeio import StoreIO


async def test_concurrent_round_trips(tmp_path, blocks, backend_kind):
    st = StoreIO(tmp_path / "s", capacity="1GiB")
    ns = st.namespace(NS, PAYLOAD, fields={"model": "t"})
    assert st.blockio(ns).backend.name == ("io_uring" if backend_kind == "uring" else "threads")
    n = 64
    for i in range(n):
        blocks.fill(i, key(i))
    # four concurrent saves of 16 blocks each
    res = await asyncio.gather(
        *[st.save(ns, [(key(i), blocks.addr(i)) for i in range(j, j + 16)]) for j in range(0, n, 16)]
    )
    assert all(r == 0 for rr in res for r in rr)
    assert st.lookup(ns, [key(i) for i in range(n)]) == n
    for i in range(n):
        blocks.clear(i)
    res = await asyncio.gather(
        *[st.load(ns, [(key(i), blocks.addr(i)) for i in range(j, j + 16)]) for j in range(0, n, 16)]
    )
    assert all(r == 0 for rr in res for r in rr)
    assert all(blocks.holds(i, key(i)) for i in range(n))
    # saving again is refused as present; unknown keys are misses
    assert (await st.save(ns, [(key(0), blocks.addr(0))])) == [-errno.EEXIST]
    assert (await st.load(ns, [(key(999), blocks.addr(0))])) == [-errno.ENOENT]
    assert st.blockio(ns).backend.in_flight == 0
    st.close()


async def test_restart_keeps_everything(tmp_path, blocks, backend_kind):
    st = StoreIO(tmp_path / "s")
    ns = st.namespace(NS, PAYLOAD)
    for i in range(32):
        blocks.fill(i, key(i))
    assert await st.save(ns, [(key(i), blocks.addr(i)) for i in range(32)]) == [0] * 32
    st.close()
    st = StoreIO(tmp_path / "s")
    ns = st.namespace(NS, PAYLOAD)
    assert st.lookup(ns, [key(i) for i in range(32)] + [key(99)]) == 32
    for i in range(32):
        blocks.clear(i)
    assert await st.load(ns, [(key(i), blocks.addr(i)) for i in range(32)]) == [0] * 32
    assert all(blocks.holds(i, key(i)) for i in range(32))
    st.close()


async def test_lookup_is_longest_present_prefix(tmp_path, blocks):
    st = StoreIO(tmp_path / "s")
    ns = st.namespace(NS, PAYLOAD)
    for i in (0, 1, 2, 4):
        blocks.fill(i, key(i))
    await st.save(ns, [(key(i), blocks.addr(i)) for i in (0, 1, 2, 4)])
    assert st.lookup(ns, [key(i) for i in range(6)]) == 3
    assert st.lookup(ns, [key(4), key(0)]) == 2
    assert st.lookup(ns, [key(3), key(0)]) == 0
    st.close()


async def test_namespaces_are_separate(tmp_path, blocks):
    st = StoreIO(tmp_path / "s")
    a = st.namespace(NS, PAYLOAD)
    b = st.namespace(bytes(16), PAYLOAD)
    blocks.fill(0, key(0))
    await st.save(a, [(key(0), blocks.addr(0))])
    assert st.lookup(a, [key(0)]) == 1 and st.lookup(b, [key(0)]) == 0
    st.close()
