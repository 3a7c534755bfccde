# SPDX-License-Identifier: Apache-2.0
"""NVIDIA Dynamo's KV router reads aiokv's KV events from real vLLM (CPU) engines.

The bug: aiokv's STORAGE events were checked only against a subscriber of our own; nothing
showed that a real router takes them as a disk tier, and a change on either side (vLLM's event
format, Dynamo's reading of it, aiokv's start announcement) could break routing to warm disks
unnoticed.
The invariant: with Dynamo's relay (KvEventPublisher) on each engine's ZMQ events and a KvRouter
(ai-dynamo-runtime, the version pinned in pyproject.toml), after a restart on a cache of two
drives a fresh router scores every stored block of three prompts for the restarted engine and
for a second engine started on the same drives, from their start announcements alone, on the
disk tier (no device block), each block announced once per engine however many drives hold it;
the router credits the disk at its disk_cache_hit_weight (0.25 by default, 1.0 when set so:
docs/operations.md, "KV events for routers"); `aiokv clear` on the drives removes every one of
them from both engines' scores. Tokens equal a run without aiokv in every life.
The fix: aiokv/connector/events.py (the announcement and removals); tests/dynamo_router.py,
tests/vllm_run.py's kv_events "tcp" (Dynamo's relay speaks TCP) and `announce`.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.e2e import ROOT, events_socket, happened, kill, part, prompts, result, run, start, wait_until

pytestmark = pytest.mark.vllm

BLOCK = 32
PER = (264 - 1) // BLOCK  # 8 full blocks per prompt, each stored and announced
PS = prompts(3, 264, seed=571)
TAIL = prompts(1, 20, seed=572)  # under a block: steps the engine, stores nothing
HOST = {"VLLM_HOST_IP": "127.0.0.1"}  # the events' tcp://*:0 binds here
ENV = dict(os.environ, PYTHONPATH=ROOT, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="WARNING", **HOST)


def _stored(res: dict) -> list:
    return [e for e in res["events"] if e[0] == "stored" and e[1] == "STORAGE"]


def _removed(res: dict) -> list:
    return [h for e in res["events"] if e[0] == "removed" and e[1] == "STORAGE" for h in e[3]]


def test_a_fresh_router_scores_the_disk_after_a_restart_and_forgets_it_after_a_clear(tiny_model, tmp_path, monkeypatch):
    from tests.dynamo_router import DynamoRouters

    drives = [str(tmp_path / "d0"), str(tmp_path / "d1")]
    base = run(
        dict(model=tiny_model, block_size=BLOCK, phases=[dict(prompts=PS), dict(prompts=TAIL), dict(prompts=TAIL)])
    )
    spec = dict(model=tiny_model, block_size=BLOCK, cache=drives[0], extra={"path": drives})
    # (with events on: the labels a restart announces from are written only then)
    first = run(dict(spec, kv_events=events_socket(), phases=[dict(prompts=PS)]))
    happened(first, part(base, [0]), saves_committed=len(PS) * PER)
    assert len(_stored(first)) == len(PS) * PER

    # the restarted engine and a second one on the same drives, each beside its Dynamo worker
    ready = [str(tmp_path / f"ready-{i}") for i in (0, 1)]
    go = [str(tmp_path / f"go-{i}") for i in (0, 1)]
    done = str(tmp_path / "announced-{}")
    lives = [
        start(
            dict(
                spec,
                kv_events="tcp",
                kv_events_subscribers=2,  # its own and Dynamo's relay: nothing is published before both are in
                ready_file=ready[i],
                phases=[
                    dict(prompts=TAIL, wait_for=go[0], announce=True, done_file=done.format(i)),
                    dict(prompts=TAIL, wait_for=go[1], orders=1),  # the clear below applied on both drives
                ],
            ),
            env=HOST,
        )
        for i in (0, 1)
    ]
    monkeypatch.setenv("DYN_FILE_KV", str(tmp_path / "discovery"))
    os.makedirs(str(tmp_path / "discovery"))
    dyn = DynamoRouters(str(tmp_path / "discovery"), tiny_model, BLOCK)
    try:
        wait_until(lambda: all(os.path.exists(r) for r in ready), "both engines up", lives)
        endpoints = [open(r).read() for r in ready]
        workers = [dyn.worker(e) for e in endpoints]
        router = dyn.router()  # fresh: it knows only what the events tell it from now on
        weighted = dyn.router(disk_cache_hit_weight=1.0)
        open(go[0], "w").close()  # (each engine publishes once Dynamo's relay subscribed)
        wait_until(lambda: all(os.path.exists(done.format(i)) for i in (0, 1)), "the start announcements", lives)

        def scores(r=router) -> list[dict]:
            return [dyn.overlap(r, p) for p in PS]

        want = {w: (0, PER) for w in workers}  # every stored block, on disk, for both engines
        for r in (router, weighted):  # (each subscribes on its own; the workers' indexers fill it in)
            wait_until(
                lambda r=r: scores(r) == [want] * len(PS), f"the routers to score {want}", timeout=120, seen=scores
            )
        for p in PS:
            picked, credit = dyn.best(router, p)
            assert picked in workers and credit == PER * 0.25, (picked, credit)  # disk_cache_hit_weight 0.25
            assert dyn.best(weighted, p)[1] == PER  # weighted as a device block

        # a clear of both drives while both engines run: they remove what they announced
        for d in drives:
            c = subprocess.run(
                [sys.executable, "-m", "aiokv", "clear", d, "--wait", "0"],
                cwd=ROOT,
                env=ENV,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert c.returncode == 0, c.stderr
        open(go[1], "w").close()
        res = [result(p) for p in lives]
        for r in (router, weighted):
            wait_until(
                lambda r=r: all(v == (0, 0) for s in scores(r) for v in s.values()),
                "the routers to forget the disk",
                timeout=120,
                seen=scores,
            )
    finally:
        for p in lives:
            kill(p)
        dyn.close()

    blocks = {tuple(p[j * BLOCK : (j + 1) * BLOCK]) for p in PS for j in range(PER)}
    for r in res:
        happened(r, part(base, [1, 2]), hit_blocks=0, store_cleared=len(PS) * PER)
        stored = _stored(r)
        # once per block, whichever drive holds it; every stored block, with its tokens
        assert len(stored) == len(PS) * PER and {tuple(e[5]) for e in stored} == blocks, len(stored)
        announced = {e[3][0] for e in stored}
        assert sorted(_removed(r)) == sorted(announced), "the clear did not remove what was announced"
