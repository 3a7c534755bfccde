# SPDX-License-Identifier: Apache-2.0
"""One engine life for the demo: vLLM (default multiprocess mode) with aiokv,
prompts sharing long prefixes, time to first token per prompt.

Threading contract: the demo's main thread drives vLLM's offline `LLM`; the threads and
processes behind it are vLLM's and aiokv's own."""

from __future__ import annotations

import json
import sys
import time


def main(model: str, cache: str, label: str) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        tokenizer=model,
        enforce_eager=True,
        block_size=32,
        dtype="float32",
        enable_prefix_caching=True,
        max_model_len=4096,
        kv_cache_memory_bytes=512 << 20,
        kv_transfer_config={
            "kv_connector": "AioKVConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"path": cache, "capacity": "2GiB"},
        },
    )
    import random

    rnd = random.Random(0)
    prompts = [[1] + [rnd.randrange(3, 500) for _ in range(n - 1)] for n in (1024, 2048, 3072)]
    one = SamplingParams(temperature=0, max_tokens=1)
    rows = []
    for p in prompts:
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": p}], one, use_tqdm=False)[0]
        rows.append(
            {
                "prompt_tokens": len(p),
                "ttft_s": round(time.perf_counter() - t, 4),
                "external_hit_tokens": out.num_cached_tokens,
            }
        )
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        use_tqdm=False,
    )
    tokens = [o.outputs[0].token_ids for o in outs]
    print(f"{label}: " + json.dumps({"ttft": rows, "tokens": [list(t) for t in tokens]}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
