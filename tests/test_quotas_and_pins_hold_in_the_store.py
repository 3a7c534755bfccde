# SPDX-License-Identifier: Apache-2.0
"""Quotas per tenant and pinned blocks, in the store (engine-free).

The bug: one tenant's flood evicted every other tenant's blocks (one LRU for all), and a hot
system prompt could not be kept resident: anything old enough was evicted.
The invariant: a tenant past its `quota` gives up its own least recently used blocks, whoever
else is stored; when the directory is full, a save never evicts another tenant's blocks while
that tenant is within its quota (only the saver's own, else the save is skipped); with several
engines the quota is the directory's, and the engine holding the tenant's oldest blocks gives
them up; pinned blocks (a request's pin, `aiokv pin --tenant`) are never evicted, survive
restarts, are bounded by pin_capacity (past it a pin is refused with one log line, the block
stored unpinned), and `aiokv unpin` lets them go.
The fix: aiokv/store/quotas.py (make_room, shed: Store.reserve and refresh), the PINNED flag in
table.py (never a victim) and its FLAGS and COMMIT records, control.py's pin orders.
"""

from __future__ import annotations

import logging

from aiokv.cli import operate
from aiokv.data import format as fmt
from aiokv.store import Store
from tests.conftest import NS, PAYLOAD, key
from tools.storeio import StoreIO

COST = fmt.slot_bytes(PAYLOAD)


async def _fill(st, ns, blocks, ids, tenant, pin=False):
    got = []
    for i in ids:
        blocks.fill(0, key(i))
        got += await st.save(ns, [(key(i), blocks.addr(0))], tenant=tenant, pin=pin)
    return got


def _held(st, ns, ids) -> list[int]:
    return [i for i in ids if ns.has(key(i))]


async def test_a_tenant_past_its_quota_gives_up_its_own_oldest(tmp_path, blocks):
    st = StoreIO(str(tmp_path / "c"), capacity="1GiB")
    st.set_quotas({"alice": 4 * COST})
    ns = st.namespace(NS, PAYLOAD)
    await _fill(st, ns, blocks, range(100, 103), "bob")
    await _fill(st, ns, blocks, range(10), "alice")
    assert _held(st, ns, range(10)) == [6, 7, 8, 9] and st.stats.quota_evictions == 6
    assert _held(st, ns, range(100, 103)) == [100, 101, 102]
    assert st.quotas.bytes_of(st.tenant("alice")) == 4 * COST
    st.close()


async def _flood(tmp_path, blocks, quotas) -> list[int]:
    """bob stores 4 blocks, then alice floods a directory of about 12 blocks: bob's left."""
    st = StoreIO(str(tmp_path / ("q" if quotas else "n")), capacity=12 * COST + 64 * 1024)
    st.set_quotas(quotas)
    ns = st.namespace(NS, PAYLOAD)
    await _fill(st, ns, blocks, range(100, 104), "bob")
    assert all(r == 0 for r in await _fill(st, ns, blocks, range(40), "alice"))
    left = _held(st, ns, range(100, 104))
    assert len(_held(st, ns, range(40))) >= 6  # alice still saves (her own oldest go)
    st.close()
    return left


async def test_a_flood_never_evicts_a_tenant_within_its_quota(tmp_path, blocks):
    assert await _flood(tmp_path, blocks, None) == []  # without quotas LRU takes bob's first
    assert await _flood(tmp_path, blocks, {"*": 20 * COST}) == [100, 101, 102, 103]  # both within theirs


