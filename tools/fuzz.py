#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""A seeded fuzz of aiokv on the real vLLM engine (CPU).

    PYTHONPATH=. .venv/bin/python tools/fuzz.py --steps N [--seed S] [--lives L] [--dir DIR]
        [--prompts P] [--fault-every K] [--store-faults P] [--random-settings] [--life-timeout S]
        [--time-budget S]

Each life prints a progress line (JSON) on stderr; the summary (with totals)
goes to stdout at the end.

Each life is a fresh process (a restart on the same cache directory) driving
vLLM step by step with random arrivals, prompt lengths and shared prefixes,
random aborts, and a KV cache small enough to preempt. With --fault-every K,
every K-th life runs with the test-only I/O fault injector (aiokv/data/faults.py)
breaking some reads (EIO, short, late, flipped bytes: a checksum failure, held
past the life's load_timeout: a timeout) and writes (EIO), and with slots of
committed blocks rewritten with another block or punched behind the store's
back (what another engine does when it evicts a block we are about to read):
load and save errors are then expected and allowed, every other check still
holds, tokens included (and the circuit breaker may open). With --store-faults P,
each store call of the scheduler side raises with probability P in every life
(tools/store_faults.py): load and save errors are then allowed too, and every save
and load is checked against vLLM's block tables (the block holds its key's tokens);
at the end no reservation may be left in the store and no load reported twice. With
--random-settings, every life draws aiokv's settings from their accepted ranges, bounds
included (SETTINGS: depths, sizes below a block, timeouts from 10 ms to a day, the breaker,
checksum threads, admission and its window, a secret or none, ...): a life whose load timeout
is under a second, or whose secret is not the last life's, may have load errors; every other
check holds.
After every step it checks:
- every block a save reads or a load writes belongs, at that moment, to the
  request it is for (no block read or written after release);
- staging buffers in use never exceed the pool, pins are held only by loads in
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
import math
import os
import random
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BS = 32
# family -> (dtype, block size (None: vLLM's), vLLM prefix cache on, longest prompt, default vLLM blocks,
#            tokens exact). The bf16 hybrid's tokens depend on how vLLM chunks a prefill even without
#            aiokv (measured: 2 of 16 prompts differ between token budgets 512 and 128), and hits change
#            the chunking of the requests beside them: there a token difference is reported, not failed;
#            ownership, leaks, load accounting and stored bytes are checked as for every family.
FAMILIES = {
    "llama": ("float32", BS, False, 300, 28, True),
    "gemma2": ("float32", BS, False, 300, 40, True),
    "mistral": ("float32", BS, False, 300, 28, True),
    "hybrid": ("bfloat16", None, True, 450, 40, False),
}


def engine_kw(spec: dict) -> dict:
    dtype, bs, prefix_cache, _, _, _ = FAMILIES[spec.get("family", "llama")]
    kw = dict(
        model=spec["model"],
        tokenizer=spec["model"],
        enforce_eager=True,
        dtype=dtype,
        enable_prefix_caching=prefix_cache,
        max_model_len=512,
        seed=0,
    )
    if bs:
        kw["block_size"] = bs
    return kw


def build_model(family: str, path: str) -> str:
    from aiokv.demo import tiny_model

    if family == "llama":
        return tiny_model.build(path, layers=2, hidden=128, heads=2, kv_heads=2, intermediate=256)
    return getattr(tiny_model, f"build_{family}")(path)


def make_prefixes(rnd: random.Random) -> list[list[int]]:
    """System prompts shared by requests of every life (so restarts hit)."""
    return [[rnd.randrange(3, 500) for _ in range(rnd.choice([40, 64, 100, 150, 220]))] for _ in range(5)]


def make_prompts(rnd: random.Random, n: int, prefixes: list[list[int]], longest: int = 300) -> list[list[int]]:
    out = []
    for _ in range(n):
        pre = rnd.choice(prefixes) if rnd.random() < 0.7 else []
        length = rnd.randrange(5, longest)
        out.append([1] + pre[:length] + [rnd.randrange(3, 500) for _ in range(max(0, length - len(pre)))])
    return out


