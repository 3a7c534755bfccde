# SPDX-License-Identifier: Apache-2.0
"""LoopThread (aiokv/util/loops.py), the one helper that starts an event loop on a thread.

Invariant: it runs what is handed in, and `stop` returns within its bound even when the
loop is stuck in a blocking call; a stopped loop refuses new work instead of losing it.
`stop` first cancels the tasks still on the loop, as `asyncio.run` does, and gives them a
bounded while to end: a task left pending on a closed loop never runs its cleanup, and
what it awaited in another runtime (a bucket request in obstore's) answers a closed loop
later (tests/test_dead_bucket_server_never_blocks.py).
"""

import asyncio
import threading
import time

import pytest

from aiokv.util import loops
from aiokv.util.loops import LoopThread


def test_runs_coroutines_and_calls_on_its_own_thread():
    lt = LoopThread("aiokv-test")
    try:

        async def where():
            return threading.current_thread().name

        assert lt.submit(where()).result(5) == "aiokv-test"
        seen = threading.Event()
        assert lt.call_soon(seen.set)
        assert seen.wait(5)
    finally:
        assert lt.stop()
    assert not lt.alive and lt.loop.is_closed()
    assert not lt.call_soon(lambda: None)
    coro = asyncio.sleep(0)
    with pytest.raises(RuntimeError):
        lt.submit(coro)
    coro.close()


def test_stop_is_bounded_when_the_loop_is_stuck():
    lt = LoopThread("aiokv-stuck")
    release = threading.Event()
    lt.call_soon(release.wait)  # a blocking call on the loop thread
    t0 = time.monotonic()
    assert lt.stop(timeout=0.3) is False
    assert time.monotonic() - t0 < 2
    release.set()
    lt.thread.join(5)
    assert not lt.alive


def test_stop_cancels_the_tasks_left_on_the_loop():
    lt = LoopThread("aiokv-tasks")
    ended = []

    async def waits_for_ever():
        try:
            await asyncio.Event().wait()
        finally:
            ended.append(threading.current_thread().name)

    pending = [lt.submit(waits_for_ever()) for _ in range(3)]
    assert lt.submit(asyncio.sleep(0)).result(5) is None  # the three are waiting by now
    assert lt.stop()
    assert ended == ["aiokv-tasks"] * 3  # each one's cleanup ran, on the loop, before it closed
    assert all(f.cancelled() for f in pending)


def test_stop_is_bounded_when_a_task_refuses_to_end(monkeypatch):
    monkeypatch.setattr(loops, "WIND_DOWN", 0.2)
    lt = LoopThread("aiokv-stubborn")
    cancels = []

    async def refuses():
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancels.append(1)

    lt.submit(refuses())
    assert lt.submit(asyncio.sleep(0)).result(5) is None
    t0 = time.monotonic()
    assert lt.stop(timeout=5) is True  # the loop itself stopped: the task is left behind
    assert time.monotonic() - t0 < 3
    assert cancels == [1] and lt.loop.is_closed()
