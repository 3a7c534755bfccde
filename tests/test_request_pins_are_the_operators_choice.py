# SPDX-License-Identifier: Apache-2.0
"""Pins from requests are the operator's choice (engine-free: vLLM's own SchedulerOutput records
through the scheduler-role connector and the scheduler side, over a real Store).

The bugs (issue 40 item 8): any API client could set kv_transfer_params {"aiokv": {"pin": true}}:
its blocks were pinned for good (through restarts, without expiry) until pin_capacity was full,
and then the operator's own `aiokv pin` was refused. A pin asked while the namespace's index was
still loading raised KeyError inside the store, logged with a traceback for every such request
(for ever if the load had failed), and the request's saves of that step were dropped.
The invariant: a request's pin is applied only for a tenant the `request_pins` setting names
(none by default; "*": every tenant), and only while that tenant's pinned blocks stay within its
bound (the size given, else a quarter of pin_capacity): the rest is stored unpinned, said in one
line a minute and counted, and the operator's pins keep their room; a malformed setting is
refused at start in one line. A pin while the index loads is refused in one line, no traceback,
however many requests ask.
The fix: aiokv/store/pins.py (pin_capacity and request_pins), Store.commit/pin_blocks(request=)
from the scheduler side, Store.pin_blocks refusing while the index loads, aiokv/config.py.
"""

from __future__ import annotations

import logging
import os
import time
from types import SimpleNamespace

import pytest

from aiokv.config import AioKVConfig, ConfigError
from aiokv.connector.scheduler_role import SchedulerRole
from aiokv.data import format as fmt
from aiokv.jobs import SaveResult, WorkerReport
from aiokv.scheduler.keys import extend_keys, request_root
from aiokv.scheduler.side import SchedulerSide
from aiokv.store import Store
from aiokv.store import replay as replay_mod
from aiokv.store.control import append_order
from aiokv.store.table import PINNED

BS = 4
NSID = bytes([7]) * 16


def _role(store) -> SchedulerRole:
    """The scheduler-role connector over a real store, as open() leaves it (one full-attention group)."""
    ns = store.namespace(NSID, 4096)
    names = SimpleNamespace(fields={}, groups=[], group_nsids=[NSID], nsid=NSID, block_size=BS)
    role = SchedulerRole(SimpleNamespace(fs_timeout=2.0), names, 1, False, True, "kv_both")
    role.sched = SchedulerSide(store, ns, BS)
    return role


