# SPDX-License-Identifier: Apache-2.0
"""Bug: with the cache directory on a FUSE mount whose data-file reads never
answer and `load_timeout` 3 s, vLLM did not finish a batch of four warm
requests in 150 s; it finished only once reads resumed. A timed-out load
waited for reads the kernel could not give back, and shutdown waited for them.

Invariant (real vLLM, real FUSE file system, tests/stallfs.py): while every
data-file read hangs, warm requests complete with the tokens of a run without
aiokv, each hit costing at most one `load_timeout`; after the first failures
the circuit breaker stops offering hits, so later requests do not wait at all;
the engine's shutdown returns; the process exits once the reads answer.

Fix: abandoned loads with stuck staging buffers set aside (aiokv/data/backend.py,
aiokv/worker/transfer.py), a bounded worker close, the breaker (aiokv/util/breaker.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from tests.e2e import ROOT, happened, prompts, run
from tests.stallfs import mounted

pytestmark = pytest.mark.vllm

PS = prompts(4, 230, seed=71)
PS2 = prompts(4, 230, seed=72)  # stored too, asked for only once the breaker is open
FULL = 229 // 32


def _start(spec: dict, mp: bool = False) -> tuple[subprocess.Popen, list[str]]:
    """One engine life in a new process (in vLLM's multiprocess mode with `mp`); its output lines.
    Its counters are read at once: buffers set aside by I/O stuck on the hung disk stay so."""
    spec = dict(spec, stuck_wait=0)
    env = dict(
        os.environ, PYTHONPATH=ROOT, VLLM_ENABLE_V1_MULTIPROCESSING="1" if mp else "0", VLLM_LOGGING_LEVEL="WARNING"
    )
    p = subprocess.Popen(
        [sys.executable, "-m", "tests.vllm_run", json.dumps(spec)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    for stream in (p.stdout, p.stderr):
        threading.Thread(target=lambda s=stream: lines.extend(s), daemon=True).start()
    return p, lines


def exits_cleanly(p: subprocess.Popen, when: str) -> None:
    """The engine process exits, with rc 0, within a minute (killed and failed otherwise)."""
    try:
        p.wait(60)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail(f"the engine process did not exit {when}")
    assert p.returncode == 0


def _result(lines: list[str], p: subprocess.Popen, timeout: float) -> dict | None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for line in list(lines):
            if line.startswith("RESULT "):
                return json.loads(line[7:])
        if p.poll() is not None and not any(x.startswith("RESULT ") for x in lines):
            time.sleep(0.5)  # let the readers catch the last lines
            if not any(x.startswith("RESULT ") for x in lines):
                return None
        time.sleep(0.1)
    return None


def test_warm_requests_finish_while_reads_hang(tiny_model, tmp_path):
    base = run(dict(model=tiny_model, phases=[dict(prompts=PS), dict(prompts=PS2)]))
    control = str(tmp_path / "stall")
    with mounted(str(tmp_path / "src"), str(tmp_path / "mnt"), control):
        cache = str(tmp_path / "mnt" / "c")
        cold = run(dict(model=tiny_model, cache=cache, phases=[dict(prompts=PS), dict(prompts=PS2)]))
        happened(cold, base, saves_committed=f">={8 * FULL}")
        with open(control, "w") as f:
            f.write("r")  # from now on no read of a data file answers
        # the first four hits each cost one timeout; the breaker then opens, and
        # four more stored prompts are served without asking the disk
        spec = dict(
            model=tiny_model,
            cache=cache,
            extra={"load_timeout": 3, "breaker_cooldown": 600, "fs_timeout": 2},
            phases=[dict(prompts=PS), dict(prompts=PS2)],
        )
        t0 = time.monotonic()
        p, lines = _start(spec)
        try:
            res = _result(lines, p, 240)
            took = time.monotonic() - t0
            assert res is not None, "vLLM did not finish while reads hung:\n" + "".join(lines[-40:])
            assert os.path.exists(control), "the reads must still hang when the engine is done"
            assert res["tokens"] == base["tokens"], "tokens differ from the run without aiokv"
            c = res["counters"]
            assert c["hit_requests"] == 4 and c["hit_blocks"] == 4 * FULL, c
            assert c["load_timeouts"] == 4 and c["load_failed_blocks"] == 4 * FULL, c
            assert c["loads_ok_blocks"] == 0, c
            assert c["breaker_opens"] == 1, c
            assert "cache disk is failing" in "".join(lines)
            assert c["pinned"] == 0 and c["pending_saves"] == 0 and c["worker_in_flight"] == 0, c
            # the thread pool's 16 threads (min(queue_depth, 16)) each hold one read the daemon
            # never answers: 16 of the four loads' 4 x FULL, those of three loads, whose buffers
            # stay set aside; the fourth load's reads never left the pool's queue, were dropped
            # when it timed out, and its buffers came back (native/pool.c)
            held = -(-16 // FULL) * FULL
            assert c["staging_in_use"] == held, "the stuck reads' slots stay set aside, and only theirs"
            assert res["free_blocks"] == res["total_blocks"] - 1 and res["requests_left"] == 0
            print(f"hung-disk run: results after {took:.1f} s")
        finally:
            os.unlink(control)  # the reads answer now
        exits_cleanly(p, "once the reads answered")
