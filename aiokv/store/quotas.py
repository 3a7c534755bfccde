# SPDX-License-Identifier: Apache-2.0
"""Quotas: bytes each tenant may hold in the directory (issue 34).

`quota: {"TENANT": SIZE, "*": SIZE}` (kv_connector_extra_config): a tenant named there may
hold that many bytes of blocks in the cache directory, every other tenant ("*") the default
(none: no quota for them). A tenant is a request's cache_salt ("" for requests without one).

Bytes are the directory's: every engine's blocks of the tenant, known from following the other
engines' journals (their COMMITs name the tenant), times the slot size of their namespace. The
rules (store.py calls them):

- a tenant's bytes are its blocks' and its reservations' not yet committed (`reserving`,
  until `settled`: one request's save reserves all its blocks in one step), so a save of many
  blocks at once is capped like one block at a time;
- a save of a tenant that would take it past its quota first evicts that tenant's own least
  recently used blocks (`own_victim`), while they are its oldest in the directory; where
  another engine holds older ones, that engine evicts them at its next look (`shed`, from
  refresh) and this one may pass the quota by 1/16 (at least a slot) meanwhile, as capacity
  is shared (space.py); past that it evicts its own anyway, and with none of its own to give
  up the save is skipped (`skipped_quota`);
- when the directory is full, a save evicts the least recently used block of a tenant that is
  not protected (`victim`): a tenant is protected while it has a quota and is within it, and
  only its own saves evict its blocks then; with nothing else to evict, the saver's own blocks,
  else the save is skipped. So one tenant's flood never evicts another tenant's blocks while
  that one is under its quota. Engines agree because each sees the same bytes per tenant (the
  journals) and each evicts only its own blocks.

`make_room` (a reservation of the store's) and `shed` (its refresh) carry the rules out.

Threading contract: the owner's (the Store's thread), like the index it reads.
"""

from __future__ import annotations

import numpy as np

from aiokv.data import format as fmt
from aiokv.util import counting

SLACK = 16  # a tenant's blocks may pass its quota by quota / SLACK while another engine holds its oldest
SHED_MAX = 4096  # blocks of tenants past their quota one refresh evicts at most
MOST = 1 << 62  # a quota beyond this is no limit (the per-tenant sums are int64; config accepts up to 1e30)


