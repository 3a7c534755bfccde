# SPDX-License-Identifier: Apache-2.0
"""Index records replayed: journal records applied to a Table in bulk (aiokv._index.apply),
a Table built from a checkpoint's records and a journal's, or (tools and tests) both
replayed into a dict of key -> (slot, atime).

Threading contract: plain functions, no state of their own; the caller's thread owns the
Table it hands in (the Store's owner, its I/O thread while opening, a follower's owner).
"""

from __future__ import annotations

import numpy as np

from aiokv import _index
from aiokv.data import format as fmt
from aiokv.store.logrecords import record_key, record_tags
from aiokv.store.table import Table, hash_size


def apply_records(table: Table, recs, tags, max_slot: int, watch: bool = False, tenants=None):
    """Journal records, in order, on a table (aiokv._index.apply; FLAGS records here, between
    the runs of the others); returns (indices of TOUCH records of keys it does not hold,
    [(tag, added)] if watch). A COMMIT's block gets the record's tenant (`tenants`: the
    records' tenant ids as the reader names them; None: as written) and flags; the table's
    counts follow."""
    if not len(recs):
        return np.zeros(0, np.uint32), []
    rt = recs["tenant"] if tenants is None else np.asarray(tenants, np.uint16)
    kinds = recs["kind"]
    cuts = np.flatnonzero(kinds == fmt.REC_FLAGS).tolist()
    if not cuts:
        return _apply_run(table, recs, tags, rt, max_slot, watch)
    touches, changes, start = [], [], 0
    for cut in cuts + [len(recs)]:
        if cut > start:
            t, c = _apply_run(table, recs[start:cut], tags[start:cut], rt[start:cut], max_slot, watch)
            touches.append(t + start)
            changes += c
        if cut < len(recs):
            slot = int(recs["slot"][cut])
            if slot < table.slots and table.tag[slot] == tags[cut]:
                table.set_flags(slot, int(recs["flags"][cut]))
        start = cut + 1
    touch = np.concatenate(touches).astype(np.uint32) if touches else np.zeros(0, np.uint32)
    return touch, changes


def _apply_run(table: Table, recs, tags, rt, max_slot: int, watch: bool):
    """apply_records of records without FLAGS among them."""
    commit = recs["kind"] == fmt.REC_COMMIT
    top = int(recs["slot"][commit].max()) if commit.any() else -1
    if top >= 0:
        table._cover(min(top, max_slot - 1))
    need = hash_size(table.count + int(commit.sum()))
    if need > len(table.hash):
        table._rehash(need)
    # the slots these records may change: theirs, and where their tags are now
    rslots = recs["slot"].astype(np.int64)
    where = np.full(len(recs), -1, np.int64)
    table.probe.find_many(np.ascontiguousarray(tags, np.uint64), where)
    aff = np.unique(np.concatenate([rslots[rslots < table.slots], where[where >= 0]]))
    was = aff[table.tag[aff] != 0]
    table.count_blocks(table.tenant[was], table.flags[was], -1)
    delta, touches, changes = _index.apply(
        table.probe,
        table.atime,
        np.ascontiguousarray(recs["kind"]),
        np.ascontiguousarray(recs["slot"]),
        np.ascontiguousarray(recs["atime"]),
        tags,
        min(max_slot, table.slots),
        watch,
    )
    table.count += delta
    # a COMMIT whose block holds its slot now names its tenant and flags (the last one wins)
    cs = rslots[commit]
    ok = cs < min(max_slot, table.slots)
    ok[ok] = table.tag[cs[ok]] == tags[commit][ok]
    table.tenant[cs[ok]] = rt[commit][ok]
    table.flags[cs[ok]] = recs["flags"][commit][ok]
    for f in table.fresh:  # (an order being applied leaves these: they came after it)
        f.update(cs[ok].tolist())
    gone = aff[table.tag[aff] == 0]
    table.tenant[gone] = 0
    table.flags[gone] = 0
    now = np.unique(np.concatenate([aff[table.tag[aff] != 0], cs[ok]]))
    table.count_blocks(table.tenant[now], table.flags[now], 1)
    table.changed(aff)  # (each to its place in the eviction order, or out: cs[ok] are among them)
    ch = np.frombuffer(changes, np.dtype([("tag", "<u8"), ("added", "u1")])) if watch else []
    return np.frombuffer(touches, np.uint32), [(int(t), bool(a)) for t, a in ch] if watch else []


def table_of(ckpt, jrecs, max_slot: int) -> tuple[Table, np.ndarray]:
    """A table from checkpoint records (sorted by slot, or not) and journal records; and the
    indices of the journal's TOUCH records of keys it does not hold."""
    sorted_ok = len(ckpt) < 2 or bool(np.all(ckpt["slot"][1:] > ckpt["slot"][:-1]))
    ok = ckpt["slot"] < max_slot
    if sorted_ok and ok.all():
        c = ckpt
        t = Table.of(c["slot"].astype(np.uint64), record_tags(c), c["atime"], c["tenant"], c["flags"])
    else:  # an older writer's order, or damage: the records one by one, as the journal's
        t = Table()
        t.forget_order()  # (ordered once built: Table.build_order)
        apply_records(t, ckpt, record_tags(ckpt), max_slot)
    touches, _ = apply_records(t, jrecs, record_tags(jrecs), max_slot)
    return t, touches


def entries_of(ckpt, jrecs):
    """Checkpoint then journal records replayed one by one into key -> (slot, atime) (tools
    and tests; the store loads a Table); with the highest MARK among them (0: none) and the
    [(key, atime)] of TOUCH records of keys they do not hold (another engine's blocks)."""
    mark = 0
    touches: list[tuple[bytes, int]] = []
    entries: dict[bytes, tuple[int, int]] = {}
    by_slot: dict[int, bytes] = {}
    for recs, journal in ((ckpt, False), (jrecs, True)):
        tags = record_tags(recs) if journal else None
        for i, r in enumerate(recs):
            kind, slot, atime = int(r["kind"]), int(r["slot"]), int(r["atime"])
            if kind in (fmt.REC_FLAGS, fmt.REC_MARK):
                mark = max(mark, slot) if kind == fmt.REC_MARK else mark
                continue
            if kind == fmt.REC_FREE:
                k = by_slot.get(slot)
                if k is not None and _index.tag(k) == int(tags[i]) and entries.get(k, (None,))[0] == slot:
                    del entries[k]
                continue
            key = record_key(r)
            if kind == fmt.REC_COMMIT or not journal:
                entries[key] = (slot, atime)
                by_slot[slot] = key
            elif kind == fmt.REC_DROP:
                entries.pop(key, None)
            elif key in entries:  # TOUCH: our key was used by us or another engine
                entries[key] = (entries[key][0], max(atime, entries[key][1]))
            else:  # a hit on another engine's block: for that engine's followers
                touches.append((key, atime))
    # A slot claimed twice means a bug or a hand-made file: keep the newest claim only.
    newest: dict[int, tuple[int, bytes]] = {}
    for key, (slot, atime) in entries.items():
        if slot in newest and newest[slot][0] >= atime:
            continue
        newest[slot] = (atime, key)
    keep = {k for _, k in newest.values()}
    return {k: v for k, v in entries.items() if k in keep}, mark, touches
