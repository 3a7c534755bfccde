# SPDX-License-Identifier: Apache-2.0
"""A decode step with nothing to save, load or count costs aiokv no bookkeeping (no engine).

The bug: vLLM calls the connector's hooks at every engine step, and at every step aiokv gathered
all its figures for vLLM's stats (every counter, the store's gauges: bytes per tenant, disk
bytes, ...: about 130 µs), built the step's plan from every running request (a Scheduled item
and a tracking call each), and polled its workers through a fresh report: about 0.3-0.4 ms a
step in all, 3 % of a 13 ms decode step on the CPU build (tools/bench_step_hooks.py;
docs/benchmarks.md, "What decode costs").
The invariant: a step where nothing moved hands vLLM no stats and gathers no figure; the first
step after a counter, a gauge's input, or REFRESH_S of time moved hands on exactly the change
(a counter that went down while another went up, a time-bound gauge); a running request whose
next block does not fill this step and that got no new block is not planned; a worker poll
with nothing arrived hands back nothing, with no report to merge.
The fix: aiokv/connector/figures.py (SchedulerFigures: one look at what every figure follows),
Req.due (aiokv/scheduler/plan.py) and the connector's scheduled_items (connector/scheduled.py), Results.quiet
(aiokv/worker/results.py) and the polls of TransferWorker and GroupedWorker.
"""

from __future__ import annotations

import types

from aiokv.connector import figures
from aiokv.connector.adapters import Adapters
from aiokv.connector.figures import SchedulerFigures
from aiokv.connector.scheduled import scheduled_items
from aiokv.connector.scheduler_role import SchedulerRole
from aiokv.scheduler.side import SchedulerSide
from aiokv.scheduler.state import Req
from aiokv.store import Store
from aiokv.worker.results import NOTHING, Results
from tests.conftest import NS, PAYLOAD

BS = 16


def _role(tmp_path):
    st = Store(str(tmp_path / "s"), capacity="1GiB")
    role = object.__new__(SchedulerRole)  # the real methods over a real store, without vLLM's configs
    role.sched = SchedulerSide(st, st.namespace(NS, PAYLOAD, fields={"model": "t"}), BS)
    role.figures, role.offer_hits, role.adapters = SchedulerFigures(1), True, Adapters(1.0)
    gathered = []
    real = SchedulerFigures.scheduler_counters

    def counting(self, sched):
        gathered.append(1)
        return real(self, sched)

    role.figures.scheduler_counters = types.MethodType(counting, role.figures)
    return role, gathered


def test_steps_where_nothing_moved_hand_on_nothing_and_gather_nothing(tmp_path, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(figures.time, "monotonic", lambda: now[0])
    role, gathered = _role(tmp_path)
    try:
        first = role.get_kv_connector_stats()
        assert first is not None and "capacity_bytes" in first.data  # the gauges, once
        assert len(gathered) == 1
        for _ in range(100):  # decode steps: nothing counted, no gauge moved
            assert role.get_kv_connector_stats() is None
        assert len(gathered) == 1, "figures were gathered at steps where nothing moved"

        # a counter moves: the next step hands on exactly that change
        role.sched.counters.hook_errors += 1
        got = role.get_kv_connector_stats().data
        assert got.get("hook_errors") == 1 and "capacity_bytes" not in got, got
        assert role.get_kv_connector_stats() is None

        # one store counter down, another up (a quota eviction is counted so): still seen
        st = role.sched.store.stats
        st.evictions += 1
        assert role.get_kv_connector_stats().data.get("store_evictions") == 1
        st.evictions -= 1
        st.quota_evictions += 1
        got = role.get_kv_connector_stats().data
        assert got.get("store_evictions") == -1 and got.get("store_quota_evictions") == 1, got

        # the workers report counters: handed on at once
        role.figures.add_worker({"bytes_written": 4096})
        got = role.get_kv_connector_stats().data
        assert got.get("bytes_written") == 4096 and "drive_writes_per_day" in got, got

        # nothing counted, but time passes: a gauge that moves with time is looked at again
        n = len(gathered)
        now[0] += figures.REFRESH_S
        role.get_kv_connector_stats()
        assert len(gathered) == n + 1
        assert role.get_kv_connector_stats() is None and len(gathered) == n + 1
    finally:
        role.shutdown()


def _output(new_reqs=(), cached=(), spec=None):
    """A SchedulerOutput as vLLM builds it: cached = [(req_id, computed, new block ids or None, resumed)]."""
    n_sched = {r.req_id: 1 for r in new_reqs}
    n_sched.update({c[0]: 1 for c in cached})
    return types.SimpleNamespace(
        scheduled_new_reqs=list(new_reqs),
        scheduled_cached_reqs=types.SimpleNamespace(
            req_ids=[c[0] for c in cached],
            num_computed_tokens=[c[1] for c in cached],
            new_block_ids=[c[2] for c in cached],
            resumed_req_ids={c[0] for c in cached if c[3]},
        ),
        num_scheduled_tokens=n_sched,
        scheduled_spec_decode_tokens=spec or {},
    )


def test_a_running_request_is_planned_only_when_a_block_fills_or_comes(tmp_path):
    reqs = {r: Req(list(range(100)), b"r", due=64) for r in ("a", "b", "c", "d")}
    reqs["e"] = Req(list(range(100)), b"r")  # never tracked yet: due 0
    out = _output(
        cached=[
            ("a", 40, None, False),  # 41 computed after the step: below 64, nothing to do
            ("b", 63, None, False),  # its block fills this step (64)
            ("c", 40, ([7],), False),  # a new block: its table grows
            ("d", 40, None, True),  # resumed: a new life
            ("e", 40, None, False),
            ("f", 40, None, False),  # unknown to the side: planned (the side decides)
        ]
    )
    items, _, decode_like = scheduled_items(out, reqs)
    assert [s.req_id for s in items] == ["b", "c", "d", "e", "f"]
    assert decode_like
    # a speculative token is not computed before it is accepted: its block does not fill yet
    items, _, decode_like = scheduled_items(_output(cached=[("b", 63, None, False)], spec={"b": [5]}), reqs)
    assert items == [] and decode_like


def test_a_poll_with_nothing_arrived_hands_back_nothing():
    r = Results()
    assert r.quiet
    r.count(bytes_written=1)
    assert not r.quiet
    r.take()
    assert r.quiet
    # what GroupedWorker and WorkerRole get from a quiet TransferWorker: shared empty sets
    assert not NOTHING and isinstance(NOTHING, frozenset)