# every life's settings with --random-settings: each drawn from its accepted range (README's
# settings table, aiokv/config.py), its bounds included, the sizes of memory the machine must
# populate capped at 64 MiB. Left as they are: path (the lives of a run share one directory; the
# several-drive tests change it), the bucket tier and its settings (no server here), and
# strict_load_failures (it makes a failed load fail its request, by design)
SETTINGS = {
    "capacity": ["64MiB", "8MiB", 1, 10**30],  # (the run's --capacity in most lives: see draw_settings)
    "staging": [1, 65536, "4MiB", "64MiB"],
    "memory": [0, 1, 65536, "4MiB", "64MiB"],
    "io": ["auto", "uring", "threads"],
    "queue_depth": [1, 2, 16384],  # (or log-uniform between)
    "load_timeout": [0.01, 0.5, 30.0, 86400.0],
    "save_timeout": [0.01, 0.5, 60.0, 86400.0],
    "fs_timeout": [0.01, 0.5, 2.0, 86400.0],
    "start_timeout": [1.0, 60.0, 86400.0],
    "breaker_failures": [0, 1, 3, 10**18],
    "breaker_cooldown": [5e-324, 0.5, 30.0, 86400.0],
    "checksum_threads": [0, 1, 4, 64],
    "admit": ["all", "all", "reused"],
    "admit_window": [1, 1 << 30],  # (or log-uniform between)
    "save_generated": [True, False],
    "layerwise": [True, False],
    "kv_events": [True, False],
    "secret": [None, "fuzz-secret-0123456789"],
}


def draw_settings(rnd: random.Random, capacity: str) -> dict:
    """One life's settings: each present with probability 1/2, at a value of SETTINGS (a bound or a
    common value) or, for the whole-number ranges, log-uniform within them; capacity is the run's
    in 3 lives of 4. The config must accept every draw (checked here, in the parent)."""
    from aiokv.config import AioKVConfig

    out = {}
    for name, values in SETTINGS.items():
        if rnd.random() < 0.5:
            continue
        v = rnd.choice(values)
        if name in ("queue_depth", "admit_window") and rnd.random() < 0.5:
            v = int(round(2 ** rnd.uniform(0, math.log2(values[-1]))))
        if name == "capacity" and rnd.random() < 0.75:
            v = capacity
        if v is not None:
            out[name] = v
    AioKVConfig.from_extra(dict(out, path="/tmp/fuzz"))  # raises if a draw is refused
    return out


# ---------------------------------------------------------------- one life (child process)


