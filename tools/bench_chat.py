#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Chats and agent loops on vLLM (CPU) under constant preemption: per turn, the hit tokens, TTFT and
the turn's time without a connector, with vLLM's own prefix cache only, and with aiokv (disk only,
with its memory tier, and disk with `admit: reused`), each aiokv setup cold and after a restart.

    PYTHONPATH=. .venv/bin/python tools/bench_chat.py [--family dense,hybrid] [--conversations 16]
        [--turns 3] [--reply 192] [--tool 512] [--out FILE] [--plot DIR] [--json]

Workloads (each life runs both, one after the other, no prefix shared between them):
- chat: N conversations; turn 1 = a system prompt every conversation shares + a user message;
  turn t = turn t-1's prompt + its reply + a new user message; replies of --reply tokens.
- agent: N loops; turn t = turn t-1's prompt + its reply (a tool call, --reply/2 tokens) + a tool
  output of --tool tokens.
All requests of a turn arrive at once; vLLM's KV budget (--kv-tokens) holds a few of them, so it
preempts constantly. Greedy decoding with ignore_eos: every reply has its full length.

Lives, each in its own process (the restart is a new process on the same cache directory):
- none: vLLM, no connector, prefix caching off;
- vllm: vLLM's own prefix cache, no connector;
- disk: aiokv with its memory tier off (`memory: 0`): every aiokv hit reads the disk;
- memory: aiokv with its memory tier (1 GiB);
- reused: as disk, with `admit: reused`.
"none" and "vllm" keep nothing across a restart, so their restart is a cold life: they run once.
The hybrid model runs with vLLM's `prefix_cache_retention_interval` None (docs/operations.md,
"Conversations") in every life. Per turn: prompt tokens, cached tokens (vLLM's and aiokv's, as vLLM
reports them), aiokv's hit tokens, TTFT (median and p90, from arrival: queueing included), the
turn's time, preemptions, and whether every reply equals the "none" life's (fp32 dense: must; bf16
hybrid: its own path dependence, docs/reliability.md). Per aiokv life: bytes written, bytes read
for hits, stored blocks.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools import harness  # noqa: E402

SETUPS = {
    "none": None,
    "vllm": None,
    "disk": {"memory": "0"},
    "memory": {},
    "reused": {"memory": "0", "admit": "reused"},
}
AIOKV = ("disk", "memory", "reused")


def _tokens(n: int, rnd: random.Random) -> list[int]:
    return [rnd.randrange(3, 500) for _ in range(n)]


