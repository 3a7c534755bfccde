#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""What aiokv's connector hooks cost per engine step at decode, on vLLM (CPU), in one process.

    PYTHONPATH=. .venv/bin/python tools/bench_step_hooks.py [--json] [--out FILE] [--requests 4]
        [--prompt 512] [--tokens 512] [--base PATH] [--layers 8 --hidden 512 ...]

A Llama-style model built locally (aiokv.demo.tiny_model, random weights) decodes --requests
prompts of --prompt tokens for --tokens tokens each (greedy, ignore_eos), one engine step at a
time, with aiokv on an empty cache directory (every full block saved). Every hook vLLM calls on
the connector, scheduler side and worker side, is timed around its call (perf_counter_ns): per
step its mean, median, p99 and max in microseconds, and their sum against the step's own time.
Most decode steps have nothing to save or load; one in --block (32) has a block to save per
request.

--base PATH runs the same life with the aiokv tree at PATH first (e.g. a `git worktree` of the
commit before), in its own process, then this tree's, in another: the two side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "get_kv_connector_stats",
    "take_events",
    "has_pending_push_work",
    "request_finished",
)
WORKER_HOOKS = (
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_block_ids_with_load_errors",
    "build_connector_worker_meta",
    "clear_connector_metadata",
)


def child(a) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import random

    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    cache = tempfile.mkdtemp(prefix="aiokv-hooks-")
    extra = {"path": cache, "capacity": "4GiB"}
    llm = LLM(
        model=a.model,
        tokenizer=a.model,
        enforce_eager=True,
        block_size=a.block,
        dtype="float32",
        enable_prefix_caching=True,
        max_model_len=a.prompt + a.tokens + 64,
        seed=0,
        kv_cache_memory_bytes=256 << 20,
        max_num_seqs=a.requests,
        kv_transfer_config={
            "kv_connector": "AioKVConnector",
            "kv_role": "kv_both",
            "kv_connector_module_path": "aiokv.connector",
            "kv_connector_extra_config": extra,
        },
    )
    eng = llm.llm_engine
    times: dict[str, list[int]] = {}

    def timed(obj, name):
        f = getattr(obj, name)
        ts = times.setdefault(name, [])

        def call(*x, **k):
            t = time.perf_counter_ns()
            try:
                return f(*x, **k)
            finally:
                ts.append(time.perf_counter_ns() - t)

        setattr(obj, name, call)

    sched_conn = eng.engine_core.engine_core.scheduler.connector
    for n in SCHEDULER_HOOKS:
        timed(sched_conn, n)
    worker_conn = get_kv_transfer_group()
    for n in WORKER_HOOKS:
        if hasattr(worker_conn, n):
            timed(worker_conn, n)
    rnd = random.Random(1)
    sp = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True)
    for i in range(a.requests):
        eng.add_request(f"w{i}", {"prompt_token_ids": [1] + [rnd.randrange(3, 500) for _ in range(a.prompt - 1)]}, sp)
    while eng.has_unfinished_requests():  # a first life: warm-up (not timed)
        eng.step()
    for ts in times.values():
        ts.clear()
    for i in range(a.requests):
        eng.add_request(f"r{i}", {"prompt_token_ids": [1] + [rnd.randrange(3, 500) for _ in range(a.prompt - 1)]}, sp)
    step_ns: list[int] = []
    while eng.has_unfinished_requests():
        t = time.perf_counter_ns()
        eng.step()
        step_ns.append(time.perf_counter_ns() - t)
    steps = len(step_ns)
    out = {"steps": steps, "step_us_median": statistics.median(step_ns) / 1e3, "hooks": {}}
    for name, ts in times.items():
        if not ts:
            continue
        s = sorted(ts)
        out["hooks"][name] = {
            "calls": len(s),
            "us_per_step": round(sum(s) / steps / 1e3, 2),
            "median_us": round(s[len(s) // 2] / 1e3, 2),
            "p99_us": round(s[int(len(s) * 0.99)] / 1e3, 2),
            "max_us": round(s[-1] / 1e3, 2),
        }
    total = sum(h["us_per_step"] for h in out["hooks"].values())
    out["hooks_us_per_step"] = round(total, 1)
    out["hooks_share_of_step"] = round(total / out["step_us_median"], 4)
    shutil.rmtree(cache, ignore_errors=True)
    return out


def life(tree: str, a) -> dict:
    env = dict(os.environ, PYTHONPATH=tree, VLLM_LOGGING_LEVEL="WARNING", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    args = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(vars(a))]
    p = subprocess.run(args, env=env, cwd=tree, capture_output=True, text=True)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[7:])
            r["tree"] = tree
            return r
    sys.stderr.write(p.stderr[-5000:])
    raise SystemExit(f"bench_step_hooks: the life on {tree} failed ({p.returncode})")


def table(runs: dict) -> str:
    names = sorted(
        {n for r in runs.values() for n in r["hooks"]}, key=lambda n: -runs["this"]["hooks"][n]["us_per_step"]
    )
    head = " | ".join(f"{k}: µs/step (median call)" for k in runs)
    lines = [f"| hook | {head} |", "|---|" + "---|" * len(runs)]
    for n in names:
        cells = []
        for r in runs.values():
            h = r["hooks"].get(n)
            cells.append(f"{h['us_per_step']:.1f} ({h['median_us']:.1f})" if h else "-")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines.append(
        "| all hooks, µs per step | " + " | ".join(f"{r['hooks_us_per_step']:.1f}" for r in runs.values()) + " |"
    )
    lines.append("| a step, µs (median) | " + " | ".join(f"{r['step_us_median']:.0f}" for r in runs.values()) + " |")
    lines.append("| hooks / step | " + " | ".join(f"{r['hooks_share_of_step']:.2%}" for r in runs.values()) + " |")
    return "\n".join(lines)


def main() -> None:
    sys.path.append(ROOT)  # last: a --child's aiokv is its PYTHONPATH's (--base runs another tree's)
    from tools import harness

    ap = harness.parser(__doc__)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--base", help="another aiokv tree to run first, side by side")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--dir", default=os.path.join(ROOT, "work-tmp", "bench_step_hooks"))
    a = ap.parse_args()
    if a.child:
        ns = argparse.Namespace(**json.loads(a.child))
        print("RESULT " + json.dumps(child(ns)), flush=True)
        return
    sys.path.insert(0, ROOT)
    from aiokv.demo.tiny_model import build

    a.model = build(
        os.path.join(a.dir, "model"),
        layers=a.layers,
        hidden=a.hidden,
        heads=a.heads,
        kv_heads=a.kv_heads,
        intermediate=a.intermediate,
    )
    runs = {}
    if a.base:
        runs["base"] = life(os.path.abspath(a.base), a)
    runs["this"] = life(ROOT, a)
    doc = {"args": {k: v for k, v in vars(a).items() if k not in ("child", "json", "out")}, "runs": runs}
    harness.emit(doc, a, lambda d: table(d["runs"]))


if __name__ == "__main__":
    main()
