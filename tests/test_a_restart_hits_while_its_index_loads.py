# SPDX-License-Identifier: Apache-2.0
"""A restarted engine's first requests hit what the directory holds, though its index is
still loading.

The bug (issue 41): since the index loads in the background (the store's loader thread), a
lookup before it was in was a miss. The suite had to wait for the index before each life's
first request (tests/vllm_run.py's `index_wait`), the multiprocess restart still raced, and a
user's clients do not wait: with the cache on a FUSE mount, the index of 59 blocks took 0.43 s
to load and a restarted engine's four requests were all misses (on a 30M-block node, up to two
seconds of cold prefills right after a restart).

The invariants (a real store; real vLLM on the CPU, the index on a FUSE mount,
tests/stallfs.py, whose loader is held where it reads the index until the test releases
it): while a namespace's index loads, a lookup answers "not yet" (vLLM asks again at its next
step) and, once it is in, the same request hits; a request aborted while it waits leaves
nothing behind; past `index_wait` (counted from the first request that waited) no request
waits, lookups miss as before, one log line says so; a load that fails ends the wait at once.
The first requests after a restart hit in the in-process harness and under `vllm serve`
(tests/test_vllm_serve_restart_hits.py), with no wait for the index in the test; tokens equal
a run without aiokv.

The fix: aiokv/scheduler/index_wait.py (SchedulerSide.match answers None while it holds,
the mechanism the bucket tier's lookups use), the `index_wait` setting, Namespace.load_failed.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time

import pytest

from aiokv.scheduler.keys import extend_keys, request_root
from aiokv.scheduler.side import SchedulerSide
from aiokv.store import Store
from aiokv.store import replay as replay_mod
from tests.e2e import happened, part, prompts, run
from tests.stallfs import mounted

BS = 32
NS = b"w" * 16
PAYLOAD = 4096
TOKENS = list(range(10 * BS + 5))


def _stored(root: str) -> list[bytes]:
    """A directory holding the 10 full blocks of TOKENS; their keys."""
    keys = extend_keys([], request_root(NS, []), TOKENS, BS, 10)
    st = Store(root, capacity="1GiB")
    ns = st.namespace(NS, PAYLOAD)
    st.commit(ns, [(k, st.reserve(ns, k)) for k in keys])
    st.close()
    return keys


@pytest.fixture
def held(tmp_path, monkeypatch):
    """(side, go, fail): a scheduler side on a restarted store whose loader is held until go.set();
    fail.set() before go.set() makes the load raise (an unreadable journal)."""
    root = str(tmp_path / "c")
    _stored(root)
    go, fail = threading.Event(), threading.Event()
    read_own = replay_mod.Replay.read_own

    def gated(self, ns):
        assert go.wait(30)
        if fail.is_set():
            raise OSError(5, "Input/output error")
        return read_own(self, ns)

    monkeypatch.setattr(replay_mod.Replay, "read_own", gated)
    store = Store(root, capacity="1GiB", io_thread=True)
    side = SchedulerSide(store, store.namespace(NS, PAYLOAD), BS, index_wait=60.0)
    yield side, go, fail
    go.set()
    side.close()


def _match(side, req: str):
    return side.match(req, TOKENS, request_root(NS, []), 0)


def _until_answered(side, req: str):
    """match() each 'step' until it answers (the loader hands the index over at a lookup)."""
    end = time.monotonic() + 20
    while (got := _match(side, req)) is None:
        assert time.monotonic() < end, "the request waited past its bound"
        time.sleep(0.005)
    return got


def test_a_request_waits_while_the_index_loads_and_then_hits(held):
    side, go, _ = held
    assert [_match(side, "r1") for _ in range(3)] == [None] * 3  # held: "not yet", step after step
    assert _match(side, "r2") is None
    assert side.counters.index_waited == 2, "a request is counted once, however often it is asked"
    go.set()
    assert _until_answered(side, "r1") == 10 * BS
    assert _match(side, "r2") == 10 * BS and side.counters.index_wait_expired == 0
    side.on_alloc("r1", TOKENS, request_root(NS, []), (list(range(1, 12)),), 10 * BS)
    assert len(side.plan([]).loads[0].keys) == 10  # the hit it was given is loaded


def test_a_request_aborted_while_it_waits_leaves_nothing(held):
    side, go, _ = held
    assert _match(side, "gone") is None and _match(side, "stays") is None
    assert side.finished("gone") is False  # vLLM's abort of a waiting request
    assert side.index_wait.waiting == {"stays"} and "gone" not in side.requests
    go.set()
    assert _until_answered(side, "stays") == 10 * BS
    side.finished("stays")
    assert not side.requests and not side.store.index.pins and not side.index_wait.waiting


def test_past_index_wait_requests_miss_and_one_line_says_so(held, caplog):
    side, go, _ = held
    caplog.set_level(logging.INFO, logger="aiokv")
    now = [1000.0]
    side.index_wait.clock = lambda: now[0]
    assert _match(side, "r1") is None
    assert sum("requests wait for the index of namespace" in r.getMessage() for r in caplog.records) == 1
    now[0] += 59.9
    assert _match(side, "r2") is None  # within index_wait of the first request that waited
    now[0] += 0.2
    assert _match(side, "r1") == 0 and _match(side, "r2") == 0 and _match(side, "r3") == 0
    assert side.counters.index_wait_expired == 2 and side.counters.index_waited == 2
    said = [r for r in caplog.records if "still loading after index_wait (60 s)" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    go.set()  # the index comes in later: hits from then on
    end = time.monotonic() + 20
    while _match(side, "r4") == 0 and time.monotonic() < end:
        time.sleep(0.005)
    assert _match(side, "r4") == 10 * BS


def test_a_failed_load_ends_the_wait_at_once(held, caplog):
    side, go, fail = held
    assert _match(side, "r1") is None
    fail.set()
    go.set()
    assert _until_answered(side, "r1") == 0, "a failed index serves no hits"
    assert side.counters.index_wait_expired == 0, "the wait ended with the failure, not with index_wait"
    assert side.store.loading == 0 and side.store.index.namespaces[NS].load_failed
    assert _match(side, "r2") == 0 and side.counters.index_waited == 1
    assert any("loading the index of namespace" in r.getMessage() for r in caplog.records)


def test_an_engine_that_never_had_a_load_never_waits(tmp_path):
    store = Store(str(tmp_path / "fresh"), capacity="1GiB", io_thread=True)
    side = SchedulerSide(store, store.namespace(NS, PAYLOAD), BS, index_wait=60.0)
    assert _match(side, "r1") == 0 and side.index_wait.over and side.counters.index_waited == 0
    side.close()


# ---- real vLLM (CPU): the cache on a FUSE mount whose index reads the test holds ----
PS = prompts(4, 230, seed=141)
LATE = prompts(1, 230, seed=142)  # asked with PS, aborted while it waits
FULL = 229 // 32


@pytest.fixture(scope="module")
def stored(tiny_model, tmp_path_factory):
    """The tokens without aiokv (PS, then LATE) and a cache holding PS (a plain directory, copied
    onto each test's mount)."""
    base = run(dict(model=tiny_model, phases=[dict(prompts=PS + LATE)]))
    cache = str(tmp_path_factory.mktemp("stored") / "c")
    cold = run(dict(model=tiny_model, cache=cache, phases=[dict(prompts=PS)]))
    happened(cold, part(base, requests=range(4)), saves_committed=4 * FULL)
    return base, cache


def _restart(tmp_path, tiny_model, stored_cache: str, phase, extra: dict | None = None) -> dict:
    """A life on a copy of the stored cache on a FUSE mount whose index reads hang from before its
    start (stallfs "i"), until what phase(control file) says (its index_gate or stall)."""
    control = str(tmp_path / "stall")
    shutil.copytree(stored_cache, str(tmp_path / "src" / "c"), symlinks=True)
    with mounted(str(tmp_path / "src"), str(tmp_path / "mnt"), control):
        with open(control, "w") as f:
            f.write("i")  # the loader will wait where it reads the index
        cache = str(tmp_path / "mnt" / "c")
        return run(dict(model=tiny_model, cache=cache, extra=extra or {}, phases=[phase(control)]))


@pytest.mark.vllm
def test_the_first_requests_after_a_restart_hit_while_the_index_loads(tiny_model, tmp_path, stored):
    base, cache = stored
    res = _restart(
        tmp_path,
        tiny_model,
        cache,
        lambda control: dict(prompts=PS + LATE, index_gate={"path": control, "then": None}, abort_after={4: 1}),
    )
    assert res.get("index_gate_step") is not None, "the requests never waited for the index"
    assert res["aborted_while"] == {"WAITING": 1}, res["aborted_while"]  # aborted while it waited
    assert res["cached"][0][:4] == [FULL * 32] * 4, res["cached"]
    happened(res, base, hit_blocks=4 * FULL, loads_ok_blocks=4 * FULL, index_waited=5, index_wait_expired=0)


@pytest.mark.vllm
def test_past_index_wait_a_restart_misses_as_before_and_says_so_once(tiny_model, tmp_path, stored):
    base, cache = stored
    # the index is held for the whole phase (removed once its requests are done)
    res = _restart(
        tmp_path,
        tiny_model,
        cache,
        lambda control: dict(prompts=PS, stall=control, stall_mode="i"),
        {"index_wait": 0.5},
    )
    happened(res, part(base, requests=range(4)), hit_blocks=0, index_waited=4, index_wait_expired=4)
    assert res["log"].count("still loading after index_wait (0.5 s)") == 1, res["log"][-3000:]


@pytest.mark.vllm
def test_a_failed_index_load_ends_the_wait_at_once(tiny_model, tmp_path, stored):
    base, cache = stored
    # index_wait a day: only the failure can end this wait before the phase's own deadline
    res = _restart(
        tmp_path,
        tiny_model,
        cache,
        lambda control: dict(prompts=PS, index_gate={"path": control, "then": "e"}),
        {"index_wait": 86400},
    )
    assert res.get("index_gate_step") is not None, "the requests never waited for the index"
    happened(res, part(base, requests=range(4)), hit_blocks=0, index_waited=4, index_wait_expired=0)
    assert "loading the index of namespace" in res["log"] and "Input/output error" in res["log"], res["log"][-3000:]
