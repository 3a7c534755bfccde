#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""End to end on vLLM (CPU): time to first token cold vs warm after a restart,
per prompt length, next to what the loaded bytes cost at fio's read bandwidth.

    PYTHONPATH=. .venv/bin/python tools/bench_e2e.py [--json] [--out FILE] [--plot DIR]
        [--lengths 2048,4096,8192] [--layers 8 --hidden 512 ...] [--dir PATH] [--baseline] [--switch-interval S]
    PYTHONPATH=. .venv/bin/python tools/bench_e2e.py --layerwise [--repeat 3] [--mp] [--lengths ...]

A mid-size Llama-style model is built locally (aiokv.demo.tiny_model.build,
random weights, no hub). Then, each in its own process (a real restart):
- base (with --baseline): vLLM without a connector; TTFT per prompt.
- cold: vLLM with aiokv on an empty cache directory; TTFT per prompt (full
  prefill; aiokv saves every full block). At exit the saves are committed.
- warm: vLLM with aiokv on that same directory, the same prompts; TTFT per
  prompt (aiokv loads every full block but the last token's; vLLM computes the
  rest). Then each prompt once more in the same process: "hot", a hit in
  vLLM's own in-memory prefix cache (no disk I/O, same tail compute): the
  engine's floor for this prompt. Then vLLM's prefix cache is reset and each
  prompt runs once more: "memory", an aiokv hit served by its host-memory tier
  (the blocks the warm pass loaded; no disk read).
Prompts are distinct random token sequences (no prefix shared between them),
one request at a time, max_tokens=1, temperature 0.

--layerwise compares warm TTFT with the `layerwise` setting off and on
(docs/design.md, "Layer-by-layer loads"): the cold life also stores a second
prompt set; then `--repeat` pairs of warm lives, off then on, each on its own
copy of the cold cache, time the stored prompts (a full hit: everything but the
last token loaded) and prompts whose first half is one of the second set's
("half": half loaded, half computed beside the copy). --mp runs the lives with
vLLM's engine core in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=1).

The byte-cost bound of a warm TTFT is hot + bytes / B, where bytes = the slots
aiokv read (hit blocks x slot bytes) and B = fio's read bandwidth measured in
the same run on the same file system (io_uring, O_DIRECT, bs = slot size,
iodepth 32 = the worker's default queue_depth, huge-page buffers).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tools import harness  # noqa: E402

BLOCK = 32


def prompts(lengths: list[int], seed: int = 1234) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[1] + [rnd.randrange(3, 500) for _ in range(n - 1)] for n in lengths]


def second_prompts(lengths: list[int]) -> list[list[int]]:
    return prompts(lengths, seed=4321)


# ------------------------------------------------------------------ child (one vLLM life)


