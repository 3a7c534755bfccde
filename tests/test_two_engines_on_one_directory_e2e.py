# SPDX-License-Identifier: Apache-2.0
"""Two real vLLM engines on one cache directory at the same time.

Bug: a second engine on a cache directory failed at start, so engines on one
host could not share their KV blocks.
Invariant: while both engines run, each hits the blocks the other committed
(loaded from the other's files) with tokens identical to a run without aiokv
and zero load errors; kill -9 of one engine in the middle of its saves leaves
the other running, and the other then hits what the dead one committed, never
a half-written block.
Fix: each engine owns an engine number and its own files and follows the
others' journals (aiokv/store/store.py, docs/design.md "Several engines").
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from aiokv.store import Store
from tests.e2e import ROOT, happened, prompts, run, wait_until

pytestmark = pytest.mark.vllm

ENV = dict(os.environ, PYTHONPATH=ROOT, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="WARNING")


def _start(spec: dict, env=ENV) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.vllm_run", json.dumps(spec)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(p: subprocess.Popen, timeout: float = 600) -> dict:
    out, err = p.communicate(timeout=timeout)
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise AssertionError(f"vLLM run failed (rc {p.returncode}):\n{err[-6000:]}")


def _blocks_of(cache: str) -> dict[int, int]:
    """engine number -> committed blocks, as a read-only opener sees them now."""
    try:
        st = Store(cache, readonly=True)
    except Exception:
        return {}
    try:
        out: dict[int, int] = {}
        for ns in st.index.namespaces.values():
            for e in ns.peers():
                out[e] = out.get(e, 0) + ns.count(e)
        return out
    finally:
        st.close()


def _kill(*procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_two_live_engines_hit_each_others_blocks(tiny_model, tmp_path):
    cache = str(tmp_path / "c")
    a_prompts, b_prompts = prompts(2, 100, seed=301), prompts(2, 100, seed=302)
    full = 2 * (99 // 32)  # blocks each pair of prompts stores (one token is left to compute)
    base = run(
        dict(model=tiny_model, phases=[dict(prompts=a_prompts, max_tokens=4), dict(prompts=b_prompts, max_tokens=4)])
    )
    go_a, go_b = str(tmp_path / "go_a"), str(tmp_path / "go_b")
    # A computes a_prompts, then waits (alive) and later runs b_prompts, which B computed
    a = _start(
        dict(
            model=tiny_model,
            cache=cache,
            phases=[
                dict(prompts=a_prompts, max_tokens=4),
                dict(prompts=b_prompts, max_tokens=4, wait_for=go_a, peer_blocks=full),
            ],
        )
    )
    b = None
    try:
        wait_until(lambda: _blocks_of(cache).get(0, 0) >= full, "engine A's saves", [a])
        # B starts while A lives: a_prompts hit A's blocks; it computes b_prompts, then waits alive.
        # B's first phase waits until B sees A's blocks (peer_blocks): B's open applies a first look
        # at A's journal (tests/test_a_starting_engine_sees_the_others_blocks_at_open.py), and any
        # record of A's that lands after that look is followed later, on B's I/O thread.
        # B's writes end 3 s late, so its last saves finish after its last output, as they did on
        # a loaded machine: an engine waiting idle must still step until they are reported and
        # committed (the test driver stepped only while outputs were due, and B's blocks stayed
        # invisible to A until this wait timed out).
        b = _start(
            dict(
                model=tiny_model,
                cache=cache,
                phases=[
                    dict(prompts=a_prompts, max_tokens=4, peer_blocks=full),
                    dict(prompts=b_prompts, max_tokens=4),
                    dict(prompts=[], wait_for=go_b),
                ],
            ),
            env=dict(
                ENV, AIOKV_FAULTS='[{"op": "write", "kind": "late", "delay": 3}]', AIOKV_FAULTS_ACK="inject I/O faults"
            ),
        )
        wait_until(lambda: _blocks_of(cache).get(1, 0) >= full, "engine B's saves", [a, b])
        open(go_a, "w").close()
        ra = _result(a)
        open(go_b, "w").close()
        rb = _result(b)
    finally:
        _kill(a, *([b] if b else []))
    # B hit A's blocks, A hit B's, all while both lived
    assert rb["cached"][0] == [96, 96] and ra["cached"][1] == [96, 96], (ra["cached"], rb["cached"])
    happened(ra, base, hit_blocks=full)
    happened(rb, dict(base, tokens=base["tokens"] + [rb["tokens"][2]]), hit_blocks=full)
    assert _blocks_of(cache) == {0: full, 1: full}  # nothing stored twice


def test_kill9_of_one_engine_mid_save_leaves_the_other_unaffected(tiny_model, tmp_path):
    cache = str(tmp_path / "c")
    ps = prompts(30, 230, seed=303)
    go = str(tmp_path / "go")
    # B starts first and waits alive; A saves a burst and is killed in the middle of it: every
    # write of A's after its first 40 completes an hour late and A waits alive after its burst,
    # so A can neither finish nor commit those before the kill, however fast the machine (the
    # test raced A's burst before: "engine A finished before it could be killed"). B's second
    # phase waits until B sees A's 28 blocks (peer_blocks) before asking: B opened the directory
    # before A's first commit, so its open's first look at the others did not see them; B follows
    # them every 0.1 s on its I/O thread, applied at its next lookup, and nothing else orders that
    # before its first request
    phase2 = dict(prompts=ps[:4], max_tokens=4, peer_blocks=28)
    b = _start(dict(model=tiny_model, cache=cache, phases=[dict(prompts=[], wait_for=go), phase2]))
    a = None
    try:
        wait_until(lambda: os.path.exists(os.path.join(cache, "lock")), "engine B's start", [b])
        burst = dict(prompts=ps, stagger=True, max_tokens=30)
        never = dict(prompts=[], wait_for=str(tmp_path / "never"))
        held = [{"op": "write", "kind": "late", "delay": 3600, "skip": 40}]
        a = _start(
            dict(model=tiny_model, cache=cache, extra={"save_timeout": 86400}, phases=[burst, never]),
            env=dict(ENV, AIOKV_FAULTS=json.dumps(held), AIOKV_FAULTS_ACK="inject I/O faults"),
        )
        wait_until(lambda: _blocks_of(cache).get(1, 0) >= 28, "engine A's saves", [a, b])  # (40 writes: ~5 prompts)
        os.kill(a.pid, signal.SIGKILL)
        a.wait()
        assert a.returncode == -signal.SIGKILL, "engine A exited before the kill"
        assert b.poll() is None, "engine B died with A"
        dead = _blocks_of(cache).get(1, 0)
        open(go, "w").close()
        rb = _result(b)
    finally:
        _kill(b, *([a] if a else []))
    base = run(dict(model=tiny_model, phases=[dict(prompts=[], max_tokens=4), dict(prompts=ps[:4], max_tokens=4)]))
    # the first prompts were done (7 blocks each committed) long before the kill: B hits them;
    # zero load errors: nothing half-written was served
    assert dead >= 28, dead
    happened(rb, base, hit_blocks=f">={2 * (229 // 32)}")
    # the dead engine's number is free: an engine taking it adopts its files and blocks
    st = Store(cache, engine=1)
    assert sum(ns.table.count for ns in st.index.namespaces.values()) >= dead
    st.close()
