# SPDX-License-Identifier: Apache-2.0
"""Keys located in bulk over a list of namespaces: for each key, the first namespace holding it
and where (as Namespace.has and Namespace.where answer one key), in one call into aiokv._index:
no Python per key on the scheduler thread (served, a load's pins, on one drive or several).

It reads each namespace's probes and their engines (Namespace._probes, _order: the tables a
lookup asks, ours first), as Namespace.run_of does for runs of keys.

Threading contract: the owner's (the Store's thread), like the index it reads.
"""

from __future__ import annotations

import numpy as np

from aiokv import _index
from aiokv.data import format as fmt


def first_holders(spaces: list, keys) -> tuple[np.ndarray, np.ndarray]:
    """Args:
        spaces: namespaces (index.Namespace), in the order they are asked.
        keys: block keys (a key that is not bytes is held by none).
    Returns:
        (space, where), int64 each: the index in `spaces` of the first holding each key, and
        the key's location there as that namespace's `where` answers it (engine <<
        ENGINE_SHIFT | slot); -1 in both for a key none of them holds.
    """
    which, slot = np.full(len(keys), -1, np.int64), np.full(len(keys), -1, np.int64)
    probes = tuple(p for n in spaces for p in n._probes)
    if not probes or not len(keys):
        return which, slot
    _index.locate_all(probes, keys, which, slot)
    space = np.repeat(np.arange(len(spaces) + 1), [len(n._probes) for n in spaces] + [1])
    engine = np.array([e for n in spaces for e in n._order] + [0], np.int64)  # (which -1: masked below)
    found = which >= 0
    return np.where(found, space[which], -1), np.where(found, engine[which] << fmt.ENGINE_SHIFT | slot, -1)


def holders(spaces: list, keys) -> np.ndarray:
    """For each key, the index in `spaces` of the first holding it (as `has` answers), -1: none."""
    return first_holders(spaces, keys)[0]