def child(args) -> None:
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)  # experiment: GIL hand-over latency between threads
    from vllm import LLM, SamplingParams

    kw = dict(
        model=args.model,
        tokenizer=args.model,
        enforce_eager=True,
        block_size=BLOCK,
        dtype="float32",
        enable_prefix_caching=True,
        max_model_len=max(args.lengths) + 64,
        max_num_batched_tokens=max(args.lengths) + 64,
        kv_cache_memory_bytes=args.kv_mib << 20,
    )
    if args.label != "base":
        kw["kv_transfer_config"] = {
            "kv_connector": "AioKVConnector",
            "kv_role": "kv_both",
            "kv_connector_module_path": "aiokv.connector",
            "kv_connector_extra_config": {
                "path": args.cache,
                "capacity": "8GiB",
                # more settings (tools/bench_bucket.py)
                **json.loads(os.environ.get("AIOKV_BENCH_EXTRA", "{}")),
            },
        }
    llm = LLM(**kw)
    one = SamplingParams(temperature=0, max_tokens=1)
    ps = prompts(args.lengths)
    # warm-up on an unrelated short prompt: first-call costs (allocations, kernels) out of the way
    llm.generate([{"prompt_token_ids": [1] + [7] * 95}], one, use_tqdm=False)
    rows = []
    passes = ["first"] + (["hot", "memory"] if args.label == "warm" else [])
    sets = {"first": ps, "hot": ps, "memory": ps}
    if args.layerwise:  # --layerwise: the second set is stored cold, hit by half warm
        second = second_prompts(args.lengths)
        passes, sets = ["first", "half"], {"first": ps, "half": second}
        if args.label != "cold":
            sets["half"] = [
                q[: len(q) // 2 // BLOCK * BLOCK] + h[len(q) // 2 // BLOCK * BLOCK :]
                for q, h in zip(second, prompts(args.lengths, seed=99))
            ]
    for kind in passes:
        if kind == "memory":
            llm.reset_prefix_cache()  # vLLM forgets them; aiokv's memory tier still holds them
        for p in sets[kind]:
            t = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": p}], one, use_tqdm=False)[0]
            rows.append(
                {
                    "pass": kind,
                    "prompt_tokens": len(p),
                    "ttft_s": time.perf_counter() - t,
                    "cached_tokens": out.num_cached_tokens,
                    "token": out.outputs[0].token_ids[0],
                }
            )
    counters = {}
    try:
        conn = llm.llm_engine.engine_core.engine_core.scheduler.connector
        counters = {k: v for k, v in conn.counters().items() if isinstance(v, int)}
    except Exception:  # noqa: BLE001
        pass
    print("RESULT " + json.dumps({"rows": rows, "counters": counters}), flush=True)
    try:
        llm.llm_engine.engine_core.shutdown()  # commits pending saves
    except Exception:  # noqa: BLE001
        pass


def life(label: str, model: str, cache: str, args, extra: dict | None = None) -> dict:
    env = dict(
        os.environ,
        VLLM_LOGGING_LEVEL="WARNING",
        TQDM_DISABLE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="1" if getattr(args, "mp", False) else "0",
        PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
    )
    if extra:
        env["AIOKV_BENCH_EXTRA"] = json.dumps({**json.loads(os.environ.get("AIOKV_BENCH_EXTRA", "{}")), **extra})
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        label,
        "--model",
        model,
        "--cache",
        cache,
        "--lengths",
        ",".join(map(str, args.lengths)),
        "--kv-mib",
        str(args.kv_mib),
    ]
    if args.layerwise:
        cmd.append("--layerwise")
    if args.switch_interval:
        cmd += ["--switch-interval", str(args.switch_interval)]
    t = time.monotonic()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[7:])
            r["process_s"] = time.monotonic() - t
            return r
    sys.stderr.write(p.stderr[-6000:])
    raise SystemExit(f"bench_e2e: the {label} run failed (exit {p.returncode})")


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------ parent