def life(args) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    spec = _load_spec(args.life)
    rnd = random.Random(spec["seed"])
    extra = {"path": spec["cache"], "capacity": spec.get("capacity", "64MiB"), "staging": "4MiB"}
    extra.update(spec.get("settings") or {})  # --random-settings: this life's draw (draw_settings)
    if spec.get("faults"):
        # a read held up past this is a load timeout (FAULTS' slow rule); a short cool-down lets
        # the breaker reopen hits within the life, so every kind of failure keeps being exercised;
        extra.update(load_timeout=LOAD_TIMEOUT, breaker_cooldown=1.0, memory=0)  # every hit read from disk
    # vLLM's own prefix cache is off (but for the hybrid family, whose align mode needs it)
    # so that a freed block holds nothing anyone may read: the fuzz poisons it, and any
    # read after release shows in the tokens.
    kw = dict(engine_kw(spec), num_gpu_blocks_override=spec["blocks"], kv_cache_memory_bytes=256 << 20, max_num_seqs=6)
    if spec["cache"]:
        kw["kv_transfer_config"] = {
            "kv_connector": "AioKVConnector",
            "kv_role": "kv_both",
            "kv_connector_module_path": "aiokv.connector",
            "kv_connector_extra_config": extra,
        }
    llm = LLM(**kw)
    engine = llm.llm_engine
    sched = engine.engine_core.engine_core.scheduler
    managers = sched.kv_cache_manager.coordinator.single_type_managers
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
        views = [layer.view for dev in wc.worker.devices for layer in dev.layers]  # every group's layers

        def poisoning_free(blocks):
            blocks = list(blocks)
            free_blocks(blocks)
            for b in blocks:
                # a block still in vLLM's own prefix cache (hybrid family) may be read again: not poisoned
                if b.ref_cnt == 0 and b.block_id and b.block_hash is None:
                    for v in views:
                        v[b.block_id].fill_(7.0)  # finite: masked positions must stay harmless
            counts["poisoned"] = counts.get("poisoned", 0) + len(blocks)

        pool.free_blocks = poisoning_free
    conn = sched.connector

    def owned(req_id: str, group: int) -> set[int]:
        return {b.block_id for b in managers[group].req_to_blocks.get(req_id, ()) if b.block_id}

    if wc is not None:
        # invariant checks wrapped around the worker's entry points (same thread as vLLM's step)
        w = wc.worker
        orig_save, orig_load = w.save, w.load

        def save(transfers):
            for t in transfers:
                if not set(t.block_ids) <= owned(t.req_id, t.group):
                    violations.append(f"save of {t.req_id} reads blocks it does not own: {t.block_ids}")
            return orig_save(transfers)

        def load(transfers):
            for t in transfers:
                # (a load whose key went missing carries slot -1: it writes nothing)
                if not {b for b, s in zip(t.block_ids, t.locations) if s >= 0} <= owned(t.req_id, t.group):
                    violations.append(f"load of {t.req_id} writes blocks it does not own: {t.block_ids}")
            return orig_load(transfers)

        w.save, w.load = save, load
    faulty = _store_faults(spec, conn, wc, managers, violations)

    prompts = spec["prompts"]
    order = list(range(len(prompts)))
    rnd.shuffle(order)
    live: dict[str, int] = {}
    outs: dict[int, list[int] | None] = {}
    spoiled: list[str] = []  # (namespace hex, key hex) of slots "another engine" rewrote or punched
    steps = 0
    deadline = time.monotonic() + spec.get("timeout", 600)
    while (order or engine.has_unfinished_requests()) and steps < spec["steps"] and time.monotonic() < deadline:
        for _ in range(rnd.choice([0, 0, 1, 1, 2, 3])):
            if order:
                i = order.pop()
                rid = f"p{i}-{spec['life']}"
                engine.add_request(
                    rid,
                    {"prompt_token_ids": prompts[i]},
                    SamplingParams(temperature=0, max_tokens=rnd.randrange(1, 24), ignore_eos=True),
                )
                live[rid] = i
        if live and rnd.random() < spec.get("abort_p", 0.06):
            rid = rnd.choice(sorted(live))
            engine.abort_request([rid])
            outs[live.pop(rid)] = None
        for o in engine.step():
            if o.finished and o.request_id in live:
                outs[live.pop(o.request_id)] = list(o.outputs[0].token_ids)
        steps += 1
        if spec.get("faults") and wc is not None and rnd.random() < spec.get("spoil_p", 0.08):
            spoiled += spoil_slot(conn, rnd)
        if wc is not None and wc.worker is not None:
            c = conn.counters()
            if wc.worker.pool.in_use > wc.worker.pool.count:
                violations.append("staging over-committed")
            # pins are held by loads in flight, or by unpins the store refused, retried next step
            if c["pinned"] and not conn.sched.loads_in_flight and not conn.sched.give_backs_pending:
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
    if spoiled:  # nothing is in flight any more
        # the other engine's journal says it dropped them (its DROP records reach us): the
        # next lives, fault-free ones included, are not offered a slot it rewrote
        for g in conn.sched.groups:
            mine = {x.split(":")[1] for x in spoiled if x.split(":")[0] == g.ns.nsid.hex()}
            conn.sched.store.drop(g.ns, [k for k in g.ns.keys(g.ns.engine) if k.hex() in mine], corrupt=False)
    res = {
        "outs": {str(k): v for k, v in outs.items()},
        "steps": steps,
        "violations": violations,
        "spoiled": spoiled,
        "preemptions": counts["preemptions"],
        "poisoned": counts.get("poisoned", 0),
    }
    pool = sched.kv_cache_manager.block_pool
    res["leaked_blocks"] = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()
    res["requests_left"] = len(sched.requests)
    if conn is not None:
        res["counters"] = {**conn.counters(), **wc.counters()}
    if faulty is not None:
        import store_faults

        res["store_faults"] = store_faults.summary(faulty)
    engine.engine_core.engine_core.shutdown()
    return res


