# SPDX-License-Identifier: Apache-2.0
"""Several drives: one Store per drive's cache directory, seen by the scheduler side
as one store (`Drives`, with one `DriveNamespace` per namespace: driveviews.py); the
same interface as one Store's (api.StoreApi), so no caller asks which it has.

Placement: a key is saved on the drive of highest rendezvous weight (BLAKE2b of the
key, keyed by a seed from the drive's configured path string) among the drives
present at start. The same list therefore finds every block again after a restart,
in any order; a drive missing at start moves only its own keys (to their next
drive, where they are misses until saved again). Lookups look on every drive, so a
block saved elsewhere while its drive was missing stays a hit.

Locations: a drive's Store hands out engine << 32 | slot in its own files; here
they carry the drive's index in the configured list above those bits
(format.on_drive), so the scheduler side, the ledger and the workers keep passing
ints; every location handed back is taken apart (format.drive_of) before it
reaches that drive's Store. A worker maps it to that drive's files the same way
(aiokv/data/drives.py).

Capacity: `capacity` is the whole list's; each drive gets an equal share
(capacity / drives listed) and evicts, and lowers its limit when full, on its own.
A drive missing at start keeps its share: the cache is that much smaller (the
others are not filled past what they were sized for).

Breakers: each drive has its own (aiokv/util/breaker.py). Its failures (I/O errors
on its files, loads that timed out waiting on it: counted per drive by the
workers, WorkerReport.drives, handed in by `record`) and its file system's stalls
(its Store's I/O thread past fs_timeout) open it; while open, its blocks are no
hits (lookup, pin, served: for every kind of group) and saves placed on it are dropped (store_skipped_drive_down);
half-open, it is probed by hits while none of its blocks is pinned. The other
drives go on. The scheduler side's own breaker then judges only a stall of every
drive (`stalled`).

Opening (`open_drives`): every drive at once, each on a thread of its own, bounded
by start_timeout; a drive that is missing (its directory's parent absent: an
unmounted drive), unusable (an OSError: unwritable, read-only) or does not answer
is one log line naming it, and the cache runs on the others; none left raises
OSError (aiokv is then off, as for one bad path). A directory that is not a store
(NotAStore) or a refused engine number is raised, as for one path.

Threading contract: a Store's. One owner thread calls Drives (the EngineCore
scheduler thread); each drive's Store has its own I/O thread; `open_drives` runs
its opens on threads of their own and returns once each has ended or timed out;
`close` closes each drive's Store on a thread of its own (the owner waits meanwhile).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import threading
from typing import Any

import numpy as np

from aiokv.data import format as fmt
from aiokv.store import loadpins, persist
from aiokv.store.driveviews import DriveNamespace
from aiokv.store.fsthread import at_once, bounded
from aiokv.store.locate import first_holders, holders
from aiokv.store.namespace import Namespace
from aiokv.store.store import StoreStats
from aiokv.util import counting
from aiokv.util.breaker import Breaker

log = logging.getLogger("aiokv")
CLOSE_SLACK = 2.0  # seconds past CLOSE_MAX the drives' closes are waited for (each is bounded by CLOSE_MAX on its own)


def seed(path: str) -> bytes:
    """A drive's placement seed: from its configured path string only."""
    return hashlib.blake2b(path.encode(), digest_size=16, person=b"aiokv-drive").digest()


def place(key: bytes, seeds: list[bytes], live: list[int]) -> int:
    """The drive (index into seeds) of highest rendezvous weight for key among `live`."""
    best, top = live[0], b""
    for i in live:
        w = hashlib.blake2b(key, digest_size=8, key=seeds[i]).digest()
        if w > top:
            best, top = i, w
    return best