def _serve(role, req: str, tenant: str, blocks: int, first: int, pin: bool = True) -> list[bytes]:
    """A new request of `tenant` asking for a pin (kv_transfer_params, as the connector reads
    them): its prompt of `blocks` full blocks prefilled in one step and saved; returns its keys."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    side = role.sched
    side.describe(req, tenant, pin)
    root, tokens = request_root(NSID, []), list(range(first, first + blocks * BS))
    side.match(req, tokens, root, 0)
    ids = list(range(first, first + blocks))
    side.on_alloc(req, tokens, root, (ids,), 0)
    so = SchedulerOutput.make_empty()
    so.scheduled_new_reqs.append(NewRequestData(req, None, [], None, None, (ids,), 0, None))
    so.num_scheduled_tokens[req] = len(tokens)
    so.scheduled_cached_reqs = CachedRequestData.make_empty()
    so.total_num_scheduled_tokens = len(tokens)
    saves = role.build_connector_meta(so).plan.saves
    side.on_report(WorkerReport(saves=[SaveResult(t.job, 0, list(t.keys), []) for t in saves]), set())
    return extend_keys([], root, tokens, BS, blocks)


def _pinned(store, keys) -> list[bool]:
    t = store.index.namespaces[NSID].table
    return [t.find(k) >= 0 and bool(t.flags[t.find(k)] & PINNED) for k in keys]


def test_a_requests_pin_is_refused_unless_request_pins_names_its_tenant(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="aiokv")
    store = Store(str(tmp_path / "c"), capacity="64MiB")
    role = _role(store)
    keys = _serve(role, "A", "acme", 2, 100)
    assert store.lookup(role.sched.ns, keys) == 2, "stored, as ever"
    assert _pinned(store, keys) == [False, False], "pinned by a request no setting allows"
    assert store.pinned_bytes() == 0 and store.stats.pins_refused == 2
    assert sum("request_pins" in r.getMessage() for r in caplog.records) == 1
    store.set_request_pins(AioKVConfig.from_extra({"request_pins": ["acme"]}).request_pins)
    assert _pinned(store, _serve(role, "B", "acme", 2, 200)) == [True, True]
    assert _pinned(store, _serve(role, "C", "bob", 2, 300)) == [False, False]
    store.set_request_pins({"*": None})
    assert _pinned(store, _serve(role, "D", "bob", 2, 400)) == [True, True]
    role.sched.close()
    store.close()


def test_a_tenants_request_pins_stop_at_its_bound_and_leave_the_operator_room(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="aiokv")
    store = Store(str(tmp_path / "c"), capacity="64MiB")
    role = _role(store)
    cost = role.sched.ns.slot_cost
    store.pin_capacity = 8 * cost
    store.set_request_pins({"acme": 3 * cost, "*": None})  # everyone else: a quarter of 8 blocks
    got = _pinned(store, _serve(role, "A", "acme", 5, 100))
    assert got == [True] * 3 + [False] * 2, "acme's requests pin 3 blocks at most"
    assert _pinned(store, _serve(role, "B", "acme", 1, 200)) == [False]  # (another request of acme: the same)
    assert _pinned(store, _serve(role, "C", "globex", 3, 300)) == [True, True, False]  # a quarter: 2
    assert store.stats.pins_refused == 4 and store.pinned_bytes() == 5 * cost
    assert sum("request_pins bound" in r.getMessage() for r in caplog.records) == 1, "one line a minute"
    # the operator's pin of another tenant still finds room: requests took 5 of 8 blocks
    bob = _serve(role, "D", "bob", 3, 400, pin=False)
    fd = os.open(tmp_path / "c", os.O_RDONLY)
    append_order(fd, "pin", None, {fmt.tenant_tag("bob")})
    os.close(fd)
    store.follow_interval = 0
    store.refresh()
    assert _pinned(store, bob) == [True] * 3 and store.pinned_bytes() == 8 * cost
    role.sched.close()
    store.close()


def test_a_pin_while_the_index_loads_is_refused_in_one_line(tmp_path, monkeypatch, caplog):
    root = str(tmp_path / "c")
    store = Store(root, capacity="64MiB")
    ns = store.namespace(NSID, 4096)
    store.commit(ns, [(k, store.reserve(ns, k)) for k in extend_keys([], request_root(NSID, []), range(40), BS, 10)])
    store.close()

    def broken(self, ns):  # the index of this namespace does not load, for the whole life
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(replay_mod.Replay, "read_own", broken)
    caplog.set_level(logging.INFO, logger="aiokv")
    store = Store(root, capacity="64MiB", io_thread=True)
    role = _role(store)
    end = time.monotonic() + 10
    while not any("loading the index" in r.getMessage() for r in caplog.records) and time.monotonic() < end:
        store.refresh()
        time.sleep(0.01)
    for i in range(6):
        _serve(role, f"R{i}", "acme", 2, 1000 + 10 * i)
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records if r.exc_info]
    assert sum("pins of namespace" in r.getMessage() for r in caplog.records) == 1, "one line, not one a request"
    role.sched.close()
    store.close()


@pytest.mark.parametrize(
    "value, want",
    [
        ("*", {"*": None}),
        (["acme", ""], {"acme": None, "": None}),
        ({"acme": "1GiB", "*": None}, {"acme": 1 << 30, "*": None}),
        ('["acme"]', {"acme": None}),
        ([], {}),
        (5, 'aiokv: request_pins must be "*", a list of tenants, or an object of tenant -> size or null'),
        ("acme", 'aiokv: request_pins must be "*", a list of tenants, or an object of tenant -> size or null'),
        ({"acme": 0}, "aiokv: request_pins['acme'] must be a positive size, such as 5GiB"),
    ],
)
def test_request_pins_is_off_by_default_and_refused_at_start_if_malformed(value, want):
    assert AioKVConfig.from_extra({}).request_pins == {}
    if isinstance(want, str):
        with pytest.raises(ConfigError) as e:
            AioKVConfig.from_extra({"request_pins": value})
        assert str(e.value).startswith(want) and "\n" not in str(e.value)
    else:
        assert AioKVConfig.from_extra({"request_pins": value}).request_pins == want
