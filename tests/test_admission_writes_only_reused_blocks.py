# SPDX-License-Identifier: Apache-2.0
"""Admission to disk (`admit: reused`): only blocks whose key was met before are written.

Bug: every block went to disk, so a workload of mostly one-off prompts spent drive
endurance on blocks nobody reads again (at 2 GB/s of saves a 7.68 TB, 1-DWPD drive
is used up in about an hour a day).
Invariant: with `reused`, a block is written only once a second request meets its key
(looked up or saved) within the window; a request never admits its own blocks (not
even when preempted and resumed: it looks its keys up again); first sightings are
remembered in a bounded sketch that forgets after 2 x window sightings and errs only
towards writing (no false negatives within the window); tokens are as without aiokv,
and after a restart the reused blocks hit.
Fix: aiokv/scheduler/admission.py, called from SchedulerSide.match and plan.
"""

from __future__ import annotations

import os

import pytest

from aiokv.scheduler.admission import Admission, Sketch
from aiokv.scheduler.state import Req
from tests.e2e import happened, prompts, run


def _req(keys) -> Req:
    return Req([], b"r", keys=list(keys))


def test_a_block_is_admitted_once_another_request_met_it():
    adm = Admission("reused", window=1000)
    keys = [os.urandom(32) for _ in range(8)]
    a = _req(keys)
    adm.looked_up(a, 5)  # a's prompt: 5 blocks looked up
    assert adm.admitted(a, keys) == [False] * 8, "a request admitted its own blocks"
    adm.looked_up(a, 8)  # a preempted and resumed: looks its blocks up again
    assert adm.admitted(a, keys) == [False] * 8, "a resumed request admitted its own blocks"
    b = _req(keys[:6] + [os.urandom(32) for _ in range(2)])
    adm.looked_up(b, 4)  # b met 4 of them in its lookup, 2 more when it saves them
    assert adm.admitted(b, b.keys) == [True] * 6 + [False] * 2
    assert Admission("all").admitted(_req(keys), keys) == [True] * 8


def test_the_sketch_forgets_after_its_window_and_errs_only_towards_writing():
    sk = Sketch(window=2000)
    first = [os.urandom(32) for _ in range(2000)]
    sk.add(first)
    assert sk.contains(first).all(), "a false negative within the window"
    others = [os.urandom(32) for _ in range(2000)]
    sk.add(others[:1000])
    assert sk.contains(first).all()  # still within 2 x window
    never = [os.urandom(32) for _ in range(20000)]
    assert sk.contains(never).mean() < 0.03, "false positives: each one a needless write"
    sk.add(others[1000:])
    sk.add([os.urandom(32) for _ in range(1500)])  # a second generation turns over: the first is gone
    assert sk.contains(first).mean() < 0.03
    assert sk.m // 8 * 2 <= 2000 * 10 // 8 * 2 + 2  # memory: 2 x 10 bits per sighting


PS = prompts(3, 300, seed=71)  # 9 full blocks each
ONCE = prompts(3, 300, seed=72)  # seen once: never written with reused


@pytest.mark.vllm
def test_reused_blocks_are_written_and_hit_after_a_restart(tiny_model, tmp_path):
    cache = str(tmp_path / "c")
    # vLLM's own prefix cache off: the repeated prompts are computed (and so saved) again
    spec = dict(
        model=tiny_model,
        prefix_caching=False,
        extra={"admit": "reused"},
        phases=[dict(prompts=PS, max_tokens=8), dict(prompts=ONCE, max_tokens=8), dict(prompts=PS, max_tokens=8)],
    )
    base = run(spec)
    res = run(dict(spec, cache=cache))
    # the first sightings of PS and ONCE are not written; the second sighting of PS is
    happened(res, base, saves_not_admitted=54, saves_committed=27, hit_blocks=0)
    per_block = res["counters"]["bytes_written"] // 27
    assert res["counters"]["drive_writes_per_day"] > 0
    assert _inspect_wear(cache) == res["counters"]["bytes_written"], "inspect's wear is what was written"
    again = dict(spec, phases=[dict(prompts=PS, max_tokens=8), dict(prompts=ONCE, max_tokens=8)])
    warm = run(dict(again, cache=cache))
    happened(warm, run(again), hit_blocks=27, saves_not_admitted=27, saves_committed=0)
    # against admit: all on the same lives: 54 blocks written for the same hits after the restart
    full = run(dict(spec, cache=str(tmp_path / "all"), extra={"admit": "all"}))
    happened(full, base, saves_committed=54, saves_not_admitted=0)
    assert full["counters"]["bytes_written"] == 54 * per_block
    assert _inspect_wear(str(tmp_path / "all")) == 2 * _inspect_wear(cache), "written: all against reused"


SYSTEM = prompts(1, 128, seed=80)[0]  # 4 blocks every request shares
SHARED = [SYSTEM + q[1:] for q in prompts(4, 65, seed=81)]  # + 2 blocks of its own each


@pytest.mark.vllm
def test_a_prefix_served_by_vllms_own_cache_is_written_once_met_again(tiny_model, tmp_path):
    """Bug: with vLLM's prefix cache on, the request that computed a shared system prompt met its
    keys first (not admitted), and every request that met them again got the blocks from vLLM's
    cache and computed nothing, so nothing saved them: the system prompt was never written and
    nothing after it could ever hit (tools/bench_chat.py: 384 blocks written, 0 hits in two
    lives). Fix: plan.track saves, with admit: reused, the blocks vLLM's cache gave a new life."""
    cache = str(tmp_path / "c")
    spec = dict(model=tiny_model, extra={"admit": "reused"}, phases=[dict(prompts=SHARED, max_tokens=8)])
    base = run(spec)
    cold = run(dict(spec, cache=cache))
    # the system prompt's 4 blocks met again by 3 requests: written once; each request's own 2: not
    happened(cold, base, saves_committed=4, saves_not_admitted=4 * 2 + 4, hit_blocks=0)
    warm = run(dict(spec, cache=cache))
    happened(warm, base, hit_blocks=">=4", saves_committed=0)


def _inspect_wear(cache: str) -> int:
    from aiokv.cli.summary import summary
    from aiokv.store import Store

    st = Store(cache, readonly=True)
    try:
        return summary(st)["wear"]["written_bytes"]
    finally:
        st.close()
