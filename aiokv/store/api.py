# SPDX-License-Identifier: Apache-2.0
"""The store's interface: what the scheduler side, the connector and the operators' tools
call, one typed Protocol that `Store` (one cache directory, store.py) and `Drives` (one
Store per drive, drives.py) both implement, so that no caller asks which of them it has.
`SpaceApi` is a namespace's side of it: `namespace.Namespace` and `driveviews.DriveNamespace`.

A single Store is one drive: `drives()` is [(0, its directory, itself)], `parts(ns)` is
[(0, itself, ns)], and `record` has nothing to judge (the scheduler side's breaker does).

Threading contract: one owner thread calls a store (the EngineCore scheduler thread, or a
tool's); a store's I/O and loader threads are its own (store.py). Nothing here runs.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class SpaceApi(Protocol):
    """One namespace as the store's owner sees it (what `StoreApi.namespace` returns)."""

    nsid: bytes
    payload_bytes: int
    slot_bytes: int
    ranks: int
    fields: dict

    @property
    def ready(self) -> bool:
        """Whether its index is in (no hits, no saves until then)."""

    def has(self, key: bytes) -> bool:
        """Whether a committed block of key is a hit here.

        Args:
            key: a block's key.
        Returns:
            True if some engine's (some drive's) committed copy of key is in the index.
        """

    def where(self, key: bytes) -> int | None:
        """The location lookups use for key.

        Args:
            key: a block's key.
        Returns:
            Its location (format.loc; several drives: with the drive's index, format.on_drive),
            or None when no copy is committed.
        """

    def reserved(self, key: bytes) -> bool:
        """Whether key has a reservation not yet committed (its data is on its way)."""

    def count(self) -> int:
        """Blocks held (a block two engines or drives hold counts twice)."""

    def keys(self) -> list[bytes]:
        """Every key held, each once, read from the files (tools and tests, not hot paths)."""

    def held(self, tag: int) -> bool:
        """Whether any engine holds a block of this key tag (the KV events' removals)."""

    def still_loading(self) -> bool:
        """Whether its index is on its way: not in and not failed."""


