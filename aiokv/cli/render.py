# SPDX-License-Identifier: Apache-2.0
"""`aiokv inspect`'s text output: the summary, the keys and the verify documents
rendered for people (the JSON documents are printed as they are, rows.py
write_json). The keys and verify renderings are iterators of lines: their lists
may hold tens of millions of items, written as they are made.

Threading: plain functions, any thread.
"""

from __future__ import annotations

import json

from aiokv.cli.rows import Rows
from aiokv.cli.summary import AGE_WINDOWS

_KEY_FIELDS = ("key", "engine", "slot", "bytes", "last_access")


def human(n: int | None) -> str:
    if n is None:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def human_age(seconds: float) -> str:
    for unit, s in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= s:
            return f"{seconds / s:.1f} {unit}"
    return f"{seconds:.0f} s"


def _fields_text(fields: dict) -> str:
    if not fields:
        return "(none)"
    return ", ".join(f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in sorted(fields.items()))


def render_summary(d: dict) -> str:
    running = [e for e in d["engines"] if e["running"]]
    owner = (
        "none running"
        if not running
        else ", ".join(f"engine {e['engine']} pid {e['pid'] if e['pid'] > 0 else 'unknown'}" for e in running)
        + " (running; this view may already be stale)"
    )
    cap = (
        human(d["capacity_bytes"])
        if d["capacity_bytes"] is not None
        else "unknown (the engine's setting, not recorded in the directory)"
    )
    t = d["total"]
    lines = [
        f"aiokv store {d['root']} (format {d['format']})",
        f"engines:   {owner}",
        f"capacity:  {cap}",
        f"total:     {t['namespaces']} namespace(s), {t['blocks']} block(s), {human(t['bytes'])} "
        f"({human(t['disk_bytes'])} allocated on disk)",
    ]
    w = d["wear"]
    if w["since"] is not None:
        dwpd = w["drive_writes_per_day"]
        lines.append(
            f"written:   {human(w['written_bytes'])} since {_when(w['since'])}"
            + (
                f", {dwpd:.3g} drive writes per day of its {human(w['drive_bytes'])} file system"
                if dwpd is not None
                else ""
            )
        )
    for e in d["engines"]:
        state = f"running, pid {e['pid'] if e['pid'] > 0 else 'unknown'}" if e["running"] else "not running"
        lines.append(
            f"engine {e['engine']}:  {state}; {e['blocks']} block(s), {human(e['bytes'])} "
            f"({human(e['disk_bytes'])} on disk)"
        )
    for r in d.get("tenants", ()):
        lines.append(f"tenant {_tenant_text(r)}")
    for n in d["namespaces"]:
        lines += [
            "",
            f"namespace {n['nsid']}",
            f"  fields:        {_fields_text(n['fields'])}",
            f"  blocks:        {n['blocks']}",
            f"  per engine:    {', '.join(f'engine {e}: {c}' for e, c in n['engines'].items()) or '-'} "
            f"({n['keys']} distinct key(s))",
            f"  bytes:         {human(n['bytes'])} ({n['bytes']} = {n['blocks']} x {n['slot_bytes']}-byte "
            f"slots x {n['ranks']} rank(s))",
            f"  payload:       {n['payload_bytes']} bytes per block per rank",
            f"  ranks:         {n['ranks']}",
            f"  on disk:       {human(n['disk_bytes'])} allocated in data files",
            f"  oldest access: {n['oldest_access'] or '-'}",
            f"  newest access: {n['newest_access'] or '-'}",
            "  used in last:  "
            + ", ".join(f"{w} {n['access'][f'used_last_{w}']}" for w, _ in AGE_WINDOWS)
            + (
                f" (median age {human_age(n['access']['median_age_seconds'])})"
                if n["access"]["median_age_seconds"] is not None
                else ""
            ),
        ]
        lines += [f"  tenant {_tenant_text(r)}" for r in n.get("tenants", ())]
    return "\n".join(lines)


def _tenant_text(r: dict) -> str:
    """A tenant's line: its name ("(none)" for requests without a cache_salt), blocks, bytes, pins."""
    pins = f", {r['pinned_blocks']} pinned" if r["pinned_blocks"] else ""
    return f"{r['tenant'] or '(none)'}: {r['blocks']} block(s), {human(r['bytes'])}{pins}"


def render_keys(d: dict):
    """The --keys document's lines (made as they are written: its lists are Rows)."""
    lines = 0
    w = 2 * 32  # (keys are at most 32 bytes)
    for n in d["namespaces"]:
        if lines:
            yield ""
        lines += 1
        yield f"namespace {n['nsid']}: {len(n['keys'])} key(s), least recently used first"
        head = True
        keys = n["keys"]
        for c in keys.batches() if isinstance(keys, Rows) else [{f: [k[f] for k in keys] for f in _KEY_FIELDS}]:
            if head and c["key"]:
                yield f"  {'KEY':<{w}}  {'ENGINE':>6}  {'SLOT':>8}  {'SIZE':>10}  LAST ACCESS"
                head = False
            size = {b: human(b) for b in set(c["bytes"])}
            for k, e, s, b, a in zip(c["key"], c["engine"], c["slot"], c["bytes"], c["last_access"]):
                yield f"  {k:<{w}}  {e:>6}  {s:>8}  {size[b]:>10}  {a or '-'}"
    if not lines:
        yield "(no namespaces)"


def render_verify(d: dict):
    """The --verify document's lines."""
    for e in d["index_errors"]:
        yield f"index: {e}"
    if d.get("index_rebuilt"):
        yield "index: rebuilt from the slot headers (--repair)"
    nbad = len(d["corrupt"])
    yield (
        f"verified {d['checked_blocks']} block(s), {human(d['checked_bytes'])} in {d['seconds']:.2f} s: "
        + (f"{nbad} corrupt" if nbad else "all intact" if not d["index_errors"] else "index damaged")
    )
    for b in d["corrupt"]:
        yield (
            f"corrupt: namespace {b['nsid']} key {b['key']} engine {b['engine']} rank {b['rank']} "
            f"slot {b['slot']}: {b['reason']}"
        )
    if d["repaired"] is not None and nbad:
        keys_dropped = {(b["nsid"], b["key"]) for b in d["repaired"]}
        yield f"repaired: dropped {len(keys_dropped)} key(s) from the index"
    elif nbad:
        yield "run again with --repair to drop them from the index (needs the engine stopped)"


def _when(since: float) -> str:
    import time

    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(since))
