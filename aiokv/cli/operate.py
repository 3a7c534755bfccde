# SPDX-License-Identifier: Apache-2.0
"""`aiokv clear`, `aiokv pin`, `aiokv unpin`: orders to a live cache directory (issue 34).

What they do (aiokv/store/control.py): the order is appended to DIR/control and synced; every
running engine applies it at its next look at the directory (at most 0.1 s while it steps) and
says so in its journal (a MARK record); the files of an engine that is not running are opened
here as their owner (its lock taken, as reclaim does) and the order applied to them. The
command then waits up to --wait seconds for the running engines' MARKs and says which applied
it. --dry-run counts what a clear would remove and changes nothing. The command acts as the
directory's owner, the user its engines run as (owner.py: as root it takes that user's ids; as
any other user it refuses).

Which blocks: the namespaces of --model NAME (namespace.json's "model", or its last path
component) or --namespace ID (a prefix of the id), else all; the tenant --tenant SALT (a
request's cache_salt; "" for requests without one), else all (a clear only); --older-than
DURATION (a clear only): blocks last used longer ago than that. Where the engines name tenants
under a `secret`, the same secret must be in AIOKV_SECRET (the tenants' tags are keyed by it).

Threading: one thread (the CLI's).
"""

from __future__ import annotations

import os
import re
import time

import numpy as np

from aiokv.cli.opening import SCHEMA, InspectError, check_root, open_readonly
from aiokv.cli.owner import as_owner
from aiokv.data import format as fmt
from aiokv.data.dirs import open_dir
from aiokv.store.control import Order, append_order
from aiokv.store.lock import StoreLocked, engines
from aiokv.store.logrecords import marks, parse_records
from aiokv.store.store import Store, ns_dir
from aiokv.store.tenants import read_file

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
WAIT = 5.0  # seconds the command waits, by default, for the running engines to apply an order


def parse_duration(text: str) -> float:
    """Seconds of '90s', '30m', '12h', '7d', '2w' (or a plain number of seconds)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text or "")
    if not m:
        raise InspectError(f"aiokv: --older-than {text!r} is not a duration (say 90s, 30m, 12h, 7d or 2w)")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def _namespaces(st: Store, model: str | None, nsid: str | None) -> list:
    spaces = sorted(st.index.namespaces.values(), key=lambda n: n.hex)
    if nsid is not None:
        got = [n for n in spaces if n.hex.startswith(nsid.lower())]
        if not got or not nsid:
            raise InspectError(f"aiokv: no namespace {nsid!r} in {st.root} (aiokv inspect lists them)")
        return got
    if model is not None:
        got = [
            n
            for n in spaces
            if str(n.fields.get("model")) == model
            or os.path.basename(str(n.fields.get("model", "")).rstrip("/")) == model
        ]
        if not got:
            known = sorted({str(n.fields.get("model")) for n in spaces})
            raise InspectError(
                f"aiokv: no namespace of model {model!r} in {st.root} (models here: {', '.join(known) or 'none'})"
            )
        return got
    return spaces


def _tags(root_fd: int, tenant: str) -> set[bytes]:
    """The tags a tenant may be named by here: unkeyed, and keyed by AIOKV_SECRET if set.
    Refused if the engines name tenants under a secret this command does not have."""
    secret = os.environ.get("AIOKV_SECRET") or None
    keyed = any(r[2] for e in engines_with_files(root_fd) for r in read_file(root_fd, e))
    if keyed and secret is None:
        raise InspectError(
            "aiokv: the engines on this directory name tenants under a secret; give the same secret in AIOKV_SECRET"
        )
    tags = {fmt.tenant_tag(tenant)}
    if secret is not None:
        tags.add(fmt.tenant_tag(tenant, fmt.tenant_key(secret)))
    return tags


def engines_with_files(root_fd: int) -> list[int]:
    """Engine numbers that have a tenants file."""
    out = []
    for name in os.listdir(root_fd):
        if name.startswith("tenants.") and name[8:].isdigit():
            out.append(int(name[8:]))
    return sorted(out)


def _count(st: Store, spaces, order: Order) -> dict:
    """What an order is for, as the directory is now: blocks and bytes per namespace and tenant."""
    rows, total_blocks, total_bytes = [], 0, 0
    for ns in spaces:
        per: dict[int, int] = {}
        for t in [ns.tables[e] for e in sorted(ns.tables)]:
            slots = st.control._matching(t, order)
            for tid, n in zip(*np.unique(t.tenant[slots], return_counts=True)):
                per[int(tid)] = per.get(int(tid), 0) + int(n)
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
                    {"tenant": st.tenants.label(tid), "blocks": n, "bytes": n * ns.slot_cost}
                    for tid, n in sorted(per.items(), key=lambda x: -x[1])
                ],
            }
        )
    return {"namespaces": rows, "blocks": total_blocks, "bytes": total_bytes}


def _mark_of(root: str, nsid: bytes, engine: int) -> int | None:
    """The control orders an engine's files of a namespace say it applied (its checkpoint's
    header, its journal's MARKs); None if it has no journal there (it does not know the namespace)."""
    d = os.path.join(ns_dir(root, nsid), fmt.engine_dir(engine)).rstrip("/")
    try:
        fd = open_dir(d)
    except OSError:
        return None
    try:
        mark, journal = 0, False
        for name in sorted(os.listdir(fd)):
            if name != "checkpoint" and not name.startswith("journal."):
                continue
            try:
                f = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=fd)
            except OSError:
                continue
            try:
                if name == "checkpoint":
                    mark = max(mark, fmt.file_header_mark(os.pread(f, fmt.FILE_HDR_BYTES, 0)))
                else:
                    journal = True
                    recs, _ = parse_records(os.pread(f, 1 << 30, fmt.FILE_HDR_BYTES))
                    mark = max(mark, marks(recs))
            finally:
                os.close(f)
        return mark if journal else None
    finally:
        os.close(fd)


