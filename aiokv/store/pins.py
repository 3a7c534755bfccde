# SPDX-License-Identifier: Apache-2.0
"""How many blocks may be pinned, and whose requests may pin (issues 34, 40).

Pinned blocks (table.PINNED) are never evicted; they take at most `pin_capacity` bytes of the
directory (`capacity`, default a tenth of the capacity: PIN_SHARE), every engine's pinned blocks
counted, as followed. Pins are the operator's: `aiokv pin` (control.py), bounded by that alone.
A request may ask for its blocks to be pinned (kv_transfer_params {"aiokv": {"pin": true}}):
only for a tenant the `request_pins` setting names ("*": every tenant; none by default), and
only while that tenant's pinned blocks (every engine's, whoever pinned them) stay within its
bound: the size given there, else REQUEST_SHARE of the pin limit. So requests never fill the pin
capacity by themselves, and a tenant no setting names never pins. A refusal is said (one line a
minute at most) and counted (`pins_refused`, per block), the block stored unpinned.
`Pins.pin_blocks` pins stored blocks (FLAGS records in our journal).

A load's pins are another kind (loadpins.py `LoadPins`, the store's `pin` and `unpin`): a key a
load is reading is held in memory and not evicted by this engine until unpinned.

Threading contract: the owner's (the Store's thread), like the index it reads; the journal
records they make are written by the Store's I/O thread (persist.py), never on this thread.
"""

from __future__ import annotations

import logging
import time

from aiokv.data import format as fmt
from aiokv.store.table import PINNED

log = logging.getLogger("aiokv")
PIN_SHARE = 10  # without pin_capacity, pinned blocks may take this share of the capacity (1/10)
REQUEST_SHARE = 4  # a tenant named in request_pins without a size: this share of the pin limit (1/4)
SAY_EVERY = 60.0  # seconds between the log lines of refused pins


