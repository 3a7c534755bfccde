# SPDX-License-Identifier: Apache-2.0
"""One store, one interface: `Store` (one cache directory) and `Drives` (one Store per drive)
both implement store/api.py's `StoreApi`, and their namespaces (`Namespace`, `DriveNamespace`)
its `SpaceApi`, with the same signatures; the connector and the scheduler side call only
that, never asking which one they have (issue 42: `getattr(store, "stores", ...)`,
`hasattr(ns, "parts")` told them apart), and the namespace answers by calls (`has`, `where`,
`count`, `keys`, `reserved`), not through dict-like views.
"""

from __future__ import annotations

import inspect
import os
import re
import typing

import pytest

from aiokv.data import format as fmt
from aiokv.store import Store
from aiokv.store.api import SpaceApi, StoreApi
from aiokv.store.drives import Drives
from aiokv.store.driveviews import DriveNamespace
from aiokv.store.namespace import Namespace
from tests.conftest import NS, PAYLOAD, key

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _accepts(proto_fn, impl_fn) -> str | None:
    """Why impl_fn cannot stand for proto_fn (None: it can): the protocol's parameters, by
    name, kind and default, in order, then only parameters with defaults."""
    want = list(inspect.signature(proto_fn).parameters.values())
    got = list(inspect.signature(impl_fn).parameters.values())
    for i, p in enumerate(want):
        if i >= len(got):
            return f"lacks {p.name}"
        q = got[i]
        if (q.name, q.kind, q.default) != (p.name, p.kind, p.default):
            return f"has {q} where the interface has {p}"
    extra = [q.name for q in got[len(want) :] if q.default is inspect.Parameter.empty]
    return f"needs {extra} too" if extra else None


def _check(proto, cls, obj) -> list[str]:
    assert isinstance(obj, proto), f"{cls.__name__} is no {proto.__name__}"
    bad = []
    for name in sorted(typing._get_protocol_attrs(proto)):
        fn = inspect.getattr_static(proto, name, None)  # (None: a plain attribute)
        if inspect.isfunction(fn):
            why = _accepts(fn, getattr(cls, name))
            if why:
                bad.append(f"{cls.__name__}.{name} {why}")
        elif callable(getattr(obj, name)):
            bad.append(f"{cls.__name__}.{name} is a method where the interface has a value")
    return bad


@pytest.fixture
def both(tmp_path):
    """(a Store, its namespace) and (a Drives of two drives, its namespace)."""
    one = Store(str(tmp_path / "one"), capacity="8MiB")
    drives = Drives(
        [str(tmp_path / "d0"), str(tmp_path / "d1")],
        {d: Store(str(tmp_path / f"d{d}"), capacity="4MiB") for d in (0, 1)},
    )
    yield (one, one.namespace(NS, PAYLOAD)), (drives, drives.namespace(NS, PAYLOAD))
    one.close()
    drives.close()


def test_store_and_drives_implement_one_interface(both):
    (one, ns), (drives, dns) = both
    bad = _check(StoreApi, Store, one) + _check(StoreApi, Drives, drives)
    bad += _check(SpaceApi, Namespace, ns) + _check(SpaceApi, DriveNamespace, dns)
    assert not bad, bad


def test_the_same_calls_give_the_same_answers_on_one_store_and_on_drives(both):
    for st, ns in both:
        keys = [key(i) for i in range(6)]
        got = [st.reserve(ns, k, "alice") for k in keys[:4]]
        assert None not in got and all(ns.reserved(k) for k in keys[:4])
        st.commit(ns, list(zip(keys[:3], got[:3])), "alice")
        st.abort(ns, [(keys[3], got[3])])
        assert st.lookup(ns, keys) == 3 and [ns.has(k) for k in keys] == [True] * 3 + [False] * 3
        assert [ns.where(k) for k in keys[:3]] == got[:3] and ns.where(keys[3]) is None
        assert not any(ns.reserved(k) for k in keys) and all(st.holds(ns, k, w) for k, w in zip(keys, got[:3]))
        assert ns.count() == st.blocks() == 3 and sorted(ns.keys()) == sorted(keys[:3])
        assert st.served(ns, keys) == [True] * 3 + [False] * 3
        assert sum(n.count() for _, _, n in st.parts(ns)) == 3 and len(st.namespaces()) == len(st.drives())
        assert st.pin(ns, keys[:2]) == got[:2] and st.load_pinned() == 2
        st.unpin(ns, keys[:2])
        assert st.load_pinned() == 0 and st.drop_at(ns, [(keys[0], got[0])], corrupt=False) == 1
        assert not ns.has(keys[0]) and st.lookup(ns, keys[1:]) == 2 and st.loading == 0 and st.used() > 0
    (one, _), (drives, dns) = both
    assert one.drives() == [(0, one.root, one)]
    assert [(d, s) for d, _, s in drives.drives()] == sorted(drives.stores.items())
    assert {fmt.drive_of(dns.where(key(i)))[0] for i in (1, 2)} <= {0, 1}


CALLERS = ("aiokv/connector", "aiokv/scheduler")
PROBES = [
    (
        re.compile(r"\b(getattr|hasattr)\(\s*(self\.)?(sched\.)?(store|st|ns|part|g\.ns)\b"),
        "getattr/hasattr on a store",
    ),
    (re.compile(r"isinstance\([^)]*\b(Drives|Store|DriveNamespace|Namespace)\b"), "isinstance of a store class"),
    (re.compile(r"\.(stores|live|on)\b|\.parts\b(?!\()"), "a Drives' insides (.stores, .live, .on, ns.parts)"),
    (re.compile(r"\.(entries|own|peers)\b"), "a dict-like view of a namespace"),
]


def test_the_connector_and_the_scheduler_side_never_ask_which_store_they_have():
    found = []
    for top in CALLERS:
        for name in sorted(os.listdir(os.path.join(ROOT, top))):
            if not name.endswith(".py"):
                continue
            with open(os.path.join(ROOT, top, name)) as f:
                for n, line in enumerate(f, 1):
                    code = line.split("#", 1)[0]
                    found += [f"{top}/{name}:{n}: {why}: {line.strip()}" for rx, why in PROBES if rx.search(code)]
    assert not found, "\n".join(found)
