# SPDX-License-Identifier: Apache-2.0
"""A table's counts: blocks per tenant, pinned blocks, pinned blocks per tenant.

`tenant_blocks` (blocks per tenant id), `pinned` (blocks with PINNED) and `tenant_pinned`
(blocks with PINNED per tenant id: the bound on a tenant's request pins, aiokv/store/pins.py),
kept as blocks come and go (table.Table's put, put_many, clear; journal.apply_records) or
counted again after a bulk build (`recount`). TableCounts is table.Table's part that keeps
them; the arrays it reads (`tag`, `tenant`, `flags`) and the counts are the Table's.

Threading contract: the Table's: changed by the one thread that changes the table.
"""

from __future__ import annotations

import numpy as np

PINNED = 1  # flags: pinned (an operator's pin, a request's: issue 34), never a victim (format.FLAG_PINNED)


class TableCounts:
    """The counting methods of table.Table (which sets `tenant_blocks`, `pinned` and
    `tenant_pinned` and holds `tag`, `tenant` and `flags`)."""

    def recount(self) -> None:
        """Blocks per tenant and pinned blocks, counted from the arrays (after a bulk build)."""
        live = self.tag != 0
        self.tenant_blocks = np.bincount(self.tenant[live], minlength=1).astype(np.int64)
        pinned = live & (self.flags & PINNED != 0)
        self.pinned = int(np.count_nonzero(pinned))
        self.tenant_pinned = np.bincount(self.tenant[pinned], minlength=1).astype(np.int64)

    def count_blocks(self, tenants, flags, sign: int) -> None:
        """Blocks of these tenants (ids) and flags came (sign 1) or went (-1)."""
        tenants = np.asarray(tenants, np.int64)
        if not len(tenants):
            return
        n = int(tenants.max()) + 1
        if n > len(self.tenant_blocks):
            self.tenant_blocks = np.concatenate([self.tenant_blocks, np.zeros(n - len(self.tenant_blocks), np.int64)])
        self.tenant_blocks[:n] += sign * np.bincount(tenants, minlength=n)
        pinned = tenants[(np.asarray(flags) & PINNED) != 0]
        self.pinned += sign * len(pinned)
        if len(pinned):
            self._count_pinned(pinned, sign)

    def count_pins(self, tenants, sign: int) -> None:
        """Blocks of these tenants (ids) were pinned (sign 1) or unpinned (-1) in bulk (bulk.py;
        the flags and `pinned` are the caller's)."""
        tenants = np.asarray(tenants, np.int64)
        if len(tenants):
            self._count_pinned(tenants, sign)

    def _count_pinned(self, tenants: np.ndarray, sign: int) -> None:
        n = int(tenants.max()) + 1
        if n > len(self.tenant_pinned):
            self.tenant_pinned = np.concatenate([self.tenant_pinned, np.zeros(n - len(self.tenant_pinned), np.int64)])
        self.tenant_pinned[:n] += sign * np.bincount(tenants, minlength=n)

    def _pin1(self, tenant: int, sign: int) -> None:
        if tenant >= len(self.tenant_pinned):
            self._count_pinned(np.array([tenant], np.int64), 0)  # (grown)
        self.tenant_pinned[tenant] += sign

    def blocks_of(self, tenant: int) -> int:
        return int(self.tenant_blocks[tenant]) if tenant < len(self.tenant_blocks) else 0

    def pinned_of(self, tenant: int) -> int:
        return int(self.tenant_pinned[tenant]) if tenant < len(self.tenant_pinned) else 0

    def _count1(self, tenant: int, flags: int, sign: int) -> None:
        if tenant >= len(self.tenant_blocks):
            self.tenant_blocks = np.concatenate(
                [self.tenant_blocks, np.zeros(tenant + 1 - len(self.tenant_blocks), np.int64)]
            )
        self.tenant_blocks[tenant] += sign
        if flags & PINNED:
            self.pinned += sign
            self._pin1(tenant, sign)
