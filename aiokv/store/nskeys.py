# SPDX-License-Identifier: Apache-2.0
"""The keys of a namespace's blocks, read from the files (Namespace.keys: tools and tests).

The tables hold tags, not keys; the keys are in each engine's files, read through the
namespace's `keys_of` (set by the store: meta.Opener.keys_of).

Threading contract: the namespace's: one thread (the Store's owner) calls it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aiokv.store.namespace import Namespace


def of_engine(ns: Namespace, engine: int) -> list[bytes]:
    """The keys of one engine's blocks of ns (none: it holds none)."""
    if engine != ns.engine and engine not in ns.tables:
        return []
    t = ns.table_of(engine)
    live = t.live()
    return [k for k in ns.keys_of(engine).keys_of(live, t.tag[live]) if k is not None]


def keys(ns: Namespace, engine: int | None = None) -> list[bytes]:
    """Every engine's keys, ours first, each once; or, given an engine's number, that engine's."""
    if engine is not None:
        return of_engine(ns, engine)
    seen: dict[bytes, None] = {}
    for e in ns.engines:
        seen.update(dict.fromkeys(of_engine(ns, e)))
    return list(seen)
