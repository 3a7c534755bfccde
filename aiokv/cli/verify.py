# SPDX-License-Identifier: Apache-2.0
"""`aiokv inspect --verify [--repair]`: the verify document, and the repair.

Only --repair writes, and only as the owner of each engine's files in turn: it
refuses to run while any engine runs on the directory. A corrupt checkpoint is
rebuilt from the slot headers by each engine's owner (with --repair); bad
blocks still bad once nobody writes are dropped from their engine's index.

Threading: one thread (the CLI's).
"""

from __future__ import annotations

import os
import time

from aiokv.cli.bads import Bads
from aiokv.cli.opening import SCHEMA, InspectError, check_root, engines_running, open_readonly
from aiokv.cli.progress import Progress
from aiokv.cli.slots import recheck, run_loop, still_bad, verify_store
from aiokv.data import format as fmt
from aiokv.store.lock import StoreLocked
from aiokv.store.store import Store


def verify(root: str, repair: bool = False, progress: bool | None = None) -> dict:
    root = os.path.abspath(root)
    check_root(root)
    t0 = time.monotonic()
    index_problems = []
    try:
        st = open_readonly(root)
    except fmt.BadBlock as e:
        # A corrupt checkpoint: read-only openers cannot replay it; an owner rebuilds
        # the index from the slot headers (with --repair, that is us).
        if not repair:
            return {
                "schema": SCHEMA,
                "root": root,
                "ok": False,
                "index_errors": [str(e)],
                "checked_blocks": 0,
                "checked_bytes": 0,
                "corrupt": [],
                "repaired": None,
                "index_rebuilt": None,
                "seconds": round(time.monotonic() - t0, 3),
            }
        index_problems.append(str(e))
        for engine in _engines_with_files(root):  # each engine's owner rebuilds its own index
            _open_owner(root, engine).close()
        st = open_readonly(root)
    try:
        spaces = st.index.namespaces.values()
        total_blocks = sum(ns.count() * ns.ranks for ns in spaces)
        total_bytes = sum(ns.count() * ns.ranks * ns.slot_bytes for ns in spaces)
        bar = Progress(total_blocks, total_bytes, progress)
        bad = Bads()
        try:
            run_loop(verify_store(st, bar, bad))
        finally:
            bar.end()
    finally:
        st.close()
    bad = bad.done()
    if len(bad):
        bad = recheck(root, bad)
    repaired = None
    if repair:
        repaired = _repair(root, bad) if len(bad) else Bads()
    return {
        "schema": SCHEMA,
        "root": root,
        "ok": not len(bad) and not index_problems,
        "index_errors": index_problems,
        "checked_blocks": total_blocks,
        "checked_bytes": total_bytes,
        "corrupt": bad.rows(),  # (written as they are made: rows.py)
        "repaired": None if repaired is None else repaired.rows(),
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
    running = engines_running(root)
    if running:
        pids = ", ".join(f"engine {e} pid {p if p > 0 else 'unknown'}" for e, p in running.items())
        raise InspectError(
            f"aiokv: cannot repair {root}: engines run on it ({pids}); stop them, then run --repair again"
        )
    try:
        return Store(root, engine=engine)
    except StoreLocked as e:
        raise InspectError(f"{e}; then run --repair again") from None


def _repair(root: str, bad: Bads) -> Bads:
    """As the owner of each engine's files in turn: drop the keys whose blocks are
    still bad now that nobody writes."""
    still = still_bad(root, bad)
    for engine, by_ns in sorted(still.keys_by_engine().items()):
        owner = _open_owner(root, engine)
        try:
            for nsid, ks in by_ns.items():
                ns = owner.index.namespaces[nsid]
                owner.drop(ns, sorted(k for k in ks if ns.block(k) is not None))
        finally:
            owner.close()
    return still