def workloads(a) -> dict[str, list[dict]]:
    """Turns of each workload: {prompts (turn 1) or new (later turns: appended after the reply), reply}."""
    rnd = random.Random(2026)
    system = [1] + _tokens(127, rnd)
    chat = [dict(prompts=[system + _tokens(64, rnd) for _ in range(a.conversations)], reply=a.reply)]
    chat += [dict(new=[_tokens(48, rnd) for _ in range(a.conversations)], reply=a.reply) for _ in range(a.turns - 1)]
    tool = [1] + _tokens(127, rnd)
    agent = [dict(prompts=[tool + _tokens(96, rnd) for _ in range(a.conversations)], reply=a.reply // 2)]
    agent += [
        dict(new=[_tokens(a.tool, rnd) for _ in range(a.conversations)], reply=a.reply // 2) for _ in range(a.turns - 1)
    ]
    return {"chat": chat, "agent": agent}


# ------------------------------------------------------------------ child (one vLLM life)


def child(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    kw = dict(
        model=spec["model"],
        tokenizer=spec["model"],
        enforce_eager=True,
        dtype=spec["dtype"],
        seed=0,
        enable_prefix_caching=spec["setup"] != "none",
        max_model_len=spec["max_model_len"],
        num_gpu_blocks_override=spec["blocks"],
        kv_cache_memory_bytes=512 << 20,
        max_num_seqs=spec["seqs"],
    )
    if spec["block_size"]:
        kw["block_size"] = spec["block_size"]
    if spec["hybrid"]:
        kw["prefix_cache_retention_interval"] = None
    if SETUPS[spec["setup"]] is not None:
        kw["kv_transfer_config"] = {
            "kv_connector": "AioKVConnector",
            "kv_role": "kv_both",
            "kv_connector_module_path": "aiokv.connector",
            "kv_connector_extra_config": {"path": spec["cache"], "capacity": "8GiB", **SETUPS[spec["setup"]]},
        }
    llm = LLM(**kw)
    engine = llm.llm_engine
    sched = engine.engine_core.engine_core.scheduler
    conn = sched.connector
    preemptions = [0]
    preempt = sched._preempt_request

    def counting(*x, **k):
        preemptions[0] += 1
        return preempt(*x, **k)

    sched._preempt_request = counting
    counters = (lambda: dict(conn.counters())) if conn is not None else (lambda: {})
    engine.add_request("warm-up", {"prompt_token_ids": [1] + [7] * 63}, SamplingParams(temperature=0, max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    rows, replies, n = [], {}, 0
    for name, turns in spec["workloads"].items():
        last, out = None, None
        for t, turn in enumerate(turns):
            ps = turn["prompts"] if t == 0 else [p + r + new for p, r, new in zip(last, out, turn["new"])]
            before, pre0, t0 = counters(), preemptions[0], time.perf_counter()
            added, first, done = {}, {}, {}
            for i, p in enumerate(ps):
                rid = f"{name}-{t}-{i}-{n}"
                n += 1
                engine.add_request(
                    rid,
                    {"prompt_token_ids": p},
                    SamplingParams(temperature=0, max_tokens=turn["reply"], ignore_eos=True),
                )
                added[rid] = (i, time.perf_counter())
            while engine.has_unfinished_requests():
                for o in engine.step():
                    rid = next((r for r in added if o.request_id.startswith(r)), None)
                    if rid is None:
                        continue
                    if rid not in first and o.outputs and o.outputs[0].token_ids:
                        first[rid] = time.perf_counter()
                    if o.finished:
                        done[rid] = o
            elapsed = time.perf_counter() - t0
            after = counters()
            out = [None] * len(ps)
            cached = 0
            for rid, (i, _at) in added.items():
                out[i] = list(done[rid].outputs[0].token_ids)
                cached += done[rid].num_cached_tokens or 0
            ttft = sorted(first[r] - added[r][1] for r in added)
            rows.append(
                {
                    "workload": name,
                    "turn": t + 1,
                    "prompt_tokens": sum(map(len, ps)),
                    "cached_tokens": cached,
                    "aiokv_hit_tokens": after.get("hit_tokens", 0) - before.get("hit_tokens", 0),
                    "ttft_median_s": statistics.median(ttft),
                    "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))],
                    "turn_s": elapsed,
                    "preemptions": preemptions[0] - pre0,
                }
            )
            replies[f"{name}/{t + 1}"] = out
            last = ps
    if conn is not None:  # let the last saves report before reading the totals
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        wc = get_kv_transfer_group()
        for _ in range(2000):
            if getattr(wc, "worker", None) is not None:
                wc.worker.drain()
            if not sched.has_requests():
                break
            engine.step()
    c = counters()
    if conn is not None:
        engine.engine_core.shutdown()  # commits what is still pending, for the restart
    keep = (
        "hit_tokens",
        "queried_tokens",
        "bytes_written",
        "bytes_read",
        "saves_committed",
        "saves_not_admitted",
        "loads_ok_blocks",
        "memory_hit_blocks",
        "load_failed_blocks",
        "save_failures",
        "stored_blocks",
    )
    return {"rows": rows, "replies": replies, "counters": {k: c[k] for k in keep if k in c}}


def life(spec: dict) -> dict:
    env = dict(
        os.environ,
        VLLM_LOGGING_LEVEL="WARNING",
        TQDM_DISABLE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
    )
    t = time.monotonic()
    p = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
    )
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[7:])
            r["process_s"] = round(time.monotonic() - t, 1)
            return r
    sys.stderr.write(p.stderr[-6000:])
    raise SystemExit(f"bench_chat: the {spec['setup']} life failed (exit {p.returncode})")


# ------------------------------------------------------------------ parent


def family(name: str, a, work: str) -> dict:
    from aiokv.demo import tiny_model as tm

    if name == "dense":
        model = tm.build(os.path.join(work, "dense"), layers=6, hidden=384, heads=6, kv_heads=2, intermediate=1024)
        base = dict(dtype="float32", block_size=32, hybrid=False, blocks=a.kv_tokens // 32)
    else:
        model = tm.build_hybrid(os.path.join(work, "hybrid"))
        base = dict(dtype="bfloat16", block_size=None, hybrid=True, blocks=max(8, a.kv_tokens // 128))
    wl = workloads(a)
    longest = max(
        len(t[0]["prompts"][0]) + sum(len(x["new"][0]) + x["reply"] for x in t[1:]) + t[0]["reply"] for t in wl.values()
    )
    base.update(model=model, workloads=wl, max_model_len=longest + 64, seqs=a.conversations)
    lives = {}
    for setup in SETUPS:
        cache = os.path.join(work, f"{name}-{setup}")
        shutil.rmtree(cache, ignore_errors=True)
        for when in ("cold", "restart") if setup in AIOKV else ("cold",):
            print(f"bench_chat: {name} {setup} {when}", file=sys.stderr, flush=True)
            lives[f"{setup}/{when}"] = life(dict(base, setup=setup, cache=cache))
    ref = lives["none/cold"]["replies"]
    for r in lives.values():
        r["replies_differing"] = {k: sum(x != y for x, y in zip(v, ref[k])) for k, v in r["replies"].items()}
        del r["replies"]
    del lives["none/cold"]["replies_differing"]
    return {"model": {k: base[k] for k in ("dtype", "block_size", "blocks")}, "lives": lives}


def admission(doc: dict) -> list[dict]:
    """disk (admit all) against reused, both lives together: bytes written per GB read for hits, hit ratio."""
    out = []
    for fam, d in doc["families"].items():
        for setup in ("disk", "reused"):
            w = sum(d["lives"][f"{setup}/{x}"]["counters"].get("bytes_written", 0) for x in ("cold", "restart"))
            rd = sum(d["lives"][f"{setup}/{x}"]["counters"].get("bytes_read", 0) for x in ("cold", "restart"))
            rows = [r for x in ("cold", "restart") for r in d["lives"][f"{setup}/{x}"]["rows"]]
            hit, prompt = sum(r["aiokv_hit_tokens"] for r in rows), sum(r["prompt_tokens"] for r in rows)
            cached = sum(r["cached_tokens"] for r in rows)
            out.append(
                {
                    "family": fam,
                    "admit": "all" if setup == "disk" else "reused",
                    "written_gb": w / 1e9,
                    "hit_read_gb": rd / 1e9,
                    "written_per_hit_gb": w / rd if rd else None,
                    "aiokv_hit_ratio": hit / prompt,
                    "cached_ratio": cached / prompt,
                }
            )
    return out


def render(doc: dict) -> str:
    lines = []
    for fam, d in doc["families"].items():
        lines.append(f"\n{fam} ({d['model']})")
        lines.append(
            "| life | workload | turn | prompt tok | cached tok | aiokv hit tok | TTFT med s | TTFT p90 s "
            "| turn s | preempt | replies ≠ none |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for lname, r in d["lives"].items():
            for row in r["rows"]:
                diff = r.get("replies_differing", {}).get(f"{row['workload']}/{row['turn']}", "-")
                lines.append(
                    f"| {lname} | {row['workload']} | {row['turn']} | {row['prompt_tokens']} | "
                    f"{row['cached_tokens']} | {row['aiokv_hit_tokens']} | {row['ttft_median_s']:.2f} | "
                    f"{row['ttft_p90_s']:.2f} | {row['turn_s']:.1f} | {row['preemptions']} | {diff} |"
                )
    lines.append(
        "\n| family | admit | written GB | read for hits GB | written per GB of hits | aiokv hit ratio | cached ratio |"
    )
    lines.append("|---|---|---|---|---|---|---|")
    for a in doc["admission"]:
        per = f"{a['written_per_hit_gb']:.2f}" if a["written_per_hit_gb"] is not None else "-"
        lines.append(
            f"| {a['family']} | {a['admit']} | {a['written_gb']:.3f} | {a['hit_read_gb']:.3f} | {per} | "
            f"{a['aiokv_hit_ratio']:.3f} | {a['cached_ratio']:.3f} |"
        )
    return "\n".join(lines)


def plot(doc: dict, outdir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(outdir, exist_ok=True)
    fams = list(doc["families"])
    fig, axes = plt.subplots(len(fams), 2, figsize=(10, 3.6 * len(fams)), squeeze=False)
    for i, fam in enumerate(fams):
        for j, wl in enumerate(("chat", "agent")):
            ax = axes[i][j]
            for lname, r in doc["families"][fam]["lives"].items():
                rows = [x for x in r["rows"] if x["workload"] == wl]
                ax.plot(
                    [x["turn"] for x in rows],
                    [x["ttft_median_s"] for x in rows],
                    marker="o",
                    label=lname,
                    linestyle="--" if lname.endswith("restart") else "-",
                )
            ax.set_title(f"{fam}, {wl}: median TTFT per turn")
            ax.set_xlabel("turn")
            ax.set_ylabel("s")
            ax.set_xticks(range(1, 1 + max(x["turn"] for x in rows)))
    axes[0][1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(outdir, "chat_ttft.png"), dpi=110)


def main() -> int:
    ap = harness.parser(__doc__, plot=True)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--family", default="dense,hybrid")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--reply", type=int, default=192, help="chat reply tokens (agent replies: half)")
    ap.add_argument("--tool", type=int, default=512, help="agent tool output tokens per turn")
    ap.add_argument(
        "--kv-tokens",
        type=int,
        default=3872,
        help="vLLM's KV budget in tokens (small: preemption; any block count works, aiokv asks vLLM which KV tensor dimension counts blocks)",
    )
    ap.add_argument("--dir", default=None, help="where models and caches go (default: a temp dir)")
    a = ap.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(json.loads(a.child))), flush=True)
        os._exit(0)
    work = a.dir or tempfile.mkdtemp(prefix="aiokv-chat-")
    t0 = time.monotonic()
    doc = {
        "when": datetime.datetime.now().isoformat(timespec="minutes"),
        "load": os.getloadavg()[0],
        "args": {k: v for k, v in vars(a).items() if k not in ("child", "json", "out", "plot")},
        "families": {f: family(f, a, work) for f in a.family.split(",")},
    }
    doc["admission"] = admission(doc)
    doc["seconds"] = round(time.monotonic() - t0)
    if not a.dir:
        shutil.rmtree(work, ignore_errors=True)
    return harness.emit(doc, a, render, plot)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    raise SystemExit(main())
