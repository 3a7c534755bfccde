# SPDX-License-Identifier: Apache-2.0
"""LoopThread (aiokv/util/loops.py), the one helper that starts an event loop on a thread.

Invariant: it runs what is handed in, and `stop` returns within its bound even when the
loop is stuck in a blocking call; a stopped loop refuses new work instead of losing it.
"""

import asyncio
import threading
import time

import pytest

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
