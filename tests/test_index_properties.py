# SPDX-License-Identifier: Apache-2.0
"""Property tests of the slot allocator and the store's index.

Invariants, under any sequence of reserve/commit/abort/pin/drop/reopen:
- no slot is held by two keys (committed or pending);
- physical bytes (slots with disk space) never exceed the capacity;
- a lookup sees exactly the committed keys; a pinned key is never evicted;
- reopening restores exactly the committed keys and their slots.
"""

from __future__ import annotations

import shutil
import tempfile

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from aiokv.data import format as fmt
from aiokv.store import Store
from aiokv.store.allocator import SlotAllocator

PAYLOAD = 4096
SLOT = fmt.slot_bytes(PAYLOAD)


@given(st.lists(st.tuples(st.sampled_from(["take", "grow", "release", "punch"]), st.integers(1, 5)), max_size=80))
def test_allocator_partitions_slots(ops):
    a = SlotAllocator()
    held: list[int] = []
    for op, n in ops:
        if op == "take":
            s = a.take()
            if s is not None:
                held.append(s)
        elif op == "grow":
            a.grow(a.plan_grow(n))
        elif op == "release" and held:
            a.release(held.pop(0))
        elif op == "punch" and held:
            a.punch(held.pop())
        free, holes = set(a.free), set(a.holes)
        assert len(free) == len(a.free) and len(holes) == len(a.holes)
        assert not (free & holes) and not (free & set(held)) and not (holes & set(held))
        assert free | holes | set(held) == set(range(a.hwm))
        assert a.in_use == len(held) and a.backed == len(held) + len(free)


keys = st.integers(0, 30).map(lambda i: i.to_bytes(16, "little"))


class StoreMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp()
        self.cap = 12 * SLOT
        self.store = Store(self.dir, capacity=self.cap)
        self.ns = self.store.namespace(b"n" * 16, PAYLOAD)
        self.pending: dict[bytes, int] = {}
        self.pinned: list[bytes] = []

    @rule(k=keys)
    def reserve(self, k):
        slot = self.store.reserve(self.ns, k)
        if slot is not None:
            assert not self.ns.has(k)
            self.pending[k] = slot

    @rule(data=st.data())
    def commit(self, data):
        if self.pending:
            k = data.draw(st.sampled_from(sorted(self.pending)))
            self.store.commit(self.ns, [(k, self.pending.pop(k))])
            assert self.store.lookup(self.ns, [k]) == 1

    @rule(data=st.data())
    def abort(self, data):
        if self.pending:
            k = data.draw(st.sampled_from(sorted(self.pending)))
            self.store.abort(self.ns, [(k, self.pending.pop(k))])
            assert self.store.lookup(self.ns, [k]) == 0

    @rule(k=keys)
    def pin(self, k):
        if self.store.pin(self.ns, [k])[0] is not None:
            self.pinned.append(k)
        else:
            self.store.unpin(self.ns, [k])

    @rule()
    def unpin(self):
        if self.pinned:
            self.store.unpin(self.ns, [self.pinned.pop(0)])

    @rule(k=keys)
    def drop(self, k):
        if k not in self.pinned:
            self.store.drop(self.ns, [k])
            assert self.store.lookup(self.ns, [k]) == 0

    @rule()
    def reopen(self):
        for k, s in self.pending.items():
            self.store.abort(self.ns, [(k, s)])
        self.pending.clear()
        for k in self.pinned:
            self.store.unpin(self.ns, [k])
        self.pinned.clear()
        before = {k: self.ns.where(k) for k in self.ns.keys()}
        self.store.close()
        self.store = Store(self.dir, capacity=self.cap)
        self.ns = self.store.namespace(b"n" * 16, PAYLOAD)
        assert {k: self.ns.where(k) for k in self.ns.keys()} == before

    @invariant()
    def slots_unique_and_bounded(self):
        used = [self.ns.where(k) for k in self.ns.keys()] + list(self.ns.pending.values())
        assert len(used) == len(set(used))
        assert self.ns.pending == self.pending
        assert self.store.index.physical_bytes <= self.cap
        for k in self.pinned:
            assert self.ns.has(k), "a pinned key was evicted"

    def teardown(self):
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


StoreMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
test_store_index = StoreMachine.TestCase
