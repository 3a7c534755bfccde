# SPDX-License-Identifier: Apache-2.0
"""What an operator sees per tenant: `aiokv inspect` and the `vllm:aiokv_tenant_bytes` series.

The bug: `aiokv inspect` and the metrics had no word on whose blocks a directory holds; and
a metric labelled by tenant, naively, makes one series per cache_salt ever seen (thousands
of customers: a Prometheus server's worst case, unbounded label cardinality).
The invariant: inspect (text and JSON, every engine's blocks, per namespace and in all)
shows each tenant's blocks, bytes and pinned blocks, adding up to the totals; under a
`secret` no name is shown, only a tag's prefix; the metric names at most TOP_TENANTS
tenants (those holding most) and "other" for the rest, its values adding up to every byte
held, and a tenant that drops out of the top has its series removed.
The fix: summary.py's `tenants`, Store.tenant_bytes, the DYNAMIC label of counters.py's
`tenant_bytes` row and AioKVPromMetrics.observe.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from aiokv.cli.render import render_summary
from aiokv.cli.summary import summary
from aiokv.data import format as fmt
from aiokv.store import Store
from aiokv.util.counters import TOP_TENANTS
from tests.conftest import NS, PAYLOAD, key
from tests.test_metrics_series_table import prom, sample
from tools.storeio import DrivesIO, StoreIO

COST = fmt.slot_bytes(PAYLOAD)


async def _fill(st, ns, blocks, ids, tenant, pin=False):
    for i in ids:
        blocks.fill(0, key(i))
        await st.save(ns, [(key(i), blocks.addr(0))], tenant=tenant, pin=pin)


async def test_inspect_counts_blocks_bytes_and_pins_per_tenant(tmp_path, blocks):
    root = str(tmp_path / "c")
    e0, e1 = StoreIO(root, capacity="1GiB"), StoreIO(root, capacity="1GiB")
    ns0, ns1 = e0.namespace(NS, PAYLOAD), e1.namespace(NS, PAYLOAD)
    await _fill(e0, ns0, blocks, range(5), "acme")
    await _fill(e0, ns0, blocks, range(10, 12), "", pin=True)
    await _fill(e1, ns1, blocks, range(20, 23), "acme")  # another engine's: counted too
    e0.close()
    e1.close()
    ro = Store(root, readonly=True)
    d = summary(ro)
    ro.close()
    rows = {r["tenant"]: r for r in d["tenants"]}
    assert set(rows) == {"acme", ""}
    assert (rows["acme"]["blocks"], rows["acme"]["bytes"], rows["acme"]["pinned_blocks"]) == (8, 8 * COST, 0)
    assert (rows[""]["blocks"], rows[""]["pinned_blocks"], rows[""]["tag"]) == (2, 2, fmt.NO_TENANT.hex())
    assert [r["tenant"] for r in d["tenants"]] == ["acme", ""]  # largest first
    assert sum(r["bytes"] for r in d["tenants"]) == d["total"]["bytes"]
    assert d["namespaces"][0]["tenants"] == d["tenants"]  # (one namespace)
    text = render_summary(d)
    assert "tenant acme: 8 block(s)" in text and "tenant (none): 2 block(s)" in text and "2 pinned" in text


async def test_under_a_secret_inspect_shows_no_tenant_name(tmp_path, blocks):
    root = str(tmp_path / "c")
    st = StoreIO(root, capacity="1GiB", secret="a secret of sixteen or more characters")
    ns = st.namespace(NS, PAYLOAD)
    await _fill(st, ns, blocks, range(3), "acme-secret-customer")
    st.close()
    ro = Store(root, readonly=True)
    d = summary(ro)
    ro.close()
    (row,) = d["tenants"]
    assert row["tenant"] == "#" + row["tag"][:12] and row["blocks"] == 3
    assert "acme-secret-customer" not in render_summary(d)


async def test_the_metric_names_the_top_tenants_and_other(tmp_path, blocks):
    st = StoreIO(str(tmp_path / "c"), capacity="1GiB")
    ns = st.namespace(NS, PAYLOAD)
    n = TOP_TENANTS + 4
    for t in range(n):  # tenant t holds t + 1 blocks
        await _fill(st, ns, blocks, range(100 * t, 100 * t + t + 1), f"t{t}")
    got = st.tenant_bytes(TOP_TENANTS)
    top = {f"t{t}" for t in range(n - TOP_TENANTS, n)}
    assert set(got) == top | {"other"}
    assert got["other"] == sum(t + 1 for t in range(n - TOP_TENANTS)) * COST
    assert sum(got.values()) == sum(t + 1 for t in range(n)) * COST

    reg = CollectorRegistry()
    pm = prom(reg)
    pm.observe({"tenant_bytes": got}, 0)
    assert sample(reg, "vllm:aiokv_tenant_bytes", tenant=f"t{n - 1}") == n * COST
    assert sample(reg, "vllm:aiokv_tenant_bytes", tenant="other") == got["other"]
    # t0 floods: it enters the top, the smallest of the top leaves it, and its series goes
    await _fill(st, ns, blocks, range(5000, 5000 + 2 * n), "t0")
    got2 = st.tenant_bytes(TOP_TENANTS)
    gone = f"t{n - TOP_TENANTS}"
    assert "t0" in got2 and gone not in got2
    pm.observe({"tenant_bytes": got2}, 0)
    assert sample(reg, "vllm:aiokv_tenant_bytes", tenant=gone) is None
    assert sample(reg, "vllm:aiokv_tenant_bytes", tenant="t0") == (2 * n + 1) * COST
    series = [s for m in reg.collect() for s in m.samples if s.name == "vllm:aiokv_tenant_bytes"]
    assert len(series) == TOP_TENANTS + 1
    st.close()


async def test_several_drives_name_the_same_top_tenants(tmp_path, blocks):
    """Each drive holds a share of each tenant: the top is taken over the drives together
    (each drive's own top and "other" added up named up to drives x (top + 1) tenants)."""
    st = DrivesIO([str(tmp_path / f"d{i}") for i in range(3)], capacity="3GiB")
    ns = st.namespace(NS, PAYLOAD)
    n = TOP_TENANTS + 6
    for t in range(n):
        await _fill(st, ns, blocks, range(1000 * t, 1000 * t + 2 * t + 1), f"t{t}")
    every = st.tenant_bytes(None)
    assert len(every) == n and sum(every.values()) == sum(2 * t + 1 for t in range(n)) * COST
    got = st.tenant_bytes(TOP_TENANTS)
    assert set(got) == {f"t{t}" for t in range(n - TOP_TENANTS, n)} | {"other"}
    assert sum(got.values()) == sum(every.values())
    st.close()
