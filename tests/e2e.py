"""Helpers for end-to-end tests on real vLLM (CPU): tiny models, runs in fresh
processes, and the assertions every such test makes."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(spec: dict, env: dict | None = None, timeout: int = 600) -> dict:
    """One engine life in a new process; returns its RESULT."""
    e = dict(os.environ, PYTHONPATH=ROOT, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="WARNING")
    e.update(env or {})
    p = subprocess.run([sys.executable, "-m", "tests.vllm_run", json.dumps(spec)], cwd=ROOT, env=e,
                       capture_output=True, text=True, timeout=timeout)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[7:])
            res["log"] = p.stderr[-4000:]
            return res
    raise AssertionError(f"vLLM run failed (rc {p.returncode}):\n{p.stderr[-6000:]}")


def prompts(n: int, length: int, seed: int = 0, prefix: list[int] | None = None) -> list[list[int]]:
    rnd = random.Random(seed)
    pre = prefix or []
    return [[1] + pre + [rnd.randrange(3, 500) for _ in range(length - len(pre) - 1)] for _ in range(n)]


def assert_clean(res: dict, *, allow_load_errors: bool = False) -> None:
    """aiokv's own counters after a run: no failures, nothing leaked."""
    c = res["counters"]
    if not allow_load_errors:
        assert c.get("load_failed_blocks", 0) == 0, c
        assert c.get("load_bad_blocks", 0) == 0, c
    assert c.get("save_failed_blocks", 0) == 0 and c.get("save_failures", 0) == 0, c
    assert c["pending_saves"] == 0, c
    assert c["pinned"] == 0, c
    assert c["worker_in_flight"] == 0 and c["staging_in_use"] == 0, c
    assert c.get("load_report_breaches", 0) == 0, c  # every load reported finished exactly once
    assert_no_leaks(res)


def assert_no_leaks(res: dict) -> None:
    # every KV block is back in vLLM's free pool (block 0 is the null block)
    assert res["free_blocks"] == res["total_blocks"] - 1, (res["free_blocks"], res["total_blocks"])
    assert res["requests_left"] == 0