class Drives:
    def __init__(self, paths: list[str], stores: dict, failures: int = 3, cooldown: float = 30.0):
        """stores: drive index (in `paths`) -> its open Store, for the drives present."""
        self.paths = list(paths)
        self.stores = dict(sorted(stores.items()))
        self.live = list(self.stores)
        self.seeds = [seed(p) for p in self.paths]
        self.breakers = {d: Breaker(failures, cooldown, where=self.paths[d]) for d in self.live}
        self.skipped_drive_down = 0

    # ---- what the connector reads ----
    @property
    def stats(self) -> StoreStats:
        """Every drive's stats summed, and the drives' own counters."""
        out = StoreStats()
        for s in self.stores.values():
            for k, v in vars(s.stats).items():
                setattr(out, k, getattr(out, k) + v)
        out.skipped_drive_down += self.skipped_drive_down
        out.drive_breaker_opens += sum(b.opens for b in self.breakers.values())
        return out

    @property
    def limit(self) -> int | None:
        limits = [s.limit for s in self.stores.values()]
        return None if None in limits else sum(limits)

    @property
    def stalled(self) -> bool:
        """Every drive's file system has stopped answering (one drive's stall is its breaker's)."""
        return all(s.stalled for s in self.stores.values())

    @property
    def loading(self) -> int:
        return sum(s.loading for s in self.stores.values())

    @property
    def fs_bytes(self) -> int:
        return sum(s.fs_bytes for s in self.stores.values())

    def namespaces(self) -> list:
        return [ns for s in self.stores.values() for ns in s.namespaces()]

    def blocks(self) -> int:
        return sum(s.blocks() for s in self.stores.values())

    def used(self) -> int:
        return sum(s.used() for s in self.stores.values())

    def load_pinned(self) -> int:
        return sum(s.load_pinned() for s in self.stores.values())

    def drives(self) -> list[tuple[int, str, Any]]:
        """(index in the configured list, its path as configured, its Store) of each drive present."""
        return [(d, self.paths[d], s) for d, s in self.stores.items()]

    def parts(self, ns: DriveNamespace) -> list[tuple[int, Any, Any]]:
        return [(d, self.stores[d], n) for d, n in ns.parts]

    def down(self) -> list[int]:
        """Drives whose breaker is not closed."""
        return [d for d, b in self.breakers.items() if b.is_open]

    def _serving(self) -> set[int]:
        """Drives whose blocks are hits now: breaker closed, or half-open with none pinned (the probe)."""
        return {d for d, b in self.breakers.items() if b.allow_hit(self.stores[d].load_pinned())}

    # ---- the scheduler side's calls ----
    def namespace(self, nsid: bytes, payload_bytes: int, ranks: int = 1, fields: dict | None = None):
        return DriveNamespace([(d, s.namespace(nsid, payload_bytes, ranks, fields)) for d, s in self.stores.items()])

    def record(self, drives: dict) -> None:
        """The workers' per-drive verdicts of one report: drive -> (failures, blocks loaded)."""
        for d, (failures, ok) in (drives or {}).items():
            b = self.breakers.get(d)
            if b is not None:
                b.record({"read_errors": failures, "loads_ok_blocks": ok})

    def refresh(self) -> None:
        first = None
        for d, s in self.stores.items():
            try:
                s.refresh()
            except Exception as e:  # one drive's trouble is its own
                first = first or e
            self.breakers[d].file_system(s.stalled)
        if first is not None:
            raise first

    def flush_if_due(self) -> None:
        self._each("flush_if_due")

    def checkpoint(self) -> None:
        self._each("checkpoint")

    def _each(self, name: str, *args) -> None:
        """store.name(*args) on every drive; the first error is raised once all were called."""
        first = None
        for s in self.stores.values():
            try:
                getattr(s, name)(*args)
            except Exception as e:
                first = first or e
        if first is not None:
            raise first

    def lookup(self, ns: DriveNamespace, keys, limit: int | None = None) -> int:
        serving = self._serving()
        parts = [(d, n) for d, n in ns.parts if d in serving]
        for d, n in parts:
            self.stores[d].lookup(n, (), 0)  # applies the last look at the other engines (store.py)
        return Namespace.run_of([part for _, part in parts], keys, limit)

    def served(self, ns: DriveNamespace, keys) -> list[bool]:
        """Whether each key's block is a hit now on a drive serving hits (as lookup and pin see
        them): one call into aiokv._index over every serving drive's probes."""
        serving = self._serving()
        parts = [n for d, n in ns.parts if d in serving]
        for d, n in ns.parts:
            if d in serving:
                self.stores[d].lookup(n, (), 0)  # applies the last look at the other engines (store.py)
        return (holders(parts, keys) >= 0).tolist()

    def holds(self, ns: DriveNamespace, key: bytes, where: int) -> bool:
        """Whether key's committed copy on the drive `where` names is the one at `where`."""
        d, w = fmt.drive_of(where)
        return d in ns.on and self.stores[d].holds(ns.on[d], key, w)

    def pin(self, ns: DriveNamespace, keys) -> list[int | None]:
        """Each key pinned on the first serving drive holding it (one call into aiokv._index
        finds them all, a call a drive pins them), its location carrying that drive's index;
        None: no drive serves it."""
        serving = self._serving()
        parts = [(d, n) for d, n in ns.parts if d in serving]
        first, where = first_holders([n for _, n in parts], keys)  # located once, for every drive
        out, every = np.full(len(keys), -1, np.int64), loadpins.objects(keys)
        for i, (d, n) in enumerate(parts):  # each drive's keys pinned at once (loadpins.py)
            idx = np.flatnonzero(first == i)
            if len(idx):
                got = self.stores[d].load_pins.locations(n, every[idx].tolist(), where[idx])
                out[idx] = np.where(got >= 0, d << fmt.DRIVE_SHIFT | got, -1)  # (fmt.on_drive)
        return loadpins.as_list(out)

    def unpin(self, ns: DriveNamespace, keys) -> None:
        """Every drive gives back its holds of these keys (a key it holds none of is left as it
        is: loadpins.py), one call into aiokv._index a drive."""
        for d, n in ns.parts:
            self.stores[d].unpin(n, keys)

    # ---- tenants: by name or tag (each drive's store registers them at their first commit) ----
    def tag(self, name: str) -> bytes:
        """A tenant's tag (the same on every drive: the secret is theirs)."""
        return self.stores[next(iter(self.stores))].tag(name)

    def pin_blocks(self, ns: DriveNamespace, keys, tenant: int | None = None, request: bool = False) -> int:
        n = 0
        for d, part in ns.parts:
            n += self.stores[d].pin_blocks(part, keys, request=request)
        return n

    def pinned_bytes(self) -> int:
        return sum(s.pinned_bytes() for s in self.stores.values())

    def tenant_bytes(self, top: int | None) -> dict[str, int]:
        """Every drive's bytes per tenant added up, then the `top` tenants and "other" (Store.tenant_bytes)."""
        out: dict[str, int] = {}
        for s in self.stores.values():
            for label, n in s.tenant_bytes(None).items():
                out[label] = out.get(label, 0) + n
        return out if top is None else counting.top_and_other(out, top)

    def reserve(self, ns: DriveNamespace, key: bytes, tenant: str | bytes = "") -> int | None:
        if ns.has(key) or ns.reserved(key):
            return None
        d = place(key, self.seeds, self.live)
        if not self.breakers[d].allow_saves():
            self.skipped_drive_down += 1
            return None
        where = self.stores[d].reserve(ns.on[d], key, tenant)
        return None if where is None else fmt.on_drive(d, where)

    def _by_drive(self, items) -> dict[int, list]:
        by: dict[int, list] = {}
        for key, where in items:
            d, w = fmt.drive_of(where)
            by.setdefault(d, []).append((key, w))
        return by

    def commit(
        self, ns: DriveNamespace, items, tenant: str | bytes = "", pinned: bool = False, request: bool = False
    ) -> None:
        self._per_drive(ns, "commit", self._by_drive(items), tenant, pinned, request)

    def abort(self, ns: DriveNamespace, items, failed: bool = True) -> None:
        self._per_drive(ns, "abort", self._by_drive(items), failed)

    def _per_drive(self, ns: DriveNamespace, name: str, by: dict, *args) -> list:
        """store.name(its part of ns, its items, *args) on each drive of `by` (drive -> items);
        their results; the first error is raised once all were called."""
        first, out = None, []
        for d, items in by.items():
            if d not in ns.on:
                continue  # no such drive here: nothing of ours
            try:
                out.append(getattr(self.stores[d], name)(ns.on[d], items, *args))
            except Exception as e:
                first = first or e
        if first is not None:
            raise first
        return out

    def drop(self, ns: DriveNamespace, keys, corrupt: bool = True) -> None:
        by: dict[int, list] = {}
        for k in keys:
            for d, n in ns.parts:
                if n.has(k):
                    by.setdefault(d, []).append(k)
                    break
        first = None
        for d, ks in by.items():
            try:
                self.stores[d].drop(ns.on[d], ks, corrupt)
            except Exception as e:
                first = first or e
        if first is not None:
            raise first

    def drop_at(self, ns: DriveNamespace, items, corrupt: bool = True) -> int:
        """Each (key, location) dropped on the drive the location names, where the key still
        sits there (another drive's copy of it stays); returns how many were dropped."""
        return sum(self._per_drive(ns, "drop_at", self._by_drive(items), corrupt))

    def verify_slot(self, ns: DriveNamespace, key: bytes, where: int) -> bool:
        d, w = fmt.drive_of(where)
        return d in ns.on and self.stores[d].verify_slot(ns.on[d], key, w)

    def close(self, checkpoint: bool = True) -> None:
        """Every drive's Store closed at once, each on a thread of its own (each bounded by
        CLOSE_MAX: persist.py, so the whole close is; CLOSE_SLACK past it, they are left running)."""
        calls = [
            (f"closing the cache directory {s.root}", lambda s=s: s.close(checkpoint)) for s in self.stores.values()
        ]
        at_once(calls, persist.CLOSE_MAX + CLOSE_SLACK)