def model_kv(model: str) -> dict:
    with open(os.path.join(model, "config.json")) as f:
        c = json.load(f)
    head = c["hidden_size"] // c["num_attention_heads"]
    per_token = c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head * 4  # fp32
    params = None
    try:
        from safetensors import safe_open

        with safe_open(os.path.join(model, "model.safetensors"), "pt") as f:
            params = sum(
                f.get_slice(k).get_shape().numel()
                if hasattr(f.get_slice(k).get_shape(), "numel")
                else _prod(f.get_slice(k).get_shape())
                for k in f.keys()
            )
    except Exception:  # noqa: BLE001
        pass
    return {
        "layers": c["num_hidden_layers"],
        "hidden": c["hidden_size"],
        "heads": c["num_attention_heads"],
        "kv_heads": c["num_key_value_heads"],
        "intermediate": c["intermediate_size"],
        "head_dim": head,
        "kv_bytes_per_token": per_token,
        "params": params,
    }


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def fio_read_gbps(d: str, slot: int, nbytes: int, depth: int = 32) -> float:
    from tools.bench_store import fio_round

    n = max(64, nbytes // slot)
    with harness.HugePages(harness.huge_pages(depth * slot)) as hp:
        return harness.middle(
            fio_round(os.path.join(d, "fio.dat"), slot, n, depth, hp.mem)["read_gbps"] for _ in range(3)
        )


def main() -> int:
    ap = harness.parser(__doc__, plot=True)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--label", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--lengths", default="2048,4096,8192", help="prompt lengths in tokens")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--kv-mib", type=int, default=768, help="vLLM KV cache memory (MiB)")
    ap.add_argument("--dir", default=None, help="where the model and the cache go (default: a temp dir)")
    ap.add_argument("--baseline", action="store_true", help="also run vLLM without a connector (one more life)")
    ap.add_argument(
        "--switch-interval",
        type=float,
        default=0.0,
        help="experiment: sys.setswitchinterval in the vLLM processes (default: Python's 0.005 s)",
    )
    ap.add_argument(
        "--layerwise",
        action="store_true",
        help="compare warm TTFT with the layerwise setting off and on (full and half hits)",
    )
    ap.add_argument("--repeat", type=int, default=3, help="--layerwise: pairs of warm lives (off, on)")
    ap.add_argument("--mp", action="store_true", help="engine core in its own process (default: in-process)")
    args = ap.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",") if x]
    if args.child:
        args.label = args.child
        child(args)
        return 0

    from aiokv.data import format as fmt
    from aiokv.demo.tiny_model import build

    base = args.dir or tempfile.mkdtemp(prefix="aiokv-e2e-")
    os.makedirs(base, exist_ok=True)
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    t0 = time.monotonic()
    model = build(
        os.path.join(base, "model"),
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        intermediate=args.intermediate,
        max_positions=max(8192, max(args.lengths) + 64),
    )
    kv = model_kv(model)
    payload = kv["kv_bytes_per_token"] * BLOCK
    slot = fmt.slot_bytes(payload)
    cache = os.path.join(base, "cache")
    shutil.rmtree(cache, ignore_errors=True)
    if args.layerwise:
        try:
            return layerwise_compare(args, model, kv, cache, base, log, t0)
        finally:
            if args.dir is None:
                shutil.rmtree(base, ignore_errors=True)
    runs = {}
    try:
        for label in (["base"] if args.baseline else []) + ["cold", "warm"]:
            log(f"bench_e2e: {label} ...")
            runs[label] = life(label, model, cache, args)
        fio_d = tempfile.mkdtemp(prefix="fio-", dir=base)
        try:
            fio_bw = fio_read_gbps(fio_d, slot, max(args.lengths) * kv["kv_bytes_per_token"])
        finally:
            shutil.rmtree(fio_d, ignore_errors=True)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    rows = []
    for i, n in enumerate(args.lengths):
        cold = runs["cold"]["rows"][i]
        warm = runs["warm"]["rows"][i]
        hot = runs["warm"]["rows"][len(args.lengths) + i]
        mem = runs["warm"]["rows"][2 * len(args.lengths) + i]
        base_r = runs["base"]["rows"][i] if "base" in runs else None
        hit_tokens = warm["cached_tokens"]
        nbytes = hit_tokens // BLOCK * slot
        io_s = nbytes / (fio_bw * 1e9)
        bound = hot["ttft_s"] + io_s
        rows.append(
            {
                "prompt_tokens": n,
                "base_s": base_r["ttft_s"] if base_r else None,
                "cold_s": cold["ttft_s"],
                "warm_s": warm["ttft_s"],
                "hot_s": hot["ttft_s"],
                "hit_tokens": hit_tokens,
                "memory_s": mem["ttft_s"],
                "memory_hit_tokens": mem["cached_tokens"],
                "bytes_loaded": nbytes,
                "fio_io_s": io_s,
                "bound_s": bound,
                "warm_over_cold": warm["ttft_s"] / cold["ttft_s"],
                "warm_over_bound": warm["ttft_s"] / bound,
                "same_token": cold["token"] == warm["token"] == hot["token"] == mem["token"],
            }
        )
    doc = harness.document(
        model=kv,
        block_size=BLOCK,
        payload_bytes=payload,
        slot_bytes=slot,
        fio_read_gbps=fio_bw,
        rows=rows,
        counters={k: r.get("counters") for k, r in runs.items()},
        process_s={k: round(r["process_s"], 1) for k, r in runs.items()},
        seconds=round(time.monotonic() - t0, 1),
        machine_path=base,
    )
    return harness.emit(doc, args, render, plot)


