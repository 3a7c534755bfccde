# SPDX-License-Identifier: Apache-2.0
"""Every stored block knows its tenant (a request's cache_salt), on disk and across engines.

The bug: the store did not know whose blocks it held (the tenant column of the index was
reserved and always 0), so nothing could be counted, evicted, cleared or pinned per tenant.
The invariant: a block committed for a tenant is that tenant's after a restart (journal
replay, checkpoint, index image), in another engine's view of the directory (whose own ids
differ), in its slot header (so a rebuild from the slots, and the bucket tier's objects, keep
it), pinned blocks stay pinned; files written before (journals of versions 1 and 2, slot
headers without a tenant) read as the tenant "" and unpinned; with a `secret` the tenant's
name is nowhere on disk. The fix: format.py (journal version 3: COMMIT records carry a tenant
id and flags, FLAGS and MARK records; DIR/tenants.<E>; the header's tenant field),
aiokv/store/tenants.py, table.py's counts, logreplay.apply_records.
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from aiokv import _native
from aiokv.data import format as fmt
from aiokv.store import Store
from aiokv.store.table import PINNED
from tests.conftest import NS, PAYLOAD, key
from tools.storeio import StoreIO

SECRET = "a secret of sixteen or more characters"


def _tenant_of(st: Store, ns, k: bytes) -> str | None:
    s = ns.table.find(k)
    return None if s < 0 else st.tenants.name_of(int(ns.table.tenant[s]))


async def _saves(st, ns, blocks, *batches):
    """Each (ids, tenant[, pin]) saved in turn, on one loop (a StoreIO's backend is its loop's)."""
    for ids, tenant, *pin in batches:
        for j, i in enumerate(ids):
            blocks.fill(j, key(i))
        items = [(key(i), blocks.addr(j)) for j, i in enumerate(ids)]
        await st.save(ns, items, tenant=tenant, pin=bool(pin and pin[0]))


def _save(st, ns, blocks, *batches):
    asyncio.run(_saves(st, ns, blocks, *batches))


def _all_bytes(root: str) -> bytes:
    out = b""
    for d, _, files in os.walk(root):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                out += fh.read()
    return out


def test_tenants_survive_restarts_checkpoints_and_the_index_image(tmp_path, blocks):
    root = str(tmp_path / "c")
    st = StoreIO(root, capacity="64MiB")
    ns = st.namespace(NS, PAYLOAD)
    _save(st, ns, blocks, ([0, 1], "alice"), ([2], "bob", True), ([3], ""))
    st.close(checkpoint=False)  # the journal alone
    for checkpointed in (False, True, True):  # journal; checkpoint + image; again from the image
        st = Store(root, capacity="64MiB")
        ns = st.namespace(NS, PAYLOAD)
        assert [_tenant_of(st, ns, key(i)) for i in range(4)] == ["alice", "alice", "bob", ""], checkpointed
        assert ns.table.flags[ns.table.find(key(2))] & PINNED and not ns.table.flags[ns.table.find(key(0))]
        assert ns.table.blocks_of(st.tenant("alice")) == 2 and ns.table.blocks_of(0) == 1
        assert ns.table.pinned == 1
        st.close(checkpoint=True)
    assert os.path.exists(os.path.join(root, "ns", NS.hex(), fmt.INDEX_NAME))


def test_without_a_secret_names_are_kept_with_one_nowhere_on_disk(tmp_path, blocks):
    for secret in (None, SECRET):
        root = str(tmp_path / ("k" if secret else "p"))
        st = StoreIO(root, capacity="64MiB", secret=secret)
        ns = st.namespace(NS, PAYLOAD)
        _save(st, ns, blocks, ([0], "tenant-name-xyzzy"))
        st.close()
        on_disk = _all_bytes(root)
        assert (b"tenant-name-xyzzy" in on_disk) == (secret is None)
        # the tag differs with the secret (keyed), and the store finds the tenant again by its name
        assert fmt.tenant_tag("tenant-name-xyzzy", fmt.tenant_key(secret)) in on_disk
        st = Store(root, secret=secret)
        ns = st.namespace(NS, PAYLOAD)
        assert int(ns.table.tenant[ns.table.find(key(0))]) == st.tenant("tenant-name-xyzzy") != 0
        st.close()
    assert fmt.tenant_tag("x") != fmt.tenant_tag("x", fmt.tenant_key(SECRET))
    assert fmt.tenant_tag("") == fmt.NO_TENANT


def test_files_of_earlier_versions_read_as_the_tenant_nobody(tmp_path):
    """A journal of version 2 (as aiokv wrote before tenants) and an old checkpoint: every block
    is the tenant "", unpinned; the owner that appends to that journal marks it version 3."""
    d = tmp_path / "c" / "ns" / NS.hex()
    st = Store(str(tmp_path / "c"), capacity="64MiB")
    st.namespace(NS, PAYLOAD)
    st.close()
    for f in os.listdir(d):
        if f.startswith("journal.") or f in ("checkpoint", fmt.INDEX_NAME):
            os.unlink(d / f)
    body = b"".join(fmt.pack_record(fmt.REC_COMMIT, key(i), i, 1000 + i) for i in range(3))
    (d / "checkpoint").write_bytes(fmt.pack_file_header(fmt.CKPT_MAGIC, 1, 3, _native.crc32c_bytes(body)) + body)
    (d / "journal.1").write_bytes(
        fmt.pack_file_header(fmt.JOURNAL_MAGIC, 1, version=2) + fmt.pack_record(fmt.REC_COMMIT, key(5), 5, 2000)
    )
    st = Store(str(tmp_path / "c"), capacity="64MiB")
    ns = st.namespace(NS, PAYLOAD)
    assert ns.table.count == 4 and ns.table.blocks_of(0) == 4 and ns.table.pinned == 0
    assert not ns.table.tenant.any() and not ns.table.flags.any()
    st.close(checkpoint=False)
    assert int.from_bytes((d / "journal.1").read_bytes()[8:10], "little") == fmt.JOURNAL_VERSION


def test_another_engine_sees_each_block_under_the_right_tenant(tmp_path, blocks):
    """Engine 0 meets alice first, engine 1 meets bob first: both call their first tenant id 1
    in their own files; each maps the other's ids into its own."""
    root = str(tmp_path / "c")
    e0 = StoreIO(root, capacity="1GiB")  # (each engine grows its files 64 MiB at a time)
    ns0 = e0.namespace(NS, PAYLOAD)
    e1 = StoreIO(root, capacity="1GiB")
    ns1 = e1.namespace(NS, PAYLOAD)
    e0.follow_interval = e1.follow_interval = 0
    _save(e0, ns0, blocks, ([0], "alice"))
    _save(e1, ns1, blocks, ([1], "bob"), ([2], "alice"))
    e0.refresh()
    e1.refresh()
    peer0, peer1 = ns0.tables[1], ns1.tables[0]
    assert e0.tenants.name_of(int(peer0.tenant[peer0.find(key(1))])) == "bob"
    assert e0.tenants.name_of(int(peer0.tenant[peer0.find(key(2))])) == "alice"
    assert e1.tenants.name_of(int(peer1.tenant[peer1.find(key(0))])) == "alice"
    alice0 = e0.tenant("alice")
    assert ns0.table.blocks_of(alice0) + peer0.blocks_of(alice0) == 2
    e0.close()
    e1.close()