def _apply_to_stopped(root: str, order: Order) -> tuple[list[int], list[int]]:
    """The order applied to the files of every engine that is not running (opened as their
    owner: Store(engine=e) applies the orders past each namespace's MARK as it opens); returns
    (engines applied here, engines running)."""
    done, running = [], []
    for e, pid in sorted(engines(root).items()):
        if pid is not None:
            running.append(e)
            continue
        try:
            st = Store(root, engine=e)
        except StoreLocked:
            running.append(e)  # it started meanwhile: it applies the order itself
            continue
        st.close(checkpoint=True)
        done.append(e)
    return done, running


def _wait(root: str, spaces, order: Order, running: list[int], wait: float) -> tuple[list[int], list[int]]:
    """(running engines that applied the order to every namespace it is for, those that did not
    within `wait` seconds)."""
    end = time.monotonic() + wait
    left = set(running)
    while True:
        for e in sorted(left):
            marks_now = [_mark_of(root, ns.nsid, e) for ns in spaces]
            if all(m is None or m >= order.number for m in marks_now):
                left.discard(e)
        if not left or time.monotonic() >= end:
            return sorted(set(running) - left), sorted(left)
        time.sleep(0.05)


def run(
    op: str,
    root: str,
    tenant: str | None,
    model: str | None = None,
    namespace: str | None = None,
    older_than: str | None = None,
    dry_run: bool = False,
    wait: float = WAIT,
) -> dict:
    """One clear, pin or unpin: its document (JSON-ready). Acts as the directory's owner (owner.py)."""
    root = os.path.abspath(root)
    check_root(root)
    if op != "clear" and tenant is None:
        raise InspectError(f'aiokv: {op} needs --tenant SALT ("" for requests without a cache_salt)')
    with as_owner(root):
        return _run(op, root, tenant, model, namespace, older_than, dry_run, wait)


def _run(op, root, tenant, model, namespace, older_than, dry_run, wait) -> dict:
    st = open_readonly(root)
    try:
        spaces = _namespaces(st, model, namespace)
        tags = _tags(st.dirs.root_fd, tenant) if tenant is not None else None
        before = time.time_ns() - int(parse_duration(older_than) * 1e9) if older_than is not None else None
        every = model is None and namespace is None
        nsids = None if every else [ns.nsid for ns in spaces]
        probe = Order(
            0, time.time_ns(), op, None if nsids is None else frozenset(nsids), tags and frozenset(tags), before
        )
        found = _count(st, spaces, probe)
        root_fd = st.dirs.root_fd
        if dry_run:
            return {"schema": SCHEMA, "root": root, "op": op, "dry_run": True, "order": None, **found}
        order = append_order(root_fd, op, nsids, tags, before)
    finally:
        st.close()
    applied_here, running = _apply_to_stopped(root, order)
    applied, pending = _wait(root, spaces, order, running, wait) if running else ([], [])
    return {
        "schema": SCHEMA,
        "root": root,
        "op": op,
        "dry_run": False,
        "order": order.number,
        **found,
        "applied_by_this_command": applied_here,
        "applied_by_engines": applied,
        "not_yet_applied_by": pending,
    }


def render(d: dict) -> str:
    from aiokv.cli.render import human

    verb = {"clear": "remove", "pin": "pin", "unpin": "unpin"}[d["op"]]
    what = f"would {verb}" if d["dry_run"] else f"to {verb}"
    lines = [f"aiokv {d['op']} {d['root']}: {d['blocks']} block(s), {human(d['bytes'])} {what}"]
    for n in d["namespaces"]:
        if not n["blocks"]:
            continue
        lines.append(f"  namespace {n['nsid'][:12]} ({n['model']}): {n['blocks']} block(s), {human(n['bytes'])}")
        for t in n["tenants"]:
            lines.append(f"    tenant {t['tenant'] or '(none)'}: {t['blocks']} block(s), {human(t['bytes'])}")
    if d["dry_run"]:
        lines.append("dry run: nothing was changed")
        return "\n".join(lines)
    lines.append(f"order {d['order']} written to {d['root']}/control")
    if d["applied_by_this_command"]:
        lines.append(
            f"applied here to the files of stopped engine(s) {', '.join(map(str, d['applied_by_this_command']))}"
        )
    if d["applied_by_engines"]:
        lines.append(f"applied by running engine(s) {', '.join(map(str, d['applied_by_engines']))}")
    if d["not_yet_applied_by"]:
        lines.append(
            f"not yet applied by running engine(s) {', '.join(map(str, d['not_yet_applied_by']))}: an engine "
            "applies it at its next step (an idle one at its next request)"
        )
    return "\n".join(lines)