def _store_faults(spec: dict, conn, wc, managers, violations: list[str]):
    """--store-faults: the scheduler side's store calls raise at random (tools/store_faults.py)."""
    if not spec.get("store_faults") or conn is None or conn.sched is None or wc is None or wc.worker is None:
        return None
    import store_faults

    return store_faults.install(conn, wc, managers, spec["store_faults"], spec["seed"], violations)


def _store_fault_problems(got: dict) -> list[str]:
    """What a life with --store-faults must not leave behind."""
    out = []
    sf, c = got.get("store_faults"), got.get("counters", {})
    if sf is not None and sf["pending_reservations"]:
        out.append(f"{sf['pending_reservations']} store reservations never given back")
    if c.get("load_report_breaches"):
        out.append(f"{c['load_report_breaches']} loads not reported exactly once")
    return out


def spoil_slot(conn, rnd: random.Random) -> list[str]:
    """What another engine on the directory does to a block we are about to read: it
    evicted it and reused the slot for another key (the slot now holds another block,
    well formed), or punched it (zeros). Done to one of our own committed blocks,
    behind the store's back; returns ["nsid:key"] of the block spoiled (or [])."""
    from aiokv import _native
    from aiokv.data.slotfile import data_path
    from aiokv.store.store import ns_dir

    g = rnd.choice(conn.sched.groups)
    ns = g.ns
    own = sorted((k, ns.block(k)[0]) for k in ns.keys(ns.engine))
    if len(own) < 2:
        return []
    (key, slot), (_, other) = rnd.sample(own, 2)
    store = conn.sched.store
    for rank in range(ns.ranks):
        fd = os.open(data_path(ns_dir(store.root, ns.nsid), rank, store.engine), os.O_RDWR)
        try:
            if rnd.random() < 0.5:
                os.pwrite(fd, os.pread(fd, ns.slot_bytes, other * ns.slot_bytes), slot * ns.slot_bytes)
            else:
                _native.fallocate(
                    fd, _native.FALLOC_FL_PUNCH_HOLE | _native.FALLOC_FL_KEEP_SIZE, slot * ns.slot_bytes, ns.slot_bytes
                )
            os.fsync(fd)
        finally:
            os.close(fd)
    return [f"{ns.nsid.hex()}:{key.hex()}"]


