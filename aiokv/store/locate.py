# SPDX-License-Identifier: Apache-2.0
"""Keys located in bulk over a list of namespaces: for each key, the first namespace holding it
and where (as Namespace.has and Namespace.where answer one key), in one call into aiokv._index:
no Python per key on the scheduler thread (served, a load's pins, on one drive or several).

It reads each namespace's probes and their engines (Namespace.probes, engines: the tables a
lookup asks, ours first), as Namespace.run_of does for runs of keys.

Threading contract: the owner's (the Store's thread), like the index it reads.
"""

from __future__ import annotations

import numpy as np

from aiokv import _index
from aiokv.data import format as fmt


def first_holders(spaces: list, keys) -> tuple[np.ndarray, np.ndarray]:
    """Args:
        spaces: namespaces (namespace.Namespace), in the order they are asked.
        keys: block keys (a key that is not bytes is held by none).
    Returns:
        (space, where), int64 each: the index in `spaces` of the first holding each key, and
        the key's location there as that namespace's `where` answers it (engine <<
        ENGINE_SHIFT | slot); -1 in both for a key none of them holds.
    """
    slot = np.full(len(keys), -1, np.int64)
    which = _probe_of(spaces, keys, slot)
    if which is None:
        return slot, slot.copy()
    engine = np.array([e for n in spaces for e in n.engines] + [0], np.int64)  # (which -1: masked below)
    found = which >= 0
    return _space_of(spaces, which), np.where(found, engine[which] << fmt.ENGINE_SHIFT | slot, -1)


def holders(spaces: list, keys) -> np.ndarray:
    """For each key, the index in `spaces` of the first holding it (as `has` answers), -1: none."""
    which = _probe_of(spaces, keys)
    return np.full(len(keys), -1, np.int64) if which is None else _space_of(spaces, which)


def _probe_of(spaces: list, keys, slot: np.ndarray | None = None) -> np.ndarray | None:
    """Each key's first probe holding it, over the spaces' probes in order (-1: none; slot, if
    given: its slot there), or None when there is nothing to ask."""
    probes = tuple(p for n in spaces for p in n.probes)
    if not probes or not len(keys):
        return None
    which = np.full(len(keys), -1, np.int64)
    if slot is None:
        _index.locate_all(probes, keys, which)
    else:
        _index.locate_all(probes, keys, which, slot)
    return which


def _space_of(spaces: list, which: np.ndarray) -> np.ndarray:
    """Probe indexes (-1: none) as indexes into `spaces` (-1: none)."""
    space = np.repeat(np.arange(len(spaces) + 1), [len(n.probes) for n in spaces] + [1])
    return np.where(which >= 0, space[which], -1)