def open_drives(paths: list[str], open_one, timeout: float, failures: int = 3, cooldown: float = 30.0):
    """(Drives, [one DriveNamespace per namespace opened]) from open_one(path, drives)
    -> (Store, [Namespace, ...]) (drives: how many are listed, for the capacity's
    share) run for every drive at once, each bounded by
    timeout. A drive missing, unusable or not answering is left out with one line;
    none left raises OSError. NotAStore and other refusals are raised (after every
    opened drive was closed)."""
    got: dict[int, tuple] = {}
    errors: dict[int, BaseException] = {}
    lock = threading.Lock()

    def run(d: int, path: str) -> None:
        try:
            if not os.path.isdir(os.path.dirname(path.rstrip("/")) or "/"):
                raise FileNotFoundError(errno.ENOENT, "its parent directory does not exist (a drive not mounted?)")
            r = bounded(
                lambda: open_one(path, len(paths)),
                timeout,
                f"the cache directory {path}",
                late=lambda r: r[0].close(checkpoint=False),
            )
        except BaseException as e:
            with lock:
                errors[d] = e
            return
        with lock:
            got[d] = r

    threads = [threading.Thread(target=run, args=(d, p), name="aiokv-drive", daemon=True) for d, p in enumerate(paths)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    refused = [e for e in errors.values() if not isinstance(e, OSError)]
    if refused:
        for store, _ in got.values():
            store.close(checkpoint=False)
        raise refused[0]
    for d, e in sorted(errors.items()):
        log.error(
            "aiokv: drive %s is left out (%s); the cache runs on the other %d of %d drives, %d/%d of its capacity",
            paths[d],
            getattr(e, "strerror", None) or e,
            len(paths) - len(errors),
            len(paths),
            len(paths) - len(errors),
            len(paths),
        )
    if not got:
        raise OSError(errno.ENOENT, f"none of the {len(paths)} drives could be opened")
    drives = Drives(paths, {d: r[0] for d, r in got.items()}, failures, cooldown)
    spaces = [DriveNamespace([(d, got[d][1][j]) for d in drives.live]) for j in range(len(got[drives.live[0]][1]))]
    return drives, spaces