async def test_several_engines_keep_the_directorys_quota(tmp_path, blocks):
    root = str(tmp_path / "c")
    e0, e1 = StoreIO(root, capacity="2GiB"), StoreIO(root, capacity="2GiB")
    for st in (e0, e1):
        st.follow_interval = 0
        st.set_quotas({"alice": 6 * COST})
    ns0, ns1 = e0.namespace(NS, PAYLOAD), e1.namespace(NS, PAYLOAD)
    await _fill(e0, ns0, blocks, range(4), "alice")
    e1.refresh()
    await _fill(e1, ns1, blocks, range(4, 10), "alice")
    e0.refresh()  # engine 0 holds the oldest: it gives them up
    e1.refresh()
    alice = e1.tenant("alice")
    assert e1.quotas.bytes_of(alice) <= 6 * COST and e0.quotas.bytes_of(e0.tenant("alice")) <= 6 * COST
    assert 9 in _held(e1, ns1, range(10)) and 0 not in _held(e1, ns1, range(10))
    e0.close()
    e1.close()


async def test_pinned_blocks_outlive_a_flood_and_a_restart_within_pin_capacity(tmp_path, blocks, caplog):
    root = str(tmp_path / "c")
    st = StoreIO(root, capacity=12 * COST + 64 * 1024)
    st.pin_capacity = 3 * COST
    ns = st.namespace(NS, PAYLOAD)
    with caplog.at_level(logging.WARNING, logger="aiokv"):
        await _fill(st, ns, blocks, range(100, 104), "", pin=True)  # the 4th is past pin_capacity
    assert st.stats.pins_refused == 1 and sum("pin_capacity" in r.message for r in caplog.records) == 1
    await _fill(st, ns, blocks, range(40), "")
    assert _held(st, ns, range(100, 104)) == [100, 101, 102]  # the unpinned 4th went with the flood
    assert st.pinned_bytes() == 3 * COST
    st.close()
    st = StoreIO(root, capacity=12 * COST + 64 * 1024)
    ns = st.namespace(NS, PAYLOAD)
    await _fill(st, ns, blocks, range(40, 80), "")
    assert _held(st, ns, range(100, 104)) == [100, 101, 102]
    st.close()


async def test_pin_and_unpin_a_tenant_with_the_command(tmp_path, blocks):
    root = str(tmp_path / "c")
    st = StoreIO(root, capacity=12 * COST + 64 * 1024)
    st.follow_interval, st.pin_capacity = 0, 4 * COST
    ns = st.namespace(NS, PAYLOAD)
    await _fill(st, ns, blocks, range(100, 102), "acme")
    doc = operate.run("pin", root, "acme", wait=0)
    assert doc["blocks"] == 2
    st.refresh()  # the engine applies the order
    await _fill(st, ns, blocks, [102], "acme")  # a pinned tenant's new blocks are pinned too
    await _fill(st, ns, blocks, range(40), "")
    assert _held(st, ns, range(100, 103)) == [100, 101, 102] and ns.table.pinned == 3
    st.close()
    st = StoreIO(root, capacity=12 * COST + 64 * 1024)
    st.follow_interval, st.pin_capacity = 0, 4 * COST
    ns = st.namespace(NS, PAYLOAD)
    assert ns.table.pinned == 3  # (their FLAGS and COMMIT records, replayed)
    operate.run("unpin", root, "acme", wait=0)
    st.refresh()
    assert ns.table.pinned == 0
    await _fill(st, ns, blocks, range(40, 80), "")
    assert _held(st, ns, range(100, 103)) == []
    st.close()
    ro = Store(root, readonly=True)
    assert ro.pinned_bytes() == 0
    ro.close()


async def test_a_quota_beyond_any_disk_is_no_limit(tmp_path, blocks):
    """quota is accepted up to 1e30 bytes (config.py); the per-tenant sums are int64."""
    st = StoreIO(str(tmp_path / "c"), capacity="1GiB")
    st.set_quotas({"*": 10**30, "acme": 10**30 // 64})
    ns = st.namespace(NS, PAYLOAD)
    assert await _fill(st, ns, blocks, range(3), "acme") + await _fill(st, ns, blocks, range(3, 6), "") == [0] * 6
    assert _held(st, ns, range(6)) == list(range(6)) and st.stats.quota_evictions == 0
    st.close()
