#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""What aiokv costs when it has nothing to give: generation throughput with
aiokv saving and never hitting vs no connector, the scheduler-side cost per
new-request lookup and per step with many running requests, and the per-layer
hooks when there is nothing to do.

    PYTHONPATH=. .venv/bin/python tools/bench_overhead.py [--json] [--out FILE]
        [--requests 32 --prompt 256 --tokens 96] [--rounds 2] [--running 64,128,256,512]

1. Throughput (real vLLM, CPU, in-process engine, one process): the same batch
   of `requests` distinct random prompts, `tokens` new tokens each (greedy,
   ignore_eos), with no connector and with aiokv on an empty cache directory
   (every full block is saved; no prompt repeats, so nothing hits). Engines
   alternate (none, aiokv, none, aiokv, ...; a fresh cache directory and fresh
   prompts each round); the figure is the median tokens/s ratio. The model is
   small on purpose (the connector's share of a step is largest there).
2. Scheduler side (no vLLM engine; the real AioKVConnector methods called on
   a connector object wired to a real SchedulerSide and Store holding 20 000
   blocks): get_num_new_matched_tokens for a new request (a 2048-token prompt
   whose first half is stored: 64 keys hashed, 32 hits) and
   build_connector_meta for a decode step with R running requests (each one
   token; every 32nd step a block fills and a save is planned), with R in
   --running. The step's share is against the decode step time measured in 1
   (same machine, same run), scaled to R requests by vLLM's measured per-
   token cost.
3. Per-layer hooks: AioKVConnector.save_kv_layer and wait_for_layer_load with
   nothing to do, ns per call, and per step (x layers).
"""

from __future__ import annotations

import gc
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tools import harness  # noqa: E402

BLOCK = 32


# ------------------------------------------------------------------ 1. throughput


def throughput(args, base: str) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM, SamplingParams

    from aiokv.demo.tiny_model import build

    model = build(
        os.path.join(base, "model"),
        layers=args.layers,
        hidden=args.hidden,
        heads=4,
        kv_heads=2,
        intermediate=args.hidden * 2,
    )
    sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    rnd = random.Random(7)
    rounds = {"none": [], "aiokv": []}
    counters = []
    for r in range(args.rounds):
        for who in ("none", "aiokv"):
            kw = dict(
                model=model,
                tokenizer=model,
                enforce_eager=True,
                block_size=BLOCK,
                dtype="float32",
                enable_prefix_caching=True,
                max_model_len=args.prompt + args.tokens + 32,
                kv_cache_memory_bytes=256 << 20,
            )
            cache = os.path.join(base, f"cache{r}")
            if who == "aiokv":
                kw["kv_transfer_config"] = {
                    "kv_connector": "AioKVConnector",
                    "kv_role": "kv_both",
                    "kv_connector_module_path": "aiokv.connector",
                    "kv_connector_extra_config": {"path": cache, "capacity": "4GiB"},
                }
            llm = LLM(**kw)
            warm = [{"prompt_token_ids": [1] + [rnd.randrange(3, 500) for _ in range(63)]}]
            llm.generate(warm, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
            ps = [
                {"prompt_token_ids": [1] + [rnd.randrange(3, 500) for _ in range(args.prompt - 1)]}
                for _ in range(args.requests)
            ]
            t = time.perf_counter()
            outs = llm.generate(ps, sp, use_tqdm=False)
            dt = time.perf_counter() - t
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            hits = sum(o.num_cached_tokens or 0 for o in outs)
            rounds[who].append({"tokens_per_s": n / dt, "seconds": dt, "tokens": n, "cached_tokens": hits})
            if who == "aiokv":
                try:
                    conn = llm.llm_engine.engine_core.engine_core.scheduler.connector
                    counters.append({k: v for k, v in conn.counters().items() if isinstance(v, int)})
                except Exception:  # noqa: BLE001
                    pass
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
            shutil.rmtree(cache, ignore_errors=True)
            print(f"throughput round {r + 1} {who}: {n / dt:.1f} tok/s", file=sys.stderr, flush=True)
    med = {k: statistics.median(x["tokens_per_s"] for x in v) for k, v in rounds.items()}
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(rounds["aiokv"], rounds["none"])]
    # decode step time: one step decodes `requests` tokens
    step_s = args.requests / med["none"]
    return {
        "model": {"layers": args.layers, "hidden": args.hidden},
        "requests": args.requests,
        "prompt": args.prompt,
        "new_tokens": args.tokens,
        "rounds": rounds,
        "median_tok_s": med,
        "ratio": med["aiokv"] / med["none"],
        "ratio_per_round": ratios,
        "step_s_at_batch": step_s,
        "aiokv_counters": counters[-1] if counters else {},
    }


# ------------------------------------------------------------------ 2. scheduler side


def _connector(store_dir: str):
    import inspect

    from aiokv.connector.connector import AioKVConnector
    from aiokv.scheduler.keys import namespace_id
    from aiokv.scheduler.side import SchedulerSide
    from aiokv.store import Store

    # as the connector opens it: with the store's I/O thread where this aiokv has one
    kw = {"io_thread": True} if "io_thread" in inspect.signature(Store).parameters else {}
    store = Store(store_dir, capacity=64 << 30, **kw)
    nsid = namespace_id({"bench": "overhead"})
    ns = store.namespace(nsid, 64 << 10)
    conn = object.__new__(AioKVConnector)  # the real methods, without a vLLM config
    try:  # the scheduler role's state: its own object since the connector was split, else the connector's
        from aiokv.connector.scheduler_role import SchedulerRole

        role = conn.scheduler_role = object.__new__(SchedulerRole)
    except ImportError:
        role = conn
    role.sched = SchedulerSide(store, ns, BLOCK)
    role.nsid = nsid
    role._roots = {}
    role.block_size = BLOCK
    conn._connector_metadata = None
    role._queried, role._queried_tokens = {}, 0
    # what AioKVConnector.__init__ sets that these methods read (getattr: older checkouts lack some)
    role._remote_tokens, role._failed_recv, role._failed_now = {}, set(), set()
    if not isinstance(getattr(type(role), "epoch", None), property):
        role.epoch = None  # (since connector/roots.py the epoch is the roots', set below)
    role._bucket_tokens = {}  # _remote_tokens before the bucket tier had its one name
    role.layerwise, role._layers, role.worker, role.offer_hits = False, None, None, True
    role.events, role._drives = None, None  # (KV events off; one drive)
    try:  # LoRA adapters' fingerprints, on their own I/O thread since issue 37
        from aiokv.connector.adapters import Adapters

        role.adapters, role._lora_misses = Adapters(2.0), 0
    except ImportError:
        pass
    try:  # the requests' key roots (the epoch, the adapters' fingerprints) since connector/roots.py
        from aiokv.connector.roots import Roots

        role.roots = Roots(nsid, role.adapters)
    except ImportError:
        pass
    return conn, role, store, ns


def _request(rid: str, tokens: list[int]):
    return types.SimpleNamespace(
        request_id=rid,
        all_token_ids=tokens,
        num_tokens=len(tokens),
        cache_salt=None,
        lora_request=None,
        mm_features=None,
        prompt_embeds=None,
        skip_reading_prefix_cache=False,
    )


def _fill(store, ns, keys) -> None:
    for i in range(0, len(keys), 512):
        part = keys[i : i + 512]
        slots = [store.reserve(ns, k) for k in part]
        for _ in range(200):  # with the store's I/O thread a reservation may wait for a grow: again next "step"
            if None not in slots:
                break
            store.refresh()
            time.sleep(0.005)
            slots = [s if s is not None else store.reserve(ns, k) for k, s in zip(part, slots)]
        store.commit(ns, [(k, s) for k, s in zip(part, slots) if s is not None])


def scheduler_side(running: list[int], base: str) -> dict:
    from aiokv.scheduler.keys import extend_keys

    conn, role, store, ns = _connector(os.path.join(base, "sched"))
    rnd = random.Random(3)
    out = {"stored_blocks": 0}
    try:
        # 20 000 unrelated stored blocks, then prompts whose first half is stored
        junk = [rnd.randbytes(32) for _ in range(20000)]
        _fill(store, ns, junk)
        prompts = []
        for i in range(200):
            toks = [1] + [rnd.randrange(3, 500) for _ in range(2047)]
            if hasattr(role, "roots"):  # since connector/roots.py
                root = role.roots.of(_request(f"p{i}", toks))
                role.roots._of.clear()
            else:
                root = role._root(_request(f"p{i}", toks))
                role._roots.clear()
            keys = extend_keys([], root, toks, BLOCK, 32)
            _fill(store, ns, keys)
            prompts.append(toks)
        out["stored_blocks"] = ns.count()
        # lookups: a new request, first call (hashes 63 keys, 32 hit) and a repeat call (memoised keys)
        first, repeat, hits = [], [], 0
        for i, toks in enumerate(prompts):
            req = _request(f"q{i}", toks)
            t = time.perf_counter_ns()
            n, _ = conn.get_num_new_matched_tokens(req, 0)
            first.append(time.perf_counter_ns() - t)
            t = time.perf_counter_ns()
            conn.get_num_new_matched_tokens(req, 0)
            repeat.append(time.perf_counter_ns() - t)
            hits += n
            conn.sched.finished(req.request_id)
            role._roots.pop(req.request_id, None)
        out["lookup_us"] = {
            "first_call": statistics.median(first) / 1e3,
            "repeat_call": statistics.median(repeat) / 1e3,
            "prompt_tokens": 2048,
            "hit_tokens_per_lookup": hits // len(prompts),
        }
        # steps with R running decode requests
        steps = []
        for R in running:
            reqs = []
            for i in range(R):
                toks = [1] + [rnd.randrange(3, 500) for _ in range(255 + rnd.randrange(32))]
                rid = f"r{R}-{i}"
                req = _request(rid, toks)
                conn.get_num_new_matched_tokens(req, 0)
                nblocks = -(-len(toks) // BLOCK) + 8
                reqs.append((rid, toks, list(range(i * 64, i * 64 + nblocks))))
            # the first step: all new (prefill), then decode steps
            new = [
                types.SimpleNamespace(req_id=rid, num_computed_tokens=0, block_ids=[blocks])
                for rid, toks, blocks in reqs
            ]
            so = types.SimpleNamespace(
                scheduled_spec_decode_tokens={},
                scheduled_new_reqs=new,
                num_scheduled_tokens={rid: len(toks) for rid, toks, _ in reqs},
                total_num_scheduled_tokens=sum(len(toks) for _, toks, _ in reqs),
                scheduled_cached_reqs=types.SimpleNamespace(
                    req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
                ),
            )
            conn.build_connector_meta(so)
            _drain(conn)
            times = []
            for _step in range(96):
                computed = []
                for _rid, toks, _ in reqs:
                    computed.append(len(toks))
                    toks.append(rnd.randrange(3, 500))  # the token this step decodes
                cached = types.SimpleNamespace(
                    req_ids=[r[0] for r in reqs],
                    resumed_req_ids=set(),
                    new_block_ids=[None] * R,
                    num_computed_tokens=computed,
                )
                so = types.SimpleNamespace(
                    scheduled_spec_decode_tokens={},
                    scheduled_new_reqs=[],
                    num_scheduled_tokens={r[0]: 1 for r in reqs},
                    total_num_scheduled_tokens=R,
                    scheduled_cached_reqs=cached,
                )
                t = time.perf_counter_ns()
                meta = conn.build_connector_meta(so)
                times.append(time.perf_counter_ns() - t)
                _drain(conn, meta)
            steps.append(
                {
                    "running": R,
                    "median_us": statistics.median(times) / 1e3,
                    "mean_us": statistics.mean(times) / 1e3,
                    "max_us": max(times) / 1e3,
                }
            )
            for rid, _, _ in reqs:
                conn.sched.finished(rid)
                role._roots.pop(rid, None)
        out["step"] = steps
    finally:
        store.close()
    return out


def _drain(conn, meta=None) -> None:
    """Report every planned save written (as the workers would), so reservations commit."""
    from aiokv.jobs import SaveResult, WorkerReport

    if meta is None:
        return
    saves = [SaveResult(t.job, 0, list(t.keys)) for t in meta.plan.saves]
    if saves:
        conn.sched.on_report(WorkerReport(saves=saves), set())


# ------------------------------------------------------------------ 3. per-layer hooks


def hooks(layers: int) -> dict:
    from aiokv.connector.connector import AioKVConnector

    conn = object.__new__(AioKVConnector)
    try:  # the worker role's state: its own object since the connector was split, else the connector's
        from aiokv.connector.worker_role import WorkerRole

        role = conn.worker_role = object.__new__(WorkerRole)
    except ImportError:
        role = conn
    role.worker = None
    conn._connector_metadata = None
    role._layers = None
    n = 200_000
    res = {}
    for name in ("save_kv_layer", "wait_for_layer_load"):
        fn = getattr(conn, name)
        args = ("model.layers.0.self_attn.attn", None, None) if name == "save_kv_layer" else ("model.layers.0",)
        t = time.perf_counter_ns()
        for _ in range(n):
            fn(*args)
        res[name + "_ns"] = (time.perf_counter_ns() - t) / n
    res["per_step_us"] = (res["save_kv_layer_ns"] + res["wait_for_layer_load_ns"]) * layers / 1e3
    res["layers"] = layers
    return res


# ------------------------------------------------------------------ main


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--running", default="64,128,256,512")
    ap.add_argument("--skip-throughput", action="store_true")
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="aiokv-overhead-")
    t0 = time.monotonic()
    try:
        doc = harness.document()
        doc["scheduler"] = scheduler_side([int(x) for x in args.running.split(",")], base)
        doc["hooks"] = hooks(args.layers)
        if not args.skip_throughput:
            doc["throughput"] = throughput(args, base)
            step = doc["throughput"]["step_s_at_batch"]
            for s in doc["scheduler"]["step"]:
                # a decode step of R requests costs at least R/32 of the measured 32-request step
                s["share_of_step_at_batch"] = s["median_us"] * 1e-6 / (step * max(1.0, s["running"] / args.requests))
        doc["seconds"] = round(time.monotonic() - t0, 1)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return harness.emit(doc, args, render)


def render(doc: dict) -> str:
    lines = []
    th = doc.get("throughput")
    if th:
        lines += [
            f"throughput: {th['requests']} requests x {th['new_tokens']} new tokens, prompt {th['prompt']}, "
            f"{th['model']['layers']} layers hidden {th['model']['hidden']}; median tok/s none "
            f"{th['median_tok_s']['none']:.1f}, aiokv {th['median_tok_s']['aiokv']:.1f}; ratio "
            f"{th['ratio']:.3f} (rounds: {', '.join(f'{r:.3f}' for r in th['ratio_per_round'])}); "
            f"decode step at batch {th['requests']}: {th['step_s_at_batch'] * 1e3:.1f} ms",
            "",
        ]
    sc = doc["scheduler"]
    lk = sc["lookup_us"]
    lines += [
        f"lookup (get_num_new_matched_tokens, {lk['prompt_tokens']}-token prompt, {lk['hit_tokens_per_lookup']} "
        f"hit tokens, {sc['stored_blocks']} blocks stored): first call {lk['first_call']:.1f} us, repeat "
        f"{lk['repeat_call']:.1f} us",
        "",
        "| running requests | build_connector_meta per step, median us | mean | max | share of a step |",
        "|---|---|---|---|---|",
    ]
    for s in sc["step"]:
        share = f"{s['share_of_step_at_batch'] * 100:.2f} %" if "share_of_step_at_batch" in s else "-"
        lines.append(f"| {s['running']} | {s['median_us']:.0f} | {s['mean_us']:.0f} | {s['max_us']:.0f} | {share} |")
    h = doc["hooks"]
    lines += [
        "",
        f"hooks with nothing to do: save_kv_layer {h['save_kv_layer_ns']:.0f} ns, wait_for_layer_load "
        f"{h['wait_for_layer_load_ns']:.0f} ns per call; {h['per_step_us']:.2f} us per step "
        f"({h['layers']} layers)",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
