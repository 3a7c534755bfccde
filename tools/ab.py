#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""One benchmark against two trees, before and after a change, interleaved in one run.

    PYTHONPATH=. .venv/bin/python tools/ab.py --before DIR --after DIR [--rounds 3] [--json]
        [--timeout S] [--before-args '...'] [--after-args '...'] -- bench_index.py --n 100000

Round r runs the before tree's copy of the script, then the after tree's (the order flips every
round, so a drift of the machine falls on both), each with PYTHONPATH=TREE and the tree as the
working directory, each with --json (added when missing). Every number in the document a run
prints is a figure, named by its path (a list's items named by their identifying fields: size,
depth, prompt_tokens...). Printed: per figure the median before and after, the median of the
rounds' own ratios after/before and their spread (lowest..highest); figures only one side has
are listed apart; --figures keeps those whose path holds one of some words (gbps,cpu).
--json: one document of the same. Each tree runs its own script against its own
aiokv, so the trees need not share an API; --before-args/--after-args add flags to one side.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools import harness  # noqa: E402

# fields that name a list's item (a row of sizes and depths, a prompt length, a phase)
IDS = ("kind", "name", "label", "mode", "size", "payload", "depth", "workers", "prompt_tokens", "n")
# parts of a document that are not figures
SKIP = {"machine", "command", "date", "params", "rounds", "counters", "process_s", "off_all", "on_all"}


def last_document(out: str):
    """The last JSON document a run printed (one line or indented) or None."""
    dec = json.JSONDecoder()
    for i in reversed([i for i, c in enumerate(out) if c in "{[" and (i == 0 or out[i - 1] == "\n")]):
        try:
            doc, _ = dec.raw_decode(out, i)
        except ValueError:
            continue
        if isinstance(doc, (dict, list)):
            return doc
    return None


def figures(doc, path: str = "", out: dict | None = None) -> dict[str, float]:
    """{path: value} of every number in the document (see the module docstring)."""
    out = {} if out is None else out
    if isinstance(doc, dict):
        for k, v in doc.items():
            if k in SKIP:
                continue
            p = f"{path}.{k}" if path else k
            if harness.number(v):
                out[p] = float(v)
            elif isinstance(v, (dict, list)):
                figures(v, p, out)
    elif isinstance(doc, list):
        for i, x in enumerate(doc):
            ids = [f"{k}={x[k]}" for k in IDS if isinstance(x, dict) and k in x] or [str(i)]
            if harness.number(x):
                out[f"{path}[{i}]"] = float(x)
            else:
                figures(x, f"{path}[{','.join(ids)}]", out)
    return out


def run_once(tree: str, script: str, args: list[str], timeout: float | None) -> dict[str, float]:
    path = os.path.join(tree, script if "/" in script else os.path.join("tools", script))
    if not os.path.exists(path):
        raise SystemExit(f"ab: {script} is not in {tree}")
    env = {**os.environ, "PYTHONPATH": tree}
    try:
        p = subprocess.run(
            [sys.executable, path, *args], cwd=tree, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        raise SystemExit(f"ab: {tree}: {script} ran past --timeout {timeout:g} s") from None
    doc = last_document(p.stdout)
    if p.returncode != 0 or doc is None:
        raise SystemExit(f"ab: {tree}: {script} failed (rc {p.returncode}):\n{(p.stderr or p.stdout)[-3000:]}")
    return figures(doc)


def compare(before: list[dict], after: list[dict]) -> dict:
    """Per figure both sides have: medians, and the median and spread of each round's after/before."""
    out = {}
    for name in (k for k in before[0] if k in after[0]):
        b = [r[name] for r in before if name in r]
        a = [r[name] for r in after if name in r]
        own = [y / x for x, y in zip(b, a) if x]
        out[name] = {"before": statistics.median(b), "after": statistics.median(a)}
        out[name].update({"ratio": None, "lo": None, "hi": None} if not own else _spread(own))
    return out


def _spread(own: list[float]) -> dict:
    s = harness.spread(own)
    return {"ratio": s["median"], "lo": s["lo"], "hi": s["hi"]}


def render(doc: dict) -> str:
    rows = [f"before = {doc['before']}", f"after  = {doc['after']}"]
    rows.append(f"{doc['script']} {' '.join(doc['args'])}: {doc['rounds']} interleaved rounds")
    w = max([len(n) for n in doc["figures"]] + [6])
    rows.append(f"{'figure':<{w}}  {'before':>12} {'after':>12}  {'after/before':>12}  spread")
    for name, f in doc["figures"].items():
        r = "" if f["ratio"] is None else f"{f['ratio']:12.3f}  {f['lo']:.3f}..{f['hi']:.3f}"
        rows.append(f"{name:<{w}}  {f['before']:12.6g} {f['after']:12.6g}  {r}")
    for side in ("only_before", "only_after"):
        if doc[side]:
            rows.append(f"{side}: {', '.join(doc[side])}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = harness.parser(__doc__, rounds=3)
    ap.add_argument("--before", required=True, help="the tree before the change (its tools/SCRIPT runs)")
    ap.add_argument("--after", required=True, help="the tree after the change")
    ap.add_argument("--timeout", type=float, default=None, help="seconds one run may take")
    ap.add_argument("--before-args", default="", help="flags for the before tree's runs only")
    ap.add_argument("--after-args", default="", help="flags for the after tree's runs only")
    ap.add_argument("--figures", default="", help="only figures whose path holds one of these (comma separated)")
    opts = ap.parse_args(argv[:cut])
    script, *args = argv[cut + 1 :] or [""]
    if not script:
        ap.error("name the benchmark after --, e.g. -- bench_index.py --n 100000")
    args += [] if "--json" in args else ["--json"]
    trees = {"before": os.path.abspath(opts.before), "after": os.path.abspath(opts.after)}
    extra = {"before": shlex.split(opts.before_args), "after": shlex.split(opts.after_args)}
    took: dict[str, list[float]] = {"before": [], "after": []}

    def side(name: str):
        def run(r: int) -> dict:
            t = time.perf_counter()
            got = run_once(trees[name], script, args + extra[name], opts.timeout)
            took[name].append(time.perf_counter() - t)
            print(f"ab: round {r + 1}/{opts.rounds} {name} {took[name][-1]:.1f} s", file=sys.stderr, flush=True)
            return got

        return run

    runs = harness.interleave({"before": side("before"), "after": side("after")}, opts.rounds)
    doc = harness.document(**trees, script=script, args=args, rounds=opts.rounds)
    doc["figures"] = compare(runs["before"], runs["after"])
    want = [w for w in opts.figures.split(",") if w]
    if want:
        doc["figures"] = {k: v for k, v in doc["figures"].items() if any(w in k for w in want)}
    doc["only_before"] = sorted(k for k in runs["before"][0] if k not in runs["after"][0])
    doc["only_after"] = sorted(k for k in runs["after"][0] if k not in runs["before"][0])
    doc["wall_s"] = {s: statistics.median(t) for s, t in took.items()}
    return harness.emit(doc, opts, render)


if __name__ == "__main__":
    sys.exit(main())
