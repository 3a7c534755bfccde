# SPDX-License-Identifier: Apache-2.0
"""The demo: a tiny model built locally, vLLM with aiokv in two separate
processes (cold, then after a restart), time to first token and external hit
tokens of each, then `aiokv inspect` on the cache.

    python -m aiokv.demo [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

from aiokv.demo.tiny_model import build


def life(model: str, cache: str, label: str) -> dict:
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING", TQDM_DISABLE="1")
    # vLLM's CPU build keeps one more core from the worker for any KV connector; on a small
    # machine that leaves none for the engine core (docs/operations.md, "Start"): reserve what
    # it reserves without a connector (one, for one worker)
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    p = subprocess.run(
        [sys.executable, "-m", "aiokv.demo.run_once", model, cache, label], env=env, capture_output=True, text=True
    )
    for line in p.stdout.splitlines():
        if line.startswith(label + ": "):
            return json.loads(line[len(label) + 2 :])
    sys.stderr.write(p.stderr[-5000:])
    raise SystemExit(f"aiokv demo: the {label} run failed (exit {p.returncode})")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m aiokv.demo")
    ap.add_argument("--dir", default=os.path.expanduser("~/.cache/aiokv-demo"))
    args = ap.parse_args()
    model = build(os.path.join(args.dir, "model"), layers=4, hidden=256, heads=4, kv_heads=2, intermediate=512)
    cache = os.path.join(args.dir, "cache")
    shutil.rmtree(cache, ignore_errors=True)
    print(f"model: {model} (4 layers, built locally)\ncache: {cache}\n")
    runs = {label: life(model, cache, label) for label in ("cold", "warm")}
    print(f"{'run':5} {'prompt':>7} {'TTFT s':>8} {'external hit tokens':>20}")
    for label, r in runs.items():
        for row in r["ttft"]:
            print(f"{label:5} {row['prompt_tokens']:7d} {row['ttft_s']:8.3f} {row['external_hit_tokens']:20d}")
    same = runs["cold"]["tokens"] == runs["warm"]["tokens"]
    hits = sum(row["external_hit_tokens"] for row in runs["warm"]["ttft"])
    cold_t = sum(row["ttft_s"] for row in runs["cold"]["ttft"])
    warm_t = sum(row["ttft_s"] for row in runs["warm"]["ttft"])
    print(f"\nwarm/cold TTFT: {warm_t / cold_t:.2f}; warm hit tokens: {hits}; tokens identical: {same}\n")
    sys.stdout.flush()
    subprocess.run([sys.executable, "-m", "aiokv", "inspect", cache], check=False)
    if not same or hits == 0:
        raise SystemExit("aiokv demo: the warm run did not hit, or its tokens differ")


if __name__ == "__main__":
    main()
