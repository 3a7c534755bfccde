# SPDX-License-Identifier: Apache-2.0
"""The persistent block store (no vLLM imports below this line).

Store (store.py) owns the index; the data path below it (aiokv/data/: BlockIO) moves
slot bytes; the on-disk format is in aiokv/data/format/ and docs/format.md.
"""

from aiokv.store.lock import StoreLocked
from aiokv.store.namespace import Namespace
from aiokv.store.store import NotAStore, Store, StoreStats

__all__ = ["Namespace", "NotAStore", "Store", "StoreLocked", "StoreStats"]
