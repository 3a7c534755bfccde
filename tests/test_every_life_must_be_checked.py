# SPDX-License-Identifier: Apache-2.0
"""The suite's own guard: an end-to-end test that starts a life with aiokv and never
passes it to tests.e2e.happened() fails, so no new test can forget to show what
happened (tokens against a run without aiokv, aiokv's counters).

Shown on an inner pytest run of this repository's conftest, with a recorded life
standing for one that tests.e2e.run returned (no engine is needed to show the guard).
"""

from __future__ import annotations

import os

from tests.e2e import ROOT

pytest_plugins = ["pytester"]

INNER = """
from tests import e2e

LIFE = {"tokens": [[[1, 2]]], "finish": [["length"]], "counters": {
    "pending_saves": 0, "pinned": 0, "worker_in_flight": 0, "staging_in_use": 0, "hit_blocks": 3},
    "free_blocks": 9, "total_blocks": 10, "requests_left": 0}


def test_forgets_its_life():
    e2e.UNCHECKED.append(dict(LIFE))


def test_checks_its_life():
    life = dict(LIFE)
    e2e.UNCHECKED.append(life)
    e2e.happened(life, {"tokens": [[[1, 2]]]}, hit_blocks=3)


def test_claims_what_did_not_happen():
    life = dict(LIFE)
    e2e.UNCHECKED.append(life)
    e2e.happened(life, {"tokens": [[[1, 2]]]}, hit_blocks=">3")
"""


def test_a_life_never_checked_fails_its_test(pytester):
    pytester.makeconftest(open(os.path.join(ROOT, "tests", "conftest.py")).read())
    pytester.makepyfile(test_inner=INNER)
    pytester.syspathinsert(ROOT)
    res = pytester.runpytest_inprocess(
        "-p", "no:cacheprovider", "-o", "addopts=", "-o", "asyncio_default_fixture_loop_scope=function"
    )
    res.assert_outcomes(passed=2, failed=1, errors=1)
    out = res.stdout.str()
    assert "ERROR at teardown of test_forgets_its_life" in out
    assert "1 engine life with aiokv never passed to tests.e2e.happened()" in out
    assert "hit_blocks = 3, expected >3" in out