class Quotas:
    def __init__(self, index, tenants, sizes: dict[str, int], space=None, stats=None):
        """sizes: tenant name (a cache_salt; "*": every other tenant) -> bytes; space (space.py)
        evicts for make_room and shed, which count in stats (the store's)."""
        self.index, self.tenants, self.space, self.stats = index, tenants, space, stats
        sizes = {name: min(size, MOST) for name, size in sizes.items()}
        self.default = sizes.get("*")
        self._named = {tenants.tag(name): size for name, size in sizes.items() if name != "*"}
        self._q = np.zeros(0, np.int64)  # per tenant id: its quota (-1: none); grown as tenants come
        self._epoch = -1  # the tenants' epoch _q was made at (an id given anew: made again)
        self._reserved: dict[tuple[bytes, bytes], tuple[bytes, int]] = {}  # (nsid, key) -> (tenant tag, bytes)
        self._reserved_of: dict[bytes, int] = {}  # tenant tag -> bytes reserved, not yet committed

    def _quotas(self, n: int) -> np.ndarray:
        if len(self._q) < n or self._epoch != self.tenants.epoch:
            q = np.full(max(n, len(self._q)), -1 if self.default is None else self.default, np.int64)
            for tag, size in self._named.items():
                tid = self.tenants.lookup(tag)
                if tid is not None and tid < len(q):
                    q[tid] = size
            if len(q) > fmt.OVERFLOW_TENANT:
                q[fmt.OVERFLOW_TENANT] = -1  # (blocks of no tenant: no quota counts them)
            self._q, self._epoch = q, self.tenants.epoch
        return self._q[:n]

    def quota_of_tag(self, tag: bytes) -> int | None:
        """The quota of a tenant by its tag (one not registered yet)."""
        return self._named.get(tag, self.default)

    def quota(self, tid: int) -> int | None:
        q = self._quotas(tid + 1)[tid]
        return None if q < 0 else int(q)

    def bytes_of(self, tid: int) -> int:
        total = 0
        for ns in self.index.namespaces.values():
            total += ns.slot_cost * (ns.table.blocks_of(tid) + sum(t.blocks_of(tid) for t in ns.tables.values()))
        return total

    # ---- reservations not yet committed (a tenant with a quota only) ----
    def reserving(self, nsid: bytes, key: bytes, tid: int | None, tag: bytes, cost: int) -> None:
        """A slot of `cost` bytes was reserved for key of the tenant (id tid, or None before its
        first commit; tag) until settled: counted if it has a quota. Kept by tag: an id is given at
        the first commit, and may be given anew once no block carries it (tenants.py)."""
        if self.quota_of(tid, tag) is not None:
            self._reserved[(nsid, key)] = (tag, cost)
            self._reserved_of[tag] = self._reserved_of.get(tag, 0) + cost

    def settled(self, nsid: bytes, key: bytes) -> None:
        """The reservation of key was committed or given back."""
        got = self._reserved.pop((nsid, key), None)
        if got is not None:
            left = self._reserved_of[got[0]] - got[1]
            if left:
                self._reserved_of[got[0]] = left
            else:
                del self._reserved_of[got[0]]

    def quota_of(self, tid: int | None, tag: bytes) -> int | None:
        """The quota of a tenant by its id, or by its tag before it has one."""
        return self.quota(tid) if tid is not None else self.quota_of_tag(tag)

    def claimed(self, tid: int | None, tag: bytes) -> int:
        """Bytes of the tenant: its blocks in the directory and its reservations not yet committed."""
        return (0 if tid is None else self.bytes_of(tid)) + self._reserved_of.get(tag, 0)

    # ---- choosing victims ----
    def protected(self, saver: int | None) -> tuple | None:
        """A victim filter (table.Table.oldest) leaving out the tenants within their quota (but
        the saver); None if no tenant is."""
        held = self.index.tenant_bytes()
        mask = held <= self._quotas(len(held))  # (no quota: -1, never within)
        if saver is not None and saver < len(mask):
            mask[saver] = False
        if not mask.any():
            return None
        return ("except", mask.view(np.uint8))

    @staticmethod
    def only(tid: int) -> tuple:
        """A victim filter letting through one tenant's blocks only."""
        return ("only", tid)

    def victim(self, saver: int | None):
        """(namespace, slot) of our least recently used block that a save of `saver` may evict
        when the directory is full: of a tenant not protected by its quota, else the saver's
        own; None if there is none."""
        filt = self.protected(saver)
        got = self.index.victim(filt)
        if got is None and filt is not None and saver is not None:
            got = self.index.victim(self.only(saver))
        return got

    def own_victim(self, tid: int):
        """(namespace, slot) of our least recently used block of tenant tid, or None."""
        return self.index.victim(self.only(tid))

    def peers_older(self, tid: int, victim) -> bool:
        """Whether another engine holds a block of tenant tid older than our victim."""
        filt = self.only(tid)
        mine = None if victim is None else self.index.victim_atime(victim)
        for ns in self.index.namespaces.values():
            for t in ns.tables.values():
                if t.blocks_of(tid):
                    a = t.oldest_atime(filt)
                    if a is not None and (mine is None or a < mine):
                        return True
        return False

    def over(self) -> list[int]:
        """Tenant ids whose blocks are past their quota now."""
        held = self.index.tenant_bytes()
        q = self._quotas(len(held))
        return np.flatnonzero((q >= 0) & (held > q)).tolist()

    # ---- keeping tenants within their quotas (the store's reserve and refresh) ----
    def make_room(self, ns, tid: int | None, tag: bytes) -> bool:
        """Room for one more block of the tenant (id tid, None before its first commit; tag) in ns
        within its quota (its blocks and its reservations not yet committed): its own least
        recently used blocks evicted while they are its oldest in the directory (another engine's
        older ones are that engine's to evict: up to quota / SLACK over meanwhile); False: none to
        give up."""
        q = self.quota_of(tid, tag)
        if q is None:
            return True
        cost = ns.slot_cost
        while self.claimed(tid, tag) + cost > q:  # (its reservations count: a prompt reserves all its blocks at once)
            if tid is None:
                return False  # it holds no block yet: nothing of its own to give up
            victim = self.own_victim(tid)
            if self.peers_older(tid, victim) and self.claimed(tid, tag) + cost <= q + max(q // SLACK, cost):
                return True  # its oldest blocks are another engine's: that one evicts them
            if victim is None or not self.space.evict(*victim, punch=victim[0] is not ns):
                return False
            self.stats.evictions -= 1  # (counted as a quota eviction instead)
            self.stats.quota_evictions += 1
        return True

    def shed(self) -> None:
        """Tenants past their quota (another engine's saves, a quota lowered): our own blocks of
        each evicted while they are its oldest in the directory (refresh)."""
        for tid in self.over():
            q, n = self.quota(tid), 0
            while q is not None and self.bytes_of(tid) > q and n < SHED_MAX:
                victim = self.own_victim(tid)
                if victim is None or self.peers_older(tid, victim) or not self.space.evict(*victim, punch=True):
                    break
                self.stats.evictions -= 1
                self.stats.quota_evictions += 1
                n += 1


def capacity_victim(quotas: Quotas | None, index):
    """The block the directory's capacity gives up first: of a tenant not protected by its quota."""
    return quotas.victim(None) or index.victim() if quotas is not None else index.victim()


def tenant_bytes(index, tenants, top: int | None) -> dict[str, int]:
    """Bytes per tenant in the directory (every engine's blocks, as followed): the `top`
    tenants holding most by their label (tenants.py), the others together as "other"
    (top None: every tenant)."""
    held = index.tenant_bytes()
    ids = np.flatnonzero(held)
    rest = 0  # the bytes of tenants that cannot be among the top: never labelled (a step's metrics)
    if top is not None and len(ids) > top:
        vals = held[ids]
        keep = vals >= np.partition(vals, len(vals) - top)[len(vals) - top]  # the top, ties included
        rest, ids = int(vals[~keep].sum()), ids[keep]
    out: dict[str, int] = {}
    for t in ids.tolist():
        label = tenants.label(t)
        out[label] = out.get(label, 0) + int(held[t])
    if top is None:
        return out
    out = counting.top_and_other(out, top)
    if rest:
        out["other"] = out.get("other", 0) + rest
    return out
