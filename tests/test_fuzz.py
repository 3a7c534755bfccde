# SPDX-License-Identifier: Apache-2.0
"""A short seeded fuzz of aiokv on the real vLLM engine (tools/fuzz.py):
random arrivals, prompt lengths, shared prefixes, aborts, preemption under a
tiny KV cache, eviction under a tiny capacity, and restarts (three engine lives
on one cache directory), with invariant checks every step and at the end (see
tools/fuzz.py). The long run is `tools/fuzz.py --steps N`; docs/reliability.md
records the longest clean run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.e2e import ROOT

pytestmark = pytest.mark.vllm


def test_short_fuzz(tmp_path):
    p = subprocess.run(
        [
            sys.executable,
            "tools/fuzz.py",
            "--steps",
            "80",
            "--lives",
            "3",
            "--prompts",
            "24",
            "--seed",
            "7",
            "--dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=ROOT),
        timeout=1200,
    )
    start = p.stdout.index("{")
    summary = json.loads(p.stdout[start:])
    problems = [x for life in summary["lives"] for x in life["problems"]]
    assert not problems, problems
    assert summary["stored_bytes"]["checked"] > 0 and not summary["stored_bytes"]["bad"]
    assert summary["ok"] and p.returncode == 0
    lives = summary["lives"]
    assert sum(life["hit_blocks"] for life in lives[1:]) > 0, "restarts must hit"
    assert sum(life["aborted"] for life in lives) > 0
    assert sum(life["saves"] for life in lives) > 0
    # what the fuzz exists for happened: requests preempted, freed blocks poisoned (a stale read
    # would show), stored blocks evicted to make room
    assert sum(life["preemptions"] for life in lives) > 0, lives
    assert sum(life["poisoned_blocks"] for life in lives) > 0, lives
    assert sum(life["evictions"] or 0 for life in lives) > 0, lives


# Gemma 2 (a window group beside a full one) runs in the suite; the hybrid (minutes per life on
# 2 cores) and the every-layer-windowed model run on demand (pytest -m long), as the store-error
# fuzz does, to keep the suite's time in bounds.
@pytest.mark.parametrize(
    "family",
    ["gemma2", pytest.param("hybrid", marks=pytest.mark.long), pytest.param("mistral", marks=pytest.mark.long)],
)
def test_short_fuzz_with_several_kv_cache_groups(tmp_path, family):
    """The same fuzz on a sliding-window + full model, on a recurrent hybrid and on
    an every-layer sliding-window model, its second life with load failures of
    every kind (EIO, short read, checksum, timeout, a slot another engine rewrote
    or punched): ownership per group (every block a load writes or a save reads
    belongs to its request in that group; block 0 never), tokens equal to a run
    without aiokv, no leaks, loads adding up to every group's planned load blocks,
    stored blocks equal to a recomputation. The bf16 hybrid's tokens depend on
    vLLM's prefill chunking even without aiokv, so its token differences are
    reported, not failed (tools/fuzz.py, FAMILIES)."""
    # the fault life's injected write errors can open the breaker before any load was tried (on a
    # busy machine the order varies; seen once in a full run): then another seed is tried, and one
    # of the two must have failed loads; every other check holds for each run
    for seed in ("7", "9"):  # (seed 9: 3 failed loads of 15 hits in its fault life, idle machine)
        p = subprocess.run(
            [
                sys.executable,
                "tools/fuzz.py",
                "--family",
                family,
                "--steps",
                "80",
                "--lives",
                "2",
                "--prompts",
                "16",
                "--seed",
                seed,
                "--fault-every",
                "2",
                "--dir",
                str(tmp_path / seed),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env=dict(os.environ, PYTHONPATH=ROOT),
            timeout=1500,
        )
        summary = json.loads(p.stdout[p.stdout.index("{") :])
        problems = [x for life in summary["lives"] for x in life["problems"]]
        assert not problems, problems
        assert summary["stored_bytes"]["checked"] > 0 and not summary["stored_bytes"]["bad"]
        assert summary["ok"] and p.returncode == 0
        assert sum(life["saves"] for life in summary["lives"]) > 0
        assert sum(life["hit_blocks"] or 0 for life in summary["lives"][1:]) > 0, "the restart must hit"
        assert sum(life["poisoned_blocks"] for life in summary["lives"]) > 0  # (preemptions: test_short_fuzz's)
        faulty = summary["lives"][1]
        assert faulty["faults"] and faulty["save_failed_blocks"] > 0, faulty  # the injector did fire
        if family == "hybrid" or faulty["load_failed_blocks"] > 0:
            break  # (the hybrid's hits are few: checkpoints only; docs/reliability.md: the long run counts them)
    if family != "hybrid":
        assert faulty["load_failed_blocks"] > 0, faulty


@pytest.mark.long
def test_short_fuzz_with_store_errors(tmp_path):
    """The same fuzz (Gemma 2: two KV-cache groups) with every store call of the scheduler
    side raising with probability 0.05 (tools/store_faults.py; the scheduler-level proof of
    each single call is tests/test_store_errors_leave_bookkeeping_whole.py). Loads and saves
    may fail (recomputed, dropped); tokens must equal the run without aiokv, every save and
    load must touch the block holding its key's tokens, and nothing may stay pinned, pending
    or reserved, or be reported finished twice."""
    p = subprocess.run(
        [
            sys.executable,
            "tools/fuzz.py",
            "--family",
            "gemma2",
            "--steps",
            "60",
            "--lives",
            "2",
            "--prompts",
            "16",
            "--seed",
            "7",
            "--store-faults",
            "0.05",
            "--dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=ROOT),
        timeout=1500,
    )
    summary = json.loads(p.stdout[p.stdout.index("{") :])
    problems = [x for life in summary["lives"] for x in life["problems"]]
    assert not problems, problems
    assert summary["ok"] and p.returncode == 0
    assert sum(life["store_faults_injected"] for life in summary["lives"]) >= 10
    assert sum(life["saves"] for life in summary["lives"]) > 0
    assert sum(life["hit_blocks"] or 0 for life in summary["lives"]) > 0, "loads must be prepared under faults"


@pytest.mark.long
def test_short_fuzz_with_random_settings(tmp_path):
    """The same fuzz with every life's settings drawn from their accepted ranges, bounds included
    (tools/fuzz.py --random-settings: queue depths 1 to 16384, staging and memory below one block,
    capacity below one block or 10^30 bytes, timeouts from 10 ms to a day, the breaker off or
    never opening, 0 to 64 checksum threads, admit reused at windows 1 to 2^30, layerwise, ...):
    tokens equal to a run without aiokv, no leak, loads adding up, stored blocks equal to a
    recomputation, in every life (issue 37, item 2)."""
    p = subprocess.run(
        [
            sys.executable,
            "tools/fuzz.py",
            "--steps",
            "80",
            "--lives",
            "4",
            "--prompts",
            "20",
            "--seed",
            "11",
            "--random-settings",
            "--dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=ROOT),
        timeout=1500,
    )
    summary = json.loads(p.stdout[p.stdout.index("{") :])
    problems = [x for life in summary["lives"] for x in life["problems"]]
    assert not problems, problems
    assert summary["stored_bytes"]["checked"] > 0 and not summary["stored_bytes"]["bad"]
    assert summary["ok"] and p.returncode == 0
    assert all(life["settings"] for life in summary["lives"]), "a life drew no setting"
    assert sum(life["saves"] for life in summary["lives"]) > 0