def layerwise_compare(args, model: str, kv: dict, cache: str, base: str, log, t0: float) -> int:
    """Warm TTFT, layerwise off vs on, alternating lives on copies of one cold cache."""
    import statistics

    log("bench_e2e: cold ...")
    cold = life("cold", model, cache, args)
    lives: dict[str, list] = {"off": [], "on": []}
    for r in range(args.repeat):
        for mode in ("off", "on"):
            mine = os.path.join(base, f"cache-{mode}")
            shutil.rmtree(mine, ignore_errors=True)
            shutil.copytree(cache, mine)
            log(f"bench_e2e: warm layerwise {mode} ({r + 1}/{args.repeat}) ...")
            lives[mode].append(life(f"warm-{mode}", model, mine, args, {"layerwise": mode == "on"}))
            shutil.rmtree(mine, ignore_errors=True)
    rows = []
    n = len(args.lengths)
    for kind, offset in (("full", 0), ("half", n)):
        for i, length in enumerate(args.lengths):
            cell = {m: [lv["rows"][offset + i] for lv in lives[m]] for m in lives}
            off = statistics.median(c["ttft_s"] for c in cell["off"])
            on = statistics.median(c["ttft_s"] for c in cell["on"])
            rows.append(
                {
                    "kind": kind,
                    "prompt_tokens": length,
                    "hit_tokens": cell["on"][0]["cached_tokens"],
                    "off_s": off,
                    "on_s": on,
                    "gain_s": off - on,
                    "on_over_off": on / off,
                    "off_all": [round(c["ttft_s"], 4) for c in cell["off"]],
                    "on_all": [round(c["ttft_s"], 4) for c in cell["on"]],
                    "same_token": len({c["token"] for m in cell for c in cell[m]}) == 1,
                }
            )
    doc = harness.document(
        model=kv,
        block_size=BLOCK,
        engine_core="own process" if args.mp else "in-process",
        repeat=args.repeat,
        rows=rows,
        counters={"cold": cold.get("counters"), "on": lives["on"][-1].get("counters")},
        seconds=round(time.monotonic() - t0, 1),
        machine_path=base,
    )
    return harness.emit(doc, args, render_layerwise, None)


def render_layerwise(doc: dict) -> str:
    m = doc["model"]
    lines = [
        f"model: {m['layers']} layers, hidden {m['hidden']}, fp32; block {doc['block_size']}; engine core "
        f"{doc['engine_core']}; median of {doc['repeat']} lives each",
        "",
        "| hit | prompt tokens | hit tokens | layerwise off s | layerwise on s | gain s | on/off | same token |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['kind']} | {r['prompt_tokens']} | {r['hit_tokens']} | {r['off_s']:.4f} | {r['on_s']:.4f} "
            f"| {r['gain_s']:+.4f} | {r['on_over_off']:.3f} | {r['same_token']} |"
        )
    return "\n".join(lines)


def render(doc: dict) -> str:
    m = doc["model"]
    lines = [
        f"model: {m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads / {m['kv_heads']} KV heads, "
        f"{(m['params'] or 0) / 1e6:.0f} M params, fp32; block {doc['block_size']} tokens = "
        f"{doc['payload_bytes'] >> 10} KiB payload ({doc['slot_bytes'] >> 10} KiB slot); "
        f"fio read {doc['fio_read_gbps']:.2f} GB/s (bs = slot, depth 32)",
        "",
        "| prompt tokens | no connector s | cold s | warm (disk) s | warm (memory tier) s | hot (vLLM prefix cache) s "
        "| hit tokens | MiB loaded | bytes at fio s | bound = hot + bytes s | warm/cold | warm/bound | same token |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        base = f"{r['base_s']:.3f}" if r["base_s"] is not None else "-"
        lines.append(
            f"| {r['prompt_tokens']} | {base} | {r['cold_s']:.3f} | {r['warm_s']:.3f} "
            f"| {r.get('memory_s', float('nan')):.3f} | {r['hot_s']:.3f} "
            f"| {r['hit_tokens']} | {r['bytes_loaded'] / 2**20:.0f} | {r['fio_io_s']:.3f} "
            f"| {r['bound_s']:.3f} | {r['warm_over_cold']:.3f} | {r['warm_over_bound']:.2f} "
            f"| {r['same_token']} |"
        )
    return "\n".join(lines)


def plot(doc: dict, outdir: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(outdir, exist_ok=True)
    rows = doc["rows"]
    xs = [r["prompt_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    if rows[0]["base_s"] is not None:
        ax.plot(xs, [r["base_s"] for r in rows], "x:", label="no connector")
    ax.plot(xs, [r["cold_s"] for r in rows], "o-", label="aiokv cold (prefill + save)")
    ax.plot(xs, [r["warm_s"] for r in rows], "s-", label="aiokv warm after restart (load)")
    ax.plot(xs, [r["memory_s"] for r in rows], "d-", label="aiokv warm, from its memory tier")
    ax.plot(xs, [r["bound_s"] for r in rows], "--", label="bound: hot + bytes at fio read")
    ax.plot(xs, [r["hot_s"] for r in rows], "^:", label="hot (vLLM in-memory prefix hit)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs)
    ax.set_xticklabels([str(x) for x in xs])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token, s")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(f"TTFT on vLLM CPU, {doc['model']['layers']}-layer model ({doc['date'][:10]})", fontsize=10)
    fig.tight_layout()
    path = os.path.join(outdir, "ttft.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    raise SystemExit(main())
