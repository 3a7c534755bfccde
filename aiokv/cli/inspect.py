"""`aiokv inspect`: what a cache directory holds, and whether its blocks verify.

Read-only by default and safe beside running engines: every engine's index is
replayed with Store(readonly=True) (no lock, no writes; a torn journal tail just
ends the replay) and data files are opened O_RDONLY. The summary lists every
engine that has used the directory (its number, pid while it runs, blocks). A replay that raced with a
checkpoint (the journal it wanted was deleted, or a namespace was half made)
is tried again, up to three replays in all. Only --repair writes, and only as
the owner of each engine's files in turn: it refuses to run while any engine
runs on the directory.

--verify reads every committed block of every rank and checks the slot header
(magic, version, namespace, rank, key, length, header CRC32C) and the payload
CRC32C, with a progress bar (tqdm) on stderr when it is a terminal. The layout tag is not checked: inspect does not know the reader's KV
layout, and a block written under another layout is not damaged. A block that
fails while an engine is writing is re-checked against a fresh replay, so a
slot the engine evicted and rewrote meanwhile is not reported as corrupt.

Errors a user can cause (not a store, locked, unreadable) are InspectError:
one line, exit status 2.

`--format json` documents carry "schema": SCHEMA; docs/inspect-json.md and
docs/inspect-schema.json describe them. Adding a field keeps SCHEMA; renaming,
removing or changing the meaning of one raises it.

Threading: one thread (the CLI's); --verify runs its own event loop.
"""
from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import datetime
import errno
import json
import os
import sys
import time

from aiokv.data.backend import OP_READ, open_backend
from aiokv.data.buffers import SlotPool
from aiokv.data import format as fmt
from aiokv.data import slotfile
from aiokv.data.slotfile import data_path, open_data_file, open_engine_dir
from aiokv.store.lock import StoreLocked, engines
from aiokv.store.store import NotAStore, Store, ns_dir

IN_FLIGHT = 32            # verify reads in flight
STAGING_LIMIT = 256 << 20  # staging memory for verify reads, at most
RETRY_PAUSE = 0.05
ATTEMPTS = 3               # replays tried when the engine moved files meanwhile
SCHEMA = 1                 # version of the --format json documents
AGE_WINDOWS = (("hour", 3600), ("day", 86400), ("week", 7 * 86400))


class InspectError(Exception):
    """One line for the user; `code` is the exit status."""

    def __init__(self, msg: str, code: int = 2):
        super().__init__(msg)
        self.code = code


# ---------------------------------------------------------------- opening

def _not_a_store(root: str, why: str) -> InspectError:
    return InspectError(f"aiokv: {root} is not an aiokv store ({why})")


def _check_root(root: str) -> None:
    if not os.path.exists(root):
        raise _not_a_store(root, "no such directory")
    if not os.path.isdir(root):
        raise _not_a_store(root, "not a directory")
    if not os.path.isfile(os.path.join(root, "aiokv.json")):
        raise _not_a_store(root, "no aiokv.json")


def _journal_missing(st: Store) -> list[str]:
    """Namespaces whose current journal file is absent: a replay that raced with
    a checkpoint (which deletes the old generation) or with namespace creation."""
    out = []
    for (nsid, _), fl in st.followers.items():
        if fl.replayed and not os.path.exists(os.path.join(fl.dir, f"journal.{fl.gen}")):
            out.append(nsid.hex())
    return out


def _running(root: str) -> dict[int, int]:
    """engine number -> pid of every engine running on the directory now."""
    return {e: pid for e, pid in engines(root).items() if pid is not None}


def open_readonly(root: str) -> Store:
    """Replay the index without the lock; retried if the engine moved files meanwhile."""
    root = os.path.abspath(root)
    _check_root(root)
    for attempt in range(ATTEMPTS):
        try:
            st = Store(root, readonly=True)
        except NotAStore as e:
            raise InspectError(str(e)) from None
        except json.JSONDecodeError as e:
            if attempt < ATTEMPTS - 1:  # namespace.json being replaced? (it is written to a temp file first)
                time.sleep(RETRY_PAUSE)
                continue
            raise InspectError(f"aiokv: {root} is not an aiokv store or is damaged (bad JSON: {e})") from None
        except FileNotFoundError as e:
            if attempt < ATTEMPTS - 1:  # a namespace being created, a file vanishing under a checkpoint
                time.sleep(RETRY_PAUSE)
                continue
            raise InspectError(f"aiokv: {root}: {e.strerror}: {e.filename} (a damaged store? an owner "
                               "opening it rebuilds what it can)") from None
        except KeyError as e:
            raise InspectError(f"aiokv: {root}: a namespace.json lacks {e}") from None
        if _journal_missing(st) and attempt < ATTEMPTS - 1:
            st.close()
            time.sleep(RETRY_PAUSE)
            continue
        return st
    raise AssertionError("unreachable")