class Pins:
    def __init__(self, index, tenants, stats, space, persist):
        self.index, self.tenants, self.stats, self.space = index, tenants, stats, space
        self.persist = persist  # (the FLAGS records of pin_blocks)
        self.capacity: int | None = None  # pin_capacity (None: capacity / PIN_SHARE)
        self.requests: dict[str, int | None] = {}  # request_pins: tenant name ("*": every other) -> bytes or None
        self._named: dict[bytes, int | None] = {}  # the same, by tag
        self._said: dict[str, float] = {}  # what was refused -> when it was last said

    def set_requests(self, spec: dict[str, int | None] | None) -> None:
        """The `request_pins` setting (aiokv/config.py): tenant name ("*": every other) ->
        bytes, or None for REQUEST_SHARE of the pin limit; None or {}: no request pins."""
        self.requests = dict(spec or {})
        self._named = {self.tenants.tag(n): size for n, size in self.requests.items() if n != "*"}

    @property
    def limit(self) -> int | None:
        """pin_capacity, or PIN_SHARE of the capacity where it is not set (None: no bound)."""
        if self.capacity is not None:
            return self.capacity
        return None if self.space.capacity is None else self.space.capacity // PIN_SHARE

    def pinned_bytes(self) -> int:
        """Bytes of pinned blocks in the directory: ours and the other engines' (as followed)."""
        return sum(
            ns.slot_cost * (ns.table.pinned + sum(t.pinned for t in ns.tables.values()))
            for ns in self.index.namespaces.values()
        )

    def free_blocks(self, ns) -> int | None:
        """Blocks of ns that may still be pinned within pin_capacity (None: no bound): an
        operator's order (aiokv pin) applied to files as they are read or held (control.py), on
        the loader's or the I/O thread too; the namespaces read through copies of their lists."""
        limit = self.limit
        if limit is None:
            return None
        pinned = sum(
            n.slot_cost * (n.table.pinned + sum(t.pinned for t in list(n.tables.values())))
            for n in list(self.index.namespaces.values())
        )
        return max(0, (limit - pinned) // ns.slot_cost)

    def pinned_of(self, tid: int) -> int:
        """Bytes of a tenant's pinned blocks in the directory (every engine's, as followed)."""
        return sum(
            ns.slot_cost * (ns.table.pinned_of(tid) + sum(t.pinned_of(tid) for t in ns.tables.values()))
            for ns in self.index.namespaces.values()
        )

    def bound(self, tag: bytes) -> int | None:
        """Bytes a tenant's pinned blocks may take for its requests to pin more (None: its
        requests may not pin)."""
        if tag in self._named:
            size = self._named[tag]
        elif "*" in self.requests:
            size = self.requests["*"]
        else:
            return None
        if size is None:
            limit = self.limit
            return None if limit is None else limit // REQUEST_SHARE
        return size

    def may_pin(self, ns, n: int, tenant: int = 0, request: bool = False) -> bool:
        """Whether n more blocks of ns, of tenant id `tenant`, may be pinned (room); all or none."""
        return self.room(ns, n, tenant, request, whole=True) == n

    def room(self, ns, n: int, tenant: int = 0, request: bool = False, whole: bool = False) -> int:
        """How many of n more blocks of ns, of tenant id `tenant`, may be pinned: within
        pin_capacity, and for a `request`'s pin within its tenant's request_pins bound (whole:
        all n or none). The rest are refused: said (one line a minute at most) and counted."""
        cost, label, k = ns.slot_cost, self.tenants.label(tenant), n
        if request:
            bound = self.bound(self.tenants.tag_of(tenant) or fmt.NO_TENANT)
            k = 0 if bound is None else min(k, max(0, (bound - self.pinned_of(tenant)) // cost))
            if bound is None:
                self._say(
                    "named",
                    "aiokv: a request of tenant %s asked for %d block(s) to be pinned; the "
                    "`request_pins` setting does not name that tenant: stored unpinned",
                    label,
                    n,
                )
            elif k < n:
                self._say(
                    "bound",
                    "aiokv: pinning %d block(s) of tenant %s for a request refused: its pinned "
                    "blocks would exceed its request_pins bound (%d bytes); stored unpinned",
                    n - k,
                    label,
                    bound,
                )
        limit = self.limit
        if limit is not None and k:
            fit = min(k, max(0, (limit - self.pinned_bytes()) // cost))
            if fit < k:
                self._say(
                    "capacity",
                    "aiokv: pinning %d block(s) of tenant %s refused: pinned blocks would "
                    "exceed pin_capacity (%d bytes); they are stored unpinned (raise pin_capacity, or unpin: "
                    "aiokv unpin)",
                    k - fit,
                    label,
                    limit,
                )
            k = fit
        if whole and k < n:
            k = 0
        self.stats.pins_refused += n - k
        return k

    def pin_blocks(self, ns, keys, tenant: int | None = None, request: bool = False) -> int:
        """Pin our stored blocks of these keys (FLAGS records; within pin_capacity, and for a
        `request`'s pin within its tenant's request_pins bound: past it the rest stays unpinned,
        said once; refused, said, while the index loads). Another engine's copy is pinned by its
        holder when it saves or hits the key itself. Returns how many were pinned now."""
        if not ns.ready:
            self.loading(ns)
            return 0
        t, recs = ns.table, []
        for k in keys:
            s = t.find(k)
            if s < 0 or t.flags[s] & PINNED:
                continue
            if not self.may_pin(ns, 1, int(t.tenant[s]) if tenant is None else tenant, request):
                break
            t.set_flags(s, int(t.flags[s]) | PINNED)
            recs.append(fmt.pack_flags(s, t.tag_at(s), int(t.flags[s])))
        self.persist.append(ns, recs)
        return len(recs)

    def loading(self, ns) -> None:
        """A pin asked of a namespace whose index is loading (or failed to load): refused, said."""
        self._say(
            "loading",
            "aiokv: pins of namespace %s are refused while its index loads (its blocks are not known yet)",
            ns.hex[:12],
        )

    def _say(self, what: str, msg: str, *args) -> None:
        now = time.monotonic()
        if now - self._said.get(what, -SAY_EVERY) >= SAY_EVERY:
            self._said[what] = now
            log.warning(msg, *args)
