# SPDX-License-Identifier: Apache-2.0
"""`aiokv clear`, `aiokv pin`, `aiokv unpin`: orders to a live cache directory (issue 34).

What they do (aiokv/store/control.py): the order is appended to DIR/control and synced; every
running engine applies it at its next look at the directory (at most 0.1 s while it steps) and
says so in its journal (a MARK record); the files of an engine that is not running are opened
as their owner (its lock taken, as reclaim does) and the order applied to them, explicitly
(store/offline.py's `apply_orders`). The command then waits up to `wait` seconds for the running
engines' MARKs (store/offline.py's `applied_mark`) and says which applied it. A dry run counts
what a clear would remove and changes nothing. The command acts as the directory's owner, the
user its engines run as (owner.py: as root it takes that user's ids; as any other user it
refuses).

Which blocks (`Selection`): the namespaces of `model` (namespace.json's "model", or its last path
component) or `namespace` (a prefix of the id), else all; the tenant `tenant` (a request's
cache_salt; "" for requests without one), else all (a clear only); `older_than` (a clear only, a
duration: select.py): blocks last used longer ago than that. Where the engines name tenants under a `secret`, the same
secret must be given (the tenants' tags are keyed by it). Errors a user can fix are the
command's type (errors.py: ClearError, PinError, UnpinError), one line each.

The path of an order, from the CLI to the engines: this module -> select.py (namespaces,
tags) -> store/readonly.py (the directory opened read-only) -> store/orderscope.py (counted,
appended to DIR/control) -> store/offline.py (applied to the stopped engines' files; the
running engines' MARKs read); the running engines take it from DIR/control themselves
(store/following.py, control.py, applying.py).

Threading: one thread (the CLI's).
"""

from __future__ import annotations

import dataclasses
import os
import time

from aiokv.ops import select
from aiokv.ops.errors import ORDER_ERRORS, OpsError
from aiokv.ops.owner import as_owner
from aiokv.store import offline, orderscope, readonly
from aiokv.store.control import Order
from aiokv.store.lock import engines

WAIT = 5.0  # seconds the command waits, by default, for the running engines to apply an order


def _count(st, spaces, order: Order) -> dict:
    """What an order is for, as the directory is now: blocks and bytes per namespace and tenant."""
    rows, total_blocks, total_bytes = [], 0, 0
    for ns in spaces:
        per = orderscope.counts(st, ns, order)
        blocks = sum(per.values())
        total_blocks += blocks
        total_bytes += blocks * ns.slot_cost
        rows.append(
            {
                "nsid": ns.hex,
                "model": ns.fields.get("model"),
                "blocks": blocks,
                "bytes": blocks * ns.slot_cost,
                "tenants": [
                    {"tenant": orderscope.tenant_label(st, tid), "blocks": n, "bytes": n * ns.slot_cost}
                    for tid, n in sorted(per.items(), key=lambda x: -x[1])
                ],
            }
        )
    return {"namespaces": rows, "blocks": total_blocks, "bytes": total_bytes}


def _apply_to_stopped(root: str) -> tuple[list[int], list[int]]:
    """The orders applied to the files of every engine that is not running (store/offline.py);
    returns (engines applied here, engines running)."""
    done, running = [], []
    for e, pid in sorted(engines(root).items()):
        if pid is not None:
            running.append(e)
        elif offline.apply_orders(root, e):
            done.append(e)
        else:
            running.append(e)  # it started meanwhile: it applies the order itself
    return done, running


def _wait(root: str, spaces, order: Order, running: list[int], wait: float) -> tuple[list[int], list[int]]:
    """(running engines that applied the order to every namespace it is for, those that did not
    within `wait` seconds)."""
    end = time.monotonic() + wait
    left = set(running)
    while True:
        for e in sorted(left):
            marks_now = [offline.applied_mark(root, ns.nsid, e) for ns in spaces]
            if all(m is None or m >= order.number for m in marks_now):
                left.discard(e)
        if not left or time.monotonic() >= end:
            return sorted(set(running) - left), sorted(left)
        time.sleep(0.05)


@dataclasses.dataclass(frozen=True)
class Selection:
    """Which blocks an order is for (the module's docstring): None is every one."""

    tenant: str | None = None  # a cache_salt ("": requests without one)
    model: str | None = None
    namespace: str | None = None  # a prefix of a namespace's id
    older_than: str | None = None  # a duration, '90s' to '2w' (a clear only)
    secret: str | None = None  # the engines' `secret`, where they key tenants by it


def run(op: str, root: str, sel: Selection, dry_run: bool = False, wait: float = WAIT) -> dict:
    """One clear, pin or unpin (op) of the blocks `sel` names: what it was for and who applied
    it (JSON-ready). Acts as the directory's owner (owner.py); raises the command's error (errors.py)."""
    error = ORDER_ERRORS[op]
    root = os.path.abspath(root)
    try:
        readonly.check_root(root)
    except readonly.StoreUnreadable as e:
        raise error(str(e)) from None
    if op != "clear" and sel.tenant is None:
        raise error(f'aiokv: {op} needs --tenant SALT ("" for requests without a cache_salt)')
    with as_owner(root, error):
        return _run(op, root, sel, dry_run, wait, error)


def _run(op: str, root: str, sel: Selection, dry_run: bool, wait: float, error: type[OpsError]) -> dict:
    tenant, model, namespace, older_than = sel.tenant, sel.model, sel.namespace, sel.older_than
    try:
        st = readonly.open_readonly(root)
    except readonly.StoreUnreadable as e:
        raise error(str(e)) from None
    try:
        spaces = select.namespaces(st, model, namespace, error)
        tags = select.tenant_tags(st, tenant, sel.secret, error) if tenant is not None else None
        age = select.parse_duration(older_than, error) if older_than is not None else None
        before = time.time_ns() - int(age * 1e9) if age is not None else None
        every = model is None and namespace is None
        nsids = None if every else [ns.nsid for ns in spaces]
        probe = Order(
            0, time.time_ns(), op, None if nsids is None else frozenset(nsids), tags and frozenset(tags), before
        )
        found = _count(st, spaces, probe)
        if dry_run:
            return {"root": root, "op": op, "dry_run": True, "order": None, **found}
        order = orderscope.append(st, op, nsids, tags, before)
    finally:
        st.close()
    applied_here, running = _apply_to_stopped(root)
    applied, pending = _wait(root, spaces, order, running, wait) if running else ([], [])
    return {
        "root": root,
        "op": op,
        "dry_run": False,
        "order": order.number,
        **found,
        "applied_by_this_command": applied_here,
        "applied_by_engines": applied,
        "not_yet_applied_by": pending,
    }
