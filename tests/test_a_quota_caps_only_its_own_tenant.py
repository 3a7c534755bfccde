# SPDX-License-Identifier: Apache-2.0
"""A quota caps its own tenant and never costs another tenant a block while the directory has room.

The bug (issue 40, item 1): a tenant's quota was checked against its committed blocks only, so a
save of many blocks at once (one request's prompt: every block is reserved in one step, committed
later) passed the quota block by block; the directory filled, and the capacity evicted the least
recently used blocks of every tenant without a quota of its own. With capacity for 60 blocks,
`quota: {"acme": 30 blocks}`, zeta holding 24 and acme 24, acme's 27 more left acme at its 30 and
zeta at 9 of 24 (the oldest of the 54 went first: zeta's whole prompts).
The invariant: a save of a tenant with a quota counts its reservations not yet committed; past
the quota it evicts the tenant's own least recently used blocks (else the save is skipped), so it
never takes the directory's room from another tenant, named in `quota` or not.
The fix: aiokv/store/quotas.py (`Quotas.reserving`: bytes reserved per tenant, until committed or
given back), Quotas.make_room (was Store._within_quota), Store.reserve/commit/abort.
"""

from __future__ import annotations

from aiokv.data import format as fmt
from tests.conftest import NS, PAYLOAD, key
from tools.storeio import StoreIO

COST = fmt.slot_bytes(PAYLOAD)
ROOM = 60 * COST + 64 * 1024  # 60 blocks and the journal's room


async def _save(st, ns, blocks, ids, tenant):
    """One save of these blocks at once (every block reserved, then written, then committed)."""
    items = []
    for n, i in enumerate(ids):
        blocks.fill(n, key(i))
        items.append((key(i), blocks.addr(n)))
    return await st.save(ns, items, tenant=tenant)


def _held(ns, ids) -> list[int]:
    return [i for i in ids if ns.has(key(i))]


async def _flood(tmp_path, blocks, quota) -> tuple[list[int], list[int]]:
    st = StoreIO(str(tmp_path / "c"), capacity=ROOM)
    st.set_quotas(quota)
    ns = st.namespace(NS, PAYLOAD)
    await _save(st, ns, blocks, range(100, 124), "zeta")
    await _save(st, ns, blocks, range(24), "acme")
    await _save(st, ns, blocks, range(24, 51), "acme")
    st.refresh()  # (a step: a tenant past its quota sheds its oldest)
    zeta, acme = _held(ns, range(100, 124)), _held(ns, range(51))
    assert st.quotas.bytes_of(st.tenant("acme")) <= 30 * COST
    st.close()
    return zeta, acme


async def test_a_flood_under_a_quota_on_the_flooder_alone_leaves_the_others_blocks(tmp_path, blocks):
    zeta, acme = await _flood(tmp_path, blocks, {"acme": 30 * COST})
    assert zeta == list(range(100, 124)), f"zeta kept {len(zeta)} of 24 blocks: {zeta}"
    assert acme == list(range(21, 51))  # its 30 newest: its own oldest went


async def test_a_quota_on_every_tenant_keeps_them_too(tmp_path, blocks):
    zeta, acme = await _flood(tmp_path, blocks, {"acme": 30 * COST, "*": 30 * COST})
    assert zeta == list(range(100, 124)) and acme == list(range(21, 51))


async def test_a_single_save_past_the_quota_keeps_only_what_fits(tmp_path, blocks):
    """A save larger than the quota by itself: the blocks past it are skipped, never another tenant's evicted."""
    st = StoreIO(str(tmp_path / "c"), capacity=ROOM)
    st.set_quotas({"acme": 10 * COST})
    ns = st.namespace(NS, PAYLOAD)
    await _save(st, ns, blocks, range(100, 124), "zeta")
    res = await _save(st, ns, blocks, range(14), "acme")
    assert res.count(0) == 10 and st.stats.skipped_quota == 4
    assert _held(ns, range(100, 124)) == list(range(100, 124)) and _held(ns, range(14)) == list(range(10))
    st.close()


async def test_reservations_given_back_free_the_quota(tmp_path, blocks):
    """Reservations aborted (a failed write) count no more against the tenant's quota."""
    st = StoreIO(str(tmp_path / "c"), capacity=ROOM)
    st.set_quotas({"acme": 4 * COST})
    ns = st.namespace(NS, PAYLOAD)
    acme = "acme"
    got = [st.reserve(ns, key(i), acme) for i in range(4)]
    assert None not in got and st.reserve(ns, key(4), acme) is None  # 4 reserved: the quota
    st.abort(ns, [(key(i), w) for i, w in enumerate(got)])
    assert await _save(st, ns, blocks, range(10, 14), "acme") == [0] * 4
    assert _held(ns, range(10, 14)) == list(range(10, 14)) and st.stats.quota_evictions == 0
    st.close()