def test_the_slot_header_carries_the_tenant_and_a_rebuild_keeps_it(tmp_path, blocks):
    root = str(tmp_path / "c")
    st = StoreIO(root, capacity="64MiB")
    ns = st.namespace(NS, PAYLOAD)
    _save(st, ns, blocks, ([0, 1], "carol"), ([2], ""))
    slots = {i: ns.block(key(i))[0] for i in range(3)}
    st.close()
    d = os.path.join(root, "ns", NS.hex())
    sb = fmt.slot_bytes(PAYLOAD)
    with open(os.path.join(d, fmt.data_file(0)), "rb") as f:
        data = f.read()
    heads = {i: data[s * sb : s * sb + fmt.HEADER_BYTES] for i, s in slots.items()}
    assert (
        fmt.header_tenant(heads[0]) == fmt.tenant_tag("carol") == fmt.check_header(heads[1], NS, 0, PAYLOAD)["tenant"]
    )
    assert fmt.header_tenant(heads[2]) == fmt.NO_TENANT  # as every block written before tenants
    spoilt = bytearray(heads[0])
    spoilt[fmt.TENANT_OFFSET] ^= 1
    assert fmt.header_tenant(bytes(spoilt)) is None  # damage: unknown, never another tenant
    # the index lost: rebuilt from the slot headers, with their tenants
    with open(os.path.join(d, "checkpoint"), "r+b") as f:
        f.write(b"garbage!")
    st = Store(root, capacity="64MiB")
    ns = st.namespace(NS, PAYLOAD)
    assert [_tenant_of(st, ns, key(i)) for i in range(3)] == ["carol", "carol", ""]
    st.close()