# ---------------------------------------------------------------- summary and keys

def iso(ns_time: int | None) -> str | None:
    if not ns_time:
        return None
    dt = datetime.datetime.fromtimestamp(ns_time / 1e9, tz=datetime.timezone.utc)
    return dt.isoformat(timespec="seconds").replace("+00:00", "Z")


def _disk_bytes(root: str, ns, engine: int) -> int:
    total = 0
    for rank in range(ns.ranks):
        try:
            total += os.stat(data_path(ns_dir(root, ns.nsid), rank, engine)).st_blocks * 512
        except FileNotFoundError:
            pass
    return total


def _ages(atimes: list[int], now_ns: int) -> dict:
    """How recently the blocks were last used (loaded or saved): the index keeps one
    access time per block, not a hit count."""
    ages = sorted((now_ns - a) / 1e9 for a in atimes)
    out = {f"used_last_{name}": sum(a <= s for a in ages) for name, s in AGE_WINDOWS}
    out["median_age_seconds"] = round(ages[len(ages) // 2], 3) if ages else None
    return out


def summary(st: Store) -> dict:
    root = st.root
    lives = engines(root)
    now = time.time_ns()
    out_ns = []
    per_engine: dict[int, dict] = {e: {"engine": e, "pid": pid, "running": pid is not None, "blocks": 0,
                                       "bytes": 0, "disk_bytes": 0} for e, pid in lives.items()}
    for nsid, ns in sorted(st.index.namespaces.items()):
        atimes = [a for d in ns.peers.values() for _, a in d.values() if a]
        held = {e: len(d) for e, d in sorted(ns.peers.items())}
        blocks = sum(held.values())
        journals = {}
        disk = 0
        for (n, e), fl in sorted(st.followers.items()):
            if n != nsid:
                continue
            ed = _disk_bytes(root, ns, e)
            disk += ed
            pe = per_engine.setdefault(e, {"engine": e, "pid": None, "running": False, "blocks": 0, "bytes": 0,
                                           "disk_bytes": 0})
            pe["blocks"] += held.get(e, 0)
            pe["bytes"] += held.get(e, 0) * ns.slot_bytes * ns.ranks
            pe["disk_bytes"] += ed
            journals[str(e)] = {"generation": fl.gen, "records": fl.records,
                                "torn_bytes": fl.log.torn_bytes if fl.log else 0}
        out_ns.append({
            "nsid": ns.hex,
            "fields": ns.fields,
            "blocks": blocks,
            "keys": len(ns.entries),  # distinct keys: two engines may hold the same block
            "engines": {str(e): n for e, n in held.items()},
            "bytes": blocks * ns.slot_bytes * ns.ranks,
            "payload_bytes": ns.payload_bytes,
            "slot_bytes": ns.slot_bytes,
            "ranks": ns.ranks,
            "disk_bytes": disk,
            "oldest_access": iso(min(atimes)) if atimes else None,
            "newest_access": iso(max(atimes)) if atimes else None,
            "access": _ages(atimes, now),
            "journals": journals,
        })
    running = [e["pid"] for e in per_engine.values() if e["running"]]
    return {
        "schema": SCHEMA,
        "root": root,
        "format": fmt.FORMAT_VERSION,
        # pid of the lowest-numbered running engine (None: none runs); every engine is in "engines"
        "owner_pid": running[0] if running else None,
        "engines": [per_engine[e] for e in sorted(per_engine)],
        # The capacity is the engine's setting, not recorded in the directory.
        "capacity_bytes": st.capacity,
        "namespaces": out_ns,
        "total": {
            "namespaces": len(out_ns),
            "blocks": sum(n["blocks"] for n in out_ns),
            "bytes": sum(n["bytes"] for n in out_ns),
            "disk_bytes": sum(n["disk_bytes"] for n in out_ns),
        },
    }


def keys(st: Store) -> dict:
    out = []
    for nsid, ns in sorted(st.index.namespaces.items()):
        items = sorted(((a, k, e, s) for e, d in ns.peers.items() for k, (s, a) in d.items()))
        out.append({
            "nsid": ns.hex,
            "keys": [{"key": k.hex(), "engine": e, "slot": s, "bytes": ns.slot_bytes * ns.ranks,
                      "payload_bytes": ns.payload_bytes * ns.ranks, "last_access": iso(a)}
                     for a, k, e, s in items],
        })
    return {"schema": SCHEMA, "root": st.root, "order": "least recently used first", "namespaces": out}


# ---------------------------------------------------------------- verify

@dataclasses.dataclass(frozen=True)
class Bad:
    nsid: bytes
    key: bytes
    rank: int
    slot: int
    reason: str
    engine: int = 0

    def as_dict(self) -> dict:
        return {"nsid": self.nsid.hex(), "key": self.key.hex(), "engine": self.engine, "rank": self.rank,
                "slot": self.slot, "reason": self.reason}


class Progress:
    """A progress bar on stderr (tqdm), by default only when stderr is a terminal."""

    def __init__(self, total_blocks: int, total_bytes: int, enabled: bool | None = None):
        from tqdm import tqdm

        self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="verifying",
                        file=sys.stderr, leave=False, dynamic_ncols=True, mininterval=0.2,
                        disable=not (sys.stderr.isatty() if enabled is None else enabled))

    def add(self, blocks: int, nbytes: int) -> None:
        self.bar.update(nbytes)

    def end(self) -> None:
        self.bar.close()


def _open_data(root: str, nsid: bytes, rank: int, engine: int) -> int:
    """Engine's data file of a rank, read-only (O_DIRECT where the file system has it)."""
    try:
        dfd = open_engine_dir(ns_dir(root, nsid), engine)
    except NotAStore:
        raise OSError(errno.ELOOP, "a symlink or not a directory") from None
    try:
        return open_data_file(dfd, rank, direct=True)[0]
    finally:
        os.close(dfd)


def check_slot(addr: int, nsid: bytes, rank: int, key: bytes, payload_len: int) -> str | None:
    """None if the slot at addr holds `key` intact (slotfile.check_slot); else what is wrong."""
    try:
        slotfile.check_slot((ctypes.c_char * (fmt.HEADER_BYTES + payload_len)).from_address(addr), nsid, rank,
                            payload_len, key)
    except fmt.BadBlock as e:
        return str(e) if str(e).startswith(("header", "payload")) else f"header {e}"
    return None


async def _verify_ns(backend, root: str, ns, items, progress: Progress | None) -> list[Bad]:
    """items: (rank, key, location). Reads each slot and checks it; returns the bad ones."""
    sb = ns.slot_bytes
    depth = max(1, min(IN_FLIGHT, STAGING_LIMIT // sb, len(items)))
    bad: list[Bad] = []
    fds: dict[tuple[int, int], int | str] = {}  # (engine, rank) -> fd or why not
    for engine, rank in sorted({(fmt.split(w)[0], r) for r, _, w in items}):
        try:
            fds[(engine, rank)] = _open_data(root, ns.nsid, rank, engine)
        except FileNotFoundError:
            fds[(engine, rank)] = "data file missing"
        except OSError as e:
            fds[(engine, rank)] = f"cannot open data file: {e.strerror}"
    todo = []
    for rank, key, where in sorted(items, key=lambda x: (x[0], x[2])):
        engine, slot = fmt.split(where)
        fd = fds[(engine, rank)]
        if isinstance(fd, str):
            bad.append(Bad(ns.nsid, key, rank, slot, fd, engine))
            if progress:
                progress.add(1, 0)
        else:
            todo.append((rank, key, slot, fd, engine))
    pool = SlotPool(sb, depth) if todo else None
    try:
        workers = min(4, depth)
        per = max(1, depth // workers)
        it = iter(range(0, len(todo), per))

        async def worker(w: int) -> None:
            bufs = [pool.addr(w * per + i) for i in range(per)]
            for start in it:
                chunk = todo[start:start + per]
                ops = [(OP_READ, fd, bufs[i], sb, s * sb) for i, (_, _, s, fd, _) in enumerate(chunk)]
                res = await backend.run(ops)
                for i, (r, (rank, key, slot, _, engine)) in enumerate(zip(res, chunk)):
                    if r < 0:
                        why = f"I/O error: {os.strerror(-r)}"
                    elif r != sb:
                        why = "short read (data file truncated)"
                    else:
                        why = check_slot(bufs[i], ns.nsid, rank, key, ns.payload_bytes)
                    if why:
                        bad.append(Bad(ns.nsid, key, rank, slot, why, engine))
                if progress:
                    progress.add(len(chunk), len(chunk) * sb)

        if todo:
            await asyncio.gather(*(worker(w) for w in range(min(workers, -(-len(todo) // per)))))
    finally:
        for fd in fds.values():
            if isinstance(fd, int):
                os.close(fd)
        if pool is not None:
            pool.close()
    return bad


async def _verify_items(root: str, namespaces: dict, work: dict, progress: Progress | None) -> list[Bad]:
    """work: nsid -> [(rank, key, slot)]."""
    backend = open_backend(asyncio.get_running_loop())
    try:
        bad: list[Bad] = []
        for nsid, items in work.items():
            if items:
                bad += await _verify_ns(backend, root, namespaces[nsid], items, progress)
        return bad
    finally:
        backend.close()


def _run(coro):
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _work_of(st: Store) -> dict:
    """nsid -> [(rank, key, location)]: every copy in every engine's files."""
    return {nsid: [(r, k, fmt.loc(e, s)) for e, d in ns.peers.items() for k, (s, _) in d.items()
                   for r in range(ns.ranks)]
            for nsid, ns in st.index.namespaces.items()}


def _recheck(root: str, bad: list[Bad], rounds: int = 3) -> list[Bad]:
    """Keep only failures still committed at the same slot that still fail.

    A running engine may evict a key and rewrite its slot between our replay and
    our read; each round replays again, so only a block that stays committed and
    stays bad is reported. Without an engine one round settles it."""
    for _ in range(rounds):
        st = open_readonly(root)
        try:
            work = _still_committed(st, bad)
            bad = _run(_verify_items(root, st.index.namespaces, work, None)) if work else []
        finally:
            st.close()
        if not bad or not _running(root):
            break
    return bad


def verify(root: str, repair: bool = False, progress: bool | None = None) -> dict:
    root = os.path.abspath(root)
    _check_root(root)
    t0 = time.monotonic()
    index_problems = []
    try:
        st = open_readonly(root)
    except fmt.BadBlock as e:
        # A corrupt checkpoint: read-only openers cannot replay it; an owner rebuilds
        # the index from the slot headers (with --repair, that is us).
        if not repair:
            return {"schema": SCHEMA, "root": root, "ok": False, "index_errors": [str(e)], "checked_blocks": 0,
                    "checked_bytes": 0, "corrupt": [], "repaired": None, "index_rebuilt": None,
                    "seconds": round(time.monotonic() - t0, 3)}
        index_problems.append(str(e))
        for engine in _engines_with_files(root):  # each engine's owner rebuilds its own index
            _open_owner(root, engine).close()
        st = open_readonly(root)
    try:
        work = _work_of(st)
        total_blocks = sum(len(v) for v in work.values())
        total_bytes = sum(len(v) * st.index.namespaces[n].slot_bytes for n, v in work.items())
        bar = Progress(total_blocks, total_bytes, progress)
        try:
            bad = _run(_verify_items(root, st.index.namespaces, work, bar))
        finally:
            bar.end()
    finally:
        st.close()
    if bad:
        bad = _recheck(root, bad)
    bad.sort(key=lambda b: (b.nsid, b.rank, b.slot))
    repaired = None
    if repair:
        repaired = _repair(root, bad) if bad else []
    return {
        "schema": SCHEMA,
        "root": root,
        "ok": not bad and not index_problems,
        "index_errors": index_problems,
        "checked_blocks": total_blocks,
        "checked_bytes": total_bytes,
        "corrupt": [b.as_dict() for b in bad],
        "repaired": None if repaired is None else [b.as_dict() for b in repaired],
        "index_rebuilt": bool(index_problems) if repair else None,
        "seconds": round(time.monotonic() - t0, 3),
    }


def _engines_with_files(root: str) -> list[int]:
    """Engine numbers that have files in some namespace of the directory."""
    found = set()
    try:
        names = os.listdir(os.path.join(root, "ns"))
    except FileNotFoundError:
        return []
    for name in names:
        try:
            inside = os.listdir(os.path.join(root, "ns", name))
        except OSError:
            continue
        for n in inside:
            if n == "checkpoint" or n.startswith("journal.") or n.startswith("rank"):
                found.add(0)
            elif fmt.engine_of_dir(n) is not None:
                found.add(fmt.engine_of_dir(n))
    return sorted(found)


def _open_owner(root: str, engine: int) -> Store:
    running = _running(root)
    if running:
        pids = ", ".join(f"engine {e} pid {p if p > 0 else 'unknown'}" for e, p in running.items())
        raise InspectError(f"aiokv: cannot repair {root}: engines run on it ({pids}); stop them, then run "
                           "--repair again")
    try:
        return Store(root, engine=engine)
    except StoreLocked as e:
        raise InspectError(f"{e}; then run --repair again") from None


def _still_committed(st, bad: list) -> dict:
    """nsid -> [(rank, key, location)] of the bad blocks whose key its engine still keeps in that slot."""
    work: dict = {}
    for b in bad:
        ns = st.index.namespaces.get(b.nsid)
        got = ns.peers.get(b.engine, {}).get(b.key) if ns is not None else None
        if got is not None and got[0] == b.slot:
            work.setdefault(b.nsid, []).append((b.rank, b.key, fmt.loc(b.engine, b.slot)))
    return work


def _repair(root: str, bad: list[Bad]) -> list[Bad]:
    """As the owner of each engine's files in turn: drop the keys whose blocks are
    still bad now that nobody writes."""
    st = open_readonly(root)
    try:
        work = _still_committed(st, bad)
        still = _run(_verify_items(root, st.index.namespaces, work, None)) if work else []
    finally:
        st.close()
    by_engine: dict = {}
    for b in still:
        by_engine.setdefault(b.engine, {}).setdefault(b.nsid, set()).add(b.key)
    for engine, by_ns in sorted(by_engine.items()):
        owner = _open_owner(root, engine)
        try:
            for nsid, ks in by_ns.items():
                ns = owner.index.namespaces[nsid]
                owner.drop(ns, sorted(k for k in ks if k in ns.own))
        finally:
            owner.close()
    return still


# ---------------------------------------------------------------- text rendering

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
    owner = ("none running" if not running else
             ", ".join(f"engine {e['engine']} pid {e['pid'] if e['pid'] > 0 else 'unknown'}" for e in running)
             + " (running; this view may already be stale)")
    cap = (human(d["capacity_bytes"]) if d["capacity_bytes"] is not None else
           "unknown (the engine's setting, not recorded in the directory)")
    t = d["total"]
    lines = [f"aiokv store {d['root']} (format {d['format']})",
             f"engines:   {owner}",
             f"capacity:  {cap}",
             f"total:     {t['namespaces']} namespace(s), {t['blocks']} block(s), {human(t['bytes'])} "
             f"({human(t['disk_bytes'])} allocated on disk)"]
    for e in d["engines"]:
        state = f"running, pid {e['pid'] if e['pid'] > 0 else 'unknown'}" if e["running"] else "not running"
        lines.append(f"engine {e['engine']}:  {state}; {e['blocks']} block(s), {human(e['bytes'])} "
                     f"({human(e['disk_bytes'])} on disk)")
    for n in d["namespaces"]:
        lines += ["",
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
                  "  used in last:  " + ", ".join(f"{w} {n['access'][f'used_last_{w}']}" for w, _ in AGE_WINDOWS)
                  + (f" (median age {human_age(n['access']['median_age_seconds'])})"
                     if n["access"]["median_age_seconds"] is not None else "")]
    return "\n".join(lines)


def render_keys(d: dict) -> str:
    lines = []
    for n in d["namespaces"]:
        if lines:
            lines.append("")
        lines.append(f"namespace {n['nsid']}: {len(n['keys'])} key(s), least recently used first")
        if n["keys"]:
            w = max(len(k["key"]) for k in n["keys"])
            lines.append(f"  {'KEY':<{w}}  {'ENGINE':>6}  {'SLOT':>8}  {'SIZE':>10}  LAST ACCESS")
            for k in n["keys"]:
                lines.append(f"  {k['key']:<{w}}  {k['engine']:>6}  {k['slot']:>8}  {human(k['bytes']):>10}  "
                             f"{k['last_access'] or '-'}")
    return "\n".join(lines) if lines else "(no namespaces)"


def render_verify(d: dict) -> str:
    lines = []
    for e in d["index_errors"]:
        lines.append(f"index: {e}")
    if d.get("index_rebuilt"):
        lines.append("index: rebuilt from the slot headers (--repair)")
    nbad = len(d["corrupt"])
    lines.append(f"verified {d['checked_blocks']} block(s), {human(d['checked_bytes'])} in {d['seconds']:.2f} s: "
                 + (f"{nbad} corrupt" if nbad else "all intact" if not d["index_errors"] else "index damaged"))
    for b in d["corrupt"]:
        lines.append(f"corrupt: namespace {b['nsid']} key {b['key']} engine {b['engine']} rank {b['rank']} "
                     f"slot {b['slot']}: "
                     f"{b['reason']}")
    if d["repaired"] is not None and nbad:
        keys_dropped = {(b["nsid"], b["key"]) for b in d["repaired"]}
        lines.append(f"repaired: dropped {len(keys_dropped)} key(s) from the index")
    elif nbad:
        lines.append("run again with --repair to drop them from the index (needs the engine stopped)")
    return "\n".join(lines)
