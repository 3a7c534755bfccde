# SPDX-License-Identifier: Apache-2.0
"""Test-only: exceptions injected into the scheduler side's store calls during a
fuzz life (tools/fuzz.py --store-faults P), and checks that every block a save
reads or a load writes is the one holding its key's tokens.

Each call of a Store method the scheduler side makes (lookup, serving, reserve, pin,
unpin, commit, abort, drop, drop_at, refresh, flush_if_due, verify_slot, close) raises,
with probability P, before it does anything (the store's contract: a call that
raises changed nothing). The connector and the scheduler side must contain it:
tokens identical to a run without aiokv, nothing pinned, reserved or pending at
the end, no load reported twice (load_report_breaches).

Threading contract: vLLM's EngineCore thread (the fuzz runs vLLM in-process).
"""

from __future__ import annotations

import random

METHODS = (
    "lookup",
    "reserve",
    "pin",
    "unpin",
    "commit",
    "abort",
    "drop",
    "drop_at",
    "served",
    "refresh",
    "flush_if_due",
    "verify_slot",
    "close",
)


class Injected(Exception):
    pass


class FaultyStore:
    """Wraps the scheduler side's Store: its methods raise at random calls."""

    def __init__(self, store, rate: float, seed: int):
        self._store, self._rate, self._rnd = store, rate, random.Random(seed)
        self.calls: dict[str, int] = {}
        self.injected: dict[str, int] = {}

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if name not in METHODS:
            return attr

        def call(*a, **kw):
            self.calls[name] = self.calls.get(name, 0) + 1
            if self._rnd.random() < self._rate:
                self.injected[name] = self.injected.get(name, 0) + 1
                raise Injected(f"injected into Store.{name}")
            return attr(*a, **kw)

        return call


def install(conn, wc, managers, rate: float, seed: int, violations: list[str]) -> FaultyStore:
    """Wrap conn's store; check the worker's saves and loads against vLLM's block tables."""
    side = conn.sched
    faulty = side.store = FaultyStore(side.store, rate, seed)
    w = wc.worker
    orig_save, orig_load = w.save, w.load

    def where(t, key) -> int | None:
        st = side.requests.get(t.req_id)
        return st.keys.index(key) if st is not None and key in st.keys else None

    def check(t, what: str, pairs) -> None:
        if side.groups[t.group].spec.kind == "state":
            return  # a state block's position is vLLM's checkpoint, not a table index
        table = managers[t.group].req_to_blocks.get(t.req_id, ())
        for key, block in pairs:
            i = where(t, key)
            if i is None or i >= len(table) or table[i].block_id != block:
                violations.append(
                    f"{what} of {t.req_id} group {t.group}: block {block} does not hold the "
                    f"tokens of its key (position {i})"
                )

    def save(transfers):
        for t in transfers:
            check(t, "save", zip(t.keys, t.block_ids))
        return orig_save(transfers)

    def load(transfers):
        for t in transfers:
            check(t, "load", [(k, b) for k, s, b in zip(t.keys, t.locations, t.block_ids) if s >= 0])
        return orig_load(transfers)

    w.save, w.load = save, load
    return faulty


def summary(faulty: FaultyStore) -> dict:
    store = faulty._store
    return {
        "calls": dict(faulty.calls),
        "injected": dict(faulty.injected),
        "pending_reservations": sum(len(ns.pending) for ns in store.index.namespaces.values()),
    }
