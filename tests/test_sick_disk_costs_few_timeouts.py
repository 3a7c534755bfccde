# SPDX-License-Identifier: Apache-2.0
"""Bug: on a slow or failing disk every request that hit waited `load_timeout`
(or failed its reads) and then recomputed: a sick drive cost every request.

Invariant: after `breaker_failures` load timeouts or I/O errors in a row the
scheduler side offers no hits and plans no saves for `breaker_cooldown`
seconds, says so once and counts it; then one load at a time probes the disk:
a success closes the breaker, a failure opens it again. Blocks that fail
verification are not disk failures. `breaker_failures=0` turns it off.

Fix: aiokv/util/breaker.py, fed by the workers' reports in SchedulerSide.on_report.
"""

from __future__ import annotations

import logging

from aiokv.jobs import WorkerReport
from aiokv.scheduler.keys import extend_keys, request_root
from aiokv.scheduler.side import Scheduled, SchedulerSide
from aiokv.store import Store
from aiokv.util.breaker import Breaker
from tests.conftest import NS

BS = 4


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _side(tmp_path, clock, failures=3):
    st = Store(tmp_path / "s")
    ns = st.namespace(NS, 4096)
    side = SchedulerSide(st, ns, BS, Breaker(failures, 30.0, clock))
    tokens = list(range(1, 4 * BS + 2))
    root = request_root(NS, [])
    keys = extend_keys([], root, tokens, BS, 4)
    st.commit(ns, [(k, st.reserve(ns, k)) for k in keys])
    return side, tokens, root


def _hits(side, tokens, root, req) -> int:
    return side.match(req, tokens, root, 0)


def test_breaker_opens_after_failures_and_probes_after_cooldown(tmp_path, caplog):
    clock = Clock()
    side, tokens, root = _side(tmp_path, clock)
    assert _hits(side, tokens, root, "a") == 4 * BS
    fresh = list(range(100, 100 + 4 * BS + 1))  # a request with nothing stored: it would save
    assert side.match("s", fresh, root, 0) == 0
    with caplog.at_level(logging.WARNING, logger="aiokv"):
        side.on_report(WorkerReport(counters={"load_timeouts": 2}), None)
        assert _hits(side, tokens, root, "b") == 4 * BS, "two failures are not a sick disk yet"
        side.on_report(WorkerReport(counters={"read_errors": 1}), None)
        assert _hits(side, tokens, root, "c") == 0, "three in a row open it: no hits"
        side.on_report(WorkerReport(counters={"load_timeouts": 5}), None)
    assert side.counters.breaker_opens == 1
    assert sum("cache disk is failing" in r.message for r in caplog.records) == 1, "said once"
    # no saves while open, counted
    plan = side.plan([Scheduled("s", 0, 4 * BS + 1, ([1, 2, 3, 4, 5],), True)])
    assert plan.saves == [] and side.counters.saves_skipped_breaker == 4
    clock.t += 29
    assert _hits(side, tokens, root, "d") == 0
    clock.t += 2  # cool-down over: half-open, one probe at a time
    assert _hits(side, tokens, root, "d") == 4 * BS
    side.on_alloc("d", tokens, root, ([1, 2, 3, 4],), 4 * BS)
    assert _hits(side, tokens, root, "e") == 0, "only one probe in flight"
    side.on_report(WorkerReport(counters={"load_timeouts": 1}), {"d"})
    assert _hits(side, tokens, root, "e") == 0, "a failed probe opens it again"
    assert side.counters.breaker_opens == 2
    clock.t += 31
    assert _hits(side, tokens, root, "e") == 4 * BS
    side.on_alloc("e", tokens, root, ([1, 2, 3, 4],), 4 * BS)
    with caplog.at_level(logging.WARNING, logger="aiokv"):
        side.on_report(WorkerReport(counters={"loads_ok_blocks": 4}), {"e"})
    assert any("answers again" in r.message for r in caplog.records)
    assert _hits(side, tokens, root, "f") == 4 * BS and _hits(side, tokens, root, "g") == 4 * BS, "closed"
    side.close()


def test_successes_and_quiet_time_reset_the_count(tmp_path):
    clock = Clock()
    side, tokens, root = _side(tmp_path, clock)
    for _ in range(5):  # failures between successful loads: a flaky disk, not a dead one
        side.on_report(WorkerReport(counters={"read_errors": 2}), None)
        side.on_report(WorkerReport(counters={"loads_ok_blocks": 3}), None)
    assert _hits(side, tokens, root, "a") == 4 * BS
    for _ in range(5):  # failures far apart
        side.on_report(WorkerReport(counters={"write_errors": 2}), None)
        clock.t += 31
    assert _hits(side, tokens, root, "b") == 4 * BS and side.counters.breaker_opens == 0
    # verification failures (the data's fault) and cancelled loads never count
    side.on_report(WorkerReport(counters={"load_bad_blocks": 50, "load_cancelled_blocks": 50}), None)
    assert _hits(side, tokens, root, "c") == 4 * BS
    side.close()


def test_zero_turns_it_off(tmp_path):
    side, tokens, root = _side(tmp_path, Clock(), failures=0)
    for _ in range(10):
        side.on_report(WorkerReport(counters={"load_timeouts": 10}), None)
    assert _hits(side, tokens, root, "a") == 4 * BS and side.counters.breaker_opens == 0
    side.close()


def test_settings_are_checked():
    from aiokv.config import AioKVConfig, ConfigError

    cfg = AioKVConfig.from_extra({"path": "/tmp/x", "breaker_failures": 0, "breaker_cooldown": 5, "save_timeout": 2})
    assert (cfg.breaker_failures, cfg.breaker_cooldown, cfg.save_timeout) == (0, 5.0, 2.0)
    for bad in ({"breaker_failures": -1}, {"breaker_cooldown": 0}, {"save_timeout": "soon"}):
        try:
            AioKVConfig.from_extra(dict(bad, path="/tmp/x"))
        except ConfigError as e:
            assert next(iter(bad)) in str(e)
        else:
            raise AssertionError(f"{bad} accepted")