@runtime_checkable
class StoreApi(Protocol):
    """A store of blocks on local disk: one cache directory, or one per drive seen as one.
    Every call is the owner's and in memory (file-system work runs on the I/O threads)."""

    @property
    def stats(self) -> Any:
        """The store's counters (a StoreStats: every drive's added up)."""

    @property
    def limit(self) -> int | None:
        """Bytes the blocks may take now: the capacity, lower while a disk is full (None: unbounded)."""

    @property
    def stalled(self) -> bool:
        """The file system has not answered within its deadline (several drives: none answers)."""

    @property
    def loading(self) -> int:
        """Namespaces (one per drive) whose index is still loading."""

    @property
    def fs_bytes(self) -> int:
        """The size of the file systems the cache directories are on."""

    # ---- namespaces and lookups ----
    def namespace(self, nsid: bytes, payload_bytes: int, ranks: int = 1, fields: dict | None = None) -> Any:
        """Open or create a namespace.

        Args:
            nsid: its id, derived by the caller from all that changes the bytes.
            payload_bytes: one rank's bytes of a block.
            ranks: the ranks each writing its part of a block.
            fields: what the nsid was derived from (written beside it, for tools).
        Returns:
            The namespace (a SpaceApi), handed back to every call about its blocks.
        """

    def lookup(self, ns: Any, keys, limit: int | None = None) -> int:
        """The hit: how many keys at the start of `keys` are committed (no side effects).

        Args:
            ns: the namespace.
            keys: block keys, in prompt order.
            limit: look at most this far.
        Returns:
            The length of the run of committed keys from the first.
        """

    def served(self, ns: Any, keys) -> list[bool]:
        """Which blocks are hits now (a drive whose breaker is open serves none), the other
        engines' last look applied, as by lookup.

        Args:
            ns: the namespace.
            keys: block keys.
        Returns:
            For each key, whether a committed block of it is served now (one call into
            aiokv._index for them all: no Python per key on the scheduler thread).
        """

    def holds(self, ns: Any, key: bytes, where: int) -> bool:
        """Whether key's committed copy is the one at location `where`."""

    def namespaces(self) -> list:
        """Every namespace open (one per drive: each drive's own Namespace)."""

    def blocks(self) -> int:
        """Blocks in every namespace (a block two engines hold counts twice)."""

    def used(self) -> int:
        """Bytes the cache directories' data files take (every engine's)."""

    # ---- saves ----
    def reserve(self, ns: Any, key: bytes, tenant: str | bytes = "") -> int | None:
        """A location to write key's block to.

        Args:
            ns: the namespace.
            key: the block's key.
            tenant: its tenant's name (a request's cache_salt) or tag.
        Returns:
            The location reserved (evicting if needed), or None: no save (held already, no room,
            a quota, a drive down, the index still loading).
        """

    def commit(self, ns: Any, items, tenant: str | bytes = "", pinned: bool = False, request: bool = False) -> None:
        """Make written blocks visible to lookups, durably.

        Args:
            ns: the namespace.
            items: (key, location) pairs reserved and fully written.
            tenant: their tenant's name or tag.
            pinned: pin them for good (request: a request asked it, bounded by request_pins).
        """

    def abort(self, ns: Any, items, failed: bool = True) -> None:
        """Give back reservations whose data was not (fully) written.

        Args:
            items: (key, location) pairs reserved.
            failed: a failed write (counted), not a cancelled one.
        """

    # ---- loads ----
    def pin(self, ns: Any, keys) -> list[int | None]:
        """Hold committed keys for a load (never evicted until unpin).

        Returns:
            Each key's location, None for a key not held (a miss).
        """

    def unpin(self, ns: Any, keys) -> None:
        """Give back the pins of a load."""

    def drop(self, ns: Any, keys, corrupt: bool = True) -> None:
        """Forget keys whose blocks did not verify (corrupt: counted as corrupt)."""

    def drop_at(self, ns: Any, items, corrupt: bool = True) -> int:
        """drop() of each (key, location) whose key still sits there.

        Returns:
            How many were dropped (a newer copy elsewhere stays).
        """

    def verify_slot(self, ns: Any, key: bytes, where: int) -> bool:
        """Whether location `where` holds a complete, verifying block of key on every rank."""

    # ---- pins that last, tenants ----
    def pin_blocks(self, ns: Any, keys, tenant: int | None = None, request: bool = False) -> int:
        """Pin stored blocks of these keys for good.

        Returns:
            How many were pinned now.
        """

    def pinned_bytes(self) -> int:
        """Bytes of blocks pinned for good in the directories (every engine's)."""

    def load_pinned(self) -> int:
        """Keys loads hold pinned now."""

    def tenant_bytes(self, top: int | None) -> dict[str, int]:
        """Bytes per tenant: the `top` tenants holding most, the others as "other" (None: all)."""

    def tag(self, name: str) -> bytes:
        """The 16-byte tag of a tenant's name (what its slot headers carry)."""

    # ---- upkeep ----
    def refresh(self) -> None:
        """Once per scheduler step: follow the other engines, apply the operators' orders, give
        back space over the capacity. Errors are raised after every drive was refreshed."""

    def record(self, drives: dict) -> None:
        """The workers' per-drive verdicts of one report.

        Args:
            drives: drive -> (failures, blocks loaded); each drive's breaker judges its own
                (one Store: nothing to judge, the scheduler side's breaker does).
        """

    def flush_if_due(self) -> None:
        """fdatasync the journals whose last sync is older than sync_interval (cheap; call often)."""

    def checkpoint(self) -> None:
        """Checkpoint every journal."""

    def close(self, checkpoint: bool = True) -> None:
        """Checkpoint (unless told not to) and close everything, within CLOSE_MAX."""

    # ---- what is behind it ----
    def drives(self) -> list[tuple[int, str, Any]]:
        """The drives: (index in the configured list, cache directory, its Store) each."""

    def parts(self, ns: Any) -> list[tuple[int, Any, Any]]:
        """A namespace's part on each drive: (drive index, its Store, its Namespace) each."""
