# SPDX-License-Identifier: Apache-2.0
"""What an operator's order (control.py: aiokv clear, pin, unpin) is for, as a directory opened
read-only (readonly.py) holds it now, and the order written: for aiokv/ops/orders.py.

- `namespaces(st)`: the directory's namespaces, by id;
- `tenants_keyed(st)`: whether an engine names tenants under a secret (its tenants file's records
  are keyed: tenantsfile.py), so a tenant's name gives its tag only with that secret;
- `counts(st, ns, order)`: the blocks of a namespace an order is for, per tenant (every engine's
  table, at once: bulk.py's select, no Python object per block), and `tenant_label(st, tid)`;
- `append(st, op, ...)`: the order appended to DIR/control and synced (control.py's append_order).

Threading: the caller's thread (the CLI's), on a Store opened read-only without an I/O thread.
"""

from __future__ import annotations

import os

import numpy as np

from aiokv.store import bulk
from aiokv.store.control import Order, append_order
from aiokv.store.namespace import Namespace
from aiokv.store.store import Store
from aiokv.store.tenants import read_file


def namespaces(st: Store) -> list[Namespace]:
    """The directory's namespaces, by their ids' hex."""
    return sorted(st.index.namespaces.values(), key=lambda n: n.hex)


def engines_with_files(root_fd: int) -> list[int]:
    """Engine numbers that have a tenants file."""
    out = []
    for name in os.listdir(root_fd):
        if name.startswith("tenants.") and name[8:].isdigit():
            out.append(int(name[8:]))
    return sorted(out)


def tenants_keyed(st: Store) -> bool:
    """Whether any engine on the directory names tenants under a secret."""
    root_fd = st.dirs.root_fd
    return any(r[2] for e in engines_with_files(root_fd) for r in read_file(root_fd, e))


def _slots(st: Store, table, order: Order) -> np.ndarray:
    """The slots of a table's blocks an order is for (a tenant without an id here holds no block here)."""
    if order.tenants is None:
        mask = bulk.ALL
    else:
        mask = bulk.tenant_mask({i for i in map(st.tenants.lookup, order.tenants) if i is not None})
    slots, _ = bulk.select(table, bulk.filter_of(order, mask), 0, table.slots, table.slots)
    return slots


def counts(st: Store, ns: Namespace, order: Order) -> dict[int, int]:
    """tenant id -> the blocks of ns (every engine's) the order is for."""
    per: dict[int, int] = {}
    for t in [ns.tables[e] for e in sorted(ns.tables)]:
        slots = _slots(st, t, order)
        for tid, n in zip(*np.unique(t.tenant[slots], return_counts=True)):
            per[int(tid)] = per.get(int(tid), 0) + int(n)
    return per


def tenant_label(st: Store, tid: int) -> str:
    """How a tenant is shown: its name, or its tag's first hex digits (tenants.py)."""
    return st.tenants.label(tid)


def append(st: Store, op: str, nsids=None, tenants=None, before: int | None = None) -> Order:
    """The order appended to the directory's control file and synced (control.py); the order written."""
    return append_order(st.dirs.root_fd, op, nsids, tenants, before)