def test_counts_follow_every_change_of_the_table():
    """The per-tenant and pinned counts equal a recount after puts, bulk puts, clears, flag
    changes and journal records applied (the way followers and replays change a table)."""
    from aiokv.store.logrecords import parse_records, record_tags
    from aiokv.store.logreplay import apply_records
    from aiokv.store.table import Table, tag_of

    rng = np.random.default_rng(7)
    t = Table()
    for step in range(400):
        op = rng.integers(0, 5)
        s = int(rng.integers(0, 64))
        if op == 0:
            t.put(s, tag_of(key(int(rng.integers(0, 80)))), step + 1, int(rng.integers(0, 4)), int(rng.integers(0, 2)))
        elif op == 1:
            ks = sorted({int(x) for x in rng.integers(0, 80, 4)})
            slots = sorted({int(x) for x in rng.integers(0, 64, len(ks))})
            n = min(len(ks), len(slots))
            tags = np.array([tag_of(key(k)) for k in ks[:n]], np.uint64)
            t.put_many(np.array(slots[:n], np.uint64), tags, np.full(n, step + 1, np.uint64), int(rng.integers(0, 4)))
        elif op == 2:
            t.clear(s)
        elif op == 3:
            t.set_flags(s, int(rng.integers(0, 2)))
        else:
            recs = []
            for _ in range(5):
                k = key(int(rng.integers(0, 80)))
                kind = (fmt.REC_COMMIT, fmt.REC_DROP, fmt.REC_FLAGS)[rng.integers(0, 3)]
                s2 = int(rng.integers(0, 64))
                if kind == fmt.REC_FLAGS:
                    recs.append(fmt.pack_flags(s2, tag_of(k), int(rng.integers(0, 2))))
                else:
                    recs.append(fmt.pack_record(kind, k, s2, step + 1, int(rng.integers(0, 4)), 1))
            r, _ = parse_records(b"".join(recs))
            apply_records(t, r, record_tags(r), 1 << 32)
        counts, pinned, per = t.tenant_blocks.copy(), t.pinned, t.tenant_pinned.copy()
        t.recount()
        for a, b in ((counts, t.tenant_blocks), (per, t.tenant_pinned)):
            n = max(len(a), len(b))
            assert np.array_equal(np.pad(a, (0, n - len(a))), np.pad(b, (0, n - len(b)))), step
        assert pinned == t.pinned and t.count == len(t.live()), step


@pytest.mark.parametrize("secret", [None, SECRET])
def test_the_tenants_file_is_bounded_and_damage_ends_it(tmp_path, secret, blocks):
    """Records of a tenants file up to the first that does not verify; an id or a tag named
    twice keeps the first record."""
    from aiokv.store.tenants import read_file

    root = tmp_path / "c"
    st = StoreIO(str(root), capacity="64MiB", secret=secret)
    _save(st, st.namespace(NS, PAYLOAD), blocks, ([0], "a"), ([1], "b"), ([2], "c"))
    st.close()
    path = root / fmt.tenants_name(0)
    raw = path.read_bytes()
    fd = os.open(root, os.O_RDONLY)
    try:
        good = read_file(fd, 0)
        assert [r[1] for r in good] == [1, 2, 3] and all(r[2] == (secret is not None) for r in good)
        assert [r[3] for r in good] == (["a", "b", "c"] if secret is None else [None] * 3)
        dup = fmt.pack_tenant(fmt.tenant_tag("z"), 1, False, "z")
        path.write_bytes(raw + dup + b"\x01" * 7)
        assert read_file(fd, 0) == good
    finally:
        os.close(fd)
