# SPDX-License-Identifier: Apache-2.0
"""A load's `pin` and `unpin` (aiokv/store/loadpins.py) work on a scheduler call's keys in a few
calls into aiokv._index and numpy (locate_all with slots, native/holds.c's hold and release,
the touches and TOUCH records in bulk) instead of a Python loop per key on the scheduler thread
(30M blocks a node: nothing per block in Python there; 1.4 us a key before). Invariant: every
answer and every piece of state is what the loop per key (`PerKey` below, the code it replaced)
made: the locations, the holds per key and per tag, the slots freed at a dropped key's last
unpin, our blocks' access times and the index's clock, our view of the other engine's access
times, the journal records (TOUCH at most once a second per block), the victim chosen; on one
Store and on several drives, for hits, misses, keys repeated in a call, holds stacked by several
loads and given back in another order, unpins of keys never pinned, keys dropped and committed
again while held; and a held key is never a victim under eviction pressure, and is one again
after its last unpin.
"""

from __future__ import annotations

import random
import time
import types

import numpy as np
import pytest

from aiokv.data import format as fmt
from aiokv.store import Store
from aiokv.store import index as index_mod
from aiokv.store import loadpins as loadpins_mod
from aiokv.store import saves as saves_mod
from aiokv.store import store as store_mod
from aiokv.store.drives import Drives
from aiokv.store.locate import holders
from aiokv.store.table import tag_of
from tests.conftest import NS, PAYLOAD, key

EVERY = loadpins_mod.TOUCH_EVERY_NS


class PerKey:
    """The loop per key that LoadPins replaced, kept as the reference (verbatim but the clock)."""

    def __init__(self, index, persist, dirs, readonly: bool):
        self.index, self.persist, self.dirs, self.readonly = index, persist, dirs, readonly

    def pin(self, ns, keys):
        out = []
        if not ns.ready:
            return [None] * len(keys)
        for k in keys:
            slot = ns.where(k)
            if slot is not None:
                self.index.pins[(ns.nsid, k)] += 1
                ns.pinned_tags[tag_of(k)] += 1
            out.append(slot)
        now = time.time_ns()
        for k in keys:  # (Index.touch, as it was)
            s = ns.table.find(k)
            if s >= 0:
                ns.table.touch(s, self.index.now(now))
        engine = self.dirs.engine
        self.touch_peers(ns, [k for k, w in zip(keys, out) if w is not None and w >> fmt.ENGINE_SHIFT != engine], now)
        return out

    def touch_peers(self, ns, keys, now: int) -> None:
        if self.readonly or not keys:
            return
        recs = []
        for k in keys:
            where = ns.where(k)
            if where is None:
                continue
            t = ns.tables.get(where >> fmt.ENGINE_SHIFT)
            s = t.find(k) if t is not None else -1
            if s >= 0 and now - t.atime_at(s) >= EVERY:
                for pt in ns.tables.values():  # (Namespace.peer_touch, as it was)
                    ps = pt.find_tag(tag_of(k))
                    if ps >= 0:
                        pt.touch(ps, now)
                recs.append(fmt.pack_record(fmt.REC_TOUCH, k, 0, now))
        self.persist.append(ns, recs)

    def unpin(self, ns, keys) -> None:
        pins, tags = self.index.pins, ns.pinned_tags
        for k in keys:
            pk = (ns.nsid, k)
            if pins[pk] > 1:
                pins[pk] -= 1
            elif pins.pop(pk, None):
                self.index.unpinned(ns, k)
            else:
                continue
            t = tag_of(k)
            if tags[t] > 1:
                tags[t] -= 1
            else:
                tags.pop(t, None)


@pytest.fixture
def clock(monkeypatch) -> list[int]:
    """The stores' wall clock made the test's ([now in ns]): both worlds see the same times."""
    now = [time.time_ns()]
    fake = types.SimpleNamespace(**{n: getattr(time, n) for n in dir(time) if not n.startswith("_")})
    fake.time_ns = lambda: now[0]
    for mod in (store_mod, saves_mod, loadpins_mod, index_mod):
        monkeypatch.setattr(mod, "time", fake)
    monkeypatch.setitem(globals(), "time", fake)
    return now


