"""The persistent block store (no vLLM imports below this line).

Store (store.py) owns the index; BlockIO (blockio.py) moves slot bytes; the
on-disk format is in format.py and docs/format.md.
"""
from aiokv.store.blockio import BlockIO
from aiokv.store.index import Namespace
from aiokv.store.lock import StoreLocked
from aiokv.store.store import NotAStore, Store, StoreStats, parse_size

__all__ = ["BlockIO", "Namespace", "NotAStore", "Store", "StoreLocked", "StoreStats", "parse_size"]
