# SPDX-License-Identifier: Apache-2.0
"""Saves and loads in one process, for tests and benchmarks: a Store (the index)
with the worker's data path (BlockIO, aiokv/data/blockio.py) beside it.

In vLLM the two never meet in one place: the scheduler side reserves, commits,
pins and drops through its Store, and each worker reads and writes the slots it
is told with a BlockIO. StoreIO does both for one rank, in that order: a save
reserves, writes through BlockIO, then commits what was written and aborts the
rest; a load pins, reads and verifies through BlockIO, unpins only the pins it
took, and drops keys whose blocks did not verify.

DrivesIO does the same over several drives (a Drives store, a DriveIO).

Threading contract: one thread, the Store's owner; `save`, `load` and `blockio`
run on an asyncio loop there, whose backend (`_backend`; DrivesIO: one per drive) the BlockIOs use.
"""

from __future__ import annotations

import asyncio
import errno

from aiokv.config import parse_size
from aiokv.data import format as fmt
from aiokv.data.blockio import BlockIO
from aiokv.data.choice import open_backend
from aiokv.data.drives import DriveIO
from aiokv.store import Namespace, Store
from aiokv.store.drives import Drives, open_drives
from aiokv.store.store import ns_dir


def _close_io(st, backends) -> None:
    """A reader-writer's slot I/O closed (its BlockIOs, then `backends`), before its store."""
    for io in st._io.values():
        io.close()
    st._io.clear()
    for backend in backends:
        backend.close()


class StoreIO(Store):
    """A Store whose slots this process also reads and writes (one-rank namespaces)."""

    def __init__(self, *args, secret: str | None = None, cpu=None, **kw):
        self._io: dict[tuple[bytes, int], BlockIO] = {}
        self._backend = None  # opened on the first blockio (a benchmark may set its own before)
        self._secret, self._cpu = secret, cpu  # BlockIO's: a MAC on every block, checksum threads
        super().__init__(*args, secret=secret, **kw)  # (the store's: tenants' tags keyed by it)

    def blockio(self, ns: Namespace, rank: int = 0) -> BlockIO:
        loop = asyncio.get_running_loop()
        if self._backend is None:
            self._backend = open_backend(loop)
        io = self._io.get((ns.nsid, rank))
        if io is None:
            io = self._io[(ns.nsid, rank)] = BlockIO(
                self._backend,
                ns_dir(self.root, ns.nsid),
                ns.nsid,
                rank,
                ns.payload_bytes,
                secret=self._secret,
                cpu=self._cpu,
            )
        return io

    async def save(self, ns: Namespace, items, rank: int = 0, tenant: str = "", pin: bool = False) -> list[int]:
        """Store (key, addr) staging buffers of `tenant` (a cache_salt; pinned if `pin`); per
        item 0, -EEXIST, -ENOSPC or -errno."""
        if ns.ranks != 1:
            raise ValueError("aiokv: StoreIO.save is for one-rank namespaces; ranks commit through the owner")
        res = [0] * len(items)
        todo = []
        tag = self.tag(tenant)  # (stamped into each slot's header)
        for i, (key, addr) in enumerate(items):
            fmt.check_key(key)
            slot = self.reserve(ns, key, tenant)
            if slot is None:
                res[i] = -errno.EEXIST if (ns.has(key) or ns.reserved(key)) else -errno.ENOSPC
            else:
                todo.append((i, slot, key, addr))
        try:
            out = await self.blockio(ns, rank).write([(s, k, a) for _, s, k, a in todo], tenant=tag)
        except BaseException:
            self.abort(ns, [(k, s) for _, s, k, _ in todo], failed=False)
            raise
        self.commit(ns, [(k, s) for (_, s, k, _), r in zip(todo, out) if r == 0], tenant, pin)
        self.abort(ns, [(k, s) for (_, s, k, _), r in zip(todo, out) if r != 0])
        for (i, _, k, _), r in zip(todo, out):
            res[i] = r if r or ns.has(k) else -errno.EIO  # written but not committed
        return res

    async def load(self, ns: Namespace, items, rank: int = 0) -> list[int]:
        """Read (key, addr) into staging buffers; per item 0, -ENOENT, -EBADMSG or -errno."""
        keys = [k for k, _ in items]
        slots = self.pin(ns, keys)
        try:
            todo = [(s, k, a) for s, (k, a) in zip(slots, items) if s is not None]
            out = iter(await self.blockio(ns, rank).read(todo))
        finally:
            # only the pins taken above: a key committed and pinned by another
            # reader meanwhile keeps its pin
            self.unpin(ns, [k for k, s in zip(keys, slots) if s is not None])
        res = [next(out) if s is not None else -errno.ENOENT for s in slots]
        self.drop(ns, [k for k, r in zip(keys, res) if r not in (0, -errno.ENOENT)])
        return res

    def close(self, checkpoint: bool = True) -> None:
        _close_io(self, [self._backend] if self._backend is not None else [])
        self._backend = None
        super().close(checkpoint)


class DrivesIO(Drives):
    """Several drives (aiokv/store/drives.py) whose slots this process also reads and
    writes, as StoreIO does for one: a DriveIO over one BlockIO per drive, each on
    its drive's own backend (`_backends`, opened at the first blockio unless set
    before, as a worker's: worker/lifecycle.py), its per-drive verdicts handed
    straight to the drives' breakers (`record`), as the workers' reports are in vLLM."""

    save = StoreIO.save
    load = StoreIO.load

    def __init__(
        self,
        paths: list[str],
        capacity=None,
        timeout: float = 60.0,
        failures: int = 3,
        cooldown: float = 30.0,
        secret: str | None = None,
        cpu=None,
        **kw,
    ):
        self._io: dict[tuple[bytes, int], DriveIO] = {}
        self._backends: dict = {}  # drive -> its backend
        self._secret, self._cpu = secret, cpu
        cap = parse_size(capacity) if capacity is not None else None
        drives, _ = open_drives(
            paths,
            lambda p, n: (Store(p, capacity=cap and cap // n, secret=secret, **kw), []),
            timeout,
            failures,
            cooldown,
        )
        self.__dict__.update(drives.__dict__)

    def blockio(self, ns, rank: int = 0) -> DriveIO:
        loop = asyncio.get_running_loop()
        for d in self.live:
            if d not in self._backends:
                self._backends[d] = open_backend(loop, path=self.paths[d])
        io = self._io.get((ns.nsid, rank))
        if io is None:
            io = self._io[(ns.nsid, rank)] = DriveIO(
                {
                    d: BlockIO(
                        self._backends[d],
                        ns_dir(self.paths[d], ns.nsid),
                        ns.nsid,
                        rank,
                        ns.payload_bytes,
                        secret=self._secret,
                        cpu=self._cpu,
                    )
                    for d in self.live
                },
                self.record,
            )
        return io

    def close(self, checkpoint: bool = True) -> None:
        _close_io(self, self._backends.values())
        self._backends.clear()
        super().close(checkpoint)