class World:
    """A directory of two engines (ours follows the other's at each lookup; the other never
    follows ours), ours pinning by the loop per key or in bulk; what it journals is kept."""

    def __init__(self, root: str, bulk: bool, capacity="64MiB"):
        self.st = Store(root, capacity=capacity)
        self.st.follow_interval = 0
        self.peer = Store(root, capacity=capacity)
        self.peer.follow_interval = 10**12
        self.ns, self.pns = self.st.namespace(NS, PAYLOAD), self.peer.namespace(NS, PAYLOAD)
        if not bulk:
            s = self.st
            s.load_pins = PerKey(s.index, s.persist, s.dirs, s.readonly)
        self.journaled: list[bytes] = []
        append = self.st.persist.append

        def kept(ns, recs, *a, **kw):
            if recs:  # (none: nothing queued)
                self.journaled.append(ns.nsid + (recs if isinstance(recs, bytes) else b"".join(recs)))
            return append(ns, recs, *a, **kw)

        self.st.persist.append = kept
        self.loads: list[tuple[list[bytes], list]] = []

    def save(self, st, ns, keys) -> None:
        for k in keys:
            w = st.reserve(ns, k)
            if w is not None:
                st.commit(ns, [(k, w)])

    def state(self) -> dict:
        st, ns = self.st, self.ns
        a = ns.alloc
        return {
            "pins": dict(st.index.pins),
            "tags": dict(ns.pinned_tags),
            "dropped": {k: list(v) for k, v in st.index.dropped_pinned.items()},
            "alloc": (a.hwm, a.in_use, list(a.free), list(a.holes)),
            "atime": ns.table.atime[: ns.table.slots].tolist(),
            "peers": {e: t.atime.tolist() for e, t in ns.tables.items()},
            "clock": st.index.clock,
            "journaled": list(self.journaled),
            "victim": (lambda v: None if v is None else (v[0].nsid, v[1]))(st.index.victim()),
            "held": st.load_pinned(),
        }

    def close(self) -> None:
        self.st.close()
        self.peer.close()


