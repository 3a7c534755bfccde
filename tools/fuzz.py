#!/usr/bin/env python3
"""A seeded fuzz of aiokv on the real vLLM engine (CPU).

    PYTHONPATH=. .venv/bin/python tools/fuzz.py --steps N [--seed S] [--lives L] [--dir DIR]
        [--prompts P] [--fault-every K] [--life-timeout S]

Each life prints a progress line (JSON) on stderr; the summary (with totals)
goes to stdout at the end.

Each life is a fresh process (a restart on the same cache directory) driving
vLLM step by step with random arrivals, prompt lengths and shared prefixes,
random aborts, and a KV cache small enough to preempt. With --fault-every K,
every K-th life runs with the test-only I/O fault injector (aiokv/io/faults.py)
breaking some reads (EIO, short, late, flipped bytes) and writes (EIO): load
and save errors are then expected and allowed, every other check still holds
(and the circuit breaker may open). After every step it checks:
- every block a save reads or a load writes belongs, at that moment, to the
  request it is for (no block read or written after release);
- staging slots in use never exceed the pool, pins are held only by loads in
  flight, pending saves only by reserved slots.
At the end of each life: every request that was not aborted produced the same
tokens as a run without aiokv; the engine's free block count, pins, pending
saves, staging and in-flight jobs are back to baseline; load errors = 0 (in
lives without faults).
At the end of the fuzz: a sample of stored blocks is compared with a fresh
recomputation of its prefix (bytes within float tolerance).
Exit 0 if every check held; prints a JSON summary.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BS = 32


def make_prefixes(rnd: random.Random) -> list[list[int]]:
    """System prompts shared by requests of every life (so restarts hit)."""
    return [[rnd.randrange(3, 500) for _ in range(rnd.choice([40, 64, 100, 150, 220]))] for _ in range(5)]


def make_prompts(rnd: random.Random, n: int, prefixes: list[list[int]]) -> list[list[int]]:
    out = []
    for _ in range(n):
        pre = rnd.choice(prefixes) if rnd.random() < 0.7 else []
        length = rnd.randrange(5, 300)
        out.append([1] + pre[:length] + [rnd.randrange(3, 500) for _ in range(max(0, length - len(pre)))])
    return out


# ---------------------------------------------------------------- one life (child process)

def life(args) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    spec = _load_spec(args.life)
    rnd = random.Random(spec["seed"])
    extra = {"path": spec["cache"], "capacity": spec.get("capacity", "64MiB"), "staging": "4MiB"}
    # vLLM's own prefix cache is off so that a freed block holds nothing anyone may
    # read: the fuzz poisons it, and any read after release shows in the tokens.
    kw = dict(model=spec["model"], tokenizer=spec["model"], enforce_eager=True, block_size=BS, dtype="float32",
              enable_prefix_caching=False, max_model_len=512, seed=0, num_gpu_blocks_override=spec["blocks"],
              kv_cache_memory_bytes=256 << 20, max_num_seqs=6)
    if spec["cache"]:
        kw["kv_transfer_config"] = {"kv_connector": "AioKVConnector", "kv_role": "kv_both",
                                    "kv_connector_module_path": "aiokv.connector", "kv_connector_extra_config": extra}
    llm = LLM(**kw)
    engine = llm.llm_engine
    sched = engine.engine_core.engine_core.scheduler
    manager = sched.kv_cache_manager.coordinator.single_type_managers[0]
    violations: list[str] = []
    counts = {"preemptions": 0}
    preempt = sched._preempt_request

    def counting_preempt(*a, **k):
        counts["preemptions"] += 1
        return preempt(*a, **k)

    sched._preempt_request = counting_preempt
    wc = get_kv_transfer_group() if spec["cache"] else None
    if wc is not None and wc.worker is not None:
        pool = sched.kv_cache_manager.block_pool
        free_blocks = pool.free_blocks
        views = [layer.view for layer in wc.worker.device.layers]

        def poisoning_free(blocks):
            blocks = list(blocks)
            free_blocks(blocks)
            for b in blocks:
                if b.ref_cnt == 0 and b.block_id:
                    for v in views:
                        v[b.block_id].fill_(7.0)  # finite: masked positions must stay harmless
            counts["poisoned"] = counts.get("poisoned", 0) + len(blocks)

        pool.free_blocks = poisoning_free
    conn = sched.connector

    def owned(req_id: str) -> set[int]:
        return {b.block_id for b in manager.req_to_blocks.get(req_id, ())}

    if wc is not None:
        # invariant checks wrapped around the worker's entry points (same thread as vLLM's step)
        w = wc.worker
        orig_save, orig_load = w.save, w.load

        def save(transfers):
            for t in transfers:
                if not set(t.block_ids) <= owned(t.req_id):
                    violations.append(f"save of {t.req_id} reads blocks it does not own: {t.block_ids}")
            return orig_save(transfers)

        def load(transfers):
            for t in transfers:
                if not set(t.block_ids) <= owned(t.req_id):
                    violations.append(f"load of {t.req_id} writes blocks it does not own: {t.block_ids}")
            return orig_load(transfers)

        w.save, w.load = save, load

    prompts = spec["prompts"]
    order = list(range(len(prompts)))
    rnd.shuffle(order)
    live: dict[str, int] = {}
    outs: dict[int, list[int] | None] = {}
    steps = 0
    deadline = time.monotonic() + spec.get("timeout", 600)
    while (order or engine.has_unfinished_requests()) and steps < spec["steps"] and time.monotonic() < deadline:
        for _ in range(rnd.choice([0, 0, 1, 1, 2, 3])):
            if order:
                i = order.pop()
                rid = f"p{i}-{spec['life']}"
                engine.add_request(rid, {"prompt_token_ids": prompts[i]},
                                   SamplingParams(temperature=0, max_tokens=rnd.randrange(1, 24), ignore_eos=True))
                live[rid] = i
        if live and rnd.random() < spec.get("abort_p", 0.06):
            rid = rnd.choice(sorted(live))
            engine.abort_request([rid])
            outs[live.pop(rid)] = None
        for o in engine.step():
            if o.finished and o.request_id in live:
                outs[live.pop(o.request_id)] = list(o.outputs[0].token_ids)
        steps += 1
        if wc is not None and wc.worker is not None:
            c = conn.counters()
            if wc.worker.pool.in_use > wc.worker.pool.count:
                violations.append("staging over-committed")
            if c["pinned"] and not conn.sched._loading:
                violations.append(f"{c['pinned']} pins without a load in flight")
    for rid in list(live):  # the step budget ran out: abort the rest
        engine.abort_request([rid])
        outs[live.pop(rid)] = None
    for _ in range(3000):
        if wc is not None and wc.worker is not None:
            wc.worker.drain()
        if not sched.has_requests():
            break
        engine.step()
    res = {"outs": {str(k): v for k, v in outs.items()}, "steps": steps, "violations": violations,
           "preemptions": counts["preemptions"], "poisoned": counts.get("poisoned", 0)}
    pool = sched.kv_cache_manager.block_pool
    res["leaked_blocks"] = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()
    res["requests_left"] = len(sched.requests)
    if conn is not None:
        res["counters"] = {**conn.counters(), **wc.counters()}
    engine.engine_core.engine_core.shutdown()
    return res


def _load_spec(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


# the I/O faults of a fault life: some of each kind, never all (hits must still happen).
# No flipped writes: the final check compares stored bytes with a recomputation.
FAULTS = [{"op": "read", "kind": "eio", "every": 9}, {"op": "read", "kind": "short", "every": 13},
          {"op": "read", "kind": "flip", "every": 17}, {"op": "read", "kind": "late", "every": 5, "delay": 0.05},
          {"op": "write", "kind": "eio", "every": 11}]


def _child(flag: str, spec: dict, timeout: float) -> dict:
    """Run one child process (a life or the final check); the spec travels in a file."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        env = dict(os.environ, PYTHONPATH=ROOT, VLLM_LOGGING_LEVEL="ERROR")
        if spec.get("faults"):
            from aiokv.io.faults import ACK

            env.update(AIOKV_FAULTS=json.dumps(spec["faults"]), AIOKV_FAULTS_ACK=ACK)
        p = subprocess.run([sys.executable, os.path.abspath(__file__), flag, f.name], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=timeout)
    finally:
        os.unlink(f.name)
    for line in p.stdout.splitlines():
        if line.startswith("LIFE "):
            return json.loads(line[5:])
    raise RuntimeError(f"fuzz {flag} failed (exit {p.returncode}):\n{p.stderr[-5000:]}")


