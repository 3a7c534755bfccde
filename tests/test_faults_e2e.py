# SPDX-License-Identifier: Apache-2.0
"""Fault injection under real vLLM (CPU): I/O that fails, comes back short,
late, or with flipped bytes.

Invariant: the engine keeps serving; tokens equal a run without aiokv; the
failure shows in aiokv's counters (a failed load is never counted as loaded);
nothing leaks: staging buffers, pins, pending saves, in-flight jobs, and vLLM's
free block count all return to baseline.
Fix under test: per-item I/O results, self-verifying blocks, load errors
reported to vLLM (recompute), the loop surviving every job failure.
"""

from __future__ import annotations

import json
import shutil

import pytest

from aiokv.data.faults import ACK
from tests.e2e import happened, prompts, run

pytestmark = pytest.mark.vllm

PS = prompts(4, 230, seed=61)
FULL = 229 // 32


def faults(*rules) -> dict:
    return {"AIOKV_FAULTS": json.dumps(list(rules)), "AIOKV_FAULTS_ACK": ACK}


@pytest.fixture(scope="module")
def stored(tiny_model, tmp_path_factory):
    """A cache holding PS, and the tokens of a run without aiokv."""
    d = tmp_path_factory.mktemp("faults")
    base = run(dict(model=tiny_model, phases=[dict(prompts=PS)]))
    cold = run(dict(model=tiny_model, cache=str(d / "c"), phases=[dict(prompts=PS)]))
    happened(cold, base, saves_committed=f">={4 * FULL}")
    return str(d / "c"), base


@pytest.mark.parametrize(
    "rule,extra",
    [
        ({"op": "read", "kind": "eio", "every": 2}, {}),
        ({"op": "read", "kind": "short", "every": 3}, {}),
        ({"op": "read", "kind": "flip", "every": 2}, {}),
        ({"op": "read", "kind": "late", "delay": 3.0}, {"load_timeout": 1}),
    ],
)
def test_read_faults_become_recomputes(tiny_model, stored, tmp_path, rule, extra):
    cache, base = stored
    mine = str(tmp_path / "c")
    shutil.copytree(cache, mine)
    res = run(dict(model=tiny_model, cache=mine, extra=extra, phases=[dict(prompts=PS)]), env=faults(rule))
    assert "FAULT INJECTION ACTIVE" in res["log"]
    assert res["faults_fired"].get(f"read:{rule['kind']}", 0) > 0, res["faults_fired"]
    happened(res, base, allow_load_errors=True, load_failed_blocks=">0", hit_blocks=4 * FULL)
    c = res["counters"]
    assert c.get("loads_ok_blocks", 0) + c["load_failed_blocks"] == c["hit_blocks"] == 4 * FULL
    if rule["kind"] == "late":
        assert c["load_timeouts"] > 0
    if rule["kind"] in ("flip", "eio", "short"):
        assert c["load_bad_blocks"] > 0  # dropped from the index, never served again
    again = run(dict(model=tiny_model, cache=mine, phases=[dict(prompts=PS)]))  # no faults now
    happened(again, base, hit_requests=">0")


def test_late_reads_within_timeout_still_hit(tiny_model, stored, tmp_path):
    cache, base = stored
    mine = str(tmp_path / "c")
    shutil.copytree(cache, mine)
    res = run(
        dict(model=tiny_model, cache=mine, phases=[dict(prompts=PS)]),
        env=faults({"op": "read", "kind": "late", "delay": 0.3}),
    )
    assert res["faults_fired"].get("read:late", 0) > 0, "the reads were made late"
    happened(res, base, loads_ok_blocks=4 * FULL)


@pytest.mark.parametrize(
    "rule",
    [
        {"op": "write", "kind": "eio", "every": 2},
        {"op": "write", "kind": "enospc", "every": 3},
        {"op": "write", "kind": "short", "every": 2},
        {"op": "write", "kind": "late", "delay": 5.0},  # far longer than the 8 steps a request lives
    ],
)
def test_write_faults_drop_only_those_saves(tiny_model, stored, tmp_path, rule):
    _, base = stored
    cache = str(tmp_path / "c")
    res = run(dict(model=tiny_model, cache=cache, phases=[dict(prompts=PS)]), env=faults(rule))
    assert res["faults_fired"].get(f"write:{rule['kind']}", 0) > 0, res["faults_fired"]
    c = res["counters"]
    if rule["kind"] == "late":
        happened(res, base, saves_committed=f">={4 * FULL}")
        assert res["pending_saves_at_finish"] > 0, "requests finish while their saves are still being written"
    else:
        happened(res, base, allow_save_errors=True, save_failed_blocks=">0")
        assert c["save_failures"] == c["save_failed_blocks"]
        assert c["saves_committed"] == c["saves_planned"] - c["save_failures"]
    warm = run(dict(model=tiny_model, cache=cache, phases=[dict(prompts=PS)]))
    happened(warm, base, hit_requests=">0")  # and no load failed: a failed save never becomes a hit


def test_flipped_bytes_on_disk_are_never_served(tiny_model, stored, tmp_path):
    _, base = stored
    cache = str(tmp_path / "c")
    cold = run(
        dict(model=tiny_model, cache=cache, phases=[dict(prompts=PS)]),
        env=faults({"op": "write", "kind": "flip", "every": 2}),
    )
    assert cold["faults_fired"].get("write:flip", 0) > 0
    happened(cold, base, saves_committed=">0")  # the flip is silent when written
    warm = run(dict(model=tiny_model, cache=cache, phases=[dict(prompts=PS)]))
    happened(warm, base, allow_load_errors=True, load_bad_blocks=">0", load_failed_blocks=">0")
