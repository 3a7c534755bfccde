"""Fault injection under real vLLM (CPU): I/O that fails, comes back short,
late, or with flipped bytes.

Invariant: the engine keeps serving; tokens equal a run without aiokv; the
failure shows in aiokv's counters (a failed load is never counted as loaded);
nothing leaks: staging slots, pins, pending saves, in-flight jobs, and vLLM's
free block count all return to baseline.
Fix under test: per-item I/O results, self-verifying blocks, load errors
reported to vLLM (recompute), the loop surviving every job failure.
"""
from __future__ import annotations

import json
import shutil

import pytest

from aiokv.io.faults import ACK
from tests.e2e import assert_clean, prompts, run

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
    assert cold["tokens"] == base["tokens"]
    return str(d / "c"), base["tokens"]


@pytest.mark.parametrize("rule,extra", [
    ({"op": "read", "kind": "eio", "every": 2}, {}),
    ({"op": "read", "kind": "short", "every": 3}, {}),
    ({"op": "read", "kind": "flip", "every": 2}, {}),
    ({"op": "read", "kind": "late", "delay": 3.0}, {"load_timeout": 1}),
])
def test_read_faults_become_recomputes(tiny_model, stored, tmp_path, rule, extra):
    cache, tokens = stored
    mine = str(tmp_path / "c")
    shutil.copytree(cache, mine)
    res = run(dict(model=tiny_model, cache=mine, extra=extra, phases=[dict(prompts=PS)]), env=faults(rule))
    assert "FAULT INJECTION ACTIVE" in res["log"]
    assert res["tokens"] == tokens
    c = res["counters"]
    assert c["load_failed_blocks"] > 0, c
    assert c["loads_ok_blocks"] + c["load_failed_blocks"] == c["hit_blocks"] == 4 * FULL
    if rule["kind"] == "late":
        assert c["load_timeouts"] > 0
    if rule["kind"] in ("flip", "eio", "short"):
        assert c["load_bad_blocks"] > 0  # dropped from the index, never served again
    assert_clean(res, allow_load_errors=True)
    again = run(dict(model=tiny_model, cache=mine, phases=[dict(prompts=PS)]))  # no faults now
    assert again["tokens"] == tokens
    assert again["counters"]["load_failed_blocks"] == 0
    assert_clean(again)


def test_late_reads_within_timeout_still_hit(tiny_model, stored, tmp_path):
    cache, tokens = stored
    mine = str(tmp_path / "c")
    shutil.copytree(cache, mine)
    res = run(dict(model=tiny_model, cache=mine, phases=[dict(prompts=PS)]),
              env=faults({"op": "read", "kind": "late", "delay": 0.3}))
    assert res["tokens"] == tokens
    assert res["counters"]["loads_ok_blocks"] == 4 * FULL
    assert_clean(res)


@pytest.mark.parametrize("rule", [
    {"op": "write", "kind": "eio", "every": 2},
    {"op": "write", "kind": "enospc", "every": 3},
    {"op": "write", "kind": "short", "every": 2},
    {"op": "write", "kind": "late", "delay": 0.5},
])
def test_write_faults_drop_only_those_saves(tiny_model, stored, tmp_path, rule):
    _, tokens = stored
    cache = str(tmp_path / "c")
    res = run(dict(model=tiny_model, cache=cache, phases=[dict(prompts=PS)]), env=faults(rule))
    assert res["tokens"] == tokens
    c = res["counters"]
    if rule["kind"] == "late":
        assert c["save_failed_blocks"] == 0 and c["saves_committed"] >= 4 * FULL
    else:
        assert c["save_failed_blocks"] > 0 and c["save_failures"] == c["save_failed_blocks"]
        assert c["saves_committed"] == c["saves_planned"] - c["save_failures"]
    assert c["pending_saves"] == 0 and c["worker_in_flight"] == 0 and c["staging_in_use"] == 0
    warm = run(dict(model=tiny_model, cache=cache, phases=[dict(prompts=PS)]))
    assert warm["tokens"] == tokens
    assert warm["counters"]["load_failed_blocks"] == 0, "a failed save must never become a hit"
    assert_clean(warm)


def test_flipped_bytes_on_disk_are_never_served(tiny_model, stored, tmp_path):
    _, tokens = stored
    cache = str(tmp_path / "c")
    cold = run(dict(model=tiny_model, cache=cache, phases=[dict(prompts=PS)]),
               env=faults({"op": "write", "kind": "flip", "every": 2}))
    assert cold["tokens"] == tokens
    warm = run(dict(model=tiny_model, cache=cache, phases=[dict(prompts=PS)]))
    assert warm["tokens"] == tokens
    c = warm["counters"]
    assert c["load_bad_blocks"] > 0 and c["load_failed_blocks"] > 0
    assert_clean(warm, allow_load_errors=True)
