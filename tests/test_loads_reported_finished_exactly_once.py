# SPDX-License-Identifier: Apache-2.0
"""Every load is reported finished exactly once per rank (worker level, real
TransferWorkers on a CPU device, and the scheduler side on a real store; no vLLM).

The bug: when preparing a load raised in a later KV-cache group, `on_alloc` had
already queued the earlier groups' loads and `fail_load` queued a second load of
the same request. The worker kept one entry per request, so the first read could
no longer be cancelled, and both loads were reported finished: vLLM's scheduler
asserts on the second report (the engine dies), and the first read copied into
blocks vLLM had already given to another request.
Invariants: the scheduler side hands the workers at most one load per request
and group, and nothing of a load that could not be prepared (no pin, no
reservation); the worker refuses a second load of a request in a group while one
is in flight and a finished report of a load it does not hold, logs and counts
each (GroupedWorker.breaches, `load_report_breaches`), and never hands vLLM a
second report. The assertion never raises: in production a breach costs a log
line, not the engine; the tests require the count to be 0 (tests/e2e.py).
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from aiokv.data.faults import ACK
from aiokv.jobs import Transfer
from aiokv.scheduler.keys import extend_keys, request_root
from aiokv.scheduler.layout import FULL, WINDOW, GroupSpec
from aiokv.scheduler.side import SchedulerSide
from aiokv.store import Store
from aiokv.worker.groups import GroupedWorker
from tests.conftest import key
from tests.workers import cpu_worker, run_jobs


@pytest.fixture
def grouped(tmp_path, monkeypatch):
    # every disk read completes 0.3 s late: a load that reads is still in flight while others finish
    monkeypatch.setenv("AIOKV_FAULTS", json.dumps([{"op": "read", "kind": "late", "delay": 0.3}]))
    monkeypatch.setenv("AIOKV_FAULTS_ACK", ACK)
    workers = {g: cpu_worker(str(tmp_path / f"g{g}"), {f"l{g}": torch.zeros(20, 2, 16, 8)}, 4) for g in (0, 1)}
    yield GroupedWorker(workers, {0, 1})
    for w in workers.values():
        w.close()


def _poll_until_idle(gw: GroupedWorker, at_least: float = 1.0, timeout: float = 10.0) -> list[str]:
    """Every finished report over polls for `at_least` seconds (more than a late read
    takes: a load the worker lost track of still reports) and until no job is in flight."""
    out: list[str] = []
    start = time.monotonic()
    while time.monotonic() < start + timeout:
        busy = gw.in_flight
        finished, _, _, _ = gw.poll()
        out += sorted(finished)
        if not busy and time.monotonic() > start + at_least:
            break
        time.sleep(0.005)
    return out


def test_a_second_load_of_a_request_is_refused_and_reported_once(grouped):
    # a load that reads (slot 0: late), then, in the same step, the failed load fail_load
    # used to add for the same request (slot -1: nothing to read, it fails at once)
    _, _, rep = run_jobs(grouped.workers[0], grouped.workers[0].save, [Transfer("s", [key(0)], [0], [1], 0)])
    assert len(rep.written()) == 1
    grouped.load([Transfer("r", [key(0)], [0], [3], 0), Transfer("r", [key(1)], [-1], [4], 1)])
    grouped.load([Transfer("r", [], [], [3], 0)])
    assert _poll_until_idle(grouped) == ["r"]
    assert grouped.breaches == 1
    grouped.load([Transfer("r", [key(0)], [-1], [5], 0)])  # a new load once the first was reported
    assert _poll_until_idle(grouped) == ["r"]
    assert grouped.breaches == 1


def test_a_report_of_a_load_not_in_flight_is_refused(grouped):
    grouped.workers[1].load([Transfer("x", [key(0)], [-1], [3], 1)])  # behind the grouped worker's back
    assert _poll_until_idle(grouped) == []
    assert grouped.breaches == 1


class _Refuses:
    """A real Store whose pin raises for one namespace (as a journal write may)."""

    def __init__(self, store: Store, bad_ns):
        self._store, self._bad = store, bad_ns

    def __getattr__(self, name):
        return getattr(self._store, name)

    def pin(self, ns, keys):
        if ns is self._bad:
            raise OSError(5, "injected")
        return self._store.pin(ns, keys)


def test_a_load_that_cannot_be_prepared_leaves_one_failed_load_and_no_pin(tmp_path):
    bs = 4
    store = Store(str(tmp_path / "c"), capacity="1GiB")
    spaces = [store.namespace(bytes([9, i]) * 8, 4096) for i in range(2)]
    side = SchedulerSide(
        store,
        [(GroupSpec(0, FULL, 4096, ("a",)), spaces[0]), (GroupSpec(1, WINDOW, 4096, ("b",), window=8), spaces[1])],
        bs,
    )
    root = request_root(spaces[0].nsid, [])
    tokens = list(range(3, 3 + 6 * bs + 1))
    keys = extend_keys([], root, tokens, bs, 6)
    for ns in spaces:
        store.commit(ns, [(k, store.reserve(ns, k)) for k in keys])
    assert side.match("r", tokens, root, 0) == 6 * bs
    side.store = _Refuses(store, spaces[1])
    ids = (list(range(1, 7)), [0, 0, 0, 0, 11, 12])
    try:  # as the connector does (update_state_after_alloc)
        side.on_alloc("r", tokens, root, ids, 6 * bs)
        raise AssertionError("on_alloc did not raise")
    except OSError:
        side.fail_load("r", ids, 6 * bs)
    assert not store.index.pins  # group 0's pins were given back
    plan = side.plan([])
    assert [(t.req_id, t.group) for t in plan.loads] == [("r", 0)]  # one load, failed: nothing to read
    assert not plan.loads[0].keys and not plan.loads[0].locations and plan.loads[0].block_ids == list(range(1, 7))
    side.on_report(None, {"r"})
    assert not store.index.pins and side.pending_saves == 0
    assert side.counters.load_blocks == 6 and side.counters.hit_requests == 0
    side.close()