def _load_spec(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


# the I/O faults of a fault life: some of each kind, never all (hits must still happen).
# Load failures: EIO, a short read, a checksum failure (a flipped byte), a timeout (a read held
# past LOAD_TIMEOUT), and (spoil_slot, from the life's loop) a slot another engine evicted and
# rewrote or punched. No flipped writes: the final check compares stored bytes with a recomputation.
LOAD_TIMEOUT = 0.5
FAULTS = [
    {"op": "read", "kind": "eio", "every": 9},
    {"op": "read", "kind": "short", "every": 13},
    {"op": "read", "kind": "flip", "every": 17},
    {"op": "read", "kind": "late", "every": 23, "delay": 1.0},
    {"op": "read", "kind": "late", "every": 5, "delay": 0.05},
    {"op": "write", "kind": "eio", "every": 11},
]


def _child(flag: str, spec: dict, timeout: float) -> dict:
    """Run one child process (a life or the final check); the spec travels in a file."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        env = dict(os.environ, PYTHONPATH=ROOT, VLLM_LOGGING_LEVEL="ERROR")
        if spec.get("faults"):
            from aiokv.data.faults import ACK

            env.update(AIOKV_FAULTS=json.dumps(spec["faults"]), AIOKV_FAULTS_ACK=ACK)
        argv = [os.path.abspath(__file__), flag, f.name]
        out, err, rc = _forked(argv, env, timeout)
        if rc is None:
            p = subprocess.run(
                [sys.executable] + argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
            )
            out, err, rc = p.stdout, p.stderr, p.returncode
    finally:
        os.unlink(f.name)
    for line in out.splitlines():
        if line.startswith("LIFE "):
            return json.loads(line[5:])
    raise RuntimeError(f"fuzz {flag} failed (exit {rc}):\n{err[-5000:]}")


def _forked(argv: list[str], env: dict, timeout: float) -> tuple[str, str, int | None]:
    """A child forked from a server that imported torch and vLLM once (tools/forkserver.py):
    (stdout, stderr, exit code); exit code None where the environment does not allow it."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    from forkserver import shared

    server = shared(ROOT)
    got = server.captured(argv, env, timeout) if server is not None else None
    return got if got is not None else ("", "", None)


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

    from aiokv.data import format as fmt
    from aiokv.data.slotfile import data_path
    from aiokv.scheduler.keys import extend_keys, namespace_id, request_root
    from aiokv.store import Store
    from aiokv.store.store import ns_dir

    spec = _load_spec(args.check)
    import shutil

    shutil.rmtree(spec["scratch"], ignore_errors=True)  # must be empty: no hits in the recomputation
    store = Store(spec["cache"], readonly=True)
    # the full-attention group's namespace (or the only one): its blocks are plain KV of their prefix
    spaces = sorted(store.index.namespaces.values(), key=lambda n: n.fields.get("group", 0))
    ns = next(
        (n for n in spaces if "groups" in n.fields and n.fields["groups"][n.fields.get("group", 0)]["kind"] == "full"),
        spaces[0],
    )
    group = ns.fields.get("group", 0)
    model_fields = {k: v for k, v in ns.fields.items() if k != "group"}
    root = request_root(namespace_id(model_fields) if "groups" in ns.fields else ns.nsid, [])
    llm = LLM(
        **engine_kw(spec),
        kv_cache_memory_bytes=64 << 20,
        kv_transfer_config={
            "kv_connector": "AioKVConnector",
            "kv_role": "kv_both",
            "kv_connector_module_path": "aiokv.connector",
            # a capacity below one block: it never stores, so it never hits; it is
            # here only to hand us the KV tensors in payload order
            "kv_connector_extra_config": {"path": spec["scratch"], "staging": "4MiB", "capacity": "4KiB"},
        },
    )
    engine = llm.llm_engine
    sched = engine.engine_core.engine_core.scheduler
    bs = sched.kv_cache_manager.coordinator.single_type_managers[group].block_size
    by_key = {}
    spoiled = set(spec.get("spoiled", ()))  # rewritten behind the store's back: not aiokv's bytes
    for p in spec["prompts"]:
        keys = extend_keys([], root, p, bs, (len(p) - 1) // bs)
        for i, k in enumerate(keys):
            if ns.has(k) and f"{ns.nsid.hex()}:{k.hex()}" not in spoiled:
                by_key.setdefault(k, (p, i))
    sample = sorted(by_key.items())[: spec.get("sample", 40)]
    manager = sched.kv_cache_manager.coordinator.single_type_managers[group]
    layers = get_kv_transfer_group().worker.workers[group].device.layers
    tol = 2e-2 if FAMILIES[spec.get("family", "llama")][0] == "bfloat16" else 1e-3
    fd = os.open(data_path(ns_dir(spec["cache"], ns.nsid), 0), os.O_RDONLY)
    worst, bad, n = 0.0, [], 0
    for key, (prompt, idx) in sample:
        rid = f"c{n}"
        n += 1
        engine.add_request(
            rid,
            {"prompt_token_ids": prompt[: (idx + 1) * bs + 1]},
            SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
        )
        internal = None
        for _ in range(3):  # prefill (align mode splits it at the last block end): the block's KV
            engine.step()  # is computed from its own prefix only
            internal = next(k for k in sched.requests if k == rid or k.startswith(rid + "-"))  # vLLM adds a suffix
            if sched.requests[internal].num_computed_tokens >= (idx + 1) * bs:
                break
        if sched.requests[internal].num_computed_tokens < (idx + 1) * bs:
            r = sched.requests[internal]
            raise RuntimeError(
                f"request {rid} was not prefilled in one step: {r.status} {r.num_computed_tokens} {len(prompt)} {idx}"
            )
        block = manager.req_to_blocks[internal][idx].block_id
        raw = os.pread(fd, ns.slot_bytes, ns.where(key) * ns.slot_bytes)
        off = fmt.HEADER_BYTES
        for layer in layers:
            stored = torch.frombuffer(bytearray(raw[off : off + layer.nbytes]), dtype=layer.dtype)
            fresh = layer.view[block].reshape(-1)
            diff = (stored.float() - fresh.float()).abs().max().item()
            worst = max(worst, diff)
            if not torch.allclose(stored.float(), fresh.float(), rtol=tol, atol=tol):
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
    ap.add_argument("--blocks", type=int, default=0, help="vLLM KV blocks (small: preemption; 0: the family's)")
    ap.add_argument("--family", default="llama", choices=sorted(FAMILIES), help="the tiny model's family")
    ap.add_argument("--capacity", default="8MiB", help="aiokv capacity (small: eviction)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--fault-every", type=int, default=0, help="every K-th life runs with I/O faults (0: none)")
    ap.add_argument(
        "--store-faults",
        type=float,
        default=0.0,
        help="probability that a store call of the scheduler side raises (every life)",
    )
    ap.add_argument(
        "--random-settings",
        action="store_true",
        help="every life draws its settings from their accepted ranges (SETTINGS, draw_settings)",
    )
    ap.add_argument("--life-timeout", type=float, default=600, help="seconds one life may step")
    ap.add_argument(
        "--time-budget",
        type=float,
        default=0,
        help="start no new life after this many seconds (0: no limit); the final check still runs",
    )
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
    d = args.dir or tempfile.mkdtemp(prefix="aiokv-fuzz-")
    model = build_model(args.family, os.path.join(d, "model-" + args.family))
    longest, blocks = FAMILIES[args.family][3], args.blocks or FAMILIES[args.family][4]
    cache = os.path.join(d, "cache")
    import shutil

    shutil.rmtree(cache, ignore_errors=True)  # every fuzz starts from an empty cache
    rnd = random.Random(args.seed)
    summary = {"seed": args.seed, "family": args.family, "lives": [], "ok": True}
    t0 = time.monotonic()
    all_prompts: list[list[int]] = []
    spoiled: list[str] = []
    prefixes = make_prefixes(rnd)
    secret = None  # the last life's (--random-settings)
    for n in range(args.lives):
        if args.time_budget and time.monotonic() - t0 > args.time_budget and summary["lives"]:
            break
        ps = make_prompts(rnd, args.prompts, prefixes, longest)
        all_prompts += ps
        common = dict(
            model=model,
            prompts=ps,
            steps=args.steps,
            blocks=blocks,
            life=n,
            capacity=args.capacity,
            timeout=args.life_timeout,
            family=args.family,
        )
        faulty = bool(args.fault_every) and n % args.fault_every == args.fault_every - 1
        settings = draw_settings(rnd, args.capacity) if args.random_settings else {}
        got = run_life(
            dict(
                common,
                cache=cache,
                seed=args.seed * 100 + n,
                faults=FAULTS if faulty else None,
                store_faults=args.store_faults,
                settings=settings,
            )
        )
        # load and save errors allowed; with drawn settings also where a load timeout under a second may
        # run out on a busy machine, and where the secret changed since the last life (the blocks stored
        # under the other one fail their MAC: recomputed, counted as corrupt)
        lenient = faulty or bool(args.store_faults) or settings.get("load_timeout", 30) < 1
        lenient |= args.random_settings and settings.get("secret") != secret
        secret = settings.get("secret")
        spoiled += got.get("spoiled", [])
        # the reference: the same prompts without aiokv, one at a time, no aborts, no step limit
        finished = [int(k) for k, v in got["outs"].items() if v is not None]
        ref = run_life(dict(common, cache=None, seed=0, prompts=[ps[i] for i in finished], steps=10**6, abort_p=0))
        problems = list(got["violations"]) + _store_fault_problems(got)
        # the reference ran with its own random max_tokens: compare the common prefix of outputs
        ref_outs = {finished[int(k)]: v for k, v in ref["outs"].items()}
        token_diffs = []
        for i in finished:
            a, b = got["outs"][str(i)], ref_outs.get(i)
            m = min(len(a), len(b or []))
            if b is None or a[:m] != b[:m]:
                token_diffs.append(i)
        if FAMILIES[args.family][5]:
            problems += [f"prompt {i}: tokens differ from the run without aiokv" for i in token_diffs]
        c = got.get("counters", {})
        if got["leaked_blocks"] or got["requests_left"]:
            problems.append(f"leaked {got['leaked_blocks']} blocks, {got['requests_left']} requests")
        for name in ("pending_saves", "pinned", "worker_in_flight", "staging_in_use", "reports_ignored") + (
            () if lenient else ("load_failed_blocks", "load_bad_blocks")
        ):
            if c.get(name):
                problems.append(f"{name} = {c[name]} at the end")
        if c.get("loads_ok_blocks", 0) + c.get("load_failed_blocks", 0) + c.get("load_cancelled_blocks", 0) != c.get(
            "load_blocks", 0
        ):
            problems.append("loads do not add up to hits")
        summary["lives"].append(
            {
                "life": n,
                "faults": faulty,
                "steps": got["steps"],
                "finished": len(finished),
                "preemptions": got["preemptions"],
                "poisoned_blocks": got["poisoned"],
                "aborted": sum(v is None for v in got["outs"].values()),
                "hit_blocks": c.get("hit_blocks"),
                "saves": c.get("saves_committed"),
                "evictions": c.get("store_evictions"),
                "load_failed_blocks": c.get("load_failed_blocks", 0),
                "save_failed_blocks": c.get("save_failed_blocks", 0),
                "load_timeouts": c.get("load_timeouts", 0),
                "spoiled": len(got.get("spoiled", [])),
                "load_bad_blocks": c.get("load_bad_blocks", 0),
                "token_diffs_inexact": [] if FAMILIES[args.family][5] else token_diffs,
                "store_faults_injected": sum((got.get("store_faults") or {}).get("injected", {}).values()),
                "settings": settings,
                "problems": problems,
            }
        )
        summary["ok"] &= not problems
        # progress, so that a long run that is stopped still leaves its figures
        print(json.dumps(dict(summary["lives"][-1], seconds=round(time.monotonic() - t0))), file=sys.stderr, flush=True)
    chk = run_life_check(
        dict(
            model=model,
            cache=cache,
            scratch=os.path.join(d, "scratch"),
            prompts=all_prompts,
            family=args.family,
            spoiled=spoiled,
        )
    )
    summary["stored_bytes"] = chk
    summary["ok"] &= not chk["bad"] and chk["checked"] > 0
    lives = summary["lives"]
    summary["totals"] = {
        k: sum(life[k] or 0 for life in lives)
        for k in (
            "steps",
            "finished",
            "aborted",
            "preemptions",
            "poisoned_blocks",
            "hit_blocks",
            "saves",
            "evictions",
            "load_failed_blocks",
            "save_failed_blocks",
            "load_timeouts",
            "spoiled",
            "load_bad_blocks",
        )
    }
    summary["totals"]["problems"] = sum(len(life["problems"]) for life in lives)
    summary["totals"]["fault_lives"] = sum(life["faults"] for life in lives)
    summary["seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps(summary, indent=1))
    return 0 if summary["ok"] else 1


def run_life_check(spec: dict) -> dict:
    return _child("--check", spec, 900)


if __name__ == "__main__":
    sys.exit(main())