def run_life(spec: dict) -> dict:
    return _child("--life", spec, spec.get("timeout", 600) + 300)


# ---------------------------------------------------------------- stored bytes vs recomputation

def check_stored_bytes(args) -> dict:
    """In a fresh engine without hits (empty cache elsewhere), recompute sampled
    prefixes and compare their KV blocks with the stored payloads."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import ctypes

    import torch
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from aiokv.keys import extend_keys, request_root
    from aiokv.store import Store
    from aiokv.store import format as fmt
    from aiokv.store.blockio import data_path
    from aiokv.store.store import ns_dir

    spec = _load_spec(args.check)
    import shutil

    shutil.rmtree(spec["scratch"], ignore_errors=True)  # must be empty: no hits in the recomputation
    store = Store(spec["cache"], readonly=True)
    (ns,) = store.index.namespaces.values()
    root = request_root(ns.nsid, [])
    by_key = {}
    for p in spec["prompts"]:
        keys = extend_keys([], root, p, BS, (len(p) - 1) // BS)
        for i, k in enumerate(keys):
            if k in ns.entries:
                by_key.setdefault(k, (p, i))
    sample = sorted(by_key.items())[: spec.get("sample", 40)]
    llm = LLM(model=spec["model"], tokenizer=spec["model"], enforce_eager=True, block_size=BS, dtype="float32",
              enable_prefix_caching=False, max_model_len=512, seed=0, kv_cache_memory_bytes=64 << 20,
              kv_transfer_config={"kv_connector": "AioKVConnector", "kv_role": "kv_both",
                                  "kv_connector_module_path": "aiokv.connector",
                                  # a capacity below one block: it never stores, so it never hits; it is
                                  # here only to hand us the KV tensors in payload order
                                  "kv_connector_extra_config": {"path": spec["scratch"], "staging": "4MiB",
                                                                "capacity": "4KiB"}})
    engine = llm.llm_engine
    sched = engine.engine_core.engine_core.scheduler
    manager = sched.kv_cache_manager.coordinator.single_type_managers[0]
    layers = get_kv_transfer_group().worker.device.layers
    fd = os.open(data_path(ns_dir(spec["cache"], ns.nsid), 0), os.O_RDONLY)
    worst, bad, n = 0.0, [], 0
    for key, (prompt, idx) in sample:
        rid = f"c{n}"
        n += 1
        engine.add_request(rid, {"prompt_token_ids": prompt[:(idx + 1) * BS + 1]},
                           SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
        engine.step()  # prefill: the block's KV is computed from its own prefix only
        internal = next(k for k in sched.requests if k == rid or k.startswith(rid + "-"))  # vLLM adds a suffix
        if sched.requests[internal].num_computed_tokens <= (idx + 1) * BS:
            r = sched.requests[internal]
            raise RuntimeError(f"request {rid} was not prefilled in one step: {r.status} {r.num_computed_tokens} {len(prompt)} {idx}")
        block = manager.req_to_blocks[internal][idx].block_id
        raw = os.pread(fd, ns.slot_bytes, ns.entries[key] * ns.slot_bytes)
        off = fmt.HEADER_BYTES
        for layer in layers:
            stored = torch.frombuffer(bytearray(raw[off:off + layer.nbytes]), dtype=layer.dtype)
            fresh = layer.view[block].reshape(-1)
            diff = (stored - fresh).abs().max().item()
            worst = max(worst, diff)
            if not torch.allclose(stored, fresh, rtol=1e-3, atol=1e-3):
                bad.append(f"{key.hex()[:12]} layer {layer.name}: max diff {diff:.3g}")
            off += layer.nbytes
        engine.abort_request([rid])
        while sched.has_requests():
            engine.step()
    os.close(fd)
    store.close()
    del ctypes
    return {"checked": n, "worst_abs_diff": worst, "bad": bad}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=150, help="engine steps per life")
    ap.add_argument("--lives", type=int, default=3, help="engine lives (restarts) on the same cache")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--blocks", type=int, default=28, help="vLLM KV blocks (small: preemption)")
    ap.add_argument("--capacity", default="8MiB", help="aiokv capacity (small: eviction)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--fault-every", type=int, default=0, help="every K-th life runs with I/O faults (0: none)")
    ap.add_argument("--life-timeout", type=float, default=600, help="seconds one life may step")
    ap.add_argument("--life", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--check", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.life:
        print("LIFE " + json.dumps(life(args)), flush=True)
        os._exit(0)
    if args.check:
        print("LIFE " + json.dumps(check_stored_bytes(args)), flush=True)
        os._exit(0)
    import tempfile

    sys.path.insert(0, ROOT)
    from aiokv.demo.tiny_model import build

    d = args.dir or tempfile.mkdtemp(prefix="aiokv-fuzz-")
    model = build(os.path.join(d, "model"), layers=2, hidden=128, heads=2, kv_heads=2, intermediate=256)
    cache = os.path.join(d, "cache")
    import shutil

    shutil.rmtree(cache, ignore_errors=True)  # every fuzz starts from an empty cache
    rnd = random.Random(args.seed)
    summary = {"seed": args.seed, "lives": [], "ok": True}
    t0 = time.monotonic()
    all_prompts: list[list[int]] = []
    prefixes = make_prefixes(rnd)
    for n in range(args.lives):
        ps = make_prompts(rnd, args.prompts, prefixes)
        all_prompts += ps
        common = dict(model=model, prompts=ps, steps=args.steps, blocks=args.blocks, life=n, capacity=args.capacity,
                      timeout=args.life_timeout)
        faulty = bool(args.fault_every) and n % args.fault_every == args.fault_every - 1
        got = run_life(dict(common, cache=cache, seed=args.seed * 100 + n, faults=FAULTS if faulty else None))
        # the reference: the same prompts without aiokv, one at a time, no aborts, no step limit
        finished = [int(k) for k, v in got["outs"].items() if v is not None]
        ref = run_life(dict(common, cache=None, seed=0, prompts=[ps[i] for i in finished], steps=10**6, abort_p=0,
                            blocks=args.blocks))
        problems = list(got["violations"])
        # the reference ran with its own random max_tokens: compare the common prefix of outputs
        ref_outs = {finished[int(k)]: v for k, v in ref["outs"].items()}
        for i in finished:
            a, b = got["outs"][str(i)], ref_outs.get(i)
            m = min(len(a), len(b or []))
            if b is None or a[:m] != b[:m]:
                problems.append(f"prompt {i}: tokens differ from the run without aiokv")
        c = got.get("counters", {})
        if got["leaked_blocks"] or got["requests_left"]:
            problems.append(f"leaked {got['leaked_blocks']} blocks, {got['requests_left']} requests")
        for name in ("pending_saves", "pinned", "worker_in_flight", "staging_in_use") + (
                () if faulty else ("load_failed_blocks", "load_bad_blocks")):
            if c.get(name):
                problems.append(f"{name} = {c[name]} at the end")
        if (c.get("loads_ok_blocks", 0) + c.get("load_failed_blocks", 0) + c.get("load_cancelled_blocks", 0)
                != c.get("hit_blocks", 0)):
            problems.append("loads do not add up to hits")
        summary["lives"].append({"life": n, "faults": faulty, "steps": got["steps"], "finished": len(finished),
                                 "preemptions": got["preemptions"], "poisoned_blocks": got["poisoned"],
                                 "aborted": sum(v is None for v in got["outs"].values()),
                                 "hit_blocks": c.get("hit_blocks"), "saves": c.get("saves_committed"),
                                 "evictions": c.get("store_evictions"), "load_failed_blocks": c.get("load_failed_blocks", 0),
                                 "save_failed_blocks": c.get("save_failed_blocks", 0), "problems": problems})
        summary["ok"] &= not problems
        # progress, so that a long run that is stopped still leaves its figures
        print(json.dumps(dict(summary["lives"][-1], seconds=round(time.monotonic() - t0))), file=sys.stderr, flush=True)
    chk = run_life_check(dict(model=model, cache=cache, scratch=os.path.join(d, "scratch"), prompts=all_prompts))
    summary["stored_bytes"] = chk
    summary["ok"] &= not chk["bad"] and chk["checked"] > 0
    lives = summary["lives"]
    summary["totals"] = {k: sum(life[k] or 0 for life in lives) for k in (
        "steps", "finished", "aborted", "preemptions", "poisoned_blocks", "hit_blocks", "saves", "evictions",
        "load_failed_blocks", "save_failed_blocks")}
    summary["totals"]["problems"] = sum(len(life["problems"]) for life in lives)
    summary["totals"]["fault_lives"] = sum(life["faults"] for life in lives)
    summary["seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps(summary, indent=1))
    return 0 if summary["ok"] else 1


def run_life_check(spec: dict) -> dict:
    return _child("--check", spec, 900)


if __name__ == "__main__":
    sys.exit(main())
