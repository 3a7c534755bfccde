# SPDX-License-Identifier: Apache-2.0
"""One event loop on a daemon thread of its own: the worker's, the bucket prober's.

uvloop where it is installed, asyncio's own loop elsewhere (a bare GPU node).

Threading contract: `submit`, `call_soon` and `stop` are called from any thread; the
loop runs on its own thread only what was handed to it. `stop` returns within its bound
whatever the loop runs: a loop that does not stop is left to the process exit. Before it
stops, the loop cancels the tasks still on it, as `asyncio.run` does: a bucket request
still awaited is then dropped by obstore's runtime, which would otherwise hand its late
answer to a closed loop (a "loop is closed" traceback on stderr, per request).
`settle` and `waited` run on a loop; `waited`'s blocking call on a thread of an executor.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading

try:
    import uvloop
except ImportError:  # a machine without it: asyncio's own loop, slower per job
    uvloop = None

log = logging.getLogger("aiokv")

WIND_DOWN = 1.0  # s a stopping loop gives the tasks it cancelled to end


class LoopThread:
    def __init__(self, name: str):
        self.name = name
        self.loop = uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()
        self.loop.set_exception_handler(self._on_error)
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def submit(self, coro) -> concurrent.futures.Future:
        """Runs `coro` on the loop; raises RuntimeError when the loop is closed."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call_soon(self, fn, *args) -> bool:
        """Calls fn(*args) on the loop; False when the loop is gone (nobody to tell)."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
            return True
        except RuntimeError:
            return False

    def stop(self, timeout: float = 5.0) -> bool:
        """Stops the loop and its thread; True when they stopped within `timeout`
        (the loop is then closed), False when the thread is still running."""
        if self.thread.is_alive():
            wind_down = self._wind_down(min(WIND_DOWN, timeout / 2))
            try:
                asyncio.run_coroutine_threadsafe(wind_down, self.loop)
            except RuntimeError:
                wind_down.close()  # closed meanwhile
            self.thread.join(timeout)
            if self.thread.is_alive():
                return False
        if not self.loop.is_closed():
            self.loop.close()
        return True

    async def _wind_down(self, bound: float) -> None:
        """Cancel every other task, give them `bound` s to end, then stop the loop."""
        try:
            me = asyncio.current_task()
            others = [t for t in asyncio.all_tasks() if t is not me]
            for t in others:
                t.cancel()
            if others:  # (an error one raises as it ends reaches _on_error, as any task's)
                await asyncio.wait(others, timeout=bound)
        finally:
            self.loop.stop()

    def _on_error(self, loop, context) -> None:
        log.error(
            "aiokv: unexpected error in the %s loop: %s",
            self.name,
            context.get("message"),
            exc_info=context.get("exception"),
        )


async def settle(futs) -> None:
    """Wait until every future of `futs` is done, even if the waiting task is
    cancelled meanwhile (asyncio.wait cancels none of them): whatever a call
    started that may still touch its buffers has ended when this returns. The
    caller raises its own error after. Exceptions stay in the futures."""
    while not all(f.done() for f in futs):
        try:
            await asyncio.wait(futs)
        except asyncio.CancelledError:
            continue


async def waited(fn, *args, executor=None):
    """fn(*args) (a blocking call: a device's copies landing, a slot call reading staging
    buffers) on a thread of `executor` (None: the running loop's default), so the loop goes
    on meanwhile; its result. A cancellation is raised only once fn has returned: what it
    writes and reads is the caller's to give back after us. Shielded, because cancelling an
    executor future that is running would mark it done while its thread still works."""
    fut = asyncio.get_running_loop().run_in_executor(executor, fn, *args)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        await settle([fut])
        if not fut.cancelled():
            fut.exception()  # retrieved: the cancellation is what the caller gets
        raise