def _ops(rnd: random.Random, n: int, steps: int) -> list[tuple]:
    """A random run: pins (hits, misses, repeats), unpins in another order (all asked, the hits
    only, reversed), unpins of keys never pinned, the clock moved by under or over a second,
    a held key dropped (and committed again), the other engine committing more."""
    ops = []
    for _ in range(steps):
        r = rnd.random()
        if r < 0.35:
            keys = [key(rnd.randrange(n + n // 4)) for _ in range(rnd.randrange(1, 40))]
            ops.append(("pin", keys + rnd.sample(keys, min(3, len(keys)))))
        elif r < 0.6:
            ops.append(("unpin", rnd.random(), rnd.randrange(3)))
        elif r < 0.67:
            ops.append(("unpin_never", [key(rnd.randrange(n, 2 * n)) for _ in range(5)]))
        elif r < 0.8:
            ops.append(("tick", rnd.choice([0, 1, EVERY // 3, EVERY - 1, EVERY, 2 * EVERY])))
        elif r < 0.9:
            ops.append(("drop", rnd.random(), rnd.random() < 0.5))
        else:
            ops.append(("peer", [key(rnd.randrange(n + n // 4)) for _ in range(5)]))
    return ops


def _apply(w: World, op: tuple, clock: list[int]):
    st, ns = w.st, w.ns
    kind = op[0]
    if kind == "pin":
        got = st.pin(ns, op[1])
        w.loads.append((op[1], got))
        return got
    if kind == "unpin" and w.loads:
        keys, got = w.loads.pop(int(op[1] * len(w.loads)))
        held = [k for k, g in zip(keys, got) if g is not None]
        st.unpin(ns, [keys, held, keys[::-1]][op[2]])
    elif kind == "unpin_never":
        st.unpin(ns, op[1])
    elif kind == "tick":
        clock[0] += op[1]
    elif kind == "drop":  # a held key of ours did not verify; maybe saved again while held
        mine = sorted(k for (_, k) in st.index.pins if ns.block(k) is not None)
        if mine:
            k = mine[int(op[1] * len(mine))]
            st.drop(ns, [k], corrupt=False)
            if op[2]:
                w.save(st, ns, [k])
    elif kind == "peer":
        w.save(w.peer, w.pns, op[1])
        st.lookup(ns, (), 0)  # follows the other engine
    return None


def _fill(w: World, rnd: random.Random, n: int) -> None:
    """Of n keys: ours, the other engine's, both's (it never follows us: it saves them too)."""
    for i in range(n):
        r = rnd.random()
        if r < 0.7:
            w.save(w.st, w.ns, [key(i)])
        if 0.5 < r < 0.85:
            w.save(w.peer, w.pns, [key(i)])
    w.st.lookup(w.ns, (), 0)


@pytest.mark.parametrize("seed", range(6))
def test_pin_and_unpin_on_one_store_leave_what_the_loop_per_key_left(tmp_path, clock, seed):
    n = 200
    worlds = [World(str(tmp_path / "loop"), bulk=False), World(str(tmp_path / "bulk"), bulk=True)]
    for w in worlds:
        _fill(w, random.Random(seed), n)
    assert worlds[0].state() == worlds[1].state() and len(worlds[1].ns.tables) == 1
    seen = set()
    for i, op in enumerate(_ops(random.Random(seed + 100), n, 300)):
        got = [_apply(w, op, clock) for w in worlds]
        assert got[0] == got[1], (i, op[0])
        want, have = worlds[0].state(), worlds[1].state()
        assert want == have, (i, op[0], [k for k in want if want[k] != have[k]])
        t = worlds[1].ns.table
        if t._ordered:
            t._order.check()
        seen |= {op[0]} | ({"dropped"} if want["dropped"] else set())
        seen |= {"touch"} if any(r[16:17] == bytes([fmt.REC_TOUCH]) for r in want["journaled"]) else set()
    assert {"pin", "unpin", "drop", "dropped", "touch", "tick", "peer"} <= seen, seen
    for w in worlds:  # every load gives back its holds: nothing held, no slot waiting
        while w.loads:
            _apply(w, ("unpin", 0.0, 0), clock)
        assert not w.st.index.pins and not w.ns.pinned_tags and not w.st.index.dropped_pinned
    assert worlds[0].state() == worlds[1].state()
    for w in worlds:
        w.close()


def test_a_hit_on_another_engines_block_is_told_once_a_second(tmp_path, clock):
    w = World(str(tmp_path / "s"), bulk=True)
    w.save(w.peer, w.pns, [key(i) for i in range(4)])
    w.st.lookup(w.ns, (), 0)
    clock[0] += EVERY

    def touches() -> int:
        return sum(r[16:17] == bytes([fmt.REC_TOUCH]) for r in w.journaled)

    where = w.st.pin(w.ns, [key(0), key(1), key(0), key(9)])
    assert [x is not None and x >> fmt.ENGINE_SHIFT for x in where] == [1, 1, 1, False]
    assert touches() == 1 and len(w.journaled[-1]) - 16 == 2 * fmt.REC_BYTES  # key 0 once, key 1
    assert w.ns.tables[1].atime_at(where[0] & fmt.SLOT_MASK) == clock[0]
    clock[0] += EVERY - 1
    w.st.pin(w.ns, [key(0), key(2)])  # key 0 within the second: key 2 only
    assert touches() == 2 and len(w.journaled[-1]) - 16 == fmt.REC_BYTES
    clock[0] += 1
    w.st.pin(w.ns, [key(0)])
    assert touches() == 3
    w.st.unpin(w.ns, [key(0)] * 4 + [key(1), key(2), key(9)])
    assert not w.st.index.pins and not w.ns.pinned_tags
    w.close()


def test_a_held_key_is_never_a_victim_and_is_one_after_its_last_unpin(tmp_path, clock):
    probe = Store(str(tmp_path / "probe"))
    cost = probe.namespace(NS, PAYLOAD).slot_cost
    probe.close()
    st = Store(str(tmp_path / "s"), capacity=8 * cost)
    ns = st.namespace(NS, PAYLOAD)

    def save(ids) -> None:
        for i in ids:
            clock[0] += 1
            st.commit(ns, [(key(i), st.reserve(ns, key(i)))])

    save(range(8))
    ids = [i for i in range(8) if ns.has(key(i))]  # (the journal takes some room too)
    assert len(ids) >= 4 and ns.count() == len(ids)
    old, older, rest = key(ids[0]), key(ids[1]), [key(i) for i in ids[2:]]
    a, b = st.pin(ns, [old, older]), st.pin(ns, [older])  # `older` held by two loads
    assert None not in a + b
    clock[0] += 1
    assert None not in st.pin(ns, rest)  # used after the two: younger
    st.unpin(ns, rest)
    save(range(100, 110))  # pressure: ten new blocks
    assert ns.has(old) and ns.has(older) and not any(ns.has(k) for k in rest)
    assert ns.table.oldest(None) == ns.block(old)[0], "held keys are the oldest: skipped, not gone"
    st.unpin(ns, [older])  # one of its two loads: still held
    st.unpin(ns, [old])
    save([200])
    assert not ns.has(old) and ns.has(older), "the last unpin of `old` made it the victim"
    st.unpin(ns, [older])
    save([201])
    assert not ns.has(older) and not st.index.pins and not ns.pinned_tags
    st.close()


def _loop_pin(st: Drives, ns, keys) -> list:
    """The loop per key that Drives.pin routed each drive's answers with (the reference)."""
    serving = st._serving()
    parts = [(d, n) for d, n in ns.parts if d in serving]
    first = holders([n for _, n in parts], keys)
    out = [None] * len(keys)
    for i, (d, n) in enumerate(parts):
        idx = np.flatnonzero(first == i).tolist()
        if idx:
            got = st.stores[d].pin(n, [keys[j] for j in idx])
            for j, w in zip(idx, got):
                out[j] = None if w is None else fmt.on_drive(d, w)
    return out


def _loop_unpin(st: Drives, ns, keys) -> None:
    """The loop per key and drive that Drives.unpin made (the reference)."""
    for d, n in ns.parts:
        pins = st.stores[d].index.pins
        mine = [k for k in keys if pins[(n.nsid, k)]]
        if mine:
            st.stores[d].unpin(n, mine)


@pytest.mark.parametrize("seed", range(3))
def test_pin_and_unpin_on_several_drives_leave_what_the_loop_per_key_left(tmp_path, clock, seed):
    def drives(name: str, bulk: bool):
        ws = {d: World(str(tmp_path / f"{name}{d}"), bulk, capacity="32MiB") for d in range(2)}
        return Drives([str(tmp_path / f"{name}{d}") for d in ws], {d: w.st for d, w in ws.items()}), ws

    (loop, lw), (bulk, bw) = drives("loop", False), drives("bulk", True)
    lns, bns = loop.namespace(NS, PAYLOAD), bulk.namespace(NS, PAYLOAD)
    for ws in (lw, bw):
        for d, w in ws.items():  # drives overlap: a key may be held on both, pin takes the first
            w.ns = w.st.namespace(NS, PAYLOAD)
            _fill(w, random.Random(seed * 10 + d), 150)
    rnd, loads, hits, drives = random.Random(seed), [], 0, set()
    for step in range(60):
        if rnd.random() < 0.55 or not loads:
            keys = [key(rnd.randrange(190)) for _ in range(rnd.randrange(1, 30))]
            keys += keys[:2]
            got = _loop_pin(loop, lns, keys)
            assert bulk.pin(bns, keys) == got
            hits += sum(g is not None for g in got)
            drives |= {d for d, st in loop.stores.items() if st.load_pinned()}
            loads.append(keys)
        else:
            keys = loads.pop(rnd.randrange(len(loads)))
            keys = keys[::-1] + [key(500 + step)]
            _loop_unpin(loop, lns, keys)
            bulk.unpin(bns, keys)
        clock[0] += rnd.choice([0, EVERY // 2, EVERY])
        assert [w.state() for w in lw.values()] == [w.state() for w in bw.values()], step
    assert hits and drives == {0, 1}, "keys held on every drive"
    for st, ws in ((loop, lw), (bulk, bw)):
        st.close()
        for w in ws.values():
            w.peer.close()
