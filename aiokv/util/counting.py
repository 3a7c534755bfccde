# SPDX-License-Identifier: Apache-2.0
"""Counting with the table of counters (aiokv/util/counters.py): the counters
counted at a place, the records a place counts into built from its rows,
reports added up, the store's stats under their table names, and a label's
values bounded to the largest few.

Threading contract: no state of its own; merge() and top_and_other() work on
the caller's dicts in the caller's thread; record() runs at import.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from aiokv.util.counters import GAUGES, HISTOGRAM, TABLE


def names(source: str) -> tuple[str, ...]:
    """The counters counted at `source` (histograms aside), in the table's order."""
    return tuple(r.key for r in TABLE if source in r.sources and r.kind != HISTOGRAM)


def top_and_other(figures: dict[str, int], top: int) -> dict[str, int]:
    """The `top` largest of {label: number} by name, every other one added up as "other" (a
    label cardinality of at most top + 1: tenant_bytes)."""
    best = sorted(figures, key=lambda k: (-figures[k], k))[:top]
    out = {k: figures[k] for k in best}
    if len(figures) > top:
        out["other"] = out.get("other", 0) + sum(v for k, v in figures.items() if k not in out)
    return out


def merge(into: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """Adds `new` to `into` (counters add up, gauges take the newer value); returns `into`."""
    for k, v in new.items():
        into[k] = v if k in GAUGES else into.get(k, 0) + v
    return into


def record(cls_name: str, source: str, module: str, prefix: str = "") -> type:
    """The dataclass a place counts into (SchedulerCounters, StoreStats): one int
    field, 0 at first, per counter the table says is counted at `source`, named
    by its key less `prefix`; so a counter added there is one row here. Built
    once, at import of `module` (the defining module's name, for repr and pickle)."""
    keys = names(source)
    if not all(k.startswith(prefix) for k in keys):
        raise ValueError(f"aiokv: every counter at {source} is named {prefix}<name>: {keys}")
    fields = [(k.removeprefix(prefix), int, dataclasses.field(default=0)) for k in keys]
    cls = dataclasses.make_dataclass(cls_name, fields)
    cls.__module__ = module
    cls.__doc__ = f"The counters counted at {source}: built from the table of counters (aiokv/util/counters.py)."
    return cls


STORE_PREFIX = "store_"  # the store's counters are keyed store_<its StoreStats field>


def store_counters(stats) -> dict[str, int]:
    """The store's stats (StoreStats) under their table names, `store_<name>`."""
    return {STORE_PREFIX + k: v for k, v in vars(stats).items()}
