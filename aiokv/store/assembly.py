# SPDX-License-Identifier: Apache-2.0
"""A Store put together: its parts made, one job each, and wired to the others they read
(`make_parts`), the operators' orders wired to the parts that apply and obey them
(`make_orders`), and the directory opened with our engine's lock (`open_dirs`). The parts
themselves: store.py's docstring.

Threading contract: the thread constructing the Store (its owner), before its I/O and
loader threads start.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiokv.config import parse_size
from aiokv.data import format as fmt
from aiokv.store.control import Control
from aiokv.store.drops import Drops
from aiokv.store.following import Following
from aiokv.store.labels import Labels
from aiokv.store.loading import Loader
from aiokv.store.loadpins import LoadPins
from aiokv.store.meta import Dirs, Opener
from aiokv.store.namespace import Namespace
from aiokv.store.persist import Persist
from aiokv.store.pins import Pins
from aiokv.store.reclaim import Reclaim
from aiokv.store.replay import Replay
from aiokv.store.saves import Saves
from aiokv.store.scan import Scan
from aiokv.store.space import Space
from aiokv.store.tenants import Tenants
from aiokv.store.wear import Wear

if TYPE_CHECKING:
    from aiokv.store.store import Store


def make_parts(store: Store, capacity, sync_interval: float, checkpoint_every: int, secret, fs_timeout: float) -> None:
    """The parts, one job each, handed the others they read (nothing opened yet); fs_timeout:
    the I/O thread's deadline, from which the close's wait for an answer is derived (persist.py)."""
    fs = store.fs
    store.dirs = Dirs(store.root, store.readonly)
    store.tenants = Tenants(store.dirs, fs, fmt.tenant_key(secret), store.index)  # tenant tags <-> ids (tenants.py)
    store.persist = Persist(fs, store.index, sync_interval, checkpoint_every, fs_timeout)
    store.tenants.checkpoint = store.persist.checkpoint
    store.following = Following(store.dirs, store.index, fs, store.tenants)
    store.space = Space(
        parse_size(capacity) if capacity is not None else None,
        store.dirs,
        store.index,
        fs,
        store.stats,
        store.persist,
        store.following.peer_bytes,
    )
    # pin_capacity, request_pins, pin_blocks; the keys loads hold (loadpins.py)
    store.pins = Pins(store.index, store.tenants, store.stats, store.space, store.persist)
    store.load_pins = LoadPins(store.index, store.persist, store.dirs, store.readonly)
    store.scan = Scan(store.dirs, store.space, fs, store.persist)
    t = store.tenants
    store._replay = Replay(store.dirs, store.index, store.space, store.persist, store.scan, t.id_at_open, t.own_loaded)
    store.labels = Labels(store.dirs, fs)  # a description per key, for the connector's KV events
    store.reclaim = Reclaim(store.dirs, store.index, fs, store.stats, store.following, store.space, sync_interval)
    store.opener = Opener(store.dirs, store.index, store._replay, store.following, store.space, fs)


def make_orders(store: Store, sync_interval: float) -> None:
    """The operators' orders (aiokv clear, pin, unpin), read at each look at the other
    engines, wired to the parts that apply them; the saves and the loader, which obey them."""
    store.control = Control(
        store.dirs,
        store.index,
        store.tenants,
        store.space,
        store.persist,
        store.stats,
        store.fs,
        store.pins.free_blocks,
        store.pins.may_pin,
    )
    store.following.control = store.control
    store._replay.orders = store.control.apply_loaded  # (applied to our index as it is read, before it serves)
    store.control.dead = store.reclaim.orders  # (and to the files of the dead engines we hold)
    store.drops = Drops(store.dirs, store.index, store.stats, store.persist)
    store.saves = Saves(
        store.dirs, store.index, store.tenants, store.stats, store.space, store.persist, store.pins, store.control
    )
    store.loader = Loader(
        store.index, store.fs, store._replay, store.control, store.tenants, store.space, store._close_dirs
    )


def open_dirs(store: Store, engine: int | None, background: bool) -> list[Namespace]:
    """Open the directory and take our engine's lock; read our tenants, the wear file and the
    orders; each namespace loaded now, or (background) returned as a shell to be loaded."""
    found = store.dirs.open(engine)
    store.tenants.load_own(store.persist.logs)
    store.wear = Wear(store.dirs.root_fd, store.engine) if not store.readonly else None  # bytes committed
    control = store.control
    control.orders += control.read_io() or []  # (applied as each namespace is in place)
    control.last = control.orders[-1].number if control.orders else 0
    control.blind = control._unreadable is not None  # (its orders then: control.take)
    shells = []
    for nsid in found:
        if background:  # loaded in the background (loading.py): not ready until then
            shells.append(store.opener.shell(nsid))
        else:
            control.catch_up(store.opener.load(nsid))
    if not store.readonly and not background:
        store.space.shrink_to_limit()
    return shells
