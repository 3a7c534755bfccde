# SPDX-License-Identifier: Apache-2.0
"""`served` (which of these keys are hits now: sliding-window and recurrent-state groups'
matching) and `Drives.pin` (which serving drive holds each key) ask aiokv._index once per call
(`_index.locate_all` through `store/locate.py`'s `holders`) instead of a Python probe per key and drive on
the scheduler thread (30M blocks a node: nothing per block in Python there). Invariant: they
answer exactly what the probe per key answered, on one Store and on several drives, for hits,
misses, reservations not committed, dropped keys, another engine's blocks, a drive whose breaker
is open, repeated keys and no keys at all.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from aiokv import _index
from aiokv.data import format as fmt
from aiokv.store import Store
from aiokv.store.drives import Drives
from aiokv.store.locate import holders
from tests.conftest import NS, PAYLOAD, key


def _follow(st: Store) -> Store:
    st.follow_interval = 0  # the other engine's commits are seen at the next lookup
    return st


def _fill(st, ns, rnd: random.Random, ids, peer=None, peer_ns=None) -> None:
    """Of `ids`: some committed here, some by another engine on the directory, some reserved and
    left pending, some committed then dropped; the rest never saved."""
    for i in ids:
        k, r = key(i), rnd.random()
        if r < 0.35:
            st.commit(ns, [(k, st.reserve(ns, k))])
        elif r < 0.5 and peer is not None:
            peer.commit(peer_ns, [(k, peer.reserve(peer_ns, k))])
        elif r < 0.6:
            st.reserve(ns, k)  # pending: no hit
        elif r < 0.7:
            st.commit(ns, [(k, st.reserve(ns, k))])
            st.drop(ns, [k], corrupt=False)


def _asked(rnd: random.Random, n: int) -> list[bytes]:
    """Random keys among those filled and some never seen, a few repeated."""
    keys = [key(rnd.randrange(n + n // 4)) for _ in range(n)]
    return keys + rnd.sample(keys, min(len(keys), 5))


@pytest.fixture
def store(tmp_path):
    root = str(tmp_path / "one")
    st, peer = _follow(Store(root, capacity="64MiB")), Store(root, capacity="64MiB")
    yield st, st.namespace(NS, PAYLOAD), peer, peer.namespace(NS, PAYLOAD)
    st.close()
    peer.close()


@pytest.fixture
def drives(tmp_path):
    """Three drives, each directory shared with another engine (a drive's namespace: two tables)."""
    paths = [str(tmp_path / f"d{d}") for d in range(3)]
    stores = {d: _follow(Store(p, capacity="32MiB")) for d, p in enumerate(paths)}
    peers = {d: Store(p, capacity="32MiB") for d, p in enumerate(paths)}
    st = Drives(paths, stores)
    yield st, st.namespace(NS, PAYLOAD), peers
    st.close()
    for p in peers.values():
        p.close()


@pytest.mark.parametrize("seed", range(4))
def test_served_on_one_store_answers_as_a_probe_per_key(store, seed):
    st, ns, peer, peer_ns = store
    rnd = random.Random(seed)
    _fill(st, ns, rnd, range(300), peer, peer_ns)
    keys = _asked(rnd, 300)
    got = st.served(ns, keys)
    assert len(ns.probes) == 2, "the other engine's blocks are a table of their own"
    assert got == [ns.has(k) for k in keys] and type(got) is list and all(type(b) is bool for b in got)
    assert True in got and False in got and not any(st.served(ns, [k for k in keys if ns.reserved(k)]))
    assert st.served(ns, []) == [] and st.served(ns, [keys[0], 7, None]) == [ns.has(keys[0]), False, False]


def _first_serving(st: Drives, dns, k) -> int | None:
    """The probe per key and drive that Drives.pin made: the first serving drive holding k."""
    serving = st._serving()
    return next((d for d, n in dns.parts if d in serving and n.has(k)), None)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("down", [None, 0, 1])
def test_served_and_pin_on_several_drives_answer_as_a_probe_per_key_and_drive(drives, seed, down):
    st, dns, peers = drives
    rnd = random.Random(seed)
    for d, n in dns.parts:  # drives overlap: a key may be held on several, pin takes the first serving
        _fill(st.stores[d], n, rnd, range(d * 100, d * 100 + 300), peers[d], peers[d].namespace(NS, PAYLOAD))
    keys = _asked(rnd, 500)
    st.served(dns, keys)  # every drive looks at its other engine
    assert all(len(n.probes) == 2 for _, n in dns.parts), "each drive's namespace has the peer's table"
    if down is not None:
        st.record({down: [3, 0]})  # three I/O errors in a row: its breaker opens
        assert st.breakers[down].is_open and down not in st._serving()
    got = st.served(dns, keys)
    want = [_first_serving(st, dns, k) for k in keys]
    assert got == [d is not None for d in want] and True in got and False in got
    expected = [None if d is None else fmt.on_drive(d, dns.on[d].where(k)) for k, d in zip(keys, want)]
    held = {d: s.load_pinned() for d, s in st.stores.items()}
    assert st.pin(dns, keys) == expected
    for d, s in st.stores.items():  # each key pinned on its drive only
        assert s.load_pinned() - held[d] == len({k for k, w in zip(keys, want) if w == d})
    st.unpin(dns, keys)
    assert st.pin(dns, []) == [] and st.served(dns, []) == []


def test_with_no_drive_serving_nothing_is_served_or_pinned(drives):
    st, dns, _ = drives
    keys = [key(i) for i in range(20)]
    for d, n in dns.parts:
        st.stores[d].commit(n, [(k, st.stores[d].reserve(n, k)) for k in keys])
    for d in st.breakers:
        st.record({d: [3, 0]})
    assert st.served(dns, keys) == [False] * 20 and st.pin(dns, keys) == [None] * 20
    assert sum(s.load_pinned() for s in st.stores.values()) == 0


def test_holders_name_the_first_space_holding_each_key(tmp_path):
    """locate.holders against `has` per key and space, spaces of one and two tables mixed."""
    sts = [Store(str(tmp_path / f"s{i}"), capacity="16MiB") for i in range(3)]
    spaces = [s.namespace(NS, PAYLOAD) for s in sts]
    rnd = random.Random(7)
    for s, n in zip(sts, spaces):
        for i in rnd.sample(range(200), 80):
            s.commit(n, [(key(i), s.reserve(n, key(i)))])
    keys = [key(i) for i in range(220)]
    for pick in ([0], [2, 0], [1, 2, 0], []):
        sub = [spaces[i] for i in pick]
        want = [next((j for j, n in enumerate(sub) if n.has(k)), -1) for k in keys]
        got = holders(sub, keys)
        assert got.dtype == np.int64 and got.tolist() == want
    out = np.empty(3, np.int64)
    with pytest.raises(ValueError, match="differ in length"):
        _index.locate_all(spaces[0].probes, keys[:2], out)
    with pytest.raises(TypeError, match="Probe"):
        _index.locate_all((1,), keys[:3], out)
    for s in sts:
        s.close()
