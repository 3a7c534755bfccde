# SPDX-License-Identifier: Apache-2.0
"""A starting engine sees what the other engines on its directory committed before it started,
from its first request on.

The risk: the blocks of the other engines are followed from the store's I/O thread's first look
at their journals (aiokv/store/following.py), applied at a later `fs.poll()`; `index_wait`
(aiokv/scheduler/index_wait.py) holds requests only while the engine's own index loads. A request
made between the two would miss blocks the other engines hold (a recompute, never wrong: the
"restart that misses").
The invariant: the connector opens its namespaces with `store.namespace()` (connector/opening.py),
which runs on the I/O thread behind that first look and applies it before it returns, so the
other engines' blocks are there before vLLM's first request. Nothing else orders it: this test
pins that order (a change that opened namespaces without the wait would fail here).
"""

from __future__ import annotations

from aiokv.scheduler.keys import extend_keys, request_root
from aiokv.store import Store

BS = 32
NS = b"f" * 16
PAYLOAD = 4096
TOKENS = list(range(10 * BS + 5))


def test_the_connector_s_open_applies_the_first_look_at_the_other_engines(tmp_path):
    root = str(tmp_path / "c")
    keys = extend_keys([], request_root(NS, []), TOKENS, BS, 10)
    a = Store(root, capacity="1GiB", engine=0)  # engine A: no I/O thread, each commit journaled at once
    ns_a = a.namespace(NS, PAYLOAD)
    a.commit(ns_a, [(k, a.reserve(ns_a, k)) for k in keys])
    a.close()
    b = Store(root, capacity="1GiB", io_thread=True, engine=1)
    try:
        ns = b.namespace(NS, PAYLOAD)
        # (B's own index may still be loading: index_wait holds requests for that, and only that)
        assert ns.peers() == [0] and ns.count(0) == 10, (ns.peers(), ns.count(0))
    finally:
        b.close()
