# SPDX-License-Identifier: Apache-2.0
"""Eviction and quota victims: exact LRU, in work bounded by the tenants, never by the blocks.

The bug (issue 40, item 3): victims came from batches of about 1/64 of the blocks, picked by a
pass over the whole table and kept for 16 filters at once. More than 16 tenants asking in turn
(a quota's own victims) thrashed the batches: a pass over every block per call (10 ms at 4M
blocks); with any pinned block, a tenant holding none of this engine's blocks made every call a
pass that found nothing and kept nothing (119 ms at 4M), and a quota's save made that call for
each block it reserved. And a batch is a snapshot: a block unpinned after it was picked, or one
skipped because a load held it, fell out of it, and up to count/64 newer blocks went first.
The invariant: a victim is the least recently used block (atime, then slot) that is not pinned
or held by a load, among all blocks or one tenant's or all but some tenants'; a block unpinned
or let go by its load is in its place at once; one call reads at most one entry per tenant with
blocks here, plus the held blocks it passes (`Table.examined` counts the entries read).
The fix: aiokv._index.Order (native/order.c): per tenant, its blocks in LRU order, kept as
blocks come, go, are used, pinned and unpinned (a list for blocks in order, a heap for those
that come back out of order); table.py keeps it, quotas.py and index.py ask it.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as hst

from aiokv.cli import operate
from aiokv.data import format as fmt
from aiokv.store import Store, bulk
from aiokv.store.logrecords import parse_records, record_tags
from aiokv.store.logreplay import apply_records
from aiokv.store.table import PINNED, Table, tag_of
from tests.conftest import NS, key

PAYLOAD = 512  # small slots: the files stay small


def _commit(st, ns, keys, tenant, pinned=False):
    items = [(k, st.reserve(ns, k, tenant)) for k in keys]
    assert None not in [w for _, w in items]
    st.commit(ns, items, tenant, pinned)


def _victims(st, ns, n) -> list[bytes]:
    """The next n victims, each taken out of the index as an eviction would (no file touched)."""
    by_slot = {ns.table.find(k): k for k in ns.keys(ns.engine)}
    out = []
    for _ in range(n):
        got = st.index.victim()
        if got is None:
            break
        out.append(by_slot[got[1]])
        st.index.remove_slot(ns, got[1])
    return out


def test_an_unpinned_block_goes_before_newer_ones(tmp_path):
    root = str(tmp_path / "c")
    st = Store(root)
    st.follow_interval = 0
    ns = st.namespace(NS, PAYLOAD)
    acme = "acme"
    _commit(st, ns, [key(0)], acme, pinned=True)
    _commit(st, ns, [key(i) for i in range(1, 400)], acme)
    assert st.index.victim()[1] == ns.table.find(key(1))  # block 0 is pinned: never a victim
    operate.run("unpin", root, "acme", wait=0)
    st.refresh()  # the order applied
    assert ns.table.pinned == 0
    got = _victims(st, ns, 3)
    assert got == [key(0), key(1), key(2)], [int.from_bytes(k[:8], "little") for k in got]
    st.close()


def test_a_block_skipped_while_a_load_holds_it_keeps_its_place():
    """Table level: the victim search passes a held block (skip) and finds it again once let go.
    (Through the Store a load's pin also marks the block used: it goes to the young end then.)"""
    t = Table()
    n = 400
    t.put_many(
        np.arange(n, dtype=np.uint64), np.arange(1, n + 1, dtype=np.uint64), np.arange(1, n + 1, dtype=np.uint64)
    )
    held = {0}
    assert t.oldest(skip=lambda s: s in held) == 1
    held.clear()
    assert t.oldest() == 0


def test_a_load_hold_makes_the_block_young_through_the_store(tmp_path):
    st = Store(str(tmp_path / "c"))
    ns = st.namespace(NS, PAYLOAD)
    _commit(st, ns, [key(i) for i in range(300)], 0)
    st.pin(ns, [key(0)])  # a load holds it (and uses it)
    assert st.index.victim()[1] == ns.table.find(key(1))
    st.unpin(ns, [key(0)])
    got = _victims(st, ns, 300)
    assert got[:2] == [key(1), key(2)] and got[-1] == key(0)
    st.close()


def _examined(st) -> int:
    return sum(t.examined for ns in st.index.namespaces.values() for t in (ns.table, *ns.tables.values()))


def test_victims_read_one_entry_per_tenant_at_most(tmp_path):
    """200k blocks of 100 tenants (a few tiny), some pinned, some held by loads, quotas on half of
    them; a tenant with no block here; every kind of victim asked for in turn."""
    st = Store(str(tmp_path / "c"))
    ns = st.namespace(NS, PAYLOAD)
    rng = np.random.default_rng(40)
    names = [f"t{i}" for i in range(100)]
    tids = [st.tenants.register(n)[1] for n in names]  # (ids as a first commit gives them)
    empty = st.tenants.register("nobody-here")[1]
    n = 200_000
    owner = rng.choice(len(tids), size=n, p=np.r_[[0.0001] * 5, [(1 - 0.0005) / 95] * 95])
    pinned = rng.random(n) < 0.01
    now = st.index.now()
    keys = [key(i, 7) for i in range(n)]
    for ti in range(len(tids)):
        for flags in (0, PINNED):
            sel = np.flatnonzero((owner == ti) & (pinned == bool(flags)))
            if len(sel):
                st.index.commit_many(ns, [keys[i] for i in sel], sel.tolist(), now, tids[ti], flags)
    for s in rng.choice(n, size=50, replace=False).tolist():
        ns.pinned_tags[ns.table.tag_at(s)] += 1  # held by loads (as Store.pin holds them)
    held = 50
    st.set_quotas({**{nm: 1500 * ns.slot_cost for nm in names[::2]}, "nobody-here": ns.slot_cost})
    q = st.quotas
    per_call = []

    def call(f, *a):
        before = _examined(st)
        f(*a)
        per_call.append((_examined(st) - before, f.__name__, a))

    for _ in range(3):
        call(st.index.victim)
        for t in tids + [empty]:
            call(q.own_victim, t)
            call(q.victim, t)
        call(q.victim, None)
    worst = max(per_call)
    bound = len(tids) + 1 + held
    assert worst[0] <= bound, f"{worst[1]}{worst[2]} read {worst[0]} entries (bound {bound}; {n} blocks)"
    st.close()


# ---- the order against a plain sort, under any sequence of changes ----
def _expected(t: Table, filt, held) -> int:
    live = t.live()
    ok = (t.flags[live] & PINNED) == 0
    ok &= ~np.isin(live, list(held))
    if filt is not None and filt[0] == "only":
        ok &= t.tenant[live] == filt[1]
    elif filt is not None:
        ten = t.tenant[live]
        ok &= ~((ten < len(filt[1])) & (filt[1][np.minimum(ten, len(filt[1]) - 1)] == 1))
    live = live[ok]
    if not len(live):
        return -1
    return int(live[np.lexsort((live, t.atime[live]))][0])


def _records(ops):
    """Journal records (another engine's, as followed): FREE ones name the tag of key k."""
    out = []
    for kind, k, slot, atime, tenant, flags in ops:
        kb = key(k, 3)
        if kind == fmt.REC_FREE:
            kb = tag_of(kb).to_bytes(8, "little") + bytes(8)
        out.append(fmt.pack_record(kind, kb, slot, atime, tenant, flags))
    return parse_records(b"".join(out))[0]


SLOTS, TENANTS = 48, 4
slot_ = hst.integers(0, SLOTS - 1)
atime_ = hst.integers(1, 60)
op_ = hst.one_of(
    hst.tuples(hst.just("put"), slot_, hst.integers(1, 80), atime_, hst.integers(0, TENANTS), hst.sampled_from([0, 1])),
    hst.tuples(hst.just("many"), hst.lists(slot_, min_size=1, max_size=6, unique=True), hst.integers(0, TENANTS)),
    hst.tuples(hst.just("clear"), slot_),
    hst.tuples(hst.just("touch"), slot_, atime_),
    hst.tuples(hst.just("flags"), slot_, hst.sampled_from([0, 1])),
    hst.tuples(
        hst.just("records"),
        hst.lists(
            hst.tuples(
                hst.sampled_from([fmt.REC_COMMIT, fmt.REC_DROP, fmt.REC_TOUCH, fmt.REC_FREE]),
                hst.integers(0, 60),
                slot_,
                atime_,
                hst.integers(0, TENANTS),
                hst.sampled_from([0, 1]),
            ),
            min_size=1,
            max_size=8,
        ),
    ),
    hst.tuples(hst.just("rename"), hst.permutations(list(range(TENANTS + 1))), hst.booleans()),
    hst.tuples(hst.just("bulk"), slot_, hst.integers(1, 80), atime_),
    # an operator's order applied in bulk (store/bulk.py): blocks erased, pinned or unpinned, all emptied
    hst.tuples(
        hst.just("order"), hst.sampled_from(["clear", "pin", "unpin"]), hst.lists(slot_, max_size=8, unique=True)
    ),
    hst.tuples(hst.just("empty")),
    # other engines' hits in bulk (TOUCH records: Table.touch_tags): tags held or not, a tag twice, older times
    hst.tuples(hst.just("touches"), hst.lists(hst.tuples(hst.integers(1, 80), hst.integers(1, 120)), max_size=8)),
)


@settings(max_examples=300, deadline=None)
@given(hst.lists(op_, max_size=40), hst.sets(slot_, max_size=4))
def test_the_order_agrees_with_a_sort_after_any_changes(ops, held):
    t, clock = Table(), 100
    for op in ops:
        if op[0] == "put":
            _, s, tag, at, ten, fl = op
            t.put(s, tag, at, ten, fl)
        elif op[0] == "many":
            slots = np.array(op[1], np.uint64)
            clock += len(slots)
            tags = slots * 1000 + np.uint64(clock)
            t.put_many(slots, tags, np.arange(clock, clock + len(slots), dtype=np.uint64), op[2])
        elif op[0] == "clear":
            t.clear(op[1])
        elif op[0] == "touch" and op[1] < t.slots and t.tag_at(op[1]):
            t.touch(op[1], op[2] + int(t.atime_at(op[1])) - 30)  # later or earlier than it was
        elif op[0] == "flags":
            t.set_flags(op[1], op[2])
        elif op[0] == "records":
            recs = _records(op[1])
            apply_records(t, recs, record_tags(recs), SLOTS)
        elif op[0] == "rename":  # another engine's ids as ours: a renaming, or two ids made one
            perm = np.array(op[1], np.uint16)
            if op[2]:
                perm[perm == 1] = 0
            t.retenant(perm[np.minimum(t.tenant, TENANTS)])
        elif op[0] == "bulk" and op[1] < t.slots and t.tag_at(op[1]):  # arrays written directly, then said
            t.atime[op[1]] = op[3]
            t.changed(np.array([op[1]]))
        elif op[0] == "order":  # the slots holding a block the order is for, as bulk.select finds them
            live = [x for x in sorted(op[2]) if x < t.slots and t.tag_at(x)]
            want = {"clear": None, "pin": 0, "unpin": PINNED}[op[1]]
            slots = np.array([x for x in live if want is None or int(t.flags[x]) & PINNED == want], np.int64)
            if op[1] == "clear":
                bulk.clear_slots(t, slots)
            else:
                bulk.flag_slots(t, slots, op[1] == "pin")
        elif op[0] == "empty":
            bulk.empty(t)
        elif op[0] == "touches" and op[1]:  # as a touch() a record did, one by one: each block its latest time
            want = t.atime.copy()
            for tag, at in op[1]:
                slot = t.find_tag(tag)
                if slot >= 0:
                    want[slot] = max(int(want[slot]), at)
            tags, ats = (np.array(c, np.uint64) for c in zip(*op[1]))
            t.touch_tags(tags, ats)
            assert np.array_equal(t.atime, want), op
        live = t.tag != 0
        pinned = live & (t.flags & PINNED != 0)
        assert t.count == int(live.sum()) and t.pinned == int(pinned.sum()), op
        assert list(np.trim_zeros(t.tenant_pinned, "b")) == list(np.trim_zeros(np.bincount(t.tenant[pinned]), "b")), op
        t._order.check() if t._ordered else None
        for filt in (None, ("only", 1), ("except", np.array([1, 0, 1], np.uint8))):
            got = t.oldest(skip=lambda s: s in held, filt=filt)
            assert got == _expected(t, filt, held), (op, filt)
    t.forget_order()
    assert t.oldest() == _expected(t, None, ()) and t._order.check() is None


def test_bulk_touches_keep_each_blocks_latest_time_and_the_lru_exact():
    """Table.touch_tags (other engines' TOUCH records, a look's at once): a tag named twice keeps
    the later of its times whatever their order, an older time leaves a block as it was, a tag
    held by none is passed over; the victims come out in LRU order after it, one by one."""
    t = Table()
    for s in range(10):
        t.put(s, 100 + s, 10 + s)  # tag 100 + s, slot s, time 10 + s: slot 0 the oldest
    tags = np.array([100, 103, 100, 105, 999, 101], np.uint64)
    ats = np.array([50, 12, 40, 60, 70, 5], np.uint64)  # 100: 50 then 40; 103 older; 999 none; 101 older
    t.touch_tags(tags, ats)
    assert t.atime[:10].tolist() == [50, 11, 12, 13, 14, 60, 16, 17, 18, 19]
    t._order.check()
    out = []
    while (v := t.oldest()) >= 0:
        out.append(v)
        t.clear(v)
    assert out == [1, 2, 3, 4, 6, 7, 8, 9, 0, 5]
