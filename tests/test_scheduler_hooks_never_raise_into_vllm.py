# SPDX-License-Identifier: Apache-2.0
"""No exception of aiokv's own scheduler-side work reaches vLLM, and every promised load
is still reported exactly once.

The bug (issue 37, item 1): `admit: reused` with an `admit_window` above 429,496,729 (the
config allowed up to 2^30) made the admission sketch compute `raw % np.uint32(m)` with
m = window x 10 bits > 2^32: OverflowError. In `match` it was logged as a failed lookup
on every request (no hit, ever); in SchedulerSide.plan() nothing caught it, and
build_connector_meta let it reach vLLM's schedule(): EngineCore died, and the loads
plan() had already taken off its queues were lost. Other scheduler-side hooks had
unguarded work too (update_state_after_alloc's bucket bookkeeping, the report's
counters, has_pending_push_work, get_kv_connector_stats, the hit sources).

The invariants, on vLLM's real Scheduler with the real connector (both roles, real
store, real io_uring, a CPU device; the model runner is
tests/test_gpu_call_order_keeps_blocks_and_completions.py's, which checks that the KV
every forward reads is exactly its tokens'): with an exception injected into the work
of each hook vLLM calls on the scheduler side (every other call), the engine runs every
request to its end; every load vLLM waits for is reported finished exactly once; a step
whose planning raised drops its saves and turns its loads into recomputes (reported
failed: vLLM recomputes them); each failure is counted (`hook_errors`, the series
vllm:aiokv_scheduler_errors) and nothing is left pinned, pending or held. And the
sketch works at every window the config accepts: at 2^30 on real vLLM, two lives hit.

The fix: aiokv/scheduler/admission.py derives its bit positions in 64 bits (double
hashing from two 8-byte slices of the key); SchedulerRole guards every hook vLLM calls
(_error: counted, the first of each hook logged with its traceback); SchedulerSide.plan
contains its own failures (step_failed: saves given back, loads replaced by failed
loads under the same job ids), fail_step does the same when the hook failed before
plan(), lost_report gives back what an unprocessed report held.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from aiokv.scheduler.admission import Admission, Sketch
from aiokv.scheduler.state import Req
from tests.e2e import happened, prompts, run

pytest.importorskip("vllm")


class Injected(Exception):
    pass


class Raising:
    """Wraps a callable: every `every`-th call (of those for which `when()` holds) raises
    before doing anything (while `on`)."""

    def __init__(self, fn, every: int = 2, when=None):
        self.fn, self.every, self.when = fn, every, when
        self.calls, self.raised, self.on = 0, 0, True

    def __call__(self, *a, **k):
        if self.on and (self.when is None or self.when()):
            self.calls += 1
            if self.calls % self.every == 0:
                self.raised += 1
                raise Injected(f"injected into {getattr(self.fn, '__name__', self.fn)}")
        return self.fn(*a, **k)


def _wrap(monkeypatch, obj, name: str, every: int = 2, when=None) -> Raising:
    r = Raising(getattr(obj, name), every, when)
    monkeypatch.setattr(obj, name, r)
    return r


class _RaisingPops(dict):
    """A dict whose pop raises at every other call (the hit sources' bookkeeping)."""

    def __init__(self, r: Raising):
        super().__init__()
        self.r = r

    def pop(self, *a):
        return self.r(lambda: dict.pop(self, *a))


def _lambda_call(f):
    return f()


# the hook -> what raises in its work (LOADS_FAIL: the cases whose loads must become recomputes)
CASES = {
    "get_num_new_matched_tokens": "lookup",
    "update_state_after_alloc/bookkeeping": "bucket_hit_tokens",
    "update_state_after_alloc/pin": "store.pin",
    "build_connector_meta/plan": "SchedulerSide.plan",
    "build_connector_meta/breaker": "Breaker.allow_saves",
    "build_connector_meta/reserve": "plan.reserve",
    "update_connector_output": "SchedulerSide.on_report",
    "request_finished": "SchedulerSide.finished",
    "has_pending_push_work": "Ledger.pending",
    "get_kv_connector_stats": "the scheduler's counters",
    "get_external_cache_hit_sources": "the hit sources' bookkeeping",
}
LOADS_FAIL = {"update_state_after_alloc/pin", "build_connector_meta/plan", "build_connector_meta/breaker"}


def _inject(case: str, conn, monkeypatch) -> list[Raising]:
    from aiokv.scheduler import commits
    from aiokv.scheduler import plan as planning

    role, side = conn.scheduler_role, conn.sched
    if case == "get_num_new_matched_tokens":
        return [_wrap(monkeypatch, side, "match")]
    if case == "update_state_after_alloc/bookkeeping":
        return [_wrap(monkeypatch, side, "bucket_hit_tokens")]
    if case == "update_state_after_alloc/pin":
        return [_wrap(monkeypatch, side.store, "pin")]
    # (the step's failure is injected at every other step that carries loads: they must fail)
    if case == "build_connector_meta/plan":
        return [_wrap(monkeypatch, side, "plan", when=lambda: bool(side._new_loads))]
    if case == "build_connector_meta/breaker":  # inside plan(), after it took the step's loads
        real_plan, loads = side.plan, [0]

        def counting(*a, **k):
            loads[0] = len(side._new_loads)
            return real_plan(*a, **k)

        monkeypatch.setattr(side, "plan", counting)
        return [_wrap(monkeypatch, side.breaker, "allow_saves", when=lambda: loads[0] > 0)]
    if case == "build_connector_meta/reserve":  # a step's saves, reserved request by request
        return [_wrap(monkeypatch, planning, "reserve")]
    if case == "update_connector_output":
        return [_wrap(monkeypatch, side, "on_report")]
    if case == "request_finished":
        return [_wrap(monkeypatch, side, "finished")]
    if case == "has_pending_push_work":
        r = Raising(commits.Ledger.pending.fget)
        monkeypatch.setattr(commits.Ledger, "pending", property(lambda self: r(self)))
        return [r]
    if case == "get_kv_connector_stats":
        return [_wrap(monkeypatch, role, "_scheduler_counters")]
    if case == "get_external_cache_hit_sources":
        r = Raising(_lambda_call)
        monkeypatch.setattr(role, "_bucket_tokens", _RaisingPops(r))
        return [r]
    raise AssertionError(case)


def _engine(tiny_model, path: str, extra: dict | None = None):
    """vLLM's Scheduler with aiokv's scheduler role, aiokv's worker role on CPU KV tensors,
    and the model runner of the GPU call-order test (it checks every KV a forward reads)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from aiokv.connector.connector import AioKVConnector
    from tests.test_gpu_call_order_keeps_blocks_and_completions import BS, Engine, Runner, _config, _kv_caches

    vc, kcc = _config(tiny_model, path, False, False)
    vc.kv_transfer_config.kv_connector_extra_config.update(extra or {})
    sched = Scheduler(
        vllm_config=vc,
        kv_cache_config=kcc,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=BS,
        log_stats=True,
    )
    conn_w = AioKVConnector(vc, KVConnectorRole.WORKER, kcc)
    kv = _kv_caches(False)
    conn_w.register_kv_caches(kv)
    prompts_by_id: dict[str, list[int]] = {}
    runner = Runner(vc, conn_w, kv, False, prompts_by_id)
    runner.instrument()
    return sched, conn_w, runner, Engine(sched, runner, False), prompts_by_id


def _lives(tiny_model, path: str, monkeypatch, case: str | None, extra: dict | None = None):
    """A cold life (its prompts saved), vLLM's own prefix cache reset, then a warm life of
    the same prompts twice over (hits, loads, preemption) with `case`'s fault injected.
    Returns (scheduler-role counters, worker-role counters, runner, engine, injectors)."""
    from aiokv.util import counters as table
    from tests.test_gpu_call_order_keeps_blocks_and_completions import NB, _add, _prompts

    sched, conn_w, runner, engine, by_id = _engine(tiny_model, path, extra)
    conn_s = sched.connector
    raising: list[Raising] = []
    try:
        for i, p in enumerate(_prompts(1)):
            by_id[f"cold{i}"] = p
            _add(sched, f"cold{i}", p, 24)
        engine.run()
        assert conn_s.sched.pending_saves == 0
        assert sched.reset_prefix_cache()
        if case is not None:
            raising = _inject(case, conn_s, monkeypatch)
        for i, p in enumerate(_prompts(1) * 2):
            by_id[f"warm{i}"] = p
            _add(sched, f"warm{i}", p, 30)
        engine.run()  # raises if anything reached vLLM, or if a request never finished
        for r in raising:
            r.on = False
        assert conn_s.sched.pending_saves == 0
    finally:
        for r in raising:
            r.on = False
        s, w = conn_s.counters(), conn_w.counters()
        conn_w.shutdown()
        conn_s.shutdown()
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == NB - 1
    assert not sched.requests
    assert "hook_errors" in table.ROWS
    return s, w, runner, engine, raising


@pytest.mark.parametrize("case", list(CASES))
def test_an_exception_in_a_hooks_own_work_never_reaches_vllm(case, tiny_model, tmp_path, monkeypatch):
    s, w, runner, engine, raising = _lives(tiny_model, str(tmp_path / "cache"), monkeypatch, case)
    raised = sum(r.raised for r in raising)
    assert raised > 0, f"{CASES[case]} was never called in the warm life"
    # every injected failure counted once, never reached vLLM (the engine ran every request out)
    assert s["hook_errors"] == raised, (s["hook_errors"], raised)
    # every load vLLM waited for reported finished exactly once; every planned save reported once
    assert engine.finished_recving == engine.promised, (engine.promised, engine.finished_recving)
    assert sum(engine.promised.values()) > 0, "no load was promised"
    assert engine.saves_reported == engine.saves_planned
    assert w["load_report_breaches"] == 0 and s["reports_ignored"] == 0, (w, s)
    # what every forward read was its tokens' KV: a failed load was recomputed, never half-used
    assert runner.bad_reads == [], runner.bad_reads[:5]
    assert runner.violations == [], runner.violations[:5]
    if case in LOADS_FAIL:  # loads taken for a step whose work failed: recomputed
        assert s["load_failed_blocks"] > 0, {k: v for k, v in s.items() if "load" in k}
    assert s["loads_ok_blocks"] + s["load_failed_blocks"] + s.get("load_cancelled_blocks", 0) == s["load_blocks"], s
    # nothing left behind
    assert s["pinned"] == 0 and s["pending_saves"] == 0, s
    assert w["staging_in_use"] == 0 and w["worker_in_flight"] == 0, w


def test_admit_reused_at_the_largest_window_plans_and_hits(tiny_model, tmp_path, monkeypatch):
    """`admit: reused` at admit_window 2^30 (the config's bound) on vLLM's scheduler: no
    failed lookup, no failed step, the blocks met twice are written and hit."""
    s, _, runner, engine, _ = _lives(
        tiny_model, str(tmp_path / "cache"), monkeypatch, None, {"admit": "reused", "admit_window": 1 << 30}
    )
    assert s["hook_errors"] == 0
    assert s["saves_not_admitted"] > 0 and s["saves_committed"] > 0, s
    assert s["hit_blocks"] > 0 and s["load_failed_blocks"] == 0, s
    assert runner.bad_reads == [] and engine.finished_recving == engine.promised


def test_the_sketch_works_at_every_accepted_window():
    for window in (1, 7, 429_496_730, 1 << 30):  # (m = 10 x window bits crosses 2^32 at 429,496,730)
        sk = Sketch(window)
        keys = [os.urandom(32) for _ in range(min(window, 3000))]
        sk.add(keys)
        assert sk.contains(keys).all(), f"a false negative within the window ({window})"
        if window >= 1000:
            assert sk.contains([os.urandom(32) for _ in range(20000)]).mean() < 0.03, window
    # the largest window's positions spread over all of its bits, not only the first 2^32
    sk = Sketch(1 << 30)
    bits = sk._bits([os.urandom(32) for _ in range(4000)])
    assert bits.dtype == np.uint64 and int(bits.max()) < sk.m
    assert int(bits.max()) > 1 << 33, "positions confined below 2^33: part of the filter never used"
    adm = Admission("reused", window=1 << 30)
    keys = [os.urandom(32) for _ in range(6)]
    a, b = Req([], b"a", keys=list(keys)), Req([], b"b", keys=list(keys))
    adm.looked_up(a, 6)
    assert adm.admitted(a, keys) == [False] * 6
    adm.looked_up(b, 6)
    assert adm.admitted(b, keys) == [True] * 6


SYSTEM = prompts(1, 128, seed=80)[0]  # 4 blocks every request shares
SHARED = [SYSTEM + q[1:] for q in prompts(4, 65, seed=81)]  # + 2 blocks of its own each


@pytest.mark.vllm
def test_admit_reused_at_the_largest_window_serves_two_lives(tiny_model, tmp_path):
    """The user's path that killed EngineCore in both lives: admit reused, admit_window 2^30."""
    cache = str(tmp_path / "c")
    spec = dict(
        model=tiny_model,
        extra={"admit": "reused", "admit_window": 1 << 30},
        phases=[dict(prompts=SHARED, max_tokens=8)],
    )
    base = run(spec)
    cold = run(dict(spec, cache=cache))
    happened(cold, base, saves_committed=4, saves_not_admitted=4 * 2 + 4, hit_blocks=0, hook_errors=0)
    warm = run(dict(spec, cache=cache))
    happened(warm, base, hit_blocks=">=4", saves_committed=0, hook_errors=0)
