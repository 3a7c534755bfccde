#!/usr/bin/env python3
"""The GPU check: on a CUDA machine with `vllm` (the CUDA build) installed, run a
small model with and without aiokv across a restart and check token equality,
hits, and aiokv's counters. Prepared to run whenever a GPU is at hand:

    pip install vllm && pip install -e . && python tools/gpu_check.py [--dir DIR]

Each engine life runs in its own process (a real restart). Exit 0 when the warm
run hit and every run's tokens equal the run without aiokv; 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def life(model: str, cache: str | None, dtype: str, block: int, extra: dict | None = None) -> dict:
    code = f"""
import json, os, random
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
kw = dict(model={model!r}, tokenizer={model!r}, dtype={dtype!r}, block_size={block}, enable_prefix_caching=True,
          max_model_len=4096, gpu_memory_utilization=0.3, enforce_eager=True)
if {cache!r}:
    kw["kv_transfer_config"] = dict(kv_connector="AioKVConnector", kv_role="kv_both",
        kv_connector_module_path="aiokv.connector", kv_connector_extra_config=dict(path={cache!r}, **{extra or {}!r}))
llm = LLM(**kw)
rnd = random.Random(0)
ps = [[1] + [rnd.randrange(3, 500) for _ in range(n - 1)] for n in (300, 1000, 2500, 2500)]
outs = llm.generate([dict(prompt_token_ids=p) for p in ps], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
res = dict(tokens=[list(o.outputs[0].token_ids) for o in outs], cached=[o.num_cached_tokens for o in outs])
core = llm.llm_engine.engine_core.engine_core
conn = core.scheduler.connector
if conn is not None:
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    wc = get_kv_transfer_group()
    for _ in range(1000):
        if wc.worker is not None:
            wc.worker.drain()
        if not core.scheduler.has_requests():
            break
        llm.llm_engine.step()
    res["counters"] = {{**conn.counters(), **wc.counters()}}
    res["device"] = type(wc.worker.device).__name__ if wc.worker else None
print("RESULT " + json.dumps(res), flush=True)
os._exit(0)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    sys.stderr.write(p.stderr[-8000:])
    raise SystemExit(f"gpu_check: an engine run failed (exit {p.returncode})")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to check")
        return 1
    sys.path.insert(0, ROOT)
    from aiokv.demo.tiny_model import build

    d = args.dir or tempfile.mkdtemp(prefix="aiokv-gpu-")
    model = build(os.path.join(d, "model"), layers=4, hidden=256, heads=4, kv_heads=2, intermediate=512)
    ok = True
    for dtype, block in (("float16", 16), ("bfloat16", 32)):
        cache = os.path.join(d, f"cache-{dtype}-{block}")
        base = life(model, None, dtype, block)
        cold = life(model, cache, dtype, block)
        warm = life(model, cache, dtype, block)
        c = warm["counters"]
        good = (cold["tokens"] == base["tokens"] and warm["tokens"] == base["tokens"] and c["hit_blocks"] > 0
                and c["load_failed_blocks"] == 0 and c["save_failures"] == 0 and c["pending_saves"] == 0
                and c["staging_in_use"] == 0 and warm["device"] == "CudaDevice")
        # layer-by-layer copy-in (side stream, an event per layer): the same tokens, every hit
        # block staged and copied; the last step's slots come back at the next step, so at
        # most the layerwise copies' slots are still held
        lw = life(model, cache, dtype, block, {"layerwise": True})
        lc = lw["counters"]
        good_lw = (lw["tokens"] == base["tokens"] and lc["hit_blocks"] == c["hit_blocks"]
                   and lc.get("layerwise_copied_blocks") == lc["hit_blocks"] == lc.get("loads_ok_blocks")
                   and lc.get("layerwise_layer_waits", 0) > 0 and lc["load_failed_blocks"] == 0
                   and lc["staging_in_use"] <= lc.get("layerwise_copied_blocks", 0))
        ok &= good and good_lw
        print(json.dumps(dict(dtype=dtype, block=block, ok=good, warm_cached=warm["cached"],
                              hit_blocks=c["hit_blocks"], loads_ok=c.get("loads_ok_blocks"),
                              cold_saves=cold["counters"]["saves_committed"], device=warm["device"],
                              layerwise_ok=good_lw, layerwise={k: v for k, v in lc.items() if "layer" in k})))
    print("gpu_check:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
